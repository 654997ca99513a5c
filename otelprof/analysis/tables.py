"""The report's tables as plain rows, so the terminal and HTML renderings show the same figures."""

from __future__ import annotations

from dataclasses import dataclass

from otelprof.analysis.summary import STEP_SPAN, RunSummary, SeriesAgg


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
        s = summary.step
        rows.append(
            TimingRow(
                STEP_SPAN,
                "step",
                s.count,
                s.mean,
                s.percentile(50),
                s.percentile(95),
                s.total,
                1.0,
                s.exact,
            )
        )
    direct: list[TimingRow] = []
    other: list[TimingRow] = []
    for agg in summary.timings.values():
        s = agg.stats
        if agg.direct_count:
            level = "in step" if not agg.nested_count else "in step + nested"
        elif agg.nested_count:
            level = f"in {agg.main_parent}"
        elif agg.root_count:
            level = "top level"
        else:
            level = "parent not found"
        row = TimingRow(
            agg.name,
            level,
            s.count,
            s.mean,
            s.percentile(50),
            s.percentile(95),
            s.total,
            summary.share(agg.name),
            s.exact,
        )
        (direct if agg.direct_count else other).append(row)
    direct.sort(key=lambda r: -(r.share or 0.0))
    other.sort(key=lambda r: -r.total_s)
    rows.extend(direct)
    untimed = summary.untimed_share
    if untimed is not None and direct:
        rows.append(
            TimingRow(
                "(untimed)",
                "in step",
                0,
                float("nan"),
                float("nan"),
                float("nan"),
                untimed * summary.step.total,
                untimed,
                True,
            )
        )
    rows.extend(other)
    return rows


def hardware_series(summary: RunSummary) -> list[SeriesAgg]:
    """Series ordered by host, then process scope, then GPU, then metric name."""
    return sorted(
        summary.series.values(),
        key=lambda s: (s.host, s.scope, s.gpu is None, s.gpu or "", s.name, s.device),
    )


@dataclass
class RankRow:
    label: str
    steps: int
    mean_s: float
    p95_s: float
    spans: int


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
