"""On a machine with an NVIDIA GPU: the real NVML path end to end (skipped elsewhere)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import otelprof
from tests.otlp_files import read_points


def _nvml_gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


pytestmark = pytest.mark.skipif(_nvml_gpu_count() == 0, reason="no NVIDIA GPU / NVML here")


def test_busy_gpu_shows_utilization_memory_power_and_temperature(tmp_path: Path) -> None:
    import torch

    with otelprof.instrument(output_dir=tmp_path, interval=0.5, gpus="all") as prof:
        if torch.cuda.is_available():
            a = torch.randn(4096, 4096, device="cuda")
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                a = (a @ a).tanh()
            torch.cuda.synchronize()
        time.sleep(1.0)
    points = read_points(prof.files["metrics"])
    by_name: dict[str, list[float]] = {}
    for p in points:
        by_name.setdefault(p.name, []).append(p.value)
        if p.name.startswith("hw.gpu."):
            assert str(p.attributes["hw.id"]).startswith(("GPU-", "MIG-"))
            assert "gpu.index" in p.attributes
    assert {"hw.gpu.utilization", "hw.gpu.memory.free", "hw.gpu.memory.usage"} <= set(by_name)
    assert all(0.0 <= v <= 1.0 for v in by_name["hw.gpu.utilization"])
    if torch.cuda.is_available():
        assert max(by_name["hw.gpu.utilization"]) > 0.2  # the matmul loop kept it busy
        assert max(by_name["otelprof.torch.cuda.memory.allocated"]) >= 4096 * 4096 * 4
    assert all(v > 0 for v in by_name.get("hw.power", [1.0]))
    assert all(0 < v < 120 for v in by_name.get("hw.temperature", [50.0]))
