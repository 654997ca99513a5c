"""Attribute limits: long string values are cut, and all attributes alive at once are
bounded in bytes; both counted.

Why: a range's attributes live until its line is written, so a large distinct string per
step grew a job's memory without bound (BENCHMARKS.md, "Faults and bounds"). The length
limit follows the SDK's convention and variables (`OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT`
first), but defaults to `DEFAULT_VALUE_LENGTH_LIMIT` instead of unlimited; cuts count as
`timings.attributes_truncated`. The byte budget (`max_attribute_bytes`) charges every dict
made here while it lives, the span built from it included (so spans in an exporter's queue
count); a dict that would pass it is replaced by the shared `OVER_BUDGET` marker, the
range keeping its timing, counted as `timings.attributes_dropped_over_budget` (a loss).
Frames themselves are bounded by count (`max_queued_spans`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from otelprof._schema import ATTR_ATTRIBUTES_DROPPED

_log = logging.getLogger("otelprof")

DEFAULT_VALUE_LENGTH_LIMIT = 4096
DEFAULT_ATTRIBUTE_BYTES = 64 << 20
COUNT_LIMIT = 128
ENV_VARS = ("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT")


def _from_environment() -> int:
    for name in ENV_VARS:
        raw = os.environ.get(name)
        if raw is None or not raw.strip():
            continue
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < 1:
            _log.warning(
                "otelprof: %s=%r is not a positive integer; using %d",
                name,
                raw,
                DEFAULT_VALUE_LENGTH_LIMIT,
            )
            return DEFAULT_VALUE_LENGTH_LIMIT
        return value
    return DEFAULT_VALUE_LENGTH_LIMIT


value_length_limit = _from_environment()
"""Characters a string attribute value keeps (set again by `instrument()`)."""
truncated = 0
"""Values truncated so far in this process (a plain int: += under the GIL is enough for a
count read by stats)."""


def refresh() -> int:
    """Read the limit from the environment again (at `instrument()`); returns it."""
    global value_length_limit
    value_length_limit = _from_environment()
    return value_length_limit


def _cut(value: Any, limit: int) -> Any:
    global truncated
    if isinstance(value, str):
        if len(value) > limit:
            truncated += 1
            return value[:limit]
        return value
    if isinstance(value, (list, tuple)) and any(
        isinstance(v, str) and len(v) > limit for v in value
    ):
        truncated += 1
        return tuple(v[:limit] if isinstance(v, str) else v for v in value)
    return value


def limit_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """`attributes` with strings cut to `value_length_limit` and at most `COUNT_LIMIT` entries
    (the SDK's default; the rest left out and counted), charged to the byte budget while
    alive (`OVER_BUDGET` when it does not fit). Size: `DICT_BYTES`, plus `ENTRY_BYTES` and
    the value's size per entry, summed in the same pass (this runs at every `timing()` with
    attributes)."""
    global truncated
    limit = value_length_limit
    if len(attributes) > COUNT_LIMIT:
        truncated += len(attributes) - COUNT_LIMIT
        attributes = dict(list(attributes.items())[:COUNT_LIMIT])
    held = HeldAttributes()
    held.nbytes = 0
    nbytes = DICT_BYTES
    for key, value in attributes.items():
        if type(value) is str:
            if len(value) > limit:
                truncated += 1
                value = value[:limit]
            # a str's size without sys.getsizeof's method call: 1 byte a character when
            # ASCII (its header included in ENTRY_BYTES), else the exact figure
            nbytes += ENTRY_BYTES + (len(value) if value.isascii() else _getsizeof(value))
        else:
            value = _cut(value, limit)
            nbytes += ENTRY_BYTES + _value_bytes(value)
        held[key] = value
    # the charge, inline (runs at every timing() with attributes): settle what freed dicts
    # handed back, then take `nbytes` if they fit (the budget has no method for it: this is
    # its only taker; `HeldAttributes.__del__` its only giver)
    b = budget
    with b._lock:
        total = b.held
        released = b._released
        while released:
            total -= released.popleft()
        if total + nbytes > b.limit:
            b.held = total
            b.over += 1
            return OVER_BUDGET
        b.held = total + nbytes
    held.nbytes = nbytes  # from now on its __del__ hands the bytes back
    return held


# ---- the byte budget ----
OVER_BUDGET: dict[str, Any] = {ATTR_ATTRIBUTES_DROPPED: "memory budget"}
"""What a range carries instead of attributes that did not fit (one shared, uncharged dict)."""

_getsizeof = sys.getsizeof
DICT_BYTES = 232
"""A small dict's own size (sys.getsizeof of a dict of up to 5 entries, CPython 3.11)."""
ENTRY_BYTES = 112
"""Per attribute: a key's share (keys are short, often interned), the dict's slot and an
ASCII string's header (49 bytes), rounded up."""


def _value_bytes(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return _getsizeof(value) + sum(_getsizeof(v) for v in value)
    return _getsizeof(value)


class AttributeBudget:
    """Bytes of attributes alive at once, at most `limit`; what would pass it is counted.

    Charges are taken under a lock (only at `timing(name, **attributes)`); a freed dict
    hands its bytes back from its `__del__`, which may run on any thread, inside a garbage
    collection too, so it only appends to a deque (atomic) and never takes the lock."""

    def __init__(self, limit: int = DEFAULT_ATTRIBUTE_BYTES) -> None:
        self.limit = limit
        self.held = 0
        self.over = 0
        """Attribute dicts dropped for the budget so far in this process."""
        self._released: deque[int] = deque()
        self._lock = threading.Lock()

    def held_bytes(self) -> int:
        """Bytes charged now (those of dicts freed since the last charge handed back)."""
        with self._lock:
            released = self._released
            while released:
                self.held -= released.popleft()
            return self.held

    def _after_fork(self) -> None:
        self._lock = threading.Lock()


budget = AttributeBudget()


class HeldAttributes(dict[str, Any]):
    """An attribute dict charged to `budget` while it lives (a plain dict to every reader;
    `nbytes` is set right after it is made: 0 until charged)."""

    __slots__ = ("nbytes",)

    nbytes: int

    def __del__(self, _release: Callable[[int], None] = budget._released.append) -> None:
        # bound at definition: at interpreter exit module globals may already be gone
        if self.nbytes:
            _release(self.nbytes)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=budget._after_fork)
