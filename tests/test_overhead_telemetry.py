"""Overhead self-telemetry: profiling's own cost as metrics, next to the data."""

from __future__ import annotations

import time
from pathlib import Path

import otelprof
from otelprof._timings import _recorder as rec
from tests.otlp_files import read_points, read_spans


def test_overhead_gauges_follow_the_ranges_recorded_and_calibration_leaves_no_trace(
    tmp_path: Path,
) -> None:
    prof = otelprof.instrument(
        output_dir=str(tmp_path), run_id="o", interval=0.2, trace_budget=float("inf"),
        host_metrics=False, process_metrics=False,
    )  # fmt: skip
    engine = prof._timings
    try:
        assert 0 < engine.range_cost_s < 1e-3  # calibrated at start, plausible
        assert len(rec.recorder.queue) == 0
        time.sleep(0.7)  # idle: no ranges
        idle_until = time.time_ns()
        deadline = time.monotonic() + 1.0
        ranges = 0
        while time.monotonic() < deadline:  # busy: bursts of ranges the builder keeps up with
            for _ in range(100):
                with otelprof.timing("busy"):
                    pass
            ranges += 100
            otelprof.step()
            time.sleep(0.001)
        busy_s = (time.time_ns() - idle_until) / 1e9
        busy_from = idle_until
        time.sleep(0.3)
    finally:
        prof.shutdown()
    spans = read_spans(prof.files["traces"])
    assert not any(s.name == "otelprof.calibration" for s in spans)
    assert sum(1 for s in spans if s.name == "busy") == ranges
    points = read_points(prof.files["metrics"])
    training = [p for p in points if p.name == "otelprof.overhead.training_thread"]
    background = [p for p in points if p.name == "otelprof.overhead.background_cpu"]
    assert training and background
    assert all(0 <= p.value <= 1.5 for p in training)
    assert all(p.value >= 0 for p in background)
    idle = [p.value for p in training if p.time_ns < busy_from]
    busy = [p.value for p in training if p.time_ns > busy_from + 300_000_000]
    assert idle and max(idle) == 0.0
    # the gauge is the ranges' rate x their calibrated cost: its busiest window reads at least
    # half the busy second's mean (a loaded machine runs fewer ranges, and the gauge says so)
    mean_busy = ranges * engine.range_cost_s / busy_s
    assert busy and max(busy) >= 0.5 * mean_busy > 0, (busy, mean_busy)
    # background threads did work while spans were built and written
    assert max(p.value for p in background if p.time_ns > busy_from) > 0
