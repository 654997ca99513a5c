"""The report's throughput under trace sampling comes from the counters and the step
histogram (every step), not from the kept step traces alone."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import otelprof
from otelprof.analysis.reader import WarningLog, open_run
from otelprof.analysis.summary import summarize
from otelprof.analysis.throughput import throughput_section

STEPS = 3000
SAMPLES, TOKENS = 8, 64


def _run(tmp_path: Path, budget: float) -> tuple[Path, float, float]:
    """A run of STEPS steps; returns its directory, the steps' wall time and the ranges'
    time, both timed here."""
    prof = otelprof.instrument(
        output_dir=str(tmp_path), run_id=f"t{budget}", trace_budget=budget,
        host_metrics=False, process_metrics=False,
    )  # fmt: skip
    wall = inner = 0.0
    try:
        for i in range(STEPS):
            t0 = time.perf_counter()
            with otelprof.timing("forward"):
                t1 = time.perf_counter()
                time.sleep(0.0002 if i % 9 else 0.0008)
                inner += time.perf_counter() - t1
            otelprof.step_work(samples=SAMPLES, tokens=TOKENS, flops=1e6)
            otelprof.step()
            wall += time.perf_counter() - t0
    finally:
        prof.shutdown()
    assert prof.run_dir is not None
    return prof.run_dir, wall, inner


def test_sampled_run_throughput_counts_every_step_from_counters_and_step_histogram(
    tmp_path: Path,
) -> None:
    run, wall, inner = _run(tmp_path, 0.0)
    warn = WarningLog(sink=lambda _m: None)
    summary = summarize(open_run([run]), warn)
    assert summary.read.spans < 2 * STEPS  # most steps' traces were sampled out
    section = throughput_section(summary)
    assert section is not None
    (train,) = [row for row in section.rows if row["phase"] == "train"]
    assert train["steps"] == STEPS  # every step, not the kept ones
    assert any("traces were sampled" in note for note in section.notes)
    # samples/s = every sample / every step's time (the step histogram's exact total)...
    assert summary.step.count == STEPS
    assert train["samples/s"] == pytest.approx(SAMPLES * STEPS / summary.step.total, rel=1e-3)
    assert train["tokens/s"] == pytest.approx(TOKENS * STEPS / summary.step.total, rel=1e-3)
    # ...which lies between the two figures timed here, independently: a step lasts at
    # least its range's body and at most the loop's wall time
    rate = train["samples/s"]  # rounded to 4 digits
    assert SAMPLES * STEPS / wall * 0.999 <= rate <= SAMPLES * STEPS / inner * 1.001


def test_fully_traced_run_keeps_the_span_throughput_without_a_sampling_note(
    tmp_path: Path,
) -> None:
    run, _wall, _inner = _run(tmp_path, float("inf"))
    summary = summarize(open_run([run]), WarningLog(sink=lambda _m: None))
    section = throughput_section(summary)
    assert section is not None
    (train,) = [row for row in section.rows if row["phase"] == "train"]
    assert train["steps"] == STEPS - 1  # step 0 (warm-up) left out, as before
    assert not any("traces were sampled" in note for note in section.notes)
