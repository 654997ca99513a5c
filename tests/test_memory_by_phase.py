"""Memory by phase: RSS labelled by phase (every run), the CUDA allocator's peaks by phase
(`memory_peaks`), as metrics and in the report's memory section.

The CUDA calls sit behind `memory_peaks.CudaPeaks`; on this machine (no GPU) a scripted
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
from otelprof.system import memory_peaks, names
from otelprof.system.memory_peaks import PhasePeaks, TorchCudaPeaks
from tests.otlp_files import read_points

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _no_profiler_left_running() -> Iterator[None]:
    yield
    otelprof.uninstrument()


class ScriptedAllocator:
    """`torch.cuda` as far as peaks go: allocated/reserved with torch's peak
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

    def device_count(self) -> int:
        return 2  # this process uses device 0 only: device 1 reports nothing

    def get_device_properties(self, _device: int) -> Any:
        return SimpleNamespace(uuid="5d3e1b2c")

    def memory_stats_as_nested_dict(self, device: int) -> dict[str, Any]:
        if device == 1:
            return {
                "allocated_bytes": {"all": {"current": 0, "peak": 0}},
                "reserved_bytes": {"all": {"current": 0, "peak": 0}},
            }
        return {
            "allocated_bytes": {"all": {"current": self.allocated, "peak": self.peak}},
            "reserved_bytes": {"all": {"current": self.reserved, "peak": self.reserved_peak}},
        }

    def reset_peak_memory_stats(self, device: int) -> None:
        assert device == 0
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
            otelprof.step()
        wait_for_samples(prof)
        train_rss = process.memory_info().rss
        with otelprof.phase("validation"):
            big = bytearray(256 * MiB)
            big[::4096] = b"\1" * len(big[::4096])  # touched: resident
            validation_rss = process.memory_info().rss
            wait_for_samples(prof)
            del big
        wait_for_samples(prof)
        otelprof.step()
    assert prof.run_dir is not None
    rows = memory_rows(capsys, prof.run_dir)
    assert abs(rows["validation"]["RSS max MiB"] - validation_rss / MiB) < 16
    assert abs(rows["train"]["RSS max MiB"] - train_rss / MiB) < 16
    assert rows["validation"]["RSS max MiB"] - rows["train"]["RSS max MiB"] > 200
    assert rows["train"]["processes"] == 1


def test_cuda_peaks_by_phase_with_memory_peaks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = ScriptedAllocator(base=100 * MiB)
    monkeypatch.setattr(
        memory_peaks,
        "TorchCudaPeaks",
        lambda: TorchCudaPeaks({"torch": SimpleNamespace(cuda=cuda)}),
    )

    def training_step(transient: int) -> None:
        cuda.alloc(transient)  # activations of the step, freed at its end
        cuda.free(transient)
        otelprof.step()

    with otelprof.instrument(
        output_dir=tmp_path, interval=0.2, host_metrics=False, memory_peaks=True
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
    values = [p.value for p in peaks]
    # read and reset each interval: after the large steps, the intervals see the small ones
    assert max(values) == 164 * MiB
    last_large = len(values) - 1 - values[::-1].index(164 * MiB)
    assert max(values[last_large + 1 :]) == 108 * MiB
    assert all(p.attributes["hw.id"] == "GPU-5d3e1b2c" for p in peaks)
    assert all(p.start_ns is not None and p.start_ns < p.time_ns for p in peaks[1:])


def test_without_memory_peaks_the_programs_peak_counters_are_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = ScriptedAllocator(base=0)
    monkeypatch.setattr(
        memory_peaks,
        "TorchCudaPeaks",
        lambda: TorchCudaPeaks({"torch": SimpleNamespace(cuda=cuda)}),
    )
    with otelprof.instrument(output_dir=tmp_path, interval=0.2, host_metrics=False):
        for _ in range(3):
            otelprof.step()
    assert cuda.resets == 0


def test_a_failing_allocator_read_turns_memory_peaks_off_without_reaching_training() -> None:
    class Broken:
        calls = 0

        def read_and_reset(self) -> list[Any]:
            self.calls += 1
            raise RuntimeError("CUDA error: an illegal memory access")

    broken = Broken()
    peaks = PhasePeaks(broken)
    peaks.on_phase("train", "validation")
    assert broken.calls == 1 and peaks.failed
    assert peaks.sample(0, "train") == []
    assert broken.calls == 1


def test_a_change_of_phase_closes_the_phases_window_until_a_collection_takes_it() -> None:
    cuda = ScriptedAllocator(base=10 * MiB)
    peaks = PhasePeaks(TorchCudaPeaks({"torch": SimpleNamespace(cuda=cuda)}))

    def transient(n: int) -> None:
        cuda.alloc(n)
        cuda.free(n)

    transient(20 * MiB)
    peaks.on_phase("train", "validation")  # the training peak so far is training's
    transient(40 * MiB)
    peaks.on_phase("validation", "train")  # the validation block's own peak
    transient(5 * MiB)
    got = {(r.name, r.attributes["otelprof.phase"]): r.value for r in peaks.sample(5, "train")}
    assert got[(names.TORCH_CUDA_PEAK_ALLOCATED.name, "train")] == 30 * MiB
    assert got[(names.TORCH_CUDA_PEAK_ALLOCATED.name, "validation")] == 50 * MiB
    assert got[(names.TORCH_CUDA_PEAK_RESERVED.name, "validation")] == 50 * MiB
    # taken and reset: the next interval's peak is what is held now
    again = peaks.sample(6, "train")
    assert [(r.name, r.value) for r in again if "allocated" in r.name] == [
        (names.TORCH_CUDA_PEAK_ALLOCATED.name, 10 * MiB)
    ]
    assert cuda.resets == 4


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
        output_dir=tmp_path, interval=0.2, host_metrics=False, memory_peaks=True
    ) as prof:
        base = torch.cuda.memory_allocated(device)
        for _ in range(5):
            transient = torch.empty(64 * MiB, dtype=torch.uint8, device=device)
            del transient
            otelprof.step()
        wait_for_samples(prof)
        with otelprof.phase("validation"):
            transient = torch.empty(256 * MiB, dtype=torch.uint8, device=device)
            del transient
        otelprof.step()
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
