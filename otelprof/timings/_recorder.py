"""The hot path: what the training thread does per range — two timestamps and an append.

A range becomes a *frame*, a small list (name, ids, step context, timestamps, error), pushed
on a per-thread stack while open (so nested ranges find their parent). When it closes on the
thread that runs the step (the one that calls `step()`), it is appended to its step's own
list (`StepContext.frames`), and the whole step reaches the span builder as one queue item
when the step ends: the builder then aggregates and samples a step in a few C-level passes
instead of a Python loop per range, which is what keeps fast steps cheap. Ranges closed on
other threads, or after their step ended, are queued one by one. A step longer than `CHUNK`
ranges is handed over in chunks, so memory stays bounded without `step()` calls.

Nothing here builds OTel objects, does I/O or takes a lock (except to count a drop). The
queue holds at most `capacity` frames, counting those inside step items; past it frames are
dropped and counted; training never waits on telemetry.

The recorder is process-wide (module globals, for the cheapest possible reads on the hot
path); `TimingsEngine` is the only writer of that state.

`Timing.__enter__`/`__exit__`, the record_function bridge's and `StepContext()` also exist
in C (`_speedups.c`, built at install when a C compiler is there, see `use_compiled`): the
same frames from the same globals, uncommon cases handed back to the Python code here, which
stays the reference.
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
from collections.abc import Callable
from time import perf_counter_ns
from types import TracebackType
from typing import Any, TypeVar

from otelprof import _limits

# frame layout (a list, for cheap construction and in-place completion)
F_NAME = 0
F_SPAN = 1  # int span id; 0 until the builder assigns one (no randomness on the hot path)
F_PARENT = 2  # the parent frame (a list), or None: the parent is the step span
F_CTX = 3  # StepContext the range was opened in
F_THREAD = 4  # ThreadState of the opening thread
F_ATTRS = 5  # user attributes or None
F_START = 6  # perf_counter_ns
F_END = 7  # perf_counter_ns
F_ERROR = 8  # (type name, message, stacktrace) or None
F_CUDA = 9  # CUDA event pair or None
F_KIND = 10  # source: KIND_* below
F_OWNER = 11  # the object that opened it (record_function instance / timing)
F_RANGE = 12  # timing frames only: the torch profiler range opened alongside, or None

KIND_RECORD_FUNCTION = KIND_RF = "record_function"
KIND_TIMING = "timing"
KIND_STEP = "step"
KIND_CHUNK = "chunk"
"""A queue item carrying `CHUNK` ranges of a step that is still running (in F_ATTRS)."""
KIND_ROWS = "rows"
"""A queue item carrying duration rows of steps sampled out on their own thread (F_ATTRS)."""

CHUNK = 512
"""Ranges a step collects on its thread before they are handed to the builder mid-step
(fewer with a small queue: `chunk_size`)."""

EXHAUSTED = (StopIteration, StopAsyncIteration)
"""A range ended by these is an iterator's final, empty `__next__` (the DataLoader's at every
epoch end): it loaded nothing, so it is neither an error nor a span (counted in `exhausted`).
Recording it would put an orphan range (its `timed_dataloader` parent is cancelled for the
same reason) in a phantom trailing step after the last `step()`."""
NOT_ERRORS = (StopIteration, StopAsyncIteration, GeneratorExit)
"""Exceptions that end a range normally: exhaustion, and a generator closed by its consumer."""

PHASE_TRAIN = "train"
PHASE_VALIDATION = "validation"
PHASE_CHECKPOINT = "checkpoint"
STEP_SPAN = "step"

MAX_DEPTH = 256
"""Open ranges kept per thread; ranges that are never closed cannot grow memory past this."""


class StepContext:
    """One training step while it records: its trace, its root span, its number and epoch."""

    __slots__ = (
        "_span_id",
        "_trace_id",
        "attrs",
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
        # A step cut short by a phase change (training interrupted by validation) is not
        # exported when no range was recorded in it: it was no real step.
        self.drop_if_empty = False
        # attributes of the step span itself (e.g. the step's samples/tokens/FLOPs)
        self.attrs: dict[str, Any] | None = None
        self._trace_id = 0  # drawn on first use: most steps are sampled out, never written
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
        self.owner: ThreadState | None = _local.state or thread_state()
        self.error = False  # a range of it (on its own thread) ended with an exception

    @property
    def trace_id(self) -> int:
        """The step's trace id (drawn on the span builder's thread, the only reader)."""
        trace_id = self._trace_id
        if not trace_id:
            trace_id = self._trace_id = _getrandbits(128) or 1
        return trace_id

    @property
    def span_id(self) -> int:
        """The step span's id (drawn like `trace_id`)."""
        span_id = self._span_id
        if not span_id:
            span_id = self._span_id = _getrandbits(64) or 1
        return span_id


