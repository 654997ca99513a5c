"""torch.compile: otelprof's helpers cause no graph break and step aside inside compiled code.

Compiled for real on CPU (the `aot_eager` backend: dynamo traces exactly as with inductor,
without a C++ toolchain run per test); `fullgraph=True` turns any graph break into an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import otelprof
from otelprof import determined_timings
from otelprof.analysis.problems import notes
from otelprof.analysis.reader import WarningLog, open_run
from otelprof.analysis.summary import summarize
from tests.otlp_files import read_spans


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    otelprof.uninstrument()
    torch._dynamo.reset()


@otelprof.timing("decorated")
def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def step_body(x: torch.Tensor) -> torch.Tensor:
    x = determined_timings.to_device(x, "cpu")
    with otelprof.timing("inner", layer=1):
        y = torch.relu(x @ x.T)
    with determined_timings.train_batch():
        y = scaled(y) + 1
    with determined_timings.reduce_metrics():
        total = y.sum()
    return determined_timings.from_device(total)


def test_helpers_inside_compiled_code_cause_no_graph_break(tmp_path: Path) -> None:
    with otelprof.instrument(output_dir=tmp_path, host_metrics=False, process_metrics=False):
        explained = torch._dynamo.explain(step_body)(torch.randn(4, 4))
        assert explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(step_body, backend="aot_eager", fullgraph=True)
        x = torch.randn(4, 4)
        assert torch.allclose(compiled(x), step_body(x))


def test_compiled_training_times_the_compiled_call_and_notes_the_compile_in_step_0(
    tmp_path: Path,
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with otelprof.timing("inside_compiled"):  # steps aside: no span, no break
            return model(x).square().mean()

    compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)
    steps = 3  # as in the README's example, which promises the note
    with otelprof.instrument(
        output_dir=tmp_path, host_metrics=False, process_metrics=False
    ) as prof:
        handle = otelprof.instrument_optimizer(optimizer)
        for _ in range(steps):
            optimizer.zero_grad()
            with determined_timings.train_batch():
                loss = compiled(torch.randn(8, 16))  # step 0 includes the compilation
                loss.backward()
                optimizer.step()
            otelprof.step()
        handle.remove()
    assert prof.run_dir is not None
    spans = read_spans(prof.run_dir / "traces.jsonl")
    assert len([s for s in spans if s.name == "step"]) == steps
    assert len([s for s in spans if s.name == "train_batch"]) == steps
    assert len([s for s in spans if s.name == "optimizer_step"]) == steps
    assert not [s for s in spans if s.name == "inside_compiled"]
    summary = summarize(open_run([prof.run_dir]), WarningLog(sink=lambda _m: None))
    assert any(n.startswith("step 0 took") for n in notes(summary)), notes(summary)
