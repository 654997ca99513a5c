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


def _gpm_supported() -> bool:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return bool(pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
    except pynvml.NVMLError:
        return False
    finally:
        pynvml.nvmlShutdown()


def _busy_run(tmp_path: Path, dtype_name: str = "float16") -> dict[str, list[tuple[float, dict]]]:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here (torch)")
    torch.cuda.set_device(0)
    with otelprof.instrument(
        output_dir=tmp_path, interval=0.5, gpus="visible", host_metrics=False
    ) as prof:
        a = torch.randn(8192, 8192, device="cuda", dtype=getattr(torch, dtype_name))
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            a = (a @ a).tanh()
        torch.cuda.synchronize()
        time.sleep(0.6)
    out: dict[str, list[tuple[float, dict]]] = {}
    for p in read_points(prof.files["metrics"]):
        out.setdefault(p.name, []).append((p.value, dict(p.attributes)))
    return out


def test_busy_gpu_shows_gpm_sm_and_tensor_activity_where_gpm_exists(tmp_path: Path) -> None:
    points = _busy_run(tmp_path)
    if not _gpm_supported():
        # pre-Hopper: GPM-only series absent (never 0), classic DRAM proxy present
        assert "hw.gpu.sm.activity" not in points
        assert all(
            a["otelprof.gpu.source"] == "nvml"
            for _, a in points.get("hw.gpu.memory.bandwidth.utilization", [])
        )
        return
    sm = [v for v, a in points["hw.gpu.sm.activity"] if a["otelprof.gpu.source"] == "gpm"]
    tensor = [v for v, _ in points["hw.gpu.tensor.activity"]]
    assert max(sm) > 0.3, sm  # fp16 matmuls keep most SMs busy
    assert max(tensor) > 0.05, tensor  # ... on the tensor pipes
    assert all(0.0 <= v <= 1.0 for v in sm + tensor)
    assert max(v for v, _ in points["hw.gpu.memory.bandwidth.utilization"]) > 0.0


def test_this_process_gpu_memory_is_reported_beside_the_device_total(tmp_path: Path) -> None:
    points = _busy_run(tmp_path)
    mine = [v for v, _ in points.get("otelprof.gpu.process.memory.usage", [])]
    used = [v for v, _ in points["hw.gpu.memory.usage"]]
    assert mine, "NVML's process list must show this process (not in a PID-namespaced container)"
    assert max(mine) >= 8192 * 8192 * 2  # at least the fp16 tensor we held
    assert max(mine) <= max(used)


def _nvml_devices() -> tuple[list[str], list[str]]:
    """(UUIDs of the physical GPUs, UUIDs of the MIG devices on those in MIG mode)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        gpus, migs = [], []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(str(pynvml.nvmlDeviceGetUUID(handle)))
            try:
                mig_on = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
            except pynvml.NVMLError:
                mig_on = False  # a GPU without MIG support
            for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle) if mig_on else 0):
                try:
                    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
                except pynvml.NVMLError:
                    continue  # an empty slot
                migs.append(str(pynvml.nvmlDeviceGetUUID(mig)))
        return gpus, migs
    finally:
        pynvml.nvmlShutdown()


def _sampled_ids(tmp_path: Path, **options: object) -> set[str]:
    with otelprof.instrument(output_dir=tmp_path, interval=0.2, host_metrics=False, **options) as p:
        time.sleep(0.7)
    return {
        str(pt.attributes["hw.id"])
        for pt in read_points(p.files["metrics"])
        if pt.name == "hw.gpu.memory.usage"
    }


def test_every_gpu_is_sampled_under_its_nvml_uuid_and_mig_devices_when_selected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus, migs = _nvml_devices()
    assert _sampled_ids(tmp_path / "all", gpus="all") == set(gpus)
    if not migs:
        return  # no GPU in MIG mode here: the physical GPUs are the devices, as above
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", migs[0])
    assert _sampled_ids(tmp_path / "mig", gpus="visible") == {migs[0]}
