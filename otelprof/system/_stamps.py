"""Read times: every counter read carries the instant it was taken, and each rate its own Δt.

Why: each system call of a read releases the GIL, and getting it back from busy training
threads can take milliseconds, so one clock reading shared by every source put rate
windows off by whole percents (BENCHMARKS.md, "Hardware sampling and read times").
`timed` stamps the midpoint of the clock readings around a read and reads again while that
bracket is wider than `TIGHT_NS` (a thread switch or preemption fell in it). A read that
releases the GIL itself (psutil) cannot be bracketed tightly, hence `_procfs`; NVML calls
take the GIL back only after the value, so they are stamped right before the call.
The Unix offset is measured the same way. Exported: a gauge point's time is its read and
its start time its rate's window (`apply_read_times`); a cumulative sum (`hw.energy`) loses
the `StampedValue` in the SDK, so its read time is found by (name, attributes, value) in
`recent_counters`. DEVELOPING.md, "system/ contract".
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

T = TypeVar("T")

MIN_WINDOW_S = 0.05
"""Shortest interval a rate is computed over: CPU times tick every 10 ms, so a shorter
window measures the tick, not the load. A shorter gap keeps the old baseline."""


RESYNC_NS = 1_000_000

TIGHT_NS = 250_000
"""A read bracketed more widely than this was interrupted (thread switch, preemption)."""

READ_TRIES = 3
"""Reads of one value at most, when each was interrupted; the narrowest bracket is kept."""


class Clock:
    """Monotonic nanoseconds for Δt, plus the offset that turns them into Unix time."""

    def __init__(
        self,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        wall_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self._monotonic_ns = monotonic_ns
        self._wall_ns = wall_ns
        self._offset = self._measure_offset()[0]

    def __call__(self) -> int:
        return self._monotonic_ns()

    def resync(self) -> None:
        """Follow a wall clock stepped by more than RESYNC_NS (plus the measurement's own
        uncertainty); smaller jitter is ignored so a window starts exactly where the last ended.
        """
        offset, width = self._measure_offset()
        if abs(offset - self._offset) > RESYNC_NS + width // 2:
            self._offset = offset

    def _measure_offset(self) -> tuple[int, int]:
        """(wall − monotonic, width of the bracket it was read in), the narrowest of a few."""
        stamped = timed(self._wall_ns, self._monotonic_ns)
        return stamped.value - stamped.time_ns, stamped.width_ns

    def to_unix_ns(self, monotonic_ns: int) -> int:
        return monotonic_ns + self._offset


@dataclass(frozen=True)
class Stamped(Generic[T]):
    """A value and the monotonic instant (ns) it was read at, within ±width_ns/2."""

    value: T
    time_ns: int
    width_ns: int = 0


def timed(read: Callable[[], T], clock: Callable[[], int], tight_ns: int = TIGHT_NS) -> Stamped[T]:
    """`read()` stamped with the midpoint of the clock readings around it, read again
    while that bracket is wider than `tight_ns`."""
    best = _bracketed(read, clock)
    for _ in range(READ_TRIES - 1):
        if best.width_ns <= tight_ns:
            break
        again = _bracketed(read, clock)
        if again.width_ns < best.width_ns:
            best = again
    return best


def _bracketed(read: Callable[[], T], clock: Callable[[], int]) -> Stamped[T]:
    before = clock()
    value = read()
    width = clock() - before
    return Stamped(value, before + width // 2, width)


class Baseline(Generic[T]):
    """The previous reading of one source and when it was taken (monotonic ns)."""

    def __init__(self) -> None:
        self.time: int | None = None
        self.value: T | None = None

    def advance(self, now: int, value: T) -> tuple[T, float, int] | None:
        """Move the baseline to `value` read at `now`; return (previous, Δt s, window start).

        The first reading only sets the baseline. A reading less than MIN_WINDOW_S after
        the baseline (including Δt == 0 or a clock that stepped back) is dropped and the
        baseline kept, so the next rate covers the whole span.
        """
        if self.time is None or self.value is None:
            self.time, self.value = now, value
            return None
        start = self.time
        dt = (now - start) / 1e9
        if dt < MIN_WINDOW_S:
            return None
        previous = self.value
        self.time, self.value = now, value
        return previous, dt, start


class StampedValue(float):
    """A float that remembers when it was read and which window it averages (Unix ns)."""

    __slots__ = ("start_ns", "time_ns")
    start_ns: int | None
    time_ns: int | None

    def __new__(cls, value: float, time_ns: int | None, start_ns: int | None) -> StampedValue:
        self = super().__new__(cls, value)
        self.time_ns = time_ns
        self.start_ns = start_ns
        return self


AttrKey = tuple[tuple[str, Any], ...]


def attr_key(attributes: Mapping[str, Any] | None) -> AttrKey:
    return tuple(sorted((attributes or {}).items()))


class _RecentCounters:
    """(name, attributes, value) -> read time of recent counter readings, bounded."""

    def __init__(self, capacity: int = 4096) -> None:
        self._items: OrderedDict[tuple[str, AttrKey, float], int] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def remember(self, name: str, attributes: AttrKey, value: float, time_ns: int) -> None:
        with self._lock:
            key = (name, attributes, float(value))
            self._items[key] = time_ns
            self._items.move_to_end(key)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)

    def find(self, name: str, attributes: AttrKey, value: float) -> int | None:
        with self._lock:
            return self._items.get((name, attributes, float(value)))


recent_counters = _RecentCounters()


def apply_read_times(metrics_data: Any) -> Any:
    """Metrics data whose system-metric points carry their read time and window (gauges)
    or read time (sums). Other points are handed on untouched; on any error, the data as
    the SDK made it.
    """
    try:
        return _apply_read_times(metrics_data)
    except Exception:
        return metrics_data


def _apply_read_times(metrics_data: Any) -> Any:
    from opentelemetry.sdk.metrics.export import Gauge, NumberDataPoint, Sum

    def stamp_metric(metric: Any) -> Any:
        data = metric.data
        if not isinstance(data, (Gauge, Sum)):
            return metric
        is_sum = isinstance(data, Sum)
        stamped = _mapped(
            data,
            "data_points",
            lambda p: _stamp_point(metric.name, p, is_sum) if isinstance(p, NumberDataPoint) else p,
        )
        return metric if stamped is data else replace(metric, data=stamped)

    return _mapped(
        metrics_data,
        "resource_metrics",
        lambda rm: _mapped(rm, "scope_metrics", lambda sm: _mapped(sm, "metrics", stamp_metric)),
    )


def _mapped(parent: Any, field: str, change: Callable[[Any], Any]) -> Any:
    """`parent` with `change` applied to each item of its list `field`; `parent` itself
    when no item changed (copy on write, so untouched data is handed on as it came)."""
    items = getattr(parent, field)
    changed = [change(item) for item in items]
    if all(a is b for a, b in zip(changed, items, strict=True)):
        return parent
    return replace(parent, **{field: changed})


def _stamp_point(name: str, point: Any, is_sum: bool) -> Any:
    value = point.value
    if isinstance(value, StampedValue):
        if value.time_ns is None:
            return replace(point, value=float(value))
        return replace(
            point,
            value=float(value),
            time_unix_nano=value.time_ns,
            start_time_unix_nano=point.start_time_unix_nano if is_sum else value.start_ns,
        )
    if is_sum and isinstance(value, (int, float)):
        read = recent_counters.find(name, attr_key(point.attributes), value)
        if read is not None:
            return replace(point, time_unix_nano=read)
    return point
