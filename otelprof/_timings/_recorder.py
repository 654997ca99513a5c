"""The hot path: what the training thread does per range — two timestamps and an append.

A range is a *frame* (`_frames`), pushed on a per-thread stack while open. Closed on the
step's own thread it joins `StepContext.frames` and the step reaches the span builder as one
queue item (aggregated in C-level passes, which keeps fast steps cheap); other ranges are
queued singly, and a step past `chunk_size` ranges is handed over in chunks. No OTel
objects, no I/O, no lock but to count a drop; past `capacity` frames are dropped and counted,
training never waits. One process-wide `recorder`: only its methods and the hot path write
its fields (ARCHITECTURE.md, "The recorder", who calls what). The Python code here is the
reference of the compiled functions in `_speedups.c` (`use_compiled`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from time import perf_counter_ns
from types import TracebackType
from typing import Any, TypeVar

from otelprof import _limits
from otelprof._schema import PHASE_TRAIN, STEP_SPAN
from otelprof._timings._frames import (
    F_CTX,
    F_CUDA,
    F_END,
    F_KIND,
    F_NAME,
    F_OWNER,
    F_START,
    F_THREAD,
    KIND_RF,
    KIND_STEP,
    KIND_TIMING,
    LAYOUT,
    Frame,
    base_frame,
    chunk_item,
    leaf_frame,
    measured_frame,
    pack_row,
    row_spans,
    rows_item,
    step_item,
)
from otelprof._timings._sampling import CAPTURE_STEPS
from otelprof._timings._trace_ids import RunTraces

CHUNK = 512
"""Ranges a step collects on its thread before they are handed to the builder mid-step
(fewer with a small queue: `chunk_size`)."""

EXHAUSTED = (StopIteration, StopAsyncIteration)
"""A range ended by these is an iterator's final, empty `__next__` (the DataLoader's at every
epoch end): neither an error nor a span (counted in `exhausted`), else an orphan range would
sit in a phantom step after the last `step()`."""
NOT_ERRORS = (StopIteration, StopAsyncIteration, GeneratorExit)
"""Exceptions that end a range normally: exhaustion, and a generator closed by its consumer."""

MAX_DEPTH = 256
"""Open ranges kept per thread; ranges that are never closed cannot grow memory past this."""


class StepContext:
    """One training step while it records: its trace, its root span, its number and epoch."""

    __slots__ = (
        "_span_id",
        "_trace_id",
        "attrs",
        "batch",
        "drop_if_empty",
        "epoch",
        "error",
        "first_child_ns",
        "frames",
        "has_children",
        "kept",
        "kineto_capture",
        "last_child_ns",
        "owner",
        "phase",
        "start_ns",
        "step",
        "trim_end",
        "trim_start",
    )

    def __init__(
        self,
        step: int,
        epoch: int | None,
        start_ns: int,
        trim_start: bool = False,
        phase: str = PHASE_TRAIN,
    ) -> None:
        self.step = step
        self.epoch = epoch
        self.phase = phase
        # the batch's place in its phase over the run (phases other than "train", set by
        # the engine); None: the step number numbers it (see `_trace_ids`)
        self.batch: int | None = None
        # A step cut short by a phase change (training interrupted by validation) is not
        # exported when no range was recorded in it: it was no real step.
        self.drop_if_empty = False
        # attributes of the step span itself (e.g. the step's samples/tokens/FLOPs)
        self.attrs: dict[str, Any] | None = None
        self._trace_id = 0  # derived on first use: most steps are sampled out, never written
        self._span_id = 0
        self.start_ns = start_ns
        # A side of the step with no step() call (the start of the first step, opened by
        # start(); the end of the trailing one, closed by shutdown()) is trimmed to the
        # step's ranges, so set-up and tear-down do not count as step time.
        self.trim_start = trim_start
        self.trim_end = False
        # builder thread only: whether ranges were recorded in it, and their extent
        self.has_children = False
        self.first_child_ns = 0
        self.last_child_ns = 0
        self.kept: bool | None = None  # builder thread: the trace sampler's decision
        self.kineto_capture = False  # in a Kineto window an anomaly started (kept in full)
        # ranges closed on the step's own thread, handed over with the step (see module doc);
        # `owner` is that thread until the step is queued, then None (later ranges go singly)
        self.frames: list[list[Any]] = []
        self.owner: ThreadState | None = recorder.threads.state or thread_state()
        self.error = False  # a range of it (on its own thread) ended with an exception

    def extend(self, start_ns: int, end_ns: int) -> None:
        """Builder thread: a range of this step ran from `start_ns` to `end_ns` (the extent
        of its ranges, which a trimmed side of the step span ends at)."""
        if not self.has_children or start_ns < self.first_child_ns:
            self.first_child_ns = start_ns
        if end_ns > self.last_child_ns:
            self.last_child_ns = end_ns
        self.has_children = True

    def trimmed(self, start_ns: int, end_ns: int) -> tuple[int, int]:
        """Builder thread: the step span's start and end, a side with no `step()` call
        (`trim_start`, `trim_end`) cut to its ranges' extent."""
        if self.has_children:
            if self.trim_start:
                start_ns = max(start_ns, self.first_child_ns)
            if self.trim_end:
                end_ns = min(end_ns, self.last_child_ns)
        return start_ns, end_ns

    @property
    def number(self) -> int:
        """What numbers it among its phase's steps on every rank: the step, or the batch."""
        batch = self.batch
        return self.step if batch is None else batch

    @property
    def trace_id(self) -> int:
        """The step's trace id, shared by every rank (`_trace_ids`; derived on the span
        builder's thread, the only reader, for kept steps). Random outside an engine."""
        trace_id = self._trace_id
        if not trace_id:
            traces = recorder.traces
            trace_id = self._trace_id = (
                traces.trace_id(self.phase, self.number)
                if traces is not None
                else _getrandbits(128) or 1
            )
        return trace_id

    @property
    def span_id(self) -> int:
        """The step span's id (drawn like `trace_id`)."""
        span_id = self._span_id
        if not span_id:
            span_id = self._span_id = _getrandbits(64) or 1
        return span_id


