"""Bounded span-name cardinality: a name per step (`ProfilerStep#17`) must not become a
time series per step in span metrics, nor a report row per step.

`<name>#<digits>` keeps its name without the number (→ `otelprof.name.number`); past
`MAX_SPAN_NAMES` distinct names each new one folds into `TIMING_OVERFLOW` (original in
`otelprof.name.original`), every folded span counted. Builder thread only (no locks);
Kineto operator names are not counted (torch bounds them).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from otelprof._schema import (
    ATTR_NAME_NUMBER,
    ATTR_NAME_ORIGINAL,
    DATALOADER_NEXT,
    FROM_DEVICE,
    OPTIMIZER_STEP,
    REDUCE_METRICS,
    STEP_LR_SCHEDULERS,
    STEP_SPAN,
    TIMING_OVERFLOW,
    TO_DEVICE,
    TRAIN_BATCH,
)

_log = logging.getLogger("otelprof")

MAX_SPAN_NAMES = 1000
"""Distinct span names per process before new names fold into `TIMING_OVERFLOW` (the step
span and Determined's timing names are always kept and not counted)."""
RESERVED = frozenset(
    {STEP_SPAN, DATALOADER_NEXT, TO_DEVICE, TRAIN_BATCH, STEP_LR_SCHEDULERS, FROM_DEVICE,
     REDUCE_METRICS, OPTIMIZER_STEP}
)  # fmt: skip

_NUMBERED = re.compile(r"^(.*\S)\s*#(\d+)$")
MAX_CACHED = 20_000
"""Raw names whose exported name is remembered (past it each is resolved again)."""
_MAX_ORIGINAL_CHARS = 256


class SpanNames:
    """Maps each recorded name to its exported name (plus attributes when it changed)."""

    def __init__(self, limit: int = MAX_SPAN_NAMES) -> None:
        self.limit = limit
        self.known: set[str] = set()
        self.folded = 0  # spans whose name went to TIMING_OVERFLOW
        self._cache: dict[str, tuple[str, dict[str, Any] | None]] = {}

    def name(self, raw: str, attributes: dict[str, Any]) -> str:
        """The exported name of a span recorded as `raw`; adds attributes in place, and
        counts a span folded into `TIMING_OVERFLOW`."""
        name, extra = self._lookup(raw)
        if extra is not None:
            attributes.update(extra)
            if name == TIMING_OVERFLOW:
                self.folded += 1
        return name

    def exported(self, raw: str) -> str:
        """The name a range recorded as `raw` is exported under, counting nothing (its
        histogram's name: `name` counts the spans actually written)."""
        return self._lookup(raw)[0]

    def _lookup(self, raw: str) -> tuple[str, dict[str, Any] | None]:
        hit = self._cache.get(raw)
        if hit is None:
            hit = self._resolve(raw)
            if len(self._cache) < MAX_CACHED:
                self._cache[raw] = hit
        return hit

    def _resolve(self, raw: str) -> tuple[str, dict[str, Any] | None]:
        extra: dict[str, Any] | None = None
        name = raw
        match = _NUMBERED.match(raw)
        if match is not None:
            name = match.group(1)
            extra = {ATTR_NAME_NUMBER: int(match.group(2))}
        if name not in self.known and name not in RESERVED:
            if len(self.known) >= self.limit:
                if not self.folded:
                    _log.warning(
                        "otelprof: more than %d distinct span names (a name per item or per "
                        "step?); new names are exported as %r with %s",
                        self.limit,
                        TIMING_OVERFLOW,
                        ATTR_NAME_ORIGINAL,
                    )
                extra = dict(extra or {})
                extra[ATTR_NAME_ORIGINAL] = raw[:_MAX_ORIGINAL_CHARS]
                return TIMING_OVERFLOW, extra
            self.known.add(name)
        return name, extra
