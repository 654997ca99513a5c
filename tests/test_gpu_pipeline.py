"""The whole GPU chain in one real run: instrument() → GPU sampler → detached files → report.

A real PyTorch training loop (CPU) runs under `otelprof.instrument()`; the only stand-in is
the NVML driver (tests/fake_nvml.py, a Hopper-like GPU with GPM drawing a constant 200 W),
put where `import pynvml` finds it. The report's GPU section and the live metrics must then
agree with the power the driver reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import otelprof
from otelprof._demo import train
from tests.fake_nvml import GPM_SM, GPM_TENSOR, FakeGpu, FakeNvml
from tests.otlp_files import read_points

WATTS = 200.0


class Driver:
    """Moves the fake GPU's counters along with real time: 200 W, 60 % SM activity."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self._stop = threading.Event()
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="fake-gpu", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.tick()

    def tick(self) -> None:
        now = time.monotonic()
        dt, self._last = now - self._last, now
        self.gpu.energy_mj += round(WATTS * 1000 * dt)
        self.gpu.run(dt, **{f"m{GPM_SM}": 60.0, f"m{GPM_TENSOR}": 30.0})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def test_a_run_on_a_fake_gpu_reports_energy_per_step_gpm_and_idle_by_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = FakeGpu(
        uuid="GPU-e2e0-0000-0000-0000-000000000000",
        utilization_rate=70,
        gpm_supported=True,
        processes=[(os.getpid(), 3 * 2**30)],
    )
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([gpu]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    driver = Driver(gpu)
    try:
        with otelprof.instrument(output_dir=tmp_path, interval=0.5) as prof:
            # 3 s of training and at least 3 steps, however few steps a busy machine fits
            # into 3 s (a step took seconds at load 20 on 2 cores)
            steps = 0
            while steps < 3:
                steps += train(prof, seconds=3.0, device="cpu").steps
            with otelprof.phase("validation"), otelprof.timing("validate"):
                time.sleep(0.6)
    finally:
        driver.stop()
    points = read_points(prof.files["metrics"])
    by_name: dict[str, list[float]] = {}
    for p in points:
        by_name.setdefault(p.name, []).append(p.value)
    assert max(by_name["hw.gpu.sm.activity"]) == pytest.approx(0.6, abs=0.05)
    assert max(by_name["otelprof.gpu.process.memory.usage"]) == 3 * 2**30
    assert by_name["otelprof.gpu.energy.per_step"], "live energy per step"
    assert "otelprof.gpu.idle" in by_name

    run_dir = Path(prof.files["metrics"]).parent
    report = subprocess.run(
        [sys.executable, "-m", "otelprof", "report", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    section = json.loads(report.stdout)["sections"]["gpu_energy"]
    rows = {(r["kind"], r["label"]): r for r in section["rows"]}
    train_row = rows[("phase", "train")]
    # constant 200 W: energy per step = 200 W × mean step time
    assert train_row["mean_power_w"] == pytest.approx(WATTS, rel=0.1)
    assert train_row["energy_per_step_j"] == pytest.approx(
        WATTS * train_row["seconds"] / train_row["steps"], rel=0.1
    )
    assert train_row["gpu_idle_share"] == pytest.approx(0.3, abs=0.02)  # 70 % busy
    assert ("phase", "validation") in rows
