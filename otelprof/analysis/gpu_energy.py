"""Energy per step and GPU idle time by phase, from GPU samples and span intervals joined on
time (neither answers "what does a step cost?" alone; user view: docs/guide/hardware.md).

- A GPU sample covers the interval since its series' previous sample: `hw.gpu.utilization`
  u gives (1 - u)·(t1 - t0) idle GPU-seconds, `hw.energy` (cumulative J) the interval's
  energy (`hw.power` × interval where NVML refuses the counter). Both are taken as uniform
  within the interval and split by overlap, so a step much shorter than the sample interval
  is attributed statistically: exact summed over many steps, not for one.
- Labels are span intervals per host: training steps, root spans of other phases, and the
  timing names inside them (outside training labelled with their phase).
- Joules per step divides by one rank's step count (the ranks step together).
- Bounded: each label keeps at most `MAX_INTERVALS` intervals (`summary.IntervalSet`; past
  that, joined and scaled, and the section says so).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otelprof._schema import ATTR_PHASE as PHASE_ATTR
from otelprof._schema import ATTR_SAMPLES as SAMPLES_ATTR
from otelprof._schema import PHASE_TRAIN as DEFAULT_PHASE
from otelprof._schema import STEP_SPAN
from otelprof.analysis.reader import PointRec, ReadPlan, ReadStats, SpanRec, Warn, iter_records
from otelprof.analysis.sections import Section, section
from otelprof.analysis.summary import MAX_INTERVALS, IntervalSet, RunSummary

UTILIZATION = "hw.gpu.utilization"
ENERGY = "hw.energy"
POWER = "hw.power"
MAX_TIMING_NAMES = 40


def overlap_ns(intervals: list[tuple[int, int]], starts: list[int], a: int, b: int) -> int:
    """Time of [a, b) inside the sorted, disjoint `intervals` (`starts` = their starts)."""
    i = max(0, bisect.bisect_right(starts, a) - 1)
    total = 0
    while i < len(intervals) and intervals[i][0] < b:
        s, e = intervals[i]
        lo, hi = max(s, a), min(e, b)
        if hi > lo:
            total += hi - lo
        i += 1
    return total


@dataclass
class LabelRow:
    """One phase or timing name: its time, the GPU idle time and energy inside it."""

    kind: str  # "phase" or "timing"
    label: str
    seconds: float = 0.0  # wall time of the label (summed over hosts)
    gpu_seconds: float = 0.0  # label time × GPUs sampled (the denominator of idle share)
    idle_gpu_seconds: float = 0.0
    energy_j: float = 0.0
    energy_seconds: float = 0.0  # label time covered by energy samples (GPU-seconds)
    energy_span_s: float = 0.0  # label time × GPUs with energy data (GPU-seconds)
    approximate: bool = False

    @property
    def idle_share(self) -> float | None:
        return self.idle_gpu_seconds / self.gpu_seconds if self.gpu_seconds else None

    @property
    def mean_power_w(self) -> float | None:
        """Mean power per GPU inside the label (W)."""
        return self.energy_j / self.energy_seconds if self.energy_seconds else None

    @property
    def total_energy_j(self) -> float | None:
        """Energy of the whole label: parts before the first / after the last sample of a
        GPU are counted at that GPU's mean power inside the label."""
        if not self.energy_seconds:
            return None
        return self.energy_j * max(1.0, self.energy_span_s / self.energy_seconds)


@dataclass
class GpuEnergy:
    """The analysis result: per label rows, steps and energy per step."""

    rows: list[LabelRow]
    train_steps: int
    energy_source: str | None  # "hw.energy", "hw.power" or None (no energy data)
    gpus: int
    samples: float | None = None  # summed over training steps, when steps carry it
    notes: list[str] = field(default_factory=list)

    def row(self, kind: str, label: str) -> LabelRow | None:
        return next((r for r in self.rows if r.kind == kind and r.label == label), None)

    @property
    def joules_per_step(self) -> float | None:
        train = self.row("phase", DEFAULT_PHASE)
        if train is None or not self.train_steps or train.total_energy_j is None:
            return None
        return train.total_energy_j / self.train_steps

    @property
    def samples_per_joule(self) -> float | None:
        train = self.row("phase", DEFAULT_PHASE)
        if self.samples is None or train is None or not train.total_energy_j:
            return None
        return self.samples / train.total_energy_j


