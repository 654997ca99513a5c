"""The per-step helpers run without a Python frame while a profiler runs, record exactly what
the Python helpers record, are put back afterwards, and torch.compile traces the Python
helpers in their place (no graph break) however late `torch._dynamo` is loaded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import otelprof
from otelprof._timings import _api, _helpers
from otelprof._timings import _recorder as rec
from tests.otlp_files import Span, read_spans

ROOT = Path(__file__).resolve().parents[1]


def _compiled_helpers_expected() -> None:
    if rec.speedups is None:
        pytest.fail("the C extension otelprof._timings._speedups was not built")
    if not _helpers.can_substitute():
        pytest.fail(
            f"torch {torch.__version__} has no torch.compiler.substitute_in_graph: the "
            "project's pinned torch (>= 2.5) is not the one installed"
        )


def test_the_helpers_are_compiled_while_a_profiler_runs_and_put_back_after(
    tmp_path: Path,
) -> None:
    _compiled_helpers_expected()
    python = {name: getattr(otelprof, name) for name in _helpers.HELPERS}
    assert all(python[name] is getattr(_api, name) for name in _helpers.HELPERS)
    with otelprof.instrument(output_dir=tmp_path, host_metrics=False, process_metrics=False):
        for name in _helpers.HELPERS:
            assert getattr(otelprof, name) is getattr(rec.speedups, name), name
    assert {name: getattr(otelprof, name) for name in _helpers.HELPERS} == python


def test_a_torch_that_cannot_trace_stand_ins_keeps_the_python_helpers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch < 2.5 has no `substitute_in_graph`: compiled twins would graph-break there."""
    monkeypatch.setattr(_helpers, "can_substitute", lambda: False)
    with otelprof.instrument(output_dir=tmp_path, host_metrics=False, process_metrics=False):
        for name in _helpers.HELPERS:
            assert getattr(otelprof, name) is getattr(_api, name), name


def test_a_helper_patched_by_someone_else_is_left_alone(tmp_path: Path) -> None:
    _compiled_helpers_expected()

    def theirs(name: str, **attributes: Any) -> Any:
        return _api.timing(name, **attributes)

    original = otelprof.timing
    otelprof.timing = theirs  # type: ignore[assignment]
    try:
        with otelprof.instrument(output_dir=tmp_path, host_metrics=False, process_metrics=False):
            assert otelprof.timing is theirs
            assert otelprof.train_batch is rec.speedups.train_batch  # type: ignore[union-attr]
        assert otelprof.timing is theirs
    finally:
        otelprof.timing = original


def _loop(prof: Any, steps: int) -> None:
    """The README's helpers, every form of call the compiled helpers take or hand on."""
    for i in range(steps):
        x, y = otelprof.to_device((torch.ones(2), torch.zeros(2)), "cpu")
        x = otelprof.to_device(x, "cpu", non_blocking=False)
        batch = otelprof.to_device({"x": x, "y": [y]}, "cpu", False)  # nested: Python's map
        with otelprof.train_batch():
            loss = (batch["x"] * 2).sum()
        with otelprof.train_batch(micro=i):  # attributes: the Python helper's
            pass
        with otelprof.timing("step_lr_schedulers"):
            pass
        with otelprof.timing(name="named_by_keyword"):
            pass
        with otelprof.timing(f"new_name_{i % 2}"):  # not cached yet the first time
            pass
        out = otelprof.from_device(loss)
        host = otelprof.from_device({"loss": loss})
        with otelprof.reduce_metrics():
            out.item()
        with otelprof.reduce_metrics(kind="mean"):
            host["loss"].item()
        prof.step()


def _shapes(spans: list[Span]) -> list[tuple[Any, ...]]:
    """Each span's name, its parent's name and its attributes: everything but times and ids."""
    by_id = {s.span_id: s.name for s in spans}
    return sorted(
        (s.name, by_id.get(s.parent_span_id, ""), tuple(sorted(map(str, s.attributes.items()))))
        for s in spans
    )


def test_compiled_helpers_record_exactly_what_the_python_helpers_record(tmp_path: Path) -> None:
    _compiled_helpers_expected()
    recorded = {}
    for arm in ("python", "compiled"):
        options = {"output_dir": tmp_path / arm, "host_metrics": False, "process_metrics": False}
        with otelprof.instrument(trace_budget=float("inf"), **options) as prof:
            if arm == "python":  # the swap undone: the Python helpers in the namespace
                prof._session._helpers.uninstall()
            assert (otelprof.timing is rec.speedups.timing) == (arm == "compiled")  # type: ignore[union-attr]
            _loop(prof, 6)
        assert prof.run_dir is not None
        recorded[arm] = _shapes(read_spans(prof.run_dir / "traces.jsonl"))
    assert recorded["compiled"] == recorded["python"]
    assert any(name == "to_device" for name, *_ in recorded["compiled"])


def test_helpers_called_wrongly_fail_as_the_python_helpers_do(tmp_path: Path) -> None:
    _compiled_helpers_expected()
    with otelprof.instrument(output_dir=tmp_path, host_metrics=False, process_metrics=False):
        for call in (
            lambda: otelprof.to_device(torch.ones(1)),
            lambda: otelprof.from_device(),
            lambda: otelprof.timing(),
            lambda: otelprof.train_batch(1),
            lambda: otelprof.to_device(torch.ones(1), "cpu", bogus=True),
        ):
            with pytest.raises(TypeError):
                call()


def test_torch_compile_traces_the_python_helpers_when_dynamo_loads_after_instrument(
    tmp_path: Path,
) -> None:
    """In a fresh interpreter torch._dynamo is not loaded yet at instrument(): the helpers are
    registered with torch.compile as soon as it is, before it traces anything."""
    _compiled_helpers_expected()
    script = textwrap.dedent(
        f"""
        import sys
        import torch
        import otelprof
        assert "torch._dynamo" not in sys.modules
        with otelprof.instrument(output_dir={str(tmp_path)!r}, host_metrics=False,
                                 process_metrics=False) as prof:
            assert type(otelprof.train_batch).__name__ == "builtin_function_or_method"
            def body(x):
                x = otelprof.to_device(x, "cpu")
                with otelprof.train_batch():
                    with otelprof.timing("inner"):
                        y = x * 2
                with otelprof.reduce_metrics():
                    y = y.sum()
                return otelprof.from_device(y)
            compiled = torch.compile(body, backend="eager", fullgraph=True)
            assert compiled(torch.ones(3)).item() == 6.0
            prof.step()
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
