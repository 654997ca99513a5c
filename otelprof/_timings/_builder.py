"""The span builder thread: recorded frames -> ReadableSpans -> the provider's span processors.

Runs every `interval_s` (and on flush), so the training thread never builds an OTel object.
Frames with CUDA events wait here until their events complete, then carry the device-side
duration. Timestamps are perf_counter_ns on the hot path and become Unix-epoch nanoseconds
here through one (wall, monotonic) pair taken at engine start: monotonic within the run,
and aligned with the wall clock of the other telemetry.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import repeat
from operator import itemgetter, truediv
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from otelprof._limits import HeldAttributes
from otelprof._schema import ATTR_CUDA_DURATION, ATTR_EPOCH, ATTR_PHASE, ATTR_STEP, STEP_SPAN
from otelprof._schema import PHASE_TRAIN as DEFAULT_PHASE
from otelprof._timings import _recorder as rec
from otelprof._timings._frames import (
    CHUNK_RANGES,
    F_ATTRS,
    F_CTX,
    F_CUDA,
    F_END,
    F_ERROR,
    F_KIND,
    F_NAME,
    F_PARENT,
    F_SPAN,
    F_START,
    F_THREAD,
    KIND_CHUNK,
    KIND_ROWS,
    KIND_STEP,
    ROW_ITEM_SIZE,
    ROWS,
    STEP_ENDED_ELSEWHERE,
    row_layout,
    row_spans,
    row_values,
)
from otelprof._timings._names import MAX_CACHED as MAX_CACHED_NAMES
from otelprof._timings._names import SpanNames
from otelprof._timings._sampling import (
    ANOMALY_BUDGET,
    Aggregates,
    DurationHistogram,
    SpanFields,
    TraceSampler,
)
from otelprof._timings._targets import SpanTargets
from otelprof._timings._trace_ids import RunTraces

_log = logging.getLogger("otelprof")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK_TYPES = (str, bool, int, float)
_UNSET = Status(StatusCode.UNSET)

YIELD_EVERY = 64
YIELD_S = 50e-6
"""The builder sleeps this long every YIELD_EVERY frames (a short stretch of its work), so
the training thread never waits long for the GIL behind a burst of span building."""
MAX_PENDING_CUDA = 65536
"""Frames held while their CUDA events run; past it a frame goes with its host duration."""
IDLE_INTERVAL_S = 1.0
"""The longest the builder sleeps while nothing arrives: each wake-up costs the builder CPU
(cold caches, the interpreter lock taken); the recorder wakes it early once its queue is
half full (`Recorder.start`)."""


_Batch = tuple[DurationHistogram, list[int]]
_Signature = tuple[list[list[int]], list[tuple[int, ...]]]
"""A step layout's duration batches, one per range position, and its rows of durations."""
_LayoutKey = tuple[str, str, tuple[str, ...]]
"""A sampled-out step's layout: its phase, the step span's name, its ranges' names."""
MAX_SIGNATURES = 256
"""Distinct step layouts (phase, range names in close order) aggregated in bulk; steps of
further layouts are aggregated range by range."""
_get_name = itemgetter(F_NAME)
_get_start = itemgetter(F_START)
_get_end = itemgetter(F_END)
_get_error = itemgetter(F_ERROR)
_row_layout_bytes = itemgetter(slice(-ROW_ITEM_SIZE, None))
"""A row's layout id, still encoded (`_frames.row_layout` decodes it)."""
_NO_FRAMES: list[Any] = []
"""What a processed step's `frames` becomes (never appended to: its owner is gone)."""


class Clock:
    """perf_counter_ns -> Unix-epoch ns through one pair sampled at engine start."""

    def __init__(self) -> None:
        self.wall_ns = time.time_ns()
        self.mono_ns = time.perf_counter_ns()

    def to_wall(self, mono_ns: int) -> int:
        return self.wall_ns + (mono_ns - self.mono_ns)