def analyze(files: Iterable[Path], warn: Warn, plan: ReadPlan | None = None) -> GpuEnergy | None:
    """One pass over a run's files (the parts `plan` reads; default: all); None when the
    run has no GPU samples or no spans."""
    phases: dict[tuple[str, str], IntervalSet] = {}
    timings: dict[tuple[str, str], IntervalSet] = {}
    timing_names: set[str] = set()
    steps_by_process: dict[Any, int] = {}
    samples: float | None = None  # None: no step declared its samples
    # (host, GPU, metric) -> that GPU's samples of the metric: (time ns, value)
    series: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
    for rec in iter_records(files, warn, ReadStats(), plan=plan):
        if isinstance(rec, SpanRec):
            host = rec.resource.host
            phase = rec.attr(PHASE_ATTR)
            if rec.name == STEP_SPAN:
                label = str(phase) if phase else DEFAULT_PHASE
                phases.setdefault((host, label), IntervalSet()).add(rec.start_ns, rec.end_ns)
                if label == DEFAULT_PHASE:
                    steps_by_process[rec.resource] = steps_by_process.get(rec.resource, 0) + 1
                    n = rec.attr(SAMPLES_ATTR)
                    if isinstance(n, (int, float)) and not isinstance(n, bool):
                        samples = (samples or 0.0) + float(n)
            elif not rec.parent_span_id and phase and phase != DEFAULT_PHASE:
                phases.setdefault((host, str(phase)), IntervalSet()).add(rec.start_ns, rec.end_ns)
            else:
                name = rec.name if not phase or phase == DEFAULT_PHASE else f"{rec.name} ({phase})"
                if name in timing_names or len(timing_names) < MAX_TIMING_NAMES:
                    timing_names.add(name)
                    timings.setdefault((host, name), IntervalSet()).add(rec.start_ns, rec.end_ns)
        elif isinstance(rec, PointRec) and rec.name in (UTILIZATION, ENERGY, POWER):
            attrs = dict(rec.attributes)
            gpu = str(attrs.get("hw.id", attrs.get("gpu.index", "")))
            key = (rec.resource.host, gpu, rec.name)
            series.setdefault(key, []).append((rec.time_ns, rec.value))
    if not series or not (phases or timings):
        return None
    # the same GPU may be reported by several processes (gpus="all"): keep one copy per time
    for key, points in series.items():
        series[key] = sorted(set(points))
    gpus = {(h, g) for h, g, _ in series}
    has_energy = {(h, g) for h, g, n in series if n == ENERGY}
    source = ENERGY if has_energy else (POWER if any(n == POWER for *_, n in series) else None)

    rows: list[LabelRow] = []
    for kind, table in (("phase", phases), ("timing", timings)):
        by_label: dict[str, LabelRow] = {}
        for (host, label), ivs in sorted(table.items()):
            row = by_label.setdefault(label, LabelRow(kind, label))
            intervals = ivs.intervals()
            starts = [s for s, _ in intervals]
            scale = ivs.scale()
            row.approximate = row.approximate or ivs.lossy
            row.seconds += ivs.covered_ns() * scale / 1e9
            for (h, gpu, name), points in series.items():
                if h != host:
                    continue
                if name == ENERGY or (name == POWER and (h, gpu) not in has_energy):
                    row.energy_span_s += ivs.covered_ns() * scale / 1e9
                _accumulate(row, name, points, intervals, starts, scale, (h, gpu) in has_energy)
        rows.extend(by_label.values())
    steps = max(steps_by_process.values(), default=0)
    notes = []
    if any(r.approximate for r in rows):
        notes.append(
            f"over {MAX_INTERVALS:,} separate intervals for a label: closest ones joined, "
            "overlaps scaled to the label's true time"
        )
    if source == POWER:
        notes.append("energy from hw.power × sample interval (NVML refused the energy counter)")
    return GpuEnergy(rows, steps, source, len(gpus), samples, notes)