_BASE_FRAME: list[Any] = [None] * 13
"""Bottom of every thread's stack: belongs to no step (F_CTX None) and no owner."""


class ThreadState:
    """Per-thread open-range stack, plus the thread's identity for span attributes."""

    __slots__ = ("hold", "ident", "name", "rows", "stack")

    def __init__(self) -> None:
        thread = threading.current_thread()
        self.ident = threading.get_ident()
        self.name = thread.name
        # steps this thread sampled out itself (`_quiet_steps`): rows of durations not yet
        # queued, and how many more steps go to the builder after a possible anomaly
        self.rows: list[tuple[int, ...]] = []
        self.hold = 0
        # The base frame is never popped: a list that empties and refills on every range
        # would be reallocated twice per range (CPython shrinks it at size 0).
        self.stack: list[list[Any]] = [_BASE_FRAME]


class _Local(threading.local):
    state: ThreadState | None = None


# ---- process-wide recorder state; written only by TimingsEngine ----
current: StepContext | None = None
"""The recording step's context; None when nothing records (no engine, or a NONE/WARMUP step)."""
queue: deque[list[Any]] = deque()
capacity: int = 0
"""Frames the queue may hold, those carried inside step and chunk items included."""
in_items: int = 0
"""Frames queued inside step/chunk items so far (written by the stepping thread)."""
out_items: int = 0
"""... and taken out by the builder (written by the builder thread only)."""
chunk_size: int = CHUNK
"""CHUNK, or a quarter of a smaller queue's capacity (set by the engine)."""
dropped: int = 0
exhausted: int = 0
_drop_lock = threading.Lock()
_local = _Local()
_rng = random.Random()  # seeded from os.urandom
_getrandbits = _rng.getrandbits
"""Trace and span ids come from otelprof's own generator: training code seeds (and
frameworks save and restore, e.g. Lightning around its sanity check) the global `random`
state, which would repeat ids across steps, runs and ranks."""

# Optional torch hooks for `timing()`, set by the engine when torch is importable.
torch_profiler_state: Any = None
"""torch.autograd.profiler: its `_is_profiler_enabled` flag is set by every Python-level torch
profiler (torch.profiler.profile, autograd.profiler.profile, emit_nvtx/itt); a module
attribute read is ~4x cheaper than torch.autograd._profiler_enabled()."""
torch_range_enter: Callable[[str, str | None], Any] | None = None
torch_range_exit: Callable[[Any], Any] | None = None
cuda_timer: Any = None  # _cuda.CudaTimer while CUDA timing is on
is_compiling: Callable[[], bool] | None = None
"""torch.compiler.is_dynamo_compiling once torch is imported: inside a region torch.compile traces,
`timing()` steps aside (a clock read or a thread-local there is a graph break)."""


def _stop_in_forked_child() -> None:
    """A forked child (e.g. a DataLoader worker) has no builder thread: record nothing there,
    rather than filling a queue nobody drains."""
    global current, capacity, in_items, out_items
    _rng.seed()  # a child must not repeat its parent's ids
    current = None
    capacity = 0
    queue.clear()
    in_items = out_items = 0
    state = _local.state
    if state is not None:
        state.rows = []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_stop_in_forked_child)


def thread_state() -> ThreadState:
    state = _local.state
    if state is None:
        state = _local.state = ThreadState()
    return state


def _count_drop(n: int = 1) -> None:
    global dropped
    with _drop_lock:
        dropped += n


def queued_frames() -> int:
    """Frames waiting for the builder, single ones and those inside step/chunk items."""
    return len(queue) + max(0, in_items - out_items)


def _queue_item(item: list[Any], carried: int) -> None:
    """Queue a step or chunk item carrying `carried` frames; past the capacity its ranges
    are dropped and counted (a step item still goes if the step span alone fits)."""
    global in_items
    queued = len(queue) + (in_items - out_items)
    if queued + carried < capacity:
        in_items += carried
        queue.append(item)
        return
    if carried:
        _count_drop(carried)
        if item[F_KIND] is KIND_STEP:
            item[F_CTX].frames = []
        else:
            return
    if queued < capacity:
        queue.append(item)
    else:
        _count_drop()


