"""Epoch ends are not errors: step count equals step() calls on every DataLoader run shape.

Real torch DataLoaders (in-process and with worker processes) under a real profiler; the
spans are read back from the detached run's traces file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import otelprof
from otelprof import determined_timings
from otelprof.analysis.reader import WarningLog, open_run
from otelprof.analysis.summary import summarize
from tests.otlp_files import Span, read_spans


@pytest.fixture(autouse=True)
def _no_profiler_left_running() -> Iterator[None]:
    yield
    otelprof.uninstrument()


def loader(n: int, workers: int = 0) -> DataLoader[Any]:
    data = TensorDataset(torch.arange(n * 2, dtype=torch.float32).reshape(n, 2))
    return DataLoader(data, batch_size=1, num_workers=workers)


def several_epochs(prof: otelprof.Profiler, workers: int = 0) -> int:
    calls = 0
    timed = otelprof.timed_dataloader(loader(4, workers))
    for epoch in range(3):
        otelprof.set_epoch(epoch)
        for (batch,) in timed:
            with determined_timings.train_batch():
                batch.sum()
            otelprof.step()
            calls += 1
    return calls


def empty_epochs(prof: otelprof.Profiler) -> int:
    calls = 0
    for n in (0, 3, 0, 0, 2, 0):
        for (batch,) in otelprof.timed_dataloader(loader(n)):
            with determined_timings.train_batch():
                batch.sum()
            otelprof.step()
            calls += 1
    return calls


def mid_epoch_stop(prof: otelprof.Profiler) -> int:
    calls = 0
    timed = otelprof.timed_dataloader(loader(6))
    for _ in range(2):
        for i, (batch,) in enumerate(timed):
            with determined_timings.train_batch():
                batch.sum()
            otelprof.step()
            calls += 1
            if i == 2:
                break  # max_steps reached mid-epoch: the generator is closed
    return calls


def raw_dataloader(prof: otelprof.Profiler) -> int:
    calls = 0
    data = loader(3)
    for _ in range(2):
        for (batch,) in data:  # no timed_dataloader: torch's own ranges only
            batch.sum()
            otelprof.step()
            calls += 1
    return calls


def generator_closed_inside_a_range(prof: otelprof.Profiler) -> int:
    def batches() -> Iterator[int]:
        for i in range(10):
            with torch.profiler.record_function("produce"):
                yield i

    calls = 0
    stream = batches()
    for _ in range(3):
        next(stream)
        otelprof.step()
        calls += 1
    with otelprof.timing("close"):
        stream.close()  # GeneratorExit inside the open `produce` range
    otelprof.step()
    return calls + 1


SHAPES: dict[str, Callable[[otelprof.Profiler], int]] = {
    "several epochs": several_epochs,
    "several epochs, 2 workers": lambda prof: several_epochs(prof, workers=2),
    "empty epochs": empty_epochs,
    "mid-epoch stop": mid_epoch_stop,
    "raw DataLoader": raw_dataloader,
    "generator closed inside a range": generator_closed_inside_a_range,
}


def record(
    tmp_path: Path, shape: Callable[[otelprof.Profiler], int]
) -> tuple[int, list[Span], Path]:
    with otelprof.instrument(
        output_dir=tmp_path, interval=0.5, host_metrics=False, process_metrics=False
    ) as prof:
        calls = shape(prof)
    assert prof.run_dir is not None
    return calls, read_spans(prof.run_dir / "traces.jsonl"), prof.run_dir


@pytest.mark.parametrize("shape", list(SHAPES))
def test_step_count_equals_step_calls_with_no_error_and_no_orphan(
    tmp_path: Path, shape: str
) -> None:
    calls, spans, run_dir = record(tmp_path, SHAPES[shape])
    steps = [s for s in spans if s.name == "step"]
    assert len(steps) == calls
    assert sorted(s.attributes["otelprof.step"] for s in steps) == list(range(calls))
    errors = [(s.name, s.events) for s in spans if s.status_code == 2]
    assert errors == []
    ids = {s.span_id for s in spans}
    orphans = [s.name for s in spans if s.parent_span_id and s.parent_span_id not in ids]
    assert orphans == []
    warn = WarningLog(sink=lambda _m: None)
    summary = summarize(open_run([run_dir]), warn)
    assert summary.step.count == calls and summary.unresolved_children == 0
    assert not summary.failed_spans


def test_timed_dataloader_passes_attribute_access_through_to_the_loader() -> None:
    sampler_loader = DataLoader(
        TensorDataset(torch.zeros(8, 1)),
        batch_size=4,
        sampler=torch.utils.data.distributed.DistributedSampler(
            TensorDataset(torch.zeros(8, 1)), num_replicas=2, rank=0
        ),
    )
    timed = otelprof.timed_dataloader(sampler_loader)
    assert timed.batch_size == 4
    assert timed.dataset is sampler_loader.dataset
    assert timed.sampler is sampler_loader.sampler
    timed.sampler.set_epoch(3)
    assert sampler_loader.sampler.epoch == 3  # type: ignore[attr-defined]
    assert len(timed) == 1
    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = timed.no_such_thing