def _clean_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """Keep OTel-valid values; other values become their str() instead of failing export."""
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        if isinstance(value, _OK_TYPES):
            out[str(key)] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, _OK_TYPES) for v in value):
            out[str(key)] = tuple(value)
        else:
            out[str(key)] = str(value)
    return out


def _span_id(frame: list[Any]) -> int:
    """Span ids are drawn here, lazily, so the hot path spends nothing on randomness (a
    step span's is its context's, which its ranges name as their parent)."""
    span_id: int = frame[F_SPAN]
    if not span_id:
        if frame[F_KIND] is KIND_STEP:
            span_id = frame[F_SPAN] = frame[F_CTX].span_id
        else:
            span_id = frame[F_SPAN] = rec.new_span_id()
    return span_id


def _parent_id(frame: list[Any], ctx: rec.StepContext, kind: str) -> int:
    if kind == KIND_STEP:
        return 0
    parent = frame[F_PARENT]
    if parent is None:
        return ctx.span_id
    frame[F_PARENT] = None  # drop the reference: the parent may be long-lived
    return _span_id(parent)


class _Wakeup:
    """An auto-reset event on one lock: `wait` is a single C-level acquire that consumes
    the wake-up (threading.Event's wait runs a Condition's Python code on every wake-up)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        with contextlib.suppress(RuntimeError):  # already set
            self._lock.release()

    def wait(self, timeout_s: float) -> bool:
        return self._lock.acquire(timeout=timeout_s)


class SpanBuilder:
    """Drains the recorder queue on its own thread and hands finished spans to the provider."""

    def __init__(
        self,
        targets: SpanTargets,
        resource: Resource,
        clock: Clock,
        *,
        interval_s: float = 0.2,
        cuda_timer: Any = None,
        version: str = "0",
        trace_budget: float = math.inf,
        traces: RunTraces | None = None,
        head_fraction: float | None = None,
        anomaly_budget: float = ANOMALY_BUDGET,
    ) -> None:
        """`targets`: the tracer provider's active span processor (see `_targets`);
        `resource`: the provider's. `trace_budget`: spans per second of step traces kept
        (see `_sampling`); every range still goes into the duration histograms
        (`aggregates`)."""
        self._targets = targets
        self._resource = resource
        self._scope = InstrumentationScope("otelprof", version)
        self._clock = clock
        self._interval_s = interval_s
        self._cuda = cuda_timer
        self._pending: deque[list[Any]] = deque()
        self._jobs: deque[Callable[[], Iterable[ReadableSpan]]] = deque()
        self._wake = _Wakeup()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one drain at a time (thread vs flush())
        self._thread: threading.Thread | None = None
        self.built = 0
        self.failed = 0
        self.cuda_unresolved = 0
        self.job_spans = 0
        self.steps_on_thread = 0  # steps sampled out on their own thread (`rec.on_thread`)
        self._encoded: list[str] = []
        self.names = SpanNames()  # bounded span-name cardinality (builder thread only)
        self.aggregates = Aggregates()
        # sampling mode's fast path: phase -> raw name -> the duration batch of its
        # histogram; batches are folded into the histograms at the end of every drain
        self._raw_hists: dict[str, dict[str, list[int]]] = {}
        self._batches: dict[int, _Batch] = {}
        # step items' bulk path: phase -> range names in close order -> its signature
        self._signatures: dict[str, dict[tuple[str, ...], _Signature]] = {}
        # rows of steps sampled out on their thread: (phase, step name, range names) -> the
        # histograms of its columns
        self._layout_histograms: dict[_LayoutKey, list[DurationHistogram]] = {}
        self._held_rows: dict[_LayoutKey, list[memoryview]] = {}  # until the drain's end
        self._signature_list: list[_Signature] = []
        # step/chunk items waiting for their ranges' CUDA events: (item, frames)
        self._pending_units: deque[tuple[list[Any], list[list[Any]]]] = deque()
        # steps ended from another thread than their own: (ctx, frames taken) to look at
        # once more for a range that thread was appending right then
        self._recheck: list[tuple[rec.StepContext, int]] = []
        self.sampler = TraceSampler(
            trace_budget,
            self._output,
            build=self._fields_or_none,
            traces=traces,
            head_fraction=head_fraction,
            anomaly_budget=anomaly_budget,
        )
        self.sampler.on_sampled_out = self._release_cuda

    # ---- lifecycle ----
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="otelprof-spans", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread, then drain everything left, waiting up to `timeout_s` for CUDA."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.drain(final=True, timeout_s=timeout_s)
        with self._lock:
            try:
                self.sampler.finish()
            finally:
                self._write_encoded()

    def submit(self, job: Callable[[], Iterable[ReadableSpan]]) -> None:
        """Run `job` on the builder thread; the spans it yields are exported like the others."""
        self._jobs.append(job)
        self._wake.set()

    def pending_cuda(self) -> int:
        return len(self._pending) + sum(len(frames) for _, frames in self._pending_units)

    def wake(self) -> None:
        """Drain now rather than at the next interval (any thread; never blocks)."""
        self._wake.set()

    def _run(self) -> None:
        wait = self._interval_s
        while not self._stop.is_set():
            self._wake.wait(wait)
            # while a wake-up finds nothing to do, the next sleep is longer, up to IDLE_INTERVAL_S
            queued = rec.recorder.queue
            busy = queued or self._jobs or self._pending or self._pending_units or self._recheck
            wait = self._interval_s if busy else min(2 * wait, IDLE_INTERVAL_S)
            try:
                self.drain(final=False)
            except Exception as error:  # never let the thread die
                _log.warning("otelprof: span builder error %r", error)

    # ---- work ----
    def drain(self, *, final: bool, timeout_s: float = 0.0) -> None:
        """Build and hand over everything queued so far; `final` (a flush): waiting up to
        `timeout_s` for CUDA events, and steps still open that head sampling selects."""
        with self._lock:
            try:
                self._recheck_steps()
                self._drain_queue()
                self._run_jobs()
                self._resolve_pending(final=final, timeout_s=timeout_s)
                if final:
                    self._recheck_steps()
                    self.sampler.flush()
            finally:
                self._write_encoded()

    def _recheck_steps(self) -> None:
        recheck, self._recheck = self._recheck, []
        for ctx, taken in recheck:
            late = ctx.frames[taken:]
            ctx.frames = _NO_FRAMES
            for frame in late:
                self._emit_or_hold(frame)

    def _drain_queue(self) -> None:
        if not self.sampler.keep_all:
            self._drain_sampling()
            return
        queue = rec.recorder.queue
        popleft = queue.popleft
        done = 0
        while True:
            try:
                frame = popleft()
            except IndexError:
                self._fold_batches()  # rows sampled out before every step was kept
                return
            done += 1
            if done % YIELD_EVERY == 0 and not self._stop.is_set():
                # hand the GIL over: a training thread coming back from torch (which
                # releases it) would otherwise wait up to the 5 ms switch interval
                time.sleep(YIELD_S)
            kind = frame[F_KIND]
            if kind is KIND_ROWS:
                self._rows(frame)
                continue
            if kind is KIND_STEP or kind is KIND_CHUNK:
                for carried in self._take_carried(frame):
                    self._emit_or_hold(carried)
                if kind is KIND_CHUNK:
                    continue
            self._emit_or_hold(frame)

    def _drain_sampling(self) -> None:
        """`_drain_queue` in sampling mode, with the common case inlined: a range (not a
        step) without CUDA events or error, in a step not decided yet. Its duration goes to
        a per-histogram batch (folded in at the end) and the frame, with the others of its
        step in a row, to the sampler's buffer; no tuple or float per range. Everything
        else takes `_emit` (BENCHMARKS.md has what each path costs the builder)."""
        queue = rec.recorder.queue
        popleft = queue.popleft
        sampler = self.sampler
        stop = self._stop
        by_phase = self._raw_hists
        step_kind = KIND_STEP
        chunk_kind = KIND_CHUNK
        rows_kind = KIND_ROWS
        cur_ctx: Any = None
        run: list[Any] = []  # consecutive ranges of `cur_ctx`, for the sampler's buffer
        cur_durations: dict[str, list[int]] = {}
        phase = DEFAULT_PHASE
        done = 0
        try:
            while True:
                try:
                    frame = popleft()
                except IndexError:
                    return
                done += 1
                if done % YIELD_EVERY == 0 and not stop.is_set():
                    time.sleep(YIELD_S)  # see `_drain_queue`
                ctx = frame[F_CTX]
                kind = frame[F_KIND]
                if (
                    ctx is not cur_ctx
                    or kind is step_kind
                    or kind is chunk_kind
                    or kind is rows_kind
                    or frame[F_CUDA] is not None
                    or frame[F_ERROR] is not None
                ):
                    if run:  # (the sampler may decide its oldest steps now)
                        sampler.buffer(cur_ctx, run)
                        run = []
                    cur_ctx = None
                    if kind is rows_kind:
                        self._rows(frame)
                        continue
                    if kind is step_kind or kind is chunk_kind:
                        carried = self._take_carried(frame)
                        self._unit(frame, carried)
                        done += len(carried) >> 2  # a step item costs about a quarter per range
                        continue
                    if (
                        frame[F_CUDA] is not None
                        or frame[F_ERROR] is not None
                        or ctx is None
                        or ctx.kept is not None
                    ):
                        self._emit_or_hold(frame)
                        continue
                    cur_ctx = ctx
                    phase = ctx.phase or DEFAULT_PHASE
                    cur_durations = by_phase.get(phase)  # type: ignore[assignment]
                    if cur_durations is None:
                        cur_durations = by_phase[phase] = {}
                start = frame[F_START]
                end = frame[F_END]
                ctx.extend(start, end)
                durations = cur_durations.get(frame[F_NAME])
                if durations is None:
                    durations = self._durations_for(frame[F_NAME], phase)
                durations.append(end - start)
                run.append(frame)
        finally:
            if run:
                sampler.buffer(cur_ctx, run)
            self._fold_batches()
            sampler.release_decided()
            rec.on_thread.publish({} if stop.is_set() else self._quiet_limits())

    def _quiet_limits(self) -> dict[str, rec.QuietLimits]:
        """What a step must reach, per phase, for the on-thread sampler to hand it over
        (`rec.OnThreadSampler`): from `TraceSampler.quiet` of the phase's root span and the
        head selection of its next numbers, from the recording step's number (the training
        thread runs ahead of the builder) or the last one decided."""
        out: dict[str, rec.QuietLimits] = {}
        current = rec.recorder.current
        for root in self.sampler.roots():
            found = self.sampler.quiet(root)
            if found is None:
                continue
            tail, anomaly_ns, recent = found
            phase = DEFAULT_PHASE if root == STEP_SPAN else root
            if current is not None and current.phase == phase:
                start = current.number
            else:
                start = self.sampler.last_number.get(phase, 0)
            unknown, selected = self.sampler.head_window(phase, start)
            if unknown > -math.inf:  # else every step may be head sampling's
                slowest = max(recent) * 1e9 if recent else 0.0
                out[phase] = rec.QuietLimits(unknown, tail, slowest, anomaly_ns, selected)
        return out

    def _rows(self, item: list[Any]) -> None:
        """Steps sampled out on their own thread (`rec.on_thread`): each layout's rows become
        one int64 view, held for the drain's end (`_fold_batches`: one fold per column and
        layout a drain, not per item); its step durations join the sampler's recent window
        now."""
        rows: list[bytes] = item[ROWS]
        item[ROWS] = None
        spans = row_spans(rows)
        rec.recorder.took(spans)
        last = _row_layout_bytes
        layouts = set(map(last, rows))  # (a loop in C: per step, no generator frame)
        if len(layouts) == 1:
            groups: dict[bytes, list[bytes]] = {layouts.pop(): rows}
        else:
            groups = {}
            for row in rows:
                groups.setdefault(last(row), []).append(row)
        for key, group in groups.items():
            phase, root, names = rec.on_thread.layouts[row_layout(key)]
            width = len(names) + 2  # the ranges, the step, the layout
            values = row_values(group)
            self._held_rows.setdefault((phase, root, names), []).append(values)
            seconds = map(truediv, values[width - 2 :: width], repeat(1e9))
            self.sampler.add_recent(root, seconds)
        self.sampler.sampled_out += spans
        self.sampler.offered(spans + len(rows))
        self.steps_on_thread += len(rows)

    def _fold_batches(self) -> None:
        """Step rows into their ranges' batches (column by column), batches and the rows
        held by `_rows` into the histograms: every loop here runs in C."""
        for (phase, root, names), views in self._held_rows.items():
            values = row_values(views)
            width = len(names) + 2  # the ranges, the step, the layout
            # a layout's histograms in its rows' column order: its ranges' (close order),
            # then the step's own (its name, not folded); `OnThreadSampler.max_layouts`
            # bounds how many layouts are remembered
            hists = self._layout_histograms.get((phase, root, names))
            if hists is None:
                add = self.aggregates.add_histogram
                hists = [add(self.names.exported(raw), phase) for raw in names]
                hists.append(add(root, phase))
                self._layout_histograms[(phase, root, names)] = hists
            for index, hist in enumerate(hists):
                hist.add_column(values, index, width)
        self._held_rows.clear()
        for columns, rows in self._signature_list:
            if rows:
                # one pass per column, not `zip(*rows)`: that makes an iterator per row, and
                # thousands of them alive at a collection get promoted
                for index, durations in enumerate(columns):
                    durations.extend(map(itemgetter(index), rows))
                rows.clear()
        for hist, durations in self._batches.values():
            if durations:
                hist.add_ns(durations)
                durations.clear()

    def _take_carried(self, item: list[Any]) -> list[list[Any]]:
        """The ranges a step or chunk item carries, taken out of it (a step's `frames`
        would otherwise keep a reference cycle, step -> frames -> step, alive)."""
        if item[F_KIND] is KIND_CHUNK:
            frames: list[list[Any]] = item[CHUNK_RANGES]
            item[CHUNK_RANGES] = None
        else:
            ctx: rec.StepContext = item[F_CTX]
            frames = ctx.frames
            if item[STEP_ENDED_ELSEWHERE]:  # ended from another thread: look again next drain
                self._recheck.append((ctx, len(frames)))
            else:
                ctx.frames = _NO_FRAMES
        rec.recorder.took(len(frames))
        return frames

    def _release_cuda(self, frames: list[list[Any]]) -> None:
        """CUDA events of ranges that will not be written go back to the pool."""
        if self._cuda is None:
            return
        release = self._cuda.release
        for frame in frames:
            if frame[F_CUDA] is not None:
                release(frame[F_CUDA])

    def _unit(self, item: list[Any], frames: list[list[Any]]) -> None:
        """A step or chunk item in sampling mode, held while its ranges' CUDA events run."""
        cuda = self._cuda
        if cuda is not None and (self._pending_units or not self._units_ready(frames)):
            self._pending_units.append((item, frames))  # in order, behind any held one
            return
        self._process_unit(item, frames)

    def _units_ready(self, frames: list[list[Any]]) -> bool:
        ready = self._cuda.ready
        return all(ready(f[F_CUDA]) for f in frames if f[F_CUDA] is not None)

    def _process_unit(self, item: list[Any], frames: list[list[Any]]) -> None:
        """Aggregate a step's (or chunk's) ranges in bulk, add them to the step's trace
        buffer, and for a step item decide the step: a few C-level passes per step."""
        try:
            ctx: rec.StepContext = item[F_CTX]
            is_chunk = item[F_KIND] is KIND_CHUNK
            n = len(frames)
            if n:
                self._aggregate_step(ctx.phase or DEFAULT_PHASE, frames)
                if is_chunk or ctx.trim_start or ctx.trim_end:  # the extent matters: trimmed
                    ctx.extend(min(map(_get_start, frames)), max(map(_get_end, frames)))
                else:
                    ctx.has_children = True
                sampler = self.sampler
                kept = ctx.kept
                if kept is None:
                    sampler.buffer(ctx, frames, ctx.error or any(map(_get_error, frames)))
                elif kept:
                    for frame in frames:
                        fields = self._fields_or_none(frame)
                        if fields is not None:
                            self._output(fields)
                else:
                    sampler.sampled_out += n
            if not is_chunk:
                self._emit(item)
        except Exception as error:
            self.failed += len(frames)
            _log.debug("otelprof: could not sample step %r: %r", item[F_NAME], error)

    def _aggregate_step(self, phase: str, frames: list[list[Any]]) -> None:
        """Every range of a step (or chunk) into its histogram's batch: a known layout
        appends one row of durations (folded in column by column at the end of the
        drain); others go range by range."""
        by_layout = self._signatures.get(phase)
        if by_layout is None:
            by_layout = self._signatures[phase] = {}
        names = tuple(map(_get_name, frames))
        signature = by_layout.get(names)
        if signature is None and len(self._signature_list) < MAX_SIGNATURES:
            columns = [self._durations_in(raw, phase) for raw in names]
            signature = by_layout[names] = (columns, [])
            self._signature_list.append(signature)
        if signature is not None:
            signature[1].append(tuple([f[F_END] - f[F_START] for f in frames]))
            return
        for frame in frames:
            durations = self._durations_in(frame[F_NAME], phase)
            durations.append(frame[F_END] - frame[F_START])

    def _durations_in(self, raw: str, phase: str) -> list[int]:
        durations = self._raw_hists.setdefault(phase, {}).get(raw)
        return self._durations_for(raw, phase) if durations is None else durations

    def _durations_for(self, raw: str, phase: str) -> list[int]:
        """The duration batch of the histogram `raw` (in `phase`) aggregates into;
        remembered per (phase, raw name) while few enough."""
        hist = self.aggregates.add_histogram(self.names.exported(raw), phase)
        # (its histogram, the batch folded in at the end)
        durations = self._batches.setdefault(id(hist), (hist, []))[1]
        by_raw = self._raw_hists[phase]
        if len(by_raw) < MAX_CACHED_NAMES:
            by_raw[raw] = durations
        return durations

    def _emit_or_hold(self, frame: list[Any]) -> None:
        """One frame the general way: held while its CUDA events run, else emitted."""
        cuda = frame[F_CUDA]
        if cuda is not None and not self._cuda.ready(cuda):
            if len(self._pending) < MAX_PENDING_CUDA:
                self._pending.append(frame)
                return
            self.cuda_unresolved += 1
        self._emit(frame)

    def _resolve_pending(self, *, final: bool, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self._resolve_units(final=final, deadline=deadline)
        while self._pending:
            frame = self._pending[0]
            if self._cuda.ready(frame[F_CUDA]):
                self._pending.popleft()
                self._emit(frame)
                continue
            if not final:
                return
            if time.monotonic() >= deadline:
                # give up waiting: emit the rest with host durations only
                while self._pending:
                    frame = self._pending.popleft()
                    frame[F_CUDA] = None
                    self.cuda_unresolved += 1
                    self._emit(frame)
                return
            time.sleep(0.001)

    def _resolve_units(self, *, final: bool, deadline: float) -> None:
        units = self._pending_units
        processed = False
        while units:
            item, frames = units[0]
            if not self._units_ready(frames):
                if not final:
                    return
                if time.monotonic() < deadline:
                    time.sleep(0.001)
                    continue
                for frame in frames:  # give up waiting: host durations only
                    if frame[F_CUDA] is not None and not self._cuda.ready(frame[F_CUDA]):
                        frame[F_CUDA] = None
                        self.cuda_unresolved += 1
            units.popleft()
            processed = True
            self._process_unit(item, frames)
        if processed:
            self._fold_batches()

    def _run_jobs(self) -> None:
        while self._jobs:
            job = self._jobs.popleft()
            try:
                for span in job():
                    try:
                        self._targets.on_end(span)
                    except Exception as error:
                        self.failed += 1
                        _log.debug("otelprof: span processor raised %r", error)
                    self.job_spans += 1
            except Exception as error:
                _log.warning("otelprof: span job failed: %r", error)

    def _emit(self, frame: list[Any]) -> None:
        if frame[F_KIND] == KIND_STEP:
            ctx: rec.StepContext = frame[F_CTX]
            if ctx.drop_if_empty and not ctx.has_children:
                return  # a step cut short by a phase change before any range: no step
        if not self.sampler.keep_all:
            self._sample(frame)
            return
        fields = self._fields_or_none(frame)
        if fields is None:
            return
        ctx = frame[F_CTX]
        phase = fields.attributes.get(ATTR_PHASE) or getattr(ctx, "phase", None) or DEFAULT_PHASE
        seconds = (fields.end_ns - fields.start_ns) / 1e9
        hist = self.aggregates.add(fields.name, phase, seconds)
        self._output(fields)
        hist.exemplar = (seconds, fields.end_ns, fields.trace_id, fields.span_id)

    def _fields_or_none(self, frame: list[Any]) -> SpanFields | None:
        try:
            return self.fields(frame)
        except Exception as error:
            self.failed += 1
            _log.debug("otelprof: could not build span %r: %r", frame[F_NAME], error)
            return None

    def _sample(self, frame: list[Any]) -> None:
        """Sampling mode: aggregate the range from the frame alone and let the sampler
        buffer the frame; span fields are built only if its step is kept."""
        try:
            ctx: rec.StepContext = frame[F_CTX]
            start, end = frame[F_START], frame[F_END]
            is_step = frame[F_KIND] == KIND_STEP
            if is_step:
                start, end = ctx.trimmed(start, end)
                name = frame[F_NAME]
            else:
                ctx.extend(start, end)
                name = self.names.exported(frame[F_NAME])
            seconds = (end - start) / 1e9
            self.aggregates.add(name, ctx.phase or DEFAULT_PHASE, seconds)
            self.sampler.span(ctx, frame, is_step, seconds, frame[F_ERROR] is not None, name)
        except Exception as error:
            self.failed += 1
            _log.debug("otelprof: could not sample span %r: %r", frame[F_NAME], error)

    def _output(self, fields: SpanFields) -> None:
        """Hand one span's fields to every target: encoded for sinks, built for the rest."""
        if not self.sampler.keep_all:  # the exemplar of its histogram: a kept span
            phase = fields.attributes.get(ATTR_PHASE) or DEFAULT_PHASE
            hist = self.aggregates.histograms.get((fields.name, phase))
            if hist is not None:
                seconds = (fields.end_ns - fields.start_ns) / 1e9
                hist.exemplar = (seconds, fields.end_ns, fields.trace_id, fields.span_id)
        targets = self._targets
        try:
            if targets.frame_sinks:
                self._encoded.append(targets.encode_span(*fields))  # type: ignore[misc]
                if len(self._encoded) >= 4096:
                    self._write_encoded()
            others = targets.span_processors
            if others:
                span = self.make_span(*fields)
                for processor in others:
                    try:
                        processor.on_end(span)
                    except Exception as error:
                        self.failed += 1
                        _log.debug("otelprof: span processor raised %r", error)
        except Exception as error:
            self.failed += 1
            _log.debug("otelprof: could not build span %r: %r", fields.name, error)
            return
        self.built += 1

    def _write_encoded(self) -> None:
        if not self._encoded:
            return
        encoded, self._encoded = self._encoded, []
        for sink in self._targets.frame_sinks:
            try:
                sink.write(self._resource, self._scope, encoded)
            except Exception as error:
                self.failed += len(encoded)
                _log.debug("otelprof: span sink raised %r", error)

    def fields(self, frame: list[Any]) -> SpanFields:
        """One frame -> the span's fields (name, trace id, span id, parent id, start, end,
        attributes, error): ids, parent, step/epoch, thread, error, CUDA."""
        ctx: rec.StepContext = frame[F_CTX]
        kind = frame[F_KIND]
        # few attributes: encoding each one is a large part of a span's export cost
        attributes: dict[str, Any] = {ATTR_STEP: ctx.step, ATTR_PHASE: ctx.phase}
        if ctx.epoch is not None:
            attributes[ATTR_EPOCH] = ctx.epoch
        start_ns, end_ns = frame[F_START], frame[F_END]
        if kind == KIND_STEP:
            start_ns, end_ns = ctx.trimmed(start_ns, end_ns)
        else:
            ctx.extend(start_ns, end_ns)
            thread = frame[F_THREAD]
            attributes["thread.id"] = thread.ident
            if thread.name != "MainThread":
                attributes["thread.name"] = thread.name
        raw = frame[F_ATTRS]
        if raw:
            attributes.update(_clean_attributes(raw))
            if type(raw) is HeldAttributes and raw.nbytes:
                # the values now live in the span (an exporter's queue may hold it): the
                # byte budget's charge moves with them (otelprof/_limits.py)
                attributes = HeldAttributes(attributes)
                attributes.nbytes, raw.nbytes = raw.nbytes, 0
        cuda = frame[F_CUDA]
        if cuda is not None:
            seconds = self._cuda.elapsed_s(cuda)
            if seconds is not None:
                attributes[ATTR_CUDA_DURATION] = seconds
        to_wall = self._clock.to_wall
        return SpanFields(
            self.names.name(frame[F_NAME], attributes),
            ctx.trace_id,
            _span_id(frame),
            _parent_id(frame, ctx, kind),
            to_wall(start_ns),
            to_wall(end_ns),
            attributes,
            frame[F_ERROR],
        )

    def make_span(
        self,
        name: str,
        trace_id: int,
        span_id: int,
        parent_id: int,
        start_ns: int,
        end_ns: int,
        attributes: dict[str, Any],
        error: tuple[str, str, str] | None = None,
        links: Any = (),
    ) -> ReadableSpan:
        context = SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED)
        parent = (
            SpanContext(trace_id, parent_id, is_remote=False, trace_flags=_SAMPLED)
            if parent_id
            else None
        )
        events: tuple[Event, ...] = ()
        status = _UNSET
        if error is not None:
            type_name, message, stack = error
            status = Status(StatusCode.ERROR, f"{type_name}: {message}")
            events = (
                Event(
                    "exception",
                    {
                        "exception.type": type_name,
                        "exception.message": message,
                        "exception.stacktrace": stack,
                        "exception.escaped": "True",
                    },
                    timestamp=end_ns,
                ),
            )
        return ReadableSpan(
            name=name,
            context=context,
            parent=parent,
            resource=self._resource,
            attributes=attributes,
            events=events,
            kind=SpanKind.INTERNAL,
            status=status,
            start_time=start_ns,
            end_time=end_ns,
            instrumentation_scope=self._scope,
            links=tuple(
                Link(SpanContext(t, sp, is_remote=False, trace_flags=_SAMPLED), attrs)
                for t, sp, attrs in links
            ),
        )