def hand_off(ctx: StepContext) -> None:
    """Queue the ranges `ctx` collected so far (on its own thread: only it appends to them)."""
    frames = ctx.frames
    if not frames:
        return
    ctx.frames = []
    item: list[Any] = [None] * 13
    item[F_CTX] = ctx
    item[F_ATTRS] = frames
    item[F_KIND] = KIND_CHUNK
    _queue_item(item, len(frames))


def _count_exhausted() -> None:
    global exhausted
    with _drop_lock:
        exhausted += 1


def describe_error(
    exc_type: type[BaseException], exc: BaseException | None, tb: TracebackType | None
) -> tuple[str, str, str]:
    """Exception type, message and stack trace as strings, so no frame (or tensor) is kept."""
    try:
        stack = "".join(traceback.format_exception(exc_type, exc, tb))
    except Exception:
        stack = ""
    return (f"{exc_type.__module__}.{exc_type.__qualname__}", str(exc), stack)


def begin_leaf(name: str) -> list[Any] | None:
    """Start a span that is never a parent (not pushed on the thread's stack), for ranges
    whose end may never come, like an optimizer step that raises between its hooks."""
    ctx = current
    if ctx is None:
        return None
    state = thread_state()
    stack = state.stack
    parent = stack[-1] if stack and stack[-1][3] is ctx else None
    frame = [name, 0, parent, ctx, state, None, 0, 0, None, None, KIND_TIMING, None, None]
    frame[6] = perf_counter_ns()
    return frame


def end_leaf(frame: list[Any]) -> None:
    frame[7] = perf_counter_ns()
    ctx = frame[3]
    if ctx.owner is frame[4]:
        frames = ctx.frames
        frames.append(frame)
        if len(frames) >= chunk_size:
            hand_off(ctx)
    elif len(queue) < capacity:
        queue.append(frame)
    else:
        _count_drop()


def _remove(stack: list[list[Any]], frame: list[Any]) -> None:
    with contextlib.suppress(ValueError):
        stack.remove(frame)


def discard_frame(frame: list[Any]) -> None:
    """Forget an open frame without emitting it (e.g. the data loader's final, empty next())."""
    _remove(frame[F_THREAD].stack, frame)


def find_owned_frame(owner: object) -> list[Any] | None:
    """The innermost open frame on this thread opened by `owner`, if any."""
    state = _local.state
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


