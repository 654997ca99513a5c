"""GPU-accurate durations: CUDA events read back off the training thread; opt-in sync mode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from otelprof._schema import ATTR_CUDA_DURATION
from otelprof._timings._recorder import timing
from tests.timings_harness import one, start_run


def gpu_only(test):  # type: ignore[no-untyped-def]
    return pytest.mark.gpu(
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")(test)
    )


@gpu_only
def test_no_cuda_events_before_the_process_uses_cuda(tmp_path: Path) -> None:
    # on a GPU machine, CPU-only code must not create a CUDA context through otelprof: in a
    # process of its own, since an earlier test in this one has made a context already
    code = f"""
import torch, otelprof
from tests.otlp_files import read_spans
with otelprof.instrument(output_dir={str(tmp_path)!r}) as prof:
    with otelprof.timing("cpu_block"):
        pass
    otelprof.step()
assert not torch.cuda.is_initialized(), "otelprof created a CUDA context"
(span,) = [s for s in read_spans(prof.files["traces"]) if s.name == "cpu_block"]
assert {ATTR_CUDA_DURATION!r} not in span.attributes, span.attributes
"""
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _gpu_work() -> None:
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a
        a = a / a.norm()


@gpu_only
def test_timing_span_gets_the_device_duration_without_synchronizing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _gpu_work()  # warm: the first matmul loads cuBLAS and its kernels on the host
    torch.cuda.synchronize()
    calls = []
    real_sync = torch.cuda.synchronize

    def counting_sync(*args: object, **kwargs: object) -> None:
        calls.append(1)
        real_sync(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.cuda, "synchronize", counting_sync)
    run = start_run(tmp_path)
    with timing("gpu_block"):
        _gpu_work()
    assert calls == [], "the training thread never synchronizes"
    monkeypatch.setattr(torch.cuda, "synchronize", real_sync)
    span = one(run.finish(), "gpu_block")
    device_s = span.attributes[ATTR_CUDA_DURATION]
    assert device_s > 5 * span.duration_s, (device_s, span.duration_s)


@gpu_only
def test_sync_mode_reproduces_synchronized_host_timings(tmp_path: Path) -> None:
    torch.zeros(1, device="cuda")
    run = start_run(tmp_path, sync_cuda=True)
    with timing("gpu_block"):
        _gpu_work()
    span = one(run.finish(), "gpu_block")
    device_s = span.attributes[ATTR_CUDA_DURATION]
    assert span.duration_s >= 0.9 * device_s


class _StandInEvent:
    """CUDA cannot run on CPU machines; this stands in for torch.cuda.Event to check our own
    queueing: the builder must wait for the end event without blocking, then read it."""

    completed = False

    def __init__(self, enable_timing: bool = True) -> None:
        assert enable_timing

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return _StandInEvent.completed

    def elapsed_time(self, end: _StandInEvent) -> float:
        return 12.5  # milliseconds


class _StandInCuda:
    Event = _StandInEvent

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        raise AssertionError("the training thread must not synchronize")


class _StandInTorch:
    cuda = _StandInCuda


def test_device_durations_wait_for_their_events_then_reach_the_span(tmp_path: Path) -> None:
    from otelprof._timings import _recorder as rec
    from otelprof._timings._cuda import CudaTimer

    run = start_run(tmp_path)
    timer = CudaTimer(_StandInTorch, events=True, sync=False)
    run.engine._builder._cuda = timer
    rec.recorder.cuda_timer = timer
    _StandInEvent.completed = False
    with timing("pending_gpu"):
        pass
    rec.recorder.cuda_timer = None
    run.engine.step()  # the step's ranges reach the builder with it
    run.engine._builder.drain(final=False)
    assert run.engine.stats()["cuda_pending"] == 1, "not built until the end event completes"
    _StandInEvent.completed = True
    run.engine._builder.drain(final=False)
    assert run.engine.stats()["cuda_pending"] == 0
    span = one(run.finish(), "pending_gpu")
    assert span.attributes[ATTR_CUDA_DURATION] == pytest.approx(0.0125)
