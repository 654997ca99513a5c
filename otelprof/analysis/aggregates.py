"""Timing figures from the in-process histograms (`otelprof.timing.duration`), not the spans.

Why: traces are sampled, but every recorded range went into a cumulative histogram per
(timing, phase) and process. Where spans were sampled out, counts, totals and means come from
the histograms (exact over every step), percentiles from their buckets (`_sampling.BOUNDS`),
and the share directly under a step from the kept traces. Where nothing was sampled out, and
for runs without histograms or with `--steps` (which they cannot filter), the span-based
figures stay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from otelprof._schema import ATTR_PHASE, ATTR_TIMING, PHASE_TRAIN, STEP_SPAN
from otelprof.analysis.quantiles import DurationStats


@dataclass(slots=True)
class HistRec:
    """One cumulative histogram point of `otelprof.timing.duration`."""

    timing: str
    phase: str
    time_ns: int
    count: int
    sum: float
    min: float
    max: float
    bucket_counts: tuple[int, ...]
    bounds: tuple[float, ...]
    resource: Any


def parse_point(dp: dict[str, Any], attrs: dict[str, Any], resource: Any) -> HistRec:
    """An OTLP JSON HistogramDataPoint (int64 as strings) -> HistRec; raises on bad data."""
    counts = tuple(int(c) for c in dp.get("bucketCounts") or ())
    bounds = tuple(float(b) for b in dp.get("explicitBounds") or ())
    if counts and len(counts) != len(bounds) + 1:
        raise ValueError("bucketCounts must have one more entry than explicitBounds")
    count = int(dp.get("count", 0))
    return HistRec(
        timing=str(attrs[ATTR_TIMING]),
        phase=str(attrs.get(ATTR_PHASE) or PHASE_TRAIN),
        time_ns=int(dp["timeUnixNano"]),
        count=count,
        sum=float(dp.get("sum", 0.0)),
        min=float(dp.get("min", math.nan)),
        max=float(dp.get("max", math.nan)),
        bucket_counts=counts,
        bounds=bounds,
        resource=resource,
    )


class HistogramStats(DurationStats):
    """DurationStats whose count/total/min/max come from histograms (exact) and whose
    percentiles interpolate within buckets."""

    __slots__ = ("_bounds", "_counts")

    def __init__(self, recs: Sequence[HistRec]) -> None:
        super().__init__(exact_cap=0)
        self._values = None
        self._bounds: tuple[float, ...] = recs[0].bounds if recs else ()
        self._counts = [0] * (len(self._bounds) + 1)
        for rec in recs:
            self.count += rec.count
            self.total += rec.sum
            if rec.count:
                self.min = min(self.min, rec.min)
                self.max = max(self.max, rec.max)
            if rec.bounds == self._bounds:
                for i, c in enumerate(rec.bucket_counts):
                    self._counts[i] += c

    def add(self, value: float) -> None:
        raise TypeError("HistogramStats is built from histograms, not single values")

    def percentile(self, q: float) -> float:
        if not self.count:
            return math.nan
        rank = q / 100.0 * self.count
        seen = 0
        for i, c in enumerate(self._counts):
            if c and seen + c >= rank:
                lo = self._bounds[i - 1] if i > 0 else self.min
                hi = self._bounds[i] if i < len(self._bounds) else self.max
                lo, hi = max(lo, self.min), min(hi, self.max)
                value = lo + (hi - lo) * ((rank - seen) / c)
                return min(max(value, self.min), self.max)
            seen += c
        return self.max


SeriesKey = tuple[Any, str, str]  # (process, timing, phase)


def keep_latest(last: dict[SeriesKey, HistRec], rec: HistRec) -> None:
    """Keep `rec` in `last` if it is its series' latest cumulative point so far (a reader
    holds one point per series, not every export's)."""
    key = (rec.resource, rec.timing, rec.phase)
    seen = last.get(key)
    if seen is None or (rec.time_ns, rec.count) >= (seen.time_ns, seen.count):
        last[key] = rec


def apply(summary: Any, recs: Sequence[HistRec], timing_key: Any, timing_agg: Any) -> bool:
    """Replace the summary's span-based timing figures with histogram ones where traces
    were sampled out; True if any was replaced. `timing_key` and `timing_agg` are the
    summary's own, so rows are keyed exactly as the span path keys them."""
    last: dict[SeriesKey, HistRec] = {}  # the last cumulative point of each series
    for rec in recs:
        keep_latest(last, rec)
    if not last:
        return False
    by_key: dict[str, list[HistRec]] = {}
    steps_by_rank: dict[Any, list[HistRec]] = {}
    for rec in last.values():
        if rec.timing == STEP_SPAN and rec.phase == PHASE_TRAIN:
            by_key.setdefault("\0step", []).append(rec)
            steps_by_rank.setdefault(rec.resource, []).append(rec)
        else:
            by_key.setdefault(timing_key(rec.timing, rec.phase), []).append(rec)
    applied = False
    step_recs = by_key.pop("\0step", [])
    # where the kept spans are complete (nothing sampled out), they stay: exact percentiles
    if step_recs and summary.step.count < sum(r.count for r in step_recs):
        applied = True
        summary.step = HistogramStats(step_recs)
        for resource, rank_recs in steps_by_rank.items():
            rank = summary.ranks.get(resource)
            if rank is not None:
                rank.steps = HistogramStats(rank_recs)
    for key, key_recs in by_key.items():
        stats = HistogramStats(key_recs)
        agg = summary.timings.get(key)
        if agg is None:
            applied = True
            summary.timings[key] = timing_agg(key, stats)
            continue
        if agg.stats.count >= stats.count:
            continue
        applied = True
        sampled = agg.stats
        # kept traces tell which share of this timing ran directly under a step
        if sampled.count and sampled.total > 0:
            agg.direct_total_s *= stats.total / sampled.total
        if sampled.count:
            scale = stats.count / sampled.count
            agg.direct_count = round(agg.direct_count * scale)
            agg.nested_count = round(agg.nested_count * scale)
            agg.root_count = round(agg.root_count * scale)
        agg.stats = stats
    return applied