def emit_step(ctx: StepContext, end_ns: int) -> None:
    """Queue the step span (the root of the step's trace): `step` in training, else the
    phase's name (`validation`, ...), so step statistics never include other phases. The
    item carries the ranges the step collected (`ctx.frames`); from now on ranges of this
    step that close late are queued singly. Ended from a thread other than the step's own,
    the item says so (F_RANGE), and the builder looks once more for a range the step's
    thread was appending right then."""
    owner = ctx.owner
    ctx.owner = None
    frame = [
        STEP_SPAN if ctx.phase == PHASE_TRAIN else ctx.phase,
        0,  # the builder gives it ctx.span_id
        0,
        ctx,
        thread_state(),
        ctx.attrs,
        ctx.start_ns,
        end_ns,
        None,
        None,
        KIND_STEP,
        None,
        owner is not None and owner is not _local.state,
    ]
    _queue_item(frame, len(ctx.frames))


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

    local = _local
    pc = perf_counter_ns
    kind = KIND_RF
    frames = queue

    def __enter__(self: Any) -> Any:
        result = original_enter(self)
        ctx = current
        if ctx is not None:
            state = local.state
            if state is None:
                state = thread_state()
            stack = state.stack
            parent = stack[-1] if stack and stack[-1][3] is ctx else None
            frame = [self.name, 0, parent, ctx, state, None, 0, 0, None, None, kind, self]
            if len(stack) < MAX_DEPTH:
                stack.append(frame)
            frame[6] = pc()
        return result

    def __exit__(
        self: Any,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Any:
        state = local.state
        if state is not None and state.stack:
            stack = state.stack
            frame: Any = stack[-1]
            if frame[11] is self:
                end = pc()
                stack.pop()
            else:  # forgotten (forget_ranges_above), closed twice, or opened while idle
                frame = find_owned_frame(self)
                if frame is not None:
                    end = pc()
                    _remove(stack, frame)
            if frame is not None:
                frame[7] = end
                frame[11] = None  # let torch free the range object now, not on the builder
                if exc_type is not None and issubclass(exc_type, NOT_ERRORS):
                    if issubclass(exc_type, EXHAUSTED):
                        _count_exhausted()
                        return original_exit(self, exc_type, exc, tb)
                elif exc_type is not None:
                    frame[8] = describe_error(exc_type, exc, tb)
                    frame[3].error = True
                ctx = frame[3]
                if ctx.owner is state:
                    own = ctx.frames
                    own.append(frame)
                    if len(own) >= chunk_size:
                        hand_off(ctx)
                elif len(frames) < capacity:
                    frames.append(frame)
                else:
                    _count_drop()
        return original_exit(self, exc_type, exc, tb)

    __enter__._otelprof_bridge = True  # type: ignore[attr-defined]
    __exit__._otelprof_bridge = True  # type: ignore[attr-defined]
    return __enter__, __exit__


_F = TypeVar("_F", bound=Callable[..., Any])


class Timing:
    """A timing span around a block or a function; made by `timing()`."""

    __slots__ = ("attributes", "name")

    def __init__(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"timing: name must be a non-empty string, got {name!r}")
        self.name = name
        # long strings cut here: they wait in the queues until written (otelprof/_limits.py)
        self.attributes = _limits.limit_attributes(attributes) if attributes else None

    def __enter__(self) -> Timing:
        ctx = current
        if ctx is None:
            return self
        state = _local.state
        if state is None:
            state = thread_state()
        stack = state.stack
        top = stack[-1]  # never empty: the base frame stays
        parent = top if top[3] is ctx else None
        # the F_* layout with literal indices (hot path); F_RANGE only exists on timing frames
        frame = [self.name, 0, parent, ctx, state, self.attributes, 0, 0, None, None, KIND_TIMING,
                 self, None]  # fmt: skip
        stack.append(frame)
        if torch_profiler_state is not None and torch_profiler_state._is_profiler_enabled:
            frame[12] = _torch_range_enter(self.name)
        if cuda_timer is not None:
            frame[9] = cuda_timer.enter()
        frame[6] = perf_counter_ns()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        state = _local.state
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
            cuda_timer.exit(frame[9])
        frame[7] = perf_counter_ns()
        if exc_type is not None:
            if not issubclass(exc_type, NOT_ERRORS):
                frame[8] = describe_error(exc_type, exc, tb)
                frame[3].error = True
            elif issubclass(exc_type, EXHAUSTED):
                _count_exhausted()
                if frame[12] is not None:
                    _torch_range_exit(frame[12])
                return
        ctx = frame[3]
        if ctx.owner is state:
            frames = ctx.frames
            frames.append(frame)
            if len(frames) >= chunk_size:
                hand_off(ctx)
        elif len(queue) < capacity:
            queue.append(frame)
        else:
            _count_drop()
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
        return torch_range_enter(name, None)  # type: ignore[misc]
    except Exception:
        return None


def _torch_range_exit(handle: Any) -> None:
    with contextlib.suppress(Exception):
        torch_range_exit(handle)  # type: ignore[misc]


# ---- the compiled hot path (`_speedups.c`): the same functions, without the interpreter ----
_py_timing_enter = Timing.__enter__
_py_timing_exit = Timing.__exit__


def _load_speedups() -> Any:
    """The compiled hot path, or None: not built (no C compiler at install) or turned off
    with OTELPROF_PURE_PYTHON=1. The Python code above stays the reference either way."""
    if os.environ.get("OTELPROF_PURE_PYTHON", "").strip() not in ("", "0"):
        return None
    try:
        from otelprof.timings import _speedups
    except ImportError:
        return None
    return _speedups


speedups = _load_speedups()
compiled = False
"""Whether `Timing`'s enter/exit run compiled now (see `use_compiled`)."""
new_step_context: Callable[[int, int | None, int, bool, str], StepContext] = StepContext
"""`StepContext(step, epoch, start_ns, trim_start, phase)`, compiled when the hot path is."""


def use_compiled(on: bool) -> bool:
    """Run `Timing`'s enter/exit compiled (when built) or in Python; returns whether they
    run compiled now. (`timing()` stays Python: torch.compile traces it to step aside.)"""
    global compiled, new_step_context
    if on and speedups is not None:
        speedups.bind(globals(), StepContext(0, None, 0))  # new contexts start as its copies
        Timing.__enter__ = speedups.method(speedups.timing_enter)  # type: ignore[method-assign]
        Timing.__exit__ = speedups.method(speedups.timing_exit)  # type: ignore[method-assign]
        new_step_context = speedups.step_context
        compiled = True
    else:
        Timing.__enter__ = _py_timing_enter  # type: ignore[method-assign]
        Timing.__exit__ = _py_timing_exit  # type: ignore[method-assign]
        new_step_context = StepContext
        compiled = False
    return compiled


use_compiled(True)
