"""The attribute value length limit: long string attributes are cut, and counted.

Why: a span's attributes stay in memory from the `timing()` call until their line is
written (recorder queue, span builder, line writer), so a large distinct string per step
(a 64 KB batch description) took a job from 0.6 GB to 2.9 GB of RSS in 20 s; memory must
be bounded in bytes. The OpenTelemetry SDK's convention is followed: string values (and
the strings of a sequence value) longer than the limit are truncated to it, and the limit
is read from `OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT` (`OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT`
first, as the SDK reads it for spans). Unlike the SDK (unlimited by default), otelprof
defaults to `DEFAULT_VALUE_LENGTH_LIMIT` characters. Each truncated value is counted
(`timings.attributes_truncated` in `Profiler.stats()`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

_log = logging.getLogger("otelprof")

DEFAULT_VALUE_LENGTH_LIMIT = 4096
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
    """`attributes` with every string value at most `value_length_limit` characters, and
    at most `COUNT_LIMIT` of them (the SDK's default attribute count limit; the rest are
    left out and counted too)."""
    global truncated
    limit = value_length_limit
    if len(attributes) > COUNT_LIMIT:
        truncated += len(attributes) - COUNT_LIMIT
        attributes = dict(list(attributes.items())[:COUNT_LIMIT])
    return {key: _cut(value, limit) for key, value in attributes.items()}
