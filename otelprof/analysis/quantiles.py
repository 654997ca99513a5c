"""Bounded-memory duration statistics: exact up to a cap, then a log-bucket sketch.

Why: small and medium runs must match figures computed independently from the same spans
exactly, yet a huge run must not hold every duration. Up to `exact_cap` values percentiles
are exact (linear interpolation, as numpy's default); beyond it the values fold into
logarithmic buckets of relative width `2 * rel_err`, so a percentile is within `rel_err` and
memory stays bounded (about 3,000 buckets cover 1 ns..3 h at the default `rel_err`).
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Sequence


class DurationStats:
    """count, total, min, max and percentiles of non-negative values."""

    __slots__ = ("_buckets", "_gamma_log", "_values", "count", "exact_cap", "max", "min", "total")

    def __init__(self, exact_cap: int = 200_000, rel_err: float = 0.005) -> None:
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.exact_cap = exact_cap
        self._values: array[float] | None = array("d")
        self._buckets: dict[int, int] = {}
        self._gamma_log = math.log((1 + rel_err) / (1 - rel_err))

    @property
    def exact(self) -> bool:
        return self._values is not None

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        if value < self.min:
            self.min = value
        if value > self.max:
            self.max = value
        if self._values is not None:
            self._values.append(value)
            if len(self._values) > self.exact_cap:
                values, self._values = self._values, None
                for v in values:
                    self._bucket_add(v)
        else:
            self._bucket_add(value)

    def merge(self, other: DurationStats) -> None:
        """Fold in `other`, the statistics of values that came after this one's. While
        `other` still holds its values they are added one by one, so the result is exactly
        that of one pass over both sequences, float total included; a sketch folds its
        buckets in (the same buckets one pass makes; the total may differ in the last bit)."""
        if other._values is not None:
            if (
                self._values is not None
                and len(self._values) + len(other._values) <= self.exact_cap
            ):
                total = self.total  # the same additions, in the same order, as add()
                for value in other._values:
                    total += value
                self.total = total
                self.count += len(other._values)
                if other._values:
                    self.min = min(self.min, other.min)
                    self.max = max(self.max, other.max)
                self._values.extend(other._values)
                return
            add = self.add
            for value in other._values:
                add(value)
            return
        if not other.count:
            return
        if self._values is not None:
            values, self._values = self._values, None
            for v in values:
                self._bucket_add(v)
        self.count += other.count
        self.total += other.total
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        for key, n in other._buckets.items():
            self._buckets[key] = self._buckets.get(key, 0) + n

    def _bucket_add(self, value: float) -> None:
        key = -(10**9) if value <= 0 else math.ceil(math.log(value) / self._gamma_log)
        self._buckets[key] = self._buckets.get(key, 0) + 1

    def median_without(self, values: Sequence[float]) -> float:
        """The median of what was added less one of each of `values` (step 0 of each
        process, say); beyond the exact cap, the sketch's median, which so few values cannot
        move past the others' middle. NaN when nothing is left."""
        if self._values is None:
            return self.percentile(50)
        rest = sorted(self._values)
        for value in values:
            i = bisect.bisect_left(rest, value)
            if i < len(rest) and rest[i] == value:
                del rest[i]
        if not rest:
            return math.nan
        mid = len(rest) // 2
        return rest[mid] if len(rest) % 2 else (rest[mid - 1] + rest[mid]) / 2

    def percentile(self, q: float) -> float:
        """The q-th percentile (0..100)."""
        if not self.count:
            return math.nan
        if self._values is not None:
            ordered = sorted(self._values)
            pos = (len(ordered) - 1) * q / 100.0
            lo = math.floor(pos)
            hi = min(lo + 1, len(ordered) - 1)
            return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
        rank = q / 100.0 * (self.count - 1)
        seen = 0
        for key in sorted(self._buckets):
            seen += self._buckets[key]
            if seen > rank:
                if key == -(10**9):
                    return 0.0
                # midpoint (in relative terms) of the bucket (gamma^(k-1), gamma^k]
                value = 2 * math.exp(key * self._gamma_log) / (1 + math.exp(self._gamma_log))
                return min(max(value, self.min), self.max)
        return self.max
