"""The report's tables as plain rows, so the terminal and JSON renderings show the same figures."""

from __future__ import annotations

import math
from dataclasses import dataclass

from otelprof._schema import MODULE_PREFIXES, RUN_ENDED
from otelprof.analysis import format as fmt
from otelprof.analysis.quantiles import DurationStats
from otelprof.analysis.stragglers import UNTIMED
from otelprof.analysis.summary import (
    PARENT_ROOT,
    PARENT_STEP,
    PARENT_WRAPS,
    STEP_SPAN,
    RunSummary,
    SeriesAgg,
)

WRAPS_STEP = "wraps step"
"""Where a range open across its step's end sat (torch's ProfilerStep#N): around the step's
parts, not one of them (summary._StepResolver)."""


@dataclass
class TimingRow:
    name: str
    level: str  # "step", "in step", "in train_batch", "top level", ...
    count: int
    mean_s: float
    p50_s: float
    p95_s: float
    total_s: float
    share: float | None  # of summed step time; only for steps and their direct children
    exact: bool


def timing_rows(summary: RunSummary) -> list[TimingRow]:
    """Step first, then direct children of steps by share, then nested and other spans."""
    rows: list[TimingRow] = []
    if summary.step.count:
        rows.append(_row(STEP_SPAN, "step", summary.step, 1.0))
    direct: list[TimingRow] = []
    other: list[TimingRow] = []
    for agg in summary.timings.values():
        if agg.name.startswith(MODULE_PREFIXES):
            continue  # the per-module section's (module_section.py)
        s = agg.stats
        if len(agg.by_parent) > 1:  # one row per parent: no total beyond any parent's own
            kept = sum(stats.count for stats in agg.by_parent.values())
            # traces sampled out: the kept ones split the histogram's exact count and total
            scale = s.count / kept if kept and s.count > kept else 1.0
            for parent, stats in agg.by_parent.items():
                row = _row(agg.name, _where(parent), stats)
                if scale != 1.0:
                    row.count, row.total_s = round(row.count * scale), row.total_s * scale
                    row.exact = False
                if parent == PARENT_STEP:
                    row.share = summary.share(agg.name)
                    direct.append(row)
                else:
                    other.append(row)
            continue
        if agg.direct_count:
            level = "in step" if not agg.nested_count else "in step + nested"
        elif agg.nested_count:
            # its main parent
            level = f"in {max(agg.nested_in, key=agg.nested_in.__getitem__, default=None)}"
        elif agg.root_count:
            level = "top level"
        elif agg.wrapper_count:
            level = WRAPS_STEP
        else:
            level = "parent not found"
        row = _row(agg.name, level, s, summary.share(agg.name))
        (direct if agg.direct_count else other).append(row)
    direct.sort(key=lambda r: -(r.share or 0.0))
    other.sort(key=lambda r: -r.total_s)
    rows.extend(direct)
    untimed = summary.untimed_share
    if untimed is not None and direct:  # no count, no percentiles: its total and share
        nan, total = math.nan, untimed * summary.step.total
        rows.append(TimingRow(UNTIMED, "in step", 0, nan, nan, nan, total, untimed, True))
    rows.extend(other)
    return rows


def timing_cells(row: TimingRow, mark: str = "") -> list[str]:
    """A timing row as the text table shows it (`mark`: before an approximate
    percentile)."""
    share = "-" if row.share is None else f"{100 * row.share:.1f}%"
    count = f"{row.count:,}" if row.count else ""
    p50, p95 = mark + fmt.ms(row.p50_s), mark + fmt.ms(row.p95_s)
    return [row.name, row.level, count, fmt.ms(row.mean_s), p50, p95, f"{row.total_s:.3f}", share]


def _where(parent: str) -> str:
    if parent == PARENT_STEP:
        return "in step"
    if parent == PARENT_WRAPS:
        return WRAPS_STEP
    return "top level" if parent == PARENT_ROOT else f"in {parent}"


def _row(name: str, level: str, s: DurationStats, share: float | None = None) -> TimingRow:
    return TimingRow(
        name, level, s.count, s.mean, s.percentile(50), s.percentile(95), s.total, share, s.exact
    )


def hardware_series(summary: RunSummary) -> list[SeriesAgg]:
    """Series ordered by host, then process scope, then GPU, then metric name; without the
    run's end marker (a flag for Prometheus' alerts: the report tells a run's end from its
    closing record)."""
    return sorted(
        (s for s in summary.series.values() if s.name != RUN_ENDED),
        key=lambda s: (s.host, s.scope, s.gpu is None, s.gpu or "", s.name, s.device),
    )


def hardware_cells(s: SeriesAgg) -> list[str]:
    """A series' cells after its host column in the text table."""
    figures = [fmt.value(v, s.unit) for v in (s.min, s.mean, s.max)]
    return [s.device, s.name, *figures, f"{s.count:,}"]


@dataclass
class RankRow:
    label: str
    steps: int
    mean_s: float
    p95_s: float
    spans: int


def rank_cells(row: RankRow) -> list[str]:
    return [row.label, f"{row.steps:,}", fmt.ms(row.mean_s), fmt.ms(row.p95_s), f"{row.spans:,}"]


def rank_rows(summary: RunSummary) -> list[RankRow]:
    ranks = sorted(
        summary.ranks.values(),
        key=lambda r: (
            r.resource.rank if r.resource.rank is not None else 1 << 30,
            r.resource.label,
        ),
    )
    return [
        RankRow(r.resource.label, r.steps.count, r.steps.mean, r.steps.percentile(95), r.spans)
        for r in ranks
    ]
