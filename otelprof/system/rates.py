"""Rate arithmetic on cumulative OS counters: Δcounter/Δt, deterministic at the edges.

Every function here is pure so the edge cases (a 32-bit counter wrapping, a device that
appears, disappears or restarts its counters, a zero-length interval) can be tested with
made-up numbers. The rule throughout: an interval that cannot be measured yields `None`
(the gauge is then absent), never a negative, infinite or invented value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_WRAP_32 = 2**32


def counter_delta(previous: int, current: int) -> int | None:
    """Increase of a cumulative counter between two readings, or None if it cannot be known.

    A counter that went down wrapped (32-bit NIC counters) only if the previous value fitted
    in 32 bits and the wrapped increase is below 2**31; else it restarted (device re-added,
    driver reload) and this interval's increase is unknown.
    """
    if current >= previous:
        return current - previous
    if previous < _WRAP_32:
        wrapped = current + _WRAP_32 - previous
        if wrapped < _WRAP_32 // 2:
            return wrapped
    return None


def summed_delta(previous: Mapping[str, int], current: Mapping[str, int]) -> tuple[int, int] | None:
    """`(total increase, devices counted)` over the devices present in both readings, or
    None when there is none (nothing measured is not zero). A new device only becomes a
    baseline; one that disappeared or restarted contributes nothing.
    """
    total = 0
    counted = 0
    for name, now in current.items():
        before = previous.get(name)
        if before is None:
            continue
        delta = counter_delta(before, now)
        if delta is None:
            continue
        total += delta
        counted += 1
    if counted == 0:
        return None
    return total, counted


def rate(delta: float | None, dt: float) -> float | None:
    """delta / dt, or None for an unknown delta or a non-positive interval."""
    if delta is None or not dt > 0:
        return None
    return delta / dt


def summed_rate(previous: Mapping[str, int], current: Mapping[str, int], dt: float) -> float | None:
    """Per-second increase summed over the devices present in both readings."""
    summed = summed_delta(previous, current)
    return rate(None if summed is None else summed[0], dt)


# psutil.cpu_times() on Linux: guest and guest_nice are already included in user and nice.
_NOT_IN_TOTAL = ("guest", "guest_nice")
_IDLE_FIELDS = ("idle", "iowait")


def cpu_busy_total(times: Any) -> tuple[float, float]:
    """(busy, total) seconds from a `psutil.cpu_times()` result, psutil's own accounting.

    Busy is everything but idle and iowait (what `psutil.cpu_percent()` and Determined's
    `cpu_util_simple` report); guest time is not counted twice.
    """
    fields = times._asdict()
    total = sum(v for k, v in fields.items() if k not in _NOT_IN_TOTAL)
    idle = sum(fields.get(k, 0.0) for k in _IDLE_FIELDS)
    return total - idle, total


def busy_fraction(previous: Any, current: Any) -> float | None:
    """CPU utilization (0–1) between two `psutil.cpu_times()` readings.

    Linux's iowait can step backwards, so the busy share is clamped to [0, 1]; no advance of
    the total (readings within one clock tick) gives None.
    """
    busy0, total0 = cpu_busy_total(previous)
    busy1, total1 = cpu_busy_total(current)
    d_total = total1 - total0
    if not d_total > 0:
        return None
    return min(1.0, max(0.0, (busy1 - busy0) / d_total))


def share_of_cpus(cpu_seconds: float, dt: float, cpus: int) -> float | None:
    """CPU seconds used in `dt` as a fraction of `cpus` cores (0–1), None if unmeasurable."""
    if not dt > 0 or cpus < 1 or cpu_seconds < 0:
        return None
    return min(1.0, cpu_seconds / (dt * cpus))
