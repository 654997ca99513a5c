"""`otelprof compare A B`: what changed from run A to run B, in figures and in plain words.

Each run is read once, exactly as `otelprof report` reads it (summary, verdict, sections);
the comparison only pairs the two reports' figures, a step's parts as time per step. Every
row has a direction (`lower` or `higher` is better, or neither, as for CPU utilization);
`changes` puts the few that matter in words, largest first, and `headline` joins the main
one with the verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from otelprof._schema import RUN_ENDED
from otelprof.analysis.format import value
from otelprof.analysis.memory_section import MEMORY_GAUGES, memory_by_phase
from otelprof.analysis.module_section import module_times
from otelprof.analysis.sections import Section
from otelprof.analysis.summary import RunSummary
from otelprof.analysis.verdict import UNTIMED, Verdict, direct_shares

SIGNIFICANT = 0.05
"""A part's change is named in words when it moves by at least this share of itself ..."""
SIGNIFICANT_OF_STEP = 0.02
"""... and by at least this share of run A's step time (noise on tiny parts stays quiet)."""
STEP_UNCHANGED = 0.02
"""Step time moving less than this is "unchanged"."""
SAME = 0.005
"""A figure moving less than this share of itself reads "same"."""
TOP_MODULES = 10
_HIGHER_IS_BETTER = ("hw.gpu.utilization", "hw.gpu.sm.activity", "hw.gpu.tensor.activity")
# compared elsewhere (memory) or not a measurement (the end marker for Prometheus' alerts)
_NOT_HARDWARE = (*MEMORY_GAUGES, RUN_ENDED)


@dataclass
class Run:
    """One side of the comparison: a run as `otelprof report` sees it."""

    label: str  # "A" or "B"
    summary: RunSummary
    verdict: Verdict
    sections: list[Section] = field(default_factory=list)

    @property
    def name(self) -> str:
        files = self.summary.files
        return ", ".join(files.run_ids) or ", ".join(str(d) for d in files.dirs)


