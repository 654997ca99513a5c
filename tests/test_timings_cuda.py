"""GPU-accurate durations: CUDA events read back off the training thread; opt-in sync mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from otelprof.timings import ATTR_CUDA_DURATION, timing
from tests.timings_harness import one, start_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here"),
]


def test_no_cuda_events_before_the_process_uses_cuda(tmp_path: Path) -> None:
    # on a GPU machine, CPU-only code must not create a CUDA context through otelprof
    if torch.cuda.is_initialized():
        pytest.skip("CUDA already initialized by an earlier test in this process")
    run = start_run(tmp_path)
    with timing("cpu_block"):
        pass
    span = one(run.finish(), "cpu_block")
    assert ATTR_CUDA_DURATION not in span.attributes
    assert not torch.cuda.is_initialized()


def _gpu_work() -> None:
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a
        a = a / a.norm()


def test_timing_span_gets_the_device_duration_without_synchronizing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.cuda.init()
    torch.zeros(1, device="cuda")
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


def test_sync_mode_reproduces_synchronized_host_timings(tmp_path: Path) -> None:
    torch.zeros(1, device="cuda")
    run = start_run(tmp_path, sync_cuda=True)
    with timing("gpu_block"):
        _gpu_work()
    span = one(run.finish(), "gpu_block")
    device_s = span.attributes[ATTR_CUDA_DURATION]
    assert span.duration_s >= 0.9 * device_s
