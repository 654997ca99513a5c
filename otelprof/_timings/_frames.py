"""Frame layouts: what the recorder hands the span builder, one layout per kind, built here.

A *frame* is a plain list (the cheapest object to build and complete in place on the
training thread), indexed by the names below. The C hot path (`_speedups.c`) uses the same
indices and exports them as `FRAME_LAYOUT`, which must equal `LAYOUT` or the recorder stays
in Python (`_recorder.use_compiled`). The hot paths write the range layouts inline (a call
per range costs more than the range); tests/test_timings_recorder.py checks they build
exactly what the constructors here build. The kinds: ARCHITECTURE.md, "Frames, one layout
per kind".
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import Any

Frame = list[Any]
ROW_ITEM_SIZE = 8  # bytes of one int64 in a row

# ---- fields of every range frame ----
F_NAME = 0  # the range's name as recorded (the builder folds it to a bounded set)
F_SPAN = 1  # int span id; 0 until the builder assigns one (no randomness on the hot path)
F_PARENT = 2  # the parent frame (a list), or None: the parent is the step span
F_CTX = 3  # StepContext the range was opened in
F_THREAD = 4  # ThreadState of the opening thread
F_ATTRS = 5  # user attributes or None
F_START = 6  # perf_counter_ns
F_END = 7  # perf_counter_ns
F_ERROR = 8  # (type name, message, stacktrace) or None
F_CUDA = 9  # CUDA event pair or None
F_KIND = 10  # KIND_* below
F_OWNER = 11  # the object that opened it (record_function instance / Timing), or None

# ---- fields of one kind only ----
F_RANGE = 12
"""Timing frames: the torch profiler range opened alongside, or None."""
STEP_ENDED_ELSEWHERE = 12
"""Step items: True when the step was ended from a thread other than its own."""
CHUNK_RANGES = F_ATTRS
"""Chunk items: the list of ranges carried."""
ROWS = F_ATTRS
"""Rows items: the list of duration rows carried (see `_recorder.OnThreadSampler`)."""

RF_LEN = 12
TIMING_LEN = 13
ITEM_LEN = 13
"""Slots of a record_function frame, of a timing frame, and of every queue item."""

KIND_RECORD_FUNCTION = KIND_RF = "record_function"
KIND_TIMING = "timing"
KIND_STEP = "step"
KIND_CHUNK = "chunk"
KIND_ROWS = "rows"

LAYOUT = {
    "F_NAME": F_NAME,
    "F_SPAN": F_SPAN,
    "F_PARENT": F_PARENT,
    "F_CTX": F_CTX,
    "F_THREAD": F_THREAD,
    "F_ATTRS": F_ATTRS,
    "F_START": F_START,
    "F_END": F_END,
    "F_ERROR": F_ERROR,
    "F_CUDA": F_CUDA,
    "F_KIND": F_KIND,
    "F_OWNER": F_OWNER,
    "F_RANGE": F_RANGE,
    "RF_LEN": RF_LEN,
    "TIMING_LEN": TIMING_LEN,
}
"""What the C hot path must agree with (its `FRAME_LAYOUT`)."""


def record_function_frame(
    name: str, parent: Frame | None, ctx: Any, state: Any, owner: Any
) -> Frame:
    """A bridged record_function range, opened (start and end set later)."""
    return [name, 0, parent, ctx, state, None, 0, 0, None, None, KIND_RF, owner]


def timing_frame(
    name: str, parent: Frame | None, ctx: Any, state: Any, attrs: dict[str, Any] | None, owner: Any
) -> Frame:
    """An `otelprof.timing` range, opened (start and end set later)."""
    return [name, 0, parent, ctx, state, attrs, 0, 0, None, None, KIND_TIMING, owner, None]


def leaf_frame(name: str, parent: Frame | None, ctx: Any, state: Any) -> Frame:
    """A range that is never a parent (not on any stack), opened."""
    return timing_frame(name, parent, ctx, state, None, None)


def measured_frame(
    name: str,
    parent: Frame | None,
    ctx: Any,
    state: Any,
    attrs: dict[str, Any] | None,
    start_ns: int,
    end_ns: int,
) -> Frame:
    """A range measured elsewhere (e.g. across threads), complete."""
    frame = timing_frame(name, parent, ctx, state, attrs, None)
    frame[F_START] = start_ns
    frame[F_END] = end_ns
    return frame


def base_frame() -> Frame:
    """The bottom of every thread's stack: belongs to no step (F_CTX None) and no owner."""
    return [None] * TIMING_LEN


def step_item(
    name: str, ctx: Any, state: Any, attrs: Any, start_ns: int, end_ns: int, elsewhere: bool
) -> Frame:
    """The step span (its ranges stay in `ctx.frames`; the builder gives it ctx.span_id)."""
    return [name, 0, 0, ctx, state, attrs, start_ns, end_ns, None, None, KIND_STEP, None, elsewhere]


def chunk_item(ctx: Any, ranges: list[Frame]) -> Frame:
    """Ranges of the running step `ctx`, handed over before it ends."""
    item: Frame = [None] * ITEM_LEN
    item[F_CTX] = ctx
    item[CHUNK_RANGES] = ranges
    item[F_KIND] = KIND_CHUNK
    return item


ROW_TYPECODE = "q"
"""A row is one `bytes` of native int64s: its ranges' durations in close order, the step's
duration, the layout id (`OnThreadSampler.layouts`). One untracked object a step, not a
tuple and an int per range; the builder reads each column as one strided slice."""


def pack_row(durations: Iterable[int], step_ns: int, layout: int) -> bytes:
    """A row (see ROW_TYPECODE); OverflowError or TypeError for a value that is no int64."""
    values = array(ROW_TYPECODE, durations)
    values.append(step_ns)
    values.append(layout)
    return values.tobytes()


def row_values(rows: Iterable[bytes | memoryview]) -> memoryview:
    """Rows of one layout (bytes, or views of them) as one flat int64 view, row after row."""
    return memoryview(b"".join(rows)).cast("q")  # ROW_TYPECODE


def row_spans(rows: list[bytes]) -> int:
    """Spans the rows stand for: each step's ranges and the step itself."""
    return sum(map(len, rows)) // ROW_ITEM_SIZE - len(rows)


def row_layout(row: bytes) -> int:
    return int.from_bytes(row[-ROW_ITEM_SIZE:], sys.byteorder, signed=True)


def rows_item(rows: list[bytes]) -> Frame:
    """Duration rows of steps sampled out on their own thread."""
    item: Frame = [None] * ITEM_LEN
    item[ROWS] = rows
    item[F_KIND] = KIND_ROWS
    return item