@dataclass
class Delta:
    """One figure in both runs."""

    group: str  # "steps", "per step", "throughput", "hardware", "memory", "modules", ...
    name: str
    unit: str  # an OTel unit: "s", "1", "By", "{sample}/s", ...
    a: float | None
    b: float | None
    better: str = ""  # "lower", "higher" or "" (neither)

    @property
    def change(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a

    @property
    def relative(self) -> float | None:
        change = self.change
        if change is None or not self.a:
            return None
        return change / abs(self.a)

    @property
    def direction(self) -> str:
        """faster/slower (times), better/worse (other figures with a better side),
        higher/lower (figures without), same (within `SAME`), new or gone."""
        if self.a is None and self.b is None:
            return ""
        if self.a is None:
            return "new"
        if self.b is None:
            return "gone"
        relative = self.relative
        if self.b == self.a or (relative is not None and abs(relative) < SAME):
            return "same"
        up = self.b > self.a
        if not self.better:
            return "higher" if up else "lower"
        good = up == (self.better == "higher")
        if self.unit == "s":
            return "faster" if good else "slower"
        return "better" if good else "worse"


@dataclass
class Comparison:
    a: Run
    b: Run
    rows: list[Delta]
    changes: list[str]  # the changes that matter, in words, most important first
    headline: str

    def group(self, name: str) -> list[Delta]:
        return [r for r in self.rows if r.group == name]


def compare(a: Run, b: Run) -> Comparison:
    """Pair the two runs' figures and say what changed."""
    rows = (
        _steps(a.summary, b.summary)
        + _per_step(a.summary, b.summary)
        + _processes(a.summary, b.summary)
        + _throughput(a.summary, b.summary)
        + _memory(a.summary, b.summary)
        + _modules(a.summary, b.summary)
        + _hardware(a.summary, b.summary)
    )
    changes, headline = _in_words(a, b, rows)
    return Comparison(a, b, rows, changes, headline)


# ---- the figures ----


def _steps(a: RunSummary, b: RunSummary) -> list[Delta]:
    def stat(s: RunSummary, what: str) -> float | None:
        if not s.step.count:
            return None
        value = s.step.mean if what == "mean" else s.step.percentile(float(what[1:]))
        return value if math.isfinite(value) else None

    rows = [
        Delta("steps", f"step time ({what})", "s", stat(a, what), stat(b, what), "lower")
        for what in ("mean", "p50", "p95")
    ]
    rows.append(Delta("steps", "steps", "{step}", float(a.step.count), float(b.step.count)))
    rows.append(Delta("steps", "processes", "{process}", float(len(a.ranks)), float(len(b.ranks))))
    return rows


def per_step_times(summary: RunSummary) -> dict[str, float]:
    """Time per training step of each direct part of a step, and of the untimed rest."""
    steps = summary.step.count
    if not steps:
        return {}
    mean = summary.step.total / steps
    return {name: share * mean for name, share in direct_shares(summary).items()}


def _per_step(a: RunSummary, b: RunSummary) -> list[Delta]:
    pa, pb = per_step_times(a), per_step_times(b)
    names = sorted(set(pa) | set(pb), key=lambda n: -max(pa.get(n, 0.0), pb.get(n, 0.0)))
    if UNTIMED in names:  # the rest last, as in the report
        names = [n for n in names if n != UNTIMED] + [UNTIMED]
    return [Delta("per step", n, "s", pa.get(n), pb.get(n), "lower") for n in names]


def _processes(a: RunSummary, b: RunSummary) -> list[Delta]:
    """Step means per rank, paired by rank (multi-process runs only)."""
    if len(a.ranks) < 2 and len(b.ranks) < 2:
        return []

    def by_rank(s: RunSummary) -> dict[str, float]:
        """Paired by rank (pids differ between runs); a process without one by host."""
        out = {}
        for r in s.ranks.values():
            if r.steps.count:
                rank = r.resource.rank
                out[f"rank {rank}" if rank is not None else r.resource.host] = r.steps.mean
        return out

    ra, rb = by_rank(a), by_rank(b)
    names = sorted(set(ra) | set(rb), key=lambda n: (not n.startswith("rank "), len(n), n))
    return [
        Delta("processes", f"{n} step time (mean)", "s", ra.get(n), rb.get(n), "lower")
        for n in names
    ]


def _by_phase(
    group: str,
    xa: dict[str, Any],
    xb: dict[str, Any],
    phases: list[str],
    better: str,
    figures: tuple[tuple[str, str, str], ...],
) -> list[Delta]:
    """A row per phase and figure (attribute, unit, label) that either run has."""
    rows = []
    for phase in phases:
        x, y = xa.get(phase), xb.get(phase)
        for attr, unit, label in figures:
            va = getattr(x, attr) if x is not None else None
            vb = getattr(y, attr) if y is not None else None
            if va is not None or vb is not None:
                rows.append(Delta(group, f"{label} ({phase})", unit, va, vb, better))
    return rows


def _throughput(a: RunSummary, b: RunSummary) -> list[Delta]:
    ta = {t.phase: t for t in a.throughput}
    tb = {t.phase: t for t in b.throughput}
    phases = [p for p in ta if p in tb] + [p for p in tb if p not in ta]
    phases += [p for p in ta if p not in tb]
    figures = (
        ("samples_per_s", "{sample}/s", "samples/s"),
        ("tokens_per_s", "{token}/s", "tokens/s"),
        ("mfu", "1", "MFU"),
    )
    return _by_phase("throughput", ta, tb, phases, "higher", figures)


def _memory(a: RunSummary, b: RunSummary) -> list[Delta]:
    ma = {m.phase: m for m in memory_by_phase(a)}
    mb = {m.phase: m for m in memory_by_phase(b)}
    figures = (
        ("cuda_peak_allocated", "By", "CUDA peak allocated"),
        ("cuda_peak_reserved", "By", "CUDA peak reserved"),
        ("rss_max", "By", "RSS max"),
    )
    return _by_phase("memory", ma, mb, list(ma) + [p for p in mb if p not in ma], "lower", figures)


def module_per_step(summary: RunSummary) -> dict[str, float]:
    """Forward + backward time per training step of each timed module (training only)."""
    steps = summary.step.count
    if not steps:
        return {}
    return {
        t.module: t.total_s / steps for t in module_times(summary) if not t.module.endswith(")")
    }


def _modules(a: RunSummary, b: RunSummary) -> list[Delta]:
    ma, mb = module_per_step(a), module_per_step(b)
    names = sorted(set(ma) | set(mb), key=lambda n: -max(ma.get(n, 0.0), mb.get(n, 0.0)))
    return [Delta("modules", n, "s", ma.get(n), mb.get(n), "lower") for n in names[:TOP_MODULES]]


def _gauges(summary: RunSummary) -> dict[str, tuple[float, str]]:
    out: dict[str, tuple[float, str]] = {}
    for s in summary.series.values():
        if s.name in _NOT_HARDWARE or s.name in out:
            continue
        mean = summary.gauge_mean(s.name)
        if mean is not None and math.isfinite(mean):
            out[s.name] = (mean, s.unit)
    return out


def _hardware(a: RunSummary, b: RunSummary) -> list[Delta]:
    ga, gb = _gauges(a), _gauges(b)
    rows = []
    for name in sorted(set(ga) | set(gb)):
        unit = (ga.get(name) or gb[name])[1]
        va = ga[name][0] if name in ga else None
        vb = gb[name][0] if name in gb else None
        better = "higher" if name in _HIGHER_IS_BETTER else ""
        rows.append(Delta("hardware", f"{name} (mean)", unit, va, vb, better))
    return rows


# ---- in words ----


def percent(relative: float) -> str:
    """'-41 %', '+3.2 %', '+0.4 %'."""
    value = 100 * relative
    return f"{value:+.0f} %" if abs(value) >= 10 else f"{value:+.1f} %"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}" if seconds < 0.01 else f"{seconds * 1e3:.1f}"


