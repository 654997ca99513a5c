"""The report's throughput section (figures: throughput_pass.py, computed in the summary's
single pass over the files)."""

from __future__ import annotations

from otelprof.analysis.sections import Section, section
from otelprof.analysis.summary import RunSummary


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else float(f"{value:.{digits}g}")


@section
def throughput_section(summary: RunSummary) -> Section | None:
    """Samples/s, tokens/s and MFU per phase (the rules: throughput_pass.py)."""
    steps = summary.steps_range
    rows = summary.throughput
    if not rows:
        return None
    table = [
        {
            "phase": r.phase,
            "steps": r.steps,
            "samples/s": _round(r.samples_per_s),
            "tokens/s": _round(r.tokens_per_s),
            "TFLOP/s": _round(r.flops_per_s / 1e12 if r.flops_per_s is not None else None),
            "MFU %": _round(100 * r.mfu if r.mfu is not None else None, 3),
            "peak TFLOP/s": _round(r.peak_flops / 1e12 if r.peak_flops else None),
            "processes": r.processes,
        }
        for r in rows
    ]
    notes = []
    if any(r.from_aggregates for r in rows):
        notes.append(
            "traces were sampled: training samples/s and tokens/s are the exported counters "
            "over every step's time (otelprof.timing.duration, step 0 included); TFLOP/s "
            "and MFU are the kept steps' rate"
        )
    if any(r.step0_only for r in rows):
        notes.append(
            "step() was never called, so the run is one step: its training rate is that "
            "step's, set-up and warm-up included"
        )
    notes += [
        "rates are work / step time of each phase's steps (other phases excluded), summed "
        "over processes; MFU is per device; "
        + (
            "steps as selected by --steps"
            if steps is not None
            else "training step 0 (warm-up) is left out"
        )
    ]
    return Section("throughput", "Throughput and MFU", table, notes)