def _accumulate(
    row: LabelRow,
    name: str,
    points: list[tuple[int, float]],
    intervals: list[tuple[int, int]],
    starts: list[int],
    scale: float,
    energy_counter: bool,
) -> None:
    """Add one GPU series' contribution to a label (see module docstring)."""
    for (t0, v0), (t1, v1) in itertools.pairwise(points):
        if t1 <= t0:
            continue
        inside = overlap_ns(intervals, starts, t0, t1) * scale
        if not inside:
            continue
        if name == UTILIZATION:
            row.gpu_seconds += inside / 1e9
            row.idle_gpu_seconds += (1.0 - min(1.0, max(0.0, v1))) * inside / 1e9
        elif name == ENERGY:
            if v1 < v0:
                continue  # counter reset (driver reload)
            row.energy_j += (v1 - v0) * inside / (t1 - t0)
            row.energy_seconds += inside / 1e9
        elif name == POWER and not energy_counter:
            row.energy_j += v1 * inside / 1e9
            row.energy_seconds += inside / 1e9


def section_rows(result: GpuEnergy) -> list[dict[str, Any]]:
    """Table rows for the report (text and JSON alike): one per phase / timing name."""
    rows = []
    for r in sorted(result.rows, key=lambda r: (r.kind != "phase", -r.seconds)):
        share = r.idle_share
        is_train = r.kind == "phase" and r.label == DEFAULT_PHASE
        jps = result.joules_per_step if is_train else None
        rows.append(
            {
                "kind": r.kind,
                "label": r.label,
                "steps": result.train_steps if is_train else None,
                "energy_per_step_j": round(jps, 4) if jps is not None else None,
                "seconds": round(r.seconds, 6),
                "gpu_idle_s": round(r.idle_gpu_seconds, 6) if r.gpu_seconds else None,
                "gpu_idle_share": round(share, 4) if share is not None else None,
                "energy_j": round(r.total_energy_j, 3) if r.total_energy_j is not None else None,
                "mean_power_w": (round(r.mean_power_w, 2) if r.mean_power_w is not None else None),
            }
        )
    return rows


def summary_notes(result: GpuEnergy) -> list[str]:
    """Headline figures: joules per step, samples per joule, GPU idle while loading data."""
    out = []
    jps = result.joules_per_step
    if jps is not None:
        out.append(
            f"energy per training step: {jps:.4g} J over {result.gpus} GPU(s) "
            f"({result.train_steps:,} steps, from {result.energy_source})"
        )
    spj = result.samples_per_joule
    if spj is not None:
        out.append(f"samples per joule: {spj:.4g}")
    loading = result.row("timing", "dataloader_next")
    if loading is not None and loading.idle_share is not None:
        out.append(
            f"GPU idle while loading data: {loading.idle_gpu_seconds:.3g} GPU-s "
            f"({loading.idle_share:.0%} of the GPU time inside dataloader_next)"
        )
    return out + result.notes


@section
def gpu_energy_section(summary: RunSummary) -> Section | None:
    """The report's "GPU energy and idle time by phase" section (text and --json)."""
    if not any(s.name in (UTILIZATION, POWER) for s in summary.series.values()):
        return None  # no GPU samples: skip the second pass over the files
    result = analyze(summary.files.jsonl, lambda _message: None, summary.plan)  # warned already
    if result is None:
        return None
    notes = summary_notes(result)
    notes.append("whole run (a --steps range does not apply to this section)")
    return Section("gpu_energy", "GPU energy and idle time by phase", section_rows(result), notes)