def _moved(d: Delta, step_a: float | None) -> bool:
    """A change worth words: new or gone, or large against itself and against the step."""
    if d.a is None or d.b is None:
        return max(d.a or 0.0, d.b or 0.0) >= SIGNIFICANT_OF_STEP * (step_a or 0.0)
    relative, change = d.relative, d.change
    if relative is None or change is None:
        return False
    return abs(relative) >= SIGNIFICANT and abs(change) >= SIGNIFICANT_OF_STEP * (step_a or 0.0)


def _part_words(d: Delta, what: str = "per step") -> str:
    if d.a is None:
        return f"{d.name} new: {_ms(d.b or 0.0)} ms {what}"
    if d.b is None:
        return f"{d.name} gone (was {_ms(d.a)} ms {what})"
    return f"{d.name} {percent(d.relative or 0.0)} {what} ({_ms(d.a)} -> {_ms(d.b)} ms)"


def _in_words(a: Run, b: Run, rows: list[Delta]) -> tuple[list[str], str]:
    step = next((r for r in rows if r.name == "step time (mean)"), None)
    step_a = step.a if step is not None else None
    changes: list[str] = []
    if step is not None and step.a is not None and step.b is not None:
        if abs(step.relative or 0.0) < STEP_UNCHANGED:
            changes.append(f"step time unchanged ({_ms(step.a)} -> {_ms(step.b)} ms)")
        else:
            changes.append(
                f"step time {percent(step.relative or 0.0)} ({_ms(step.a)} -> {_ms(step.b)} ms)"
            )
    parts = [r for r in rows if r.group == "per step" and _moved(r, step_a)]
    parts.sort(key=lambda r: -abs((r.b or 0.0) - (r.a or 0.0)))
    words = [_part_words(d) for d in parts[:3]]
    changes.extend(words)
    verdict = f"still {b.verdict.kind}"
    if a.verdict.kind != b.verdict.kind:
        verdict = f"now {b.verdict.kind} (was {a.verdict.kind})"
    changes.append(verdict)
    for d in rows:
        if d.group == "throughput" and d.relative is not None and abs(d.relative) >= 0.02:
            changes.append(f"{d.name} {percent(d.relative)}")
    for d in rows:
        if d.group == "memory" and d.relative is not None and abs(d.relative) >= SIGNIFICANT:
            changes.append(
                f"{d.name} {percent(d.relative)} "
                f"({value(d.a or 0.0, 'By')} -> {value(d.b or 0.0, 'By')})"
            )
    modules = [r for r in rows if r.group == "modules" and _moved(r, step_a)]
    modules.sort(key=lambda r: -abs((r.b or 0.0) - (r.a or 0.0)))
    changes.extend(f"module {_part_words(d)}" for d in modules[:2])
    if len(a.summary.ranks) != len(b.summary.ranks):
        changes.append(
            f"processes: {len(a.summary.ranks)} -> {len(b.summary.ranks)} (per-step figures "
            "are per process)"
        )
    lead = words[0] if words else changes[0]
    return changes, f"{lead}; {verdict}"
