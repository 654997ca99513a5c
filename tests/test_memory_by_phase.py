"""Memory by phase and step: RSS labelled by phase (every run), CUDA allocator peaks per step
(`step_memory`), as metrics and in the report's memory section.

The CUDA calls sit behind `step_memory.CudaPeaks`; on this machine (no GPU) a scripted
allocator with torch's peak semantics stands in for `torch.cuda`, and the GPU test skips.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

import otelprof
from otelprof.cli import main as cli_main
from otelprof.system import names, step_memory
from otelprof.system.step_memory import StepPeaks, TorchCudaPeaks
from tests.otlp_files import read_points

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _no_profiler_left_running() -> Iterator[None]:
    yield
    otelprof.uninstrument()


class ScriptedAllocator:
    """`torch.cuda` as far as per-step peaks go: allocated/reserved with torch's peak
    counters (a peak is the highest since the last reset; a reset starts it at the current)."""

    def __init__(self, base: int) -> None:
        self.allocated = self.peak = base
        self.reserved = self.reserved_peak = base
        self.resets = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, -(-self.allocated // (2 * MiB)) * 2 * MiB)
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, n: int) -> None:
        self.allocated -= n

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, _device: int) -> Any:
        return SimpleNamespace(uuid="5d3e1b2c")

    def memory_stats_as_nested_dict(self, _device: int) -> dict[str, Any]:
        return {
            "allocated_bytes": {"all": {"current": self.allocated, "peak": self.peak}},
            "reserved_bytes": {"all": {"current": self.reserved, "peak": self.reserved_peak}},
        }

    def reset_peak_memory_stats(self, _device: int) -> None:
        self.resets += 1
        self.peak, self.reserved_peak = self.allocated, self.reserved


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def wait_for_samples(prof: Any, n: int = 2) -> None:
    """Until the system sampler has taken `n` more snapshots (each labels the phase now)."""
    system = prof._session.system
    target = system.samples_taken + n
    wait_for(lambda: system.samples_taken >= target)


def memory_rows(capsys: pytest.CaptureFixture[str], run_dir: Path) -> dict[str, dict[str, Any]]:
    capsys.readouterr()
    assert cli_main(["report", "--json", str(run_dir)]) == 0
    doc = json.loads(capsys.readouterr().out)
    return {r["phase"]: r for r in doc["sections"]["memory"]["rows"]}


def test_rss_by_phase_matches_what_psutil_saw_in_each_phase(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    process = psutil.Process()
    with otelprof.instrument(output_dir=tmp_path, interval=0.2, host_metrics=False) as prof:
        for _ in range(3):
            prof.step()
        wait_for_samples(prof)
        train_rss = process.memory_info().rss
        with otelprof.phase("validation"):
            big = bytearray(256 * MiB)
            big[::4096] = b"\1" * len(big[::4096])  # touched: resident
            validation_rss = process.memory_info().rss
            wait_for_samples(prof)
            del big
        wait_for_samples(prof)
        prof.step()
    assert prof.run_dir is not None
    rows = memory_rows(capsys, prof.run_dir)
    assert abs(rows["validation"]["RSS max MiB"] - validation_rss / MiB) < 16
    assert abs(rows["train"]["RSS max MiB"] - train_rss / MiB) < 16
    assert rows["validation"]["RSS max MiB"] - rows["train"]["RSS max MiB"] > 200
    assert rows["train"]["processes"] == 1


def test_cuda_peaks_per_step_and_phase_with_step_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = ScriptedAllocator(base=100 * MiB)
    monkeypatch.setattr(
        step_memory, "TorchCudaPeaks", lambda: TorchCudaPeaks({"torch": SimpleNamespace(cuda=cuda)})
    )

    def training_step(transient: int) -> None:
        cuda.alloc(transient)  # activations of the step, freed at its end
        cuda.free(transient)
        prof.step()

    with otelprof.instrument(
        output_dir=tmp_path, interval=0.2, host_metrics=False, step_memory=True
    ) as prof:
        for _ in range(4):
            training_step(64 * MiB)
        wait_for_samples(prof)
        for _ in range(4):
            training_step(8 * MiB)  # smaller steps: their own, lower peak
        wait_for_samples(prof)
        with otelprof.phase("validation"):
            cuda.alloc(300 * MiB)
            cuda.free(300 * MiB)
        training_step(8 * MiB)
        wait_for_samples(prof)
    assert prof.run_dir is not None

    rows = memory_rows(capsys, prof.run_dir)
    assert rows["train"]["CUDA peak allocated MiB"] == 164.0
    assert rows["validation"]["CUDA peak allocated MiB"] == 400.0
    assert rows["validation"]["CUDA peak reserved MiB"] == 400.0
    peaks = [
        p
        for p in read_points(prof.files["metrics"])
        if p.name == names.TORCH_CUDA_PEAK_ALLOCATED.name
        and p.attributes["otelprof.phase"] == "train"
    ]
    # reset each step: after the large steps, the collections see the small steps' peak
    assert peaks[0].value == 164 * MiB and peaks[-1].value == 108 * MiB
    assert all(p.attributes["hw.id"] == "GPU-5d3e1b2c" for p in peaks)
    assert all(p.start_ns is not None and p.start_ns < p.time_ns for p in peaks[1:])


def test_without_step_memory_the_programs_peak_counters_are_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = ScriptedAllocator(base=0)
    monkeypatch.setattr(
        step_memory, "TorchCudaPeaks", lambda: TorchCudaPeaks({"torch": SimpleNamespace(cuda=cuda)})
    )
    with otelprof.instrument(output_dir=tmp_path, interval=0.2, host_metrics=False) as prof:
        for _ in range(3):
            prof.step()
    assert cuda.resets == 0


def test_a_failing_allocator_read_turns_step_memory_off_without_reaching_training() -> None:
    class Broken:
        calls = 0

        def read_and_reset(self) -> list[Any]:
            self.calls += 1
            raise RuntimeError("CUDA error: an illegal memory access")

    broken = Broken()
    peaks = StepPeaks(broken)
    peaks.on_step(1, 1000, False)
    peaks.on_phase("train", "validation")
    assert broken.calls == 1 and peaks.failed
    assert peaks.sample(0) == []


def test_step_peaks_keep_each_phases_highest_until_a_collection_takes_them() -> None:
    cuda = ScriptedAllocator(base=10 * MiB)
    peaks = StepPeaks(TorchCudaPeaks({"torch": SimpleNamespace(cuda=cuda)}))
    for transient in (5 * MiB, 20 * MiB, 1 * MiB):
        cuda.alloc(transient)
        cuda.free(transient)
        peaks.on_step(0, 0, False)
    cuda.alloc(40 * MiB)
    cuda.free(40 * MiB)
    peaks.on_phase("validation", "train")  # leaving validation: its block's peak
    got = {(r.name, r.attributes["otelprof.phase"]): r.value for r in peaks.sample(5)}
    assert got[(names.TORCH_CUDA_PEAK_ALLOCATED.name, "train")] == 30 * MiB
    assert got[(names.TORCH_CUDA_PEAK_ALLOCATED.name, "validation")] == 50 * MiB
    assert peaks.sample(6) == []  # taken: the next collection starts afresh


def test_real_torch_without_cuda_gives_no_peaks_and_leaves_cuda_alone() -> None:
    torch = pytest.importorskip("torch")
    before = torch.cuda.is_initialized()
    if before:
        pytest.skip("CUDA is initialized in this process; see the GPU test")
    assert TorchCudaPeaks().read_and_reset() == []
    assert torch.cuda.is_initialized() is False


def test_cuda_peaks_on_a_gpu_match_the_tensors_the_step_allocated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine (runs on a GPU host: make gpu-check)")
    device = torch.device("cuda", 0)
    keep = torch.zeros(16 * MiB // 4, device=device)  # resident across steps
    with otelprof.instrument(
        output_dir=tmp_path, interval=0.2, host_metrics=False, step_memory=True
    ) as prof:
        base = torch.cuda.memory_allocated(device)
        for _ in range(5):
            transient = torch.empty(64 * MiB, dtype=torch.uint8, device=device)
            del transient
            prof.step()
        wait_for_samples(prof)
        with otelprof.phase("validation"):
            transient = torch.empty(256 * MiB, dtype=torch.uint8, device=device)
            del transient
        prof.step()
        wait_for_samples(prof)
    del keep
    assert prof.run_dir is not None
    rows = memory_rows(capsys, prof.run_dir)
    assert rows["train"]["CUDA peak allocated MiB"] == round((base + 64 * MiB) / MiB, 1)
    assert rows["validation"]["CUDA peak allocated MiB"] == round((base + 256 * MiB) / MiB, 1)
    assert (
        rows["validation"]["CUDA peak reserved MiB"]
        >= rows["validation"]["CUDA peak allocated MiB"]
    )