_BASE_FRAME: Frame = base_frame()
"""Bottom of every thread's stack: belongs to no step (F_CTX None) and no owner."""


class ThreadState:
    """Per-thread open-range stack, plus the thread's identity for span attributes."""

    __slots__ = ("hold", "ident", "name", "rows", "stack")

    def __init__(self) -> None:
        thread = threading.current_thread()
        self.ident = threading.get_ident()
        self.name = thread.name
        # steps this thread sampled out itself (`OnThreadSampler`): rows of durations not yet
        # queued, and how many more steps go to the builder after a possible anomaly
        self.rows: list[bytes] = []
        self.hold = 0
        # The base frame is never popped: a list that empties and refills on every range
        # would be reallocated twice per range (CPython shrinks it at size 0).
        self.stack: list[Frame] = [_BASE_FRAME]


class _Local(threading.local):
    state: ThreadState | None = None


_rng = random.Random()  # seeded from os.urandom
_getrandbits = _rng.getrandbits
"""Ids come from otelprof's own generator: training code seeds (and frameworks save and
restore) the global `random` state, which would repeat ids across steps, runs and ranks."""


class Recorder:
    """The process-wide recorder's state, and every operation on it (one instance,
    `recorder`). Fields are public to read; only its methods and the hot path (here and in
    `_speedups.c`, which reads them by offset) write them. Who calls what: ARCHITECTURE.md,
    "The recorder"."""

    __slots__ = (
        "_lock",
        "capacity",
        "chunk_size",
        "clock",
        "cuda_timer",
        "current",
        "dropped",
        "exhausted",
        "in_items",
        "out_items",
        "queue",
        "started",
        "threads",
        "torch_profiler_flags",
        "torch_range_enter",
        "torch_range_exit",
        "traces",
        "wake_builder",
    )

    def __init__(self) -> None:
        self.threads = _Local()
        """Each thread's `ThreadState` (`thread_state()`), as `threads.state`."""
        self.clock: Callable[[], int] = perf_counter_ns
        """What ranges are timed with (a test may replace it)."""
        self.current: StepContext | None = None
        """The recording step's context; None when nothing records (no engine, or a
        NONE/WARMUP step)."""
        self.queue: deque[Frame] = deque()
        self.capacity = 0
        """Frames the queue may hold, those carried inside step and chunk items included."""
        self.in_items = 0
        """Frames queued inside step/chunk/rows items so far (written by the stepping thread)."""
        self.out_items = 0
        """... and taken out by the builder (written by the builder thread only)."""
        self.chunk_size = CHUNK
        """CHUNK, or a quarter of a smaller queue's capacity."""
        self.dropped = 0
        self.exhausted = 0
        self.started = False
        """Between `start()` and `stop()`: one engine at a time records (it is process-wide)."""
        self.cuda_timer: Any = None
        """_cuda.CudaTimer while CUDA timing is on."""
        # Optional torch hooks for `timing()`, set by the engine when torch is importable.
        self.torch_profiler_flags: tuple[dict[str, Any], str] | None = None
        """(namespace, key) of the flag every Python-level torch profiler sets while it
        records (`_torch_compat.profiler_flag`): a dict read, cheaper than a call."""
        self.torch_range_enter: Callable[[str, str | None], Any] | None = None
        self.torch_range_exit: Callable[[Any], Any] | None = None
        self.traces: RunTraces | None = None
        """The run attempt's trace ids (`_trace_ids`), while an engine runs."""
        self.wake_builder: Callable[[], None] | None = None
        """Called once the queue is half full: the builder sleeps up to a second while idle."""
        self._lock = threading.Lock()  # counts only: the hot path takes no lock

    # ---- lifecycle (the engine) ----
    def start(
        self,
        capacity: int,
        traces: RunTraces | None = None,
        wake_builder: Callable[[], None] | None = None,
    ) -> None:
        """An empty queue of `capacity` frames, counters at zero; nothing records yet. Trace
        ids from `traces` (random without); `wake_builder`: see the field. RuntimeError
        while started already."""
        with self._lock:
            if self.started:
                raise RuntimeError("another TimingsEngine is running; shut it down first")
            self.started = True
        self.traces = traces
        self.wake_builder = wake_builder
        self.dropped = 0
        self.exhausted = 0
        self.queue.clear()
        self.in_items = self.out_items = 0
        self.capacity = capacity
        self.chunk_size = max(1, min(CHUNK, capacity // 4))

    def set_cuda_timer(self, timer: Any) -> None:
        """Time ranges on the GPU too (a `_cuda.CudaTimer`), or not (None)."""
        self.cuda_timer = timer

    def set_torch_hooks(
        self, profiler_flags: tuple[dict[str, Any], str] | None, range_enter: Any, range_exit: Any
    ) -> None:
        """torch's profiler flag and range functions (`timing()` opens torch ranges too)."""
        self.torch_profiler_flags = profiler_flags
        self.torch_range_enter = range_enter
        self.torch_range_exit = range_exit

    def stop(self) -> None:
        """Record nothing more: no step, no room in the queue, no torch or CUDA hooks."""
        self.started = False
        self.current = None
        self.capacity = 0
        self.cuda_timer = None
        self.wake_builder = None
        self.set_torch_hooks(None, None, None)

    def record(self, ctx: StepContext | None) -> None:
        """Ranges opened from now on belong to step `ctx` (None: nothing records)."""
        self.current = ctx

    def begin_step(
        self, step: int, epoch: int | None, start_ns: int, trim_start: bool, phase: str
    ) -> StepContext:
        """A new step's context, recorded from now on (compiled: `use_compiled`)."""
        ctx = self.current = StepContext(step, epoch, start_ns, trim_start, phase)
        return ctx

    def end_step(self, ctx: StepContext, end_ns: int) -> ThreadState | None:
        """Nothing records; the finished step `ctx` is sampled out on its own thread
        (`on_thread`) or queued whole (`emit_step`). Returns the thread state it ran on
        (None: it was queued before). Compiled: `use_compiled`."""
        self.current = None
        state = ctx.owner
        if state is None or not on_thread.sample_out(ctx, end_ns, state):
            self.emit_step(ctx, end_ns)
        return state

    def _after_fork(self) -> None:
        """A forked child (e.g. a DataLoader worker) has no builder thread: record nothing
        there, rather than filling a queue nobody drains."""
        _rng.seed()  # a child must not repeat its parent's ids
        self.started = False
        self.current = None
        self.capacity = 0
        self.wake_builder = None  # the parent's builder thread is not in the child
        self.queue.clear()
        self.in_items = self.out_items = 0
        self._lock = threading.Lock()
        state = self.threads.state
        if state is not None:
            state.rows = []

    @contextlib.contextmanager
    def isolated(self, room: int) -> Iterator[Callable[[], None]]:
        """Record into a private step with room for `room` more frames (calibrating the
        hot path); yields a function that forgets what was recorded so far. Every field is
        restored afterwards and nothing recorded reaches the builder."""
        saved, capacity, dropped, in_items = (
            self.current,
            self.capacity,
            self.dropped,
            self.in_items,
        )
        queued = len(self.queue)
        ctx = StepContext(-1, None, self.clock())

        def discard() -> None:
            ctx.frames.clear()
            while len(self.queue) > queued:
                self.queue.pop()
            self.in_items = in_items

        self.current = ctx
        self.capacity = queued + room + 1  # the append path, never the drop path
        try:
            yield discard
        finally:
            self.current, self.capacity, self.dropped = saved, capacity, dropped
            discard()

    # ---- counts ----
    def count_drop(self, n: int = 1) -> None:
        with self._lock:
            self.dropped += n

    def count_exhausted(self) -> None:
        with self._lock:
            self.exhausted += 1

    def queued_frames(self) -> int:
        """Frames waiting for the builder, single ones and those inside items."""
        return len(self.queue) + max(0, self.in_items - self.out_items)

    def took(self, n: int) -> None:
        """The builder took `n` frames out of step, chunk or rows items (its thread only)."""
        self.out_items += n

    # ---- the queue ----
    def _queue_item(self, item: Frame, carried: int) -> None:
        """Queue a step, chunk or rows item carrying `carried` frames; past the capacity its
        ranges are dropped and counted (a step item still goes if the step span alone fits)."""
        queue = self.queue
        queued = len(queue) + (self.in_items - self.out_items)
        if queued + carried < self.capacity:
            self.in_items += carried
            queue.append(item)
            if 2 * (queued + carried) >= self.capacity and self.wake_builder is not None:
                self.wake_builder()
            return
        if carried:
            self.count_drop(carried)
            if item[F_KIND] is KIND_STEP:
                item[F_CTX].frames = []
            else:
                return
        if queued < self.capacity:
            queue.append(item)
        else:
            self.count_drop()

    def enqueue(self, frame: Frame) -> None:
        """Queue one finished range (or count it dropped when the queue is full)."""
        if len(self.queue) < self.capacity:
            self.queue.append(frame)
        else:
            self.count_drop()

    def enqueue_measured(
        self,
        name: str,
        attrs: dict[str, Any] | None,
        start_ns: int,
        end_ns: int,
        ctx: StepContext,
        parent: Frame | None,
        state: ThreadState,
    ) -> None:
        """Queue a range measured by its caller (e.g. across threads: a DDP all-reduce from
        its last bucket to its future's end); `ctx`, `parent` and `state` from `position`."""
        self.enqueue(measured_frame(name, parent, ctx, state, attrs, start_ns, end_ns))

    def enqueue_rows(self, rows: list[bytes]) -> None:
        """Queue duration rows of steps sampled out on their thread (`on_thread`)."""
        self._queue_item(rows_item(rows), row_spans(rows))

    def hand_off(self, ctx: StepContext) -> None:
        """Queue the ranges `ctx` collected so far (on its own thread: only it appends)."""
        frames = ctx.frames
        if not frames:
            return
        ctx.frames = []
        self._queue_item(chunk_item(ctx, frames), len(frames))

    def emit_step(self, ctx: StepContext, end_ns: int) -> None:
        """Queue the step span with the ranges it collected: `step` in training, else the
        phase's name, so step statistics never include other phases. Later ranges of it go
        singly. Ended from another thread, the item says so (STEP_ENDED_ELSEWHERE): the
        builder looks once more for a range the step's thread was appending right then."""
        owner = ctx.owner
        ctx.owner = None
        item = step_item(
            STEP_SPAN if ctx.phase == PHASE_TRAIN else ctx.phase,
            ctx,
            thread_state(),
            ctx.attrs,
            ctx.start_ns,
            end_ns,
            owner is not None and owner is not self.threads.state,
        )
        self._queue_item(item, len(ctx.frames))

    def deliver(self, frame: Frame, state: ThreadState) -> None:
        """A closed range: to its step's own list on the step's thread, else the queue."""
        ctx = frame[F_CTX]
        if ctx.owner is state:
            frames = ctx.frames
            frames.append(frame)
            if len(frames) >= self.chunk_size:
                self.hand_off(ctx)
        elif len(self.queue) < self.capacity:
            self.queue.append(frame)
        else:
            self.count_drop()

    # ---- the calling thread's ranges ----
    def begin_leaf(self, name: str) -> Frame | None:
        """Start a span that is never a parent (not pushed on the thread's stack), for
        ranges whose end may never come, like an optimizer step that raises between its
        hooks."""
        ctx = self.current
        if ctx is None:
            return None
        state = thread_state()
        stack = state.stack
        parent = stack[-1] if stack and stack[-1][F_CTX] is ctx else None
        frame = leaf_frame(name, parent, ctx, state)
        frame[F_START] = self.clock()
        return frame

    def end_leaf(self, frame: Frame) -> None:
        frame[F_END] = self.clock()
        self.deliver(frame, frame[F_THREAD])

    def position(self) -> tuple[StepContext | None, Frame | None, ThreadState]:
        """(recording step, innermost open range of it on this thread or None, this
        thread's state): where a range measured by its caller belongs."""
        ctx = self.current
        state = thread_state()
        top = state.stack[-1]
        return ctx, (top if top[F_CTX] is ctx else None), state

    def depth(self) -> int:
        """Open ranges on this thread, plus one (the base frame)."""
        return len(thread_state().stack)

    def top_name(self) -> str | None:
        """The name of the innermost open range on this thread (None: none is open)."""
        stack = thread_state().stack
        return stack[-1][F_NAME] if len(stack) > 1 else None

    def forget_above(self, depth: int) -> None:
        """Forget ranges opened on this thread above `depth` (a `depth()` value) without
        emitting them; their exits then find nothing to close."""
        stack = thread_state().stack
        if depth >= 1 and len(stack) > depth:
            del stack[depth:]


recorder = Recorder()


class QuietLimits:
    """What a step of one phase must reach to go to the span builder while its trace
    sampler is quiet, as the builder last published it (`OnThreadSampler.publish`)."""

    __slots__ = ("anomaly_ns", "first_unknown", "selected", "slowest_ns", "tail_tokens")

    def __init__(
        self,
        first_unknown: float,
        tail_tokens: float,
        slowest_ns: float,
        anomaly_ns: float,
        selected: frozenset[int],
    ) -> None:
        self.first_unknown = first_unknown
        """The first step (batch) number head sampling's selection is not known for."""
        self.tail_tokens = tail_tokens
        """Spans the tail budget holds; those of steps handed over are subtracted here (on
        the training thread) until the next publication."""
        self.slowest_ns = slowest_ns
        """The slowest recent step: a slower one may be the tail's."""
        self.anomaly_ns = anomaly_ns
        """A step this long may be an anomaly."""
        self.selected = selected
        """The numbers below `first_unknown` that head sampling selects."""


class OnThreadSampler:
    """Steps sampled out on their own thread, at `step()`, while the trace sampler is quiet.

    Why: at fast step rates almost every step is sampled out, and handing each to the
    builder costs it interpreter-lock time and keeps the ranges alive long enough for the
    garbage collector to promote them (BENCHMARKS.md). A step that cannot reach the
    builder's published `QuietLimits` becomes one row of durations (`_frames.pack_row`,
    queued `rows_per_item` at a time) and its ranges are freed at once; any step that could
    be kept (the first ones, the budgets', errors, anomalies and the `capture_steps` after
    them, long steps) goes to the builder whole, so the sampler decides the same; only the
    timing differs (DEVELOPING.md, "Always on: sinks, histograms, sampling").
    """

    __slots__ = (
        "capture_steps",
        "layout_ids",
        "layouts",
        "limits",
        "long_step_ns",
        "max_layouts",
        "rows_per_item",
    )

    def __init__(self) -> None:
        self.limits: dict[str, QuietLimits] = {}
        """Published by the span builder (one atomic rebinding); a phase not in it: every
        step goes to the builder."""
        self.layouts: dict[int, tuple[str, str, tuple[str, ...]]] = {}
        """Row layout id -> (phase, root span name, range names in close order); written on
        the training thread before the first row of that layout is queued."""
        self.layout_ids: dict[str, dict[tuple[str, ...], int]] = {}
        self.max_layouts = 256
        self.rows_per_item = 64
        """Sampled-out steps per queue item: the histograms lag by at most this."""
        self.long_step_ns = 10_000_000
        """A step this long or longer goes to the builder whole, and holds the next
        `capture_steps` there too (it may be an anomaly): deciding here would cost more than
        the builder spends (BENCHMARKS.md, "The training loop")."""
        self.capture_steps = CAPTURE_STEPS

    def publish(self, limits: dict[str, QuietLimits]) -> None:
        """Replace what steps must exceed to go to the builder (the span builder's thread)."""
        self.limits = limits

    def reset(self) -> None:
        """A new engine: nothing published, no layouts."""
        self.limits = {}
        self.layouts.clear()
        self.layout_ids.clear()

    def sample_out(self, ctx: StepContext, end_ns: int, state: ThreadState) -> bool:
        """At `step()`: True if the step was sampled out here (its row queued or batched,
        its ranges freed), False if it must go to the builder. Only `state`'s own thread
        decides: ended from another thread, a step goes to the builder."""
        if state is not recorder.threads.state:
            return False
        duration = end_ns - ctx.start_ns
        if duration >= self.long_step_ns:
            state.hold = self.capture_steps
            return False
        phase = ctx.phase
        limits = self.limits.get(phase)
        if limits is None:
            return False
        if duration >= limits.anomaly_ns:
            state.hold = self.capture_steps  # maybe an anomaly: the next steps may be captured
            return False
        if state.hold:
            state.hold -= 1
            return False
        if ctx.kept is not None or ctx.trim_start or ctx.error:
            return False
        frames = ctx.frames
        if not frames:
            return False
        number = ctx.batch
        if number is None:
            number = ctx.step
        if number >= limits.first_unknown or number in limits.selected:  # head sampling's
            return False
        spans = len(frames) + 1
        if spans <= limits.tail_tokens and duration > limits.slowest_ns:  # maybe the tail's
            limits.tail_tokens -= spans
            return False
        layout = self._layout_of(phase, frames)
        if layout is None:
            return False
        # one bytes object (`_frames.pack_row`): no container for the collector to track,
        # so rows waiting for the builder never set off collections (a GIL stall each)
        try:
            row = pack_row([f[F_END] - f[F_START] for f in frames], duration, layout)
        except (OverflowError, TypeError):  # a clock that gives no int64 ns: the builder's
            return False
        cuda = recorder.cuda_timer
        if cuda is not None:  # its CUDA events are reused by later ranges
            for frame in frames:
                if frame[F_CUDA] is not None:
                    cuda.release(frame[F_CUDA])
        ctx.owner = None  # ranges of it that close late are queued singly ...
        ctx.kept = False  # ... and counted as sampled out
        frames.clear()  # its ranges are freed now, on this thread (no cycle left to collect)
        rows = state.rows
        rows.append(row)
        if len(rows) >= self.rows_per_item:
            self.hand_rows(state)
        return True

    def _layout_of(self, phase: str, frames: list[Frame]) -> int | None:
        """The id of the layout of a step whose ranges closed in this order (None: the table
        is full)."""
        names = tuple([f[F_NAME] for f in frames])
        by_names = self.layout_ids.get(phase)
        if by_names is None:
            by_names = self.layout_ids[phase] = {}
        layout = by_names.get(names)
        if layout is None:
            if len(self.layouts) >= self.max_layouts:
                return None
            layout = len(self.layouts)
            root = STEP_SPAN if phase == PHASE_TRAIN else phase
            self.layouts[layout] = (phase, root, names)
            by_names[names] = layout
        return layout

    def hand_rows(self, state: ThreadState) -> None:
        """Queue the thread's batch of rows (from that thread, or once it no longer steps)."""
        rows = state.rows
        if not rows:
            return
        state.rows = []
        recorder.enqueue_rows(rows)


on_thread = OnThreadSampler()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=recorder._after_fork)


def thread_state() -> ThreadState:
    """The calling thread's state, made on its first use."""
    threads = recorder.threads
    state = threads.state
    if state is None:
        state = threads.state = ThreadState()
    return state


def thread_state_if_any() -> ThreadState | None:
    """The calling thread's state, None if it never recorded."""
    return recorder.threads.state


def new_span_id() -> int:
    """A span id from otelprof's own generator (`_rng`)."""
    return _getrandbits(64) or 1


def describe_error(
    exc_type: type[BaseException], exc: BaseException | None, tb: TracebackType | None
) -> tuple[str, str, str]:
    """Exception type, message and stack trace as strings, so no frame (or tensor) is kept."""
    try:
        stack = "".join(traceback.format_exception(exc_type, exc, tb))
    except Exception:
        stack = ""
    return (f"{exc_type.__module__}.{exc_type.__qualname__}", str(exc), stack)


def _remove(stack: list[Frame], frame: Frame) -> None:
    with contextlib.suppress(ValueError):
        stack.remove(frame)


def discard_frame(frame: Frame) -> None:
    """Forget an open frame without emitting it (e.g. the data loader's final, empty next())."""
    _remove(frame[F_THREAD].stack, frame)


def find_owned_frame(owner: object) -> Frame | None:
    """The innermost open frame on this thread opened by `owner`, if any."""
    state = recorder.threads.state
    if state is None:
        return None
    stack = state.stack
    if stack:
        top = stack[-1]
        if top[F_OWNER] is owner:
            return top
        for frame in reversed(stack):
            if frame[F_OWNER] is owner:
                return frame
    return None


def bridged_methods(original_enter: Any, original_exit: Any) -> tuple[Any, Any]:
    """`__enter__`/`__exit__` for torch's record_function: torch's own run first/last, and
    in between the range is recorded like a `timing`. Compiled when the hot path is at the
    time of the call (`use_compiled`); the compiled exit hands every uncommon case (an
    exception, a range not on top of the stack) to the Python one."""
    enter, exit_ = _py_bridged_methods(original_enter, original_exit)
    if not compiled or speedups is None:
        return enter, exit_
    fast_enter = functools.partial(speedups.bridge_enter, original_enter)
    fast_exit = functools.partial(speedups.bridge_exit, exit_, original_exit)
    fast_enter._otelprof_bridge = fast_exit._otelprof_bridge = True  # type: ignore[attr-defined]
    return speedups.method(fast_enter), speedups.method(fast_exit)  # bound like a def


def _py_bridged_methods(original_enter: Any, original_exit: Any) -> tuple[Any, Any]:
    """The Python bridge (the reference; inlined: this is the hot path)."""

    kind = KIND_RF
    rec = recorder

    def __enter__(self: Any) -> Any:
        result = original_enter(self)
        ctx = rec.current
        if ctx is not None:
            state = rec.threads.state
            if state is None:
                state = thread_state()
            stack = state.stack
            parent = stack[-1] if stack and stack[-1][3] is ctx else None
            # _frames.record_function_frame, inline (hot path)
            frame = [self.name, 0, parent, ctx, state, None, 0, 0, None, None, kind, self]
            if len(stack) < MAX_DEPTH:
                stack.append(frame)
            frame[6] = rec.clock()
        return result

    def __exit__(
        self: Any,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Any:
        state = rec.threads.state
        if state is not None and state.stack:
            stack = state.stack
            frame: Any = stack[-1]
            if frame[11] is self:
                end = rec.clock()
                stack.pop()
            else:  # forgotten (forget_above), closed twice, or opened while idle
                frame = find_owned_frame(self)
                if frame is not None:
                    end = rec.clock()
                    _remove(stack, frame)
            if frame is not None:
                frame[7] = end
                frame[11] = None  # let torch free the range object now, not on the builder
                if exc_type is not None and issubclass(exc_type, NOT_ERRORS):
                    if issubclass(exc_type, EXHAUSTED):
                        rec.count_exhausted()
                        return original_exit(self, exc_type, exc, tb)
                elif exc_type is not None:
                    frame[8] = describe_error(exc_type, exc, tb)
                    frame[3].error = True
                ctx = frame[3]
                if ctx.owner is state:  # Recorder.deliver, inline (hot path)
                    own = ctx.frames
                    own.append(frame)
                    if len(own) >= rec.chunk_size:
                        rec.hand_off(ctx)
                elif len(rec.queue) < rec.capacity:
                    rec.queue.append(frame)
                else:
                    rec.count_drop()
        return original_exit(self, exc_type, exc, tb)

    __enter__._otelprof_bridge = True  # type: ignore[attr-defined]
    __exit__._otelprof_bridge = True  # type: ignore[attr-defined]
    return __enter__, __exit__


_F = TypeVar("_F", bound=Callable[..., Any])


class Timing:
    """A timing span around a block or a function; made by `timing()`. Its `__enter__` and
    `__exit__` below are the reference of the compiled ones (`use_compiled`)."""

    __slots__ = ("attributes", "name")

    def __init__(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"timing: name must be a non-empty string, got {name!r}")
        self.name = name
        # long strings cut here: they wait in the queues until written (otelprof/_limits.py)
        self.attributes = _limits.limit_attributes(attributes) if attributes else None

    def __enter__(self) -> Timing:
        rec = recorder
        ctx = rec.current
        if ctx is None:
            return self
        state = rec.threads.state
        if state is None:
            state = thread_state()
        stack = state.stack
        top = stack[-1]  # never empty: the base frame stays
        parent = top if top[3] is ctx else None
        # _frames.timing_frame, inline with literal indices (hot path)
        frame = [self.name, 0, parent, ctx, state, self.attributes, 0, 0, None, None, KIND_TIMING,
                 self, None]  # fmt: skip
        stack.append(frame)
        flags = rec.torch_profiler_flags
        if flags is not None and flags[0].get(flags[1]):
            frame[12] = _torch_range_enter(self.name)
        if rec.cuda_timer is not None:
            frame[9] = rec.cuda_timer.enter()
        frame[6] = rec.clock()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        rec = recorder
        state = rec.threads.state
        if state is None:
            return
        stack = state.stack
        frame: Any = stack[-1]  # the base frame's owner is None, never a Timing
        if frame[11] is self:
            stack.pop()
        else:
            frame = find_owned_frame(self)
            if frame is None:
                return
            _remove(stack, frame)
        if frame[9] is not None:
            rec.cuda_timer.exit(frame[9])
        frame[7] = rec.clock()
        if exc_type is not None:
            if not issubclass(exc_type, NOT_ERRORS):
                frame[8] = describe_error(exc_type, exc, tb)
                frame[3].error = True
            elif issubclass(exc_type, EXHAUSTED):
                rec.count_exhausted()
                if frame[12] is not None:
                    _torch_range_exit(frame[12])
                return
        ctx = frame[3]
        if ctx.owner is state:  # Recorder.deliver, inline (hot path)
            frames = ctx.frames
            frames.append(frame)
            if len(frames) >= rec.chunk_size:
                rec.hand_off(ctx)
        elif len(rec.queue) < rec.capacity:
            rec.queue.append(frame)
        else:
            rec.count_drop()
        if frame[12] is not None:
            _torch_range_exit(frame[12])

    def cancel(self) -> None:
        """Close without emitting a span (the block turned out not to be a real occurrence)."""
        frame = find_owned_frame(self)
        if frame is not None:
            discard_frame(frame)
            if frame[12] is not None:
                _torch_range_exit(frame[12])

    def __call__(self, func: _F) -> _F:
        """Decorator use: every call of `func` is one span (none inside compiled code)."""

        @functools.wraps(func)
        def timed(*args: Any, **kwargs: Any) -> Any:
            check = is_compiling or _find_is_compiling()
            if check is not None and check():
                return func(*args, **kwargs)
            with self:
                return func(*args, **kwargs)

        return timed  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"timing({self.name!r}{', ' if self.attributes else ''}{self.attributes or ''})"


is_compiling: Callable[[], bool] | None = None
"""torch.compiler.is_dynamo_compiling once torch is imported: inside a region torch.compile traces,
`timing()` steps aside (a clock read or a thread-local there is a graph break)."""

_timings_by_name: dict[str, Timing] = {}
MAX_CACHED_NAMES = 4096


def timing(name: str, **attributes: Any) -> Timing:
    """A timing span around a block (`with timing("reduce_metrics"):`) or a function
    (`@timing("train_batch")`), a child of the enclosing range or of the step span.

    Free when no profiler records. While a torch profiler is recording it also opens a
    `record_function` range of the same name, so the name shows up in torch traces.
    Exceptions mark the span as an error and propagate unchanged. Open ranges live on the
    thread's stack, not in the object, so one object may be entered on several threads
    and nested in itself (attribute-free timings are shared per name). Inside a region
    that torch.compile traces it is a no-op (no graph break, no span).
    """
    check = is_compiling or _find_is_compiling()
    if check is not None and check():
        return _PASSTHROUGH
    if not attributes:
        try:
            return _timings_by_name[name]
        except (KeyError, TypeError):  # a new name (or not a string: Timing says so)
            pass
    made = Timing(name, attributes)
    if not attributes and len(_timings_by_name) < MAX_CACHED_NAMES:
        _timings_by_name[name] = made
    return made


def forget_timing(name: str) -> None:
    """Drop `timing(name)`'s cached object (a name used once, e.g. by the calibration)."""
    _timings_by_name.pop(name, None)


class _Passthrough(Timing):
    """What `timing()` returns inside compiled code: nothing to trace, nothing recorded."""

    __slots__ = ()

    def __enter__(self) -> Timing:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def cancel(self) -> None:
        return None


_PASSTHROUGH = _Passthrough("compiled region")


def compiling() -> bool:
    """Whether torch.compile traces the calling code now (then nothing is recorded: a clock
    read or a thread-local there is a graph break)."""
    check = is_compiling or _find_is_compiling()
    return check is not None and check()


def _find_is_compiling() -> Callable[[], bool] | None:
    """torch.compiler.is_compiling, once torch is imported (importing otelprof never imports
    torch); None before."""
    global is_compiling
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        # is_dynamo_compiling: a bare `return False` in eager (the cheapest check on the hot
        # path), constant-folded to True by dynamo while it traces.
        compiler = torch.compiler
        is_compiling = getattr(compiler, "is_dynamo_compiling", None) or compiler.is_compiling
    except Exception:
        is_compiling = _never
    return is_compiling


def _never() -> bool:
    return False


def _torch_range_enter(name: str) -> Any:
    try:
        return recorder.torch_range_enter(name, None)  # type: ignore[misc]
    except Exception:
        return None


def _torch_range_exit(handle: Any) -> None:
    with contextlib.suppress(Exception):
        recorder.torch_range_exit(handle)  # type: ignore[misc]


# ---- the compiled hot path (`_speedups.c`): the same functions, without the interpreter ----
_py_timing_enter = Timing.__enter__
_py_timing_exit = Timing.__exit__
_py_begin_step = Recorder.begin_step
_py_end_step = Recorder.end_step


def _load_speedups() -> Any:
    """The compiled hot path, or None: not built (no C compiler at install) or turned off
    with OTELPROF_PURE_PYTHON=1. The Python code above stays the reference either way."""
    if os.environ.get("OTELPROF_PURE_PYTHON", "").strip() not in ("", "0"):
        return None
    try:
        from otelprof._timings import _speedups
    except ImportError:
        return None
    return _speedups


speedups = _load_speedups()
compiled = False
"""Whether the recorder's hot path runs compiled now (see `use_compiled`)."""


def use_compiled(on: bool) -> bool:
    """Run `Timing`'s enter/exit, `Recorder.begin_step` and `end_step` compiled (when
    built) or in Python; returns whether they run compiled now. The C code is handed what it
    reads as it is now: call again after replacing the clock or the thread-local. (`timing()`
    stays Python: torch.compile traces it to step aside.)"""
    global compiled
    if on and speedups is not None and getattr(speedups, "FRAME_LAYOUT", None) == LAYOUT:
        speedups.bind(
            recorder,
            on_thread,
            (Recorder, OnThreadSampler, Timing, ThreadState, StepContext, QuietLimits, _Local),
            StepContext(0, None, 0),  # what a new context starts as, copied slot by slot
            (
                _py_timing_exit,
                _py_begin_step,
                _py_end_step,
                thread_state,
                _torch_range_enter,
            ),
            (KIND_TIMING, KIND_RF, KIND_STEP, MAX_DEPTH, PHASE_TRAIN, STEP_SPAN),
        )
        Timing.__enter__ = speedups.method(speedups.timing_enter)  # type: ignore[method-assign]
        Timing.__exit__ = speedups.method(speedups.timing_exit)  # type: ignore[method-assign]
        Recorder.begin_step = speedups.method(speedups.begin_step)  # type: ignore[method-assign]
        Recorder.end_step = speedups.method(speedups.end_step)  # type: ignore[method-assign]
        compiled = True
    else:
        Timing.__enter__ = _py_timing_enter  # type: ignore[method-assign]
        Timing.__exit__ = _py_timing_exit  # type: ignore[method-assign]
        Recorder.begin_step = _py_begin_step  # type: ignore[method-assign]
        Recorder.end_step = _py_end_step  # type: ignore[method-assign]
        compiled = False
    return compiled


use_compiled(True)
