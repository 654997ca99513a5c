"""TimingsEngine: step boundaries, phases, schedules, and the lifecycle of bridge, builder
and Kineto.

One engine runs per process (the recorder is process-wide). Step 0 begins at `start()` and
each `step()` ends one step and begins the next, like `torch.profiler.profile`; a range open
across a boundary stays in the step it started in. The edges (first step trimmed to its
ranges, `after_training` after the last `step()`, ranges still open at shutdown not
exported) and phases are the user's contract: docs/guide/timings.md, and DEVELOPING.md
("Phases, throughput and framework integrations").
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import re
import threading
from collections import deque
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

from opentelemetry.sdk.resources import Resource

from otelprof import _torch_compat
from otelprof._schema import (
    ATTR_ATTEMPT,
    PHASE_AFTER_TRAINING,
    PHASE_TRAIN,
    STEP_SPAN,
    is_torch_step_range,
)
from otelprof._timings import _recorder as rec
from otelprof._timings._bridge import Bridge
from otelprof._timings._builder import Clock, SpanBuilder
from otelprof._timings._frames import F_NAME, row_spans
from otelprof._timings._sampling import KINETO_WINDOW_STEPS
from otelprof._timings._schedule import ScheduleAction, as_action, schedule
from otelprof._timings._targets import SpanTargets
from otelprof._timings._trace_ids import RunTraces
from otelprof.config import Settings

_log = logging.getLogger("otelprof")
_lock = threading.Lock()

DEFAULT_KINETO_SCHEDULE = schedule(wait=1, warmup=1, active=3, repeat=1)
"""Kineto's window when no schedule is given: timing spans stay always on, but a full
torch.profiler session on every step would grow without bound, so it gets one short window."""


_PHASE_NAME = re.compile(r"[a-z][a-z0-9_.-]{0,31}")


def check_phase(phase: object) -> str:
    """A phase name: short, lower-case, and not `step` (the training root span's name)."""
    if not isinstance(phase, str) or not _PHASE_NAME.fullmatch(phase) or phase == STEP_SPAN:
        raise ValueError(
            "phase must be a short lower-case name such as 'train', 'validation' or "
            f"'checkpoint' (letters, digits, '_', '.', '-'; not 'step'), got {phase!r}"
        )
    return phase


class TimingsEngine:
    """Turns record_function ranges, `timing()` blocks and steps into OTel spans."""

    __slots__ = (
        "_batch_in_epoch",
        "_bridge",
        "_builder",
        "_calibrate",
        "_capture",
        "_capturing",
        "_clock",
        "_ctx",
        "_ctx_is_block",
        "_cuda",
        "_epoch",
        "_finished",
        "_from_capture",
        "_kineto",
        "_kineto_action",
        "_phase",
        "_phase_batches",
        "_phase_listeners",
        "_running",
        "_schedule",
        "_schedule_errors",
        "_settings",
        "_step",
        "_step_from_start",
        "_step_listeners",
        "_step_start",
        "_stepping",
        "_torch",
        "_train_acc_ns",
        "_train_t0",
        "kineto_captures",
        "range_cost_s",
        "traces",
    )

    def __init__(
        self,
        targets: SpanTargets,
        resource: Resource,
        settings: Settings,
        *,
        calibrate: Callable[[], float] | None = None,
        version: str = "0",
    ) -> None:
        """`targets`: the tracer provider's active span processor and `resource` its
        resource: where built spans go. `calibrate`: measures what one range costs the
        thread that opens it, run by `start()` before the builder thread starts
        (`range_cost_s`). `version`: otelprof's, for the spans' instrumentation scope."""
        self._settings = settings
        self._calibrate = calibrate
        self._clock = Clock()
        self._torch: Any = None
        if settings.record_function or settings.kineto or settings.cuda_events:
            with contextlib.suppress(Exception):
                self._torch = importlib.import_module("torch")
        self._cuda: Any = None  # CUDA-event timing, when asked and CUDA is there
        if self._torch is not None and (settings.cuda_events or settings.sync_cuda):
            with contextlib.suppress(Exception):
                if self._torch.cuda.is_available():
                    from otelprof._timings._cuda import CudaTimer

                    self._cuda = CudaTimer(
                        self._torch, events=settings.cuda_events, sync=settings.sync_cuda
                    )
        # every rank of the run attempt derives the same trace ids and head sampling
        attempt = resource.attributes.get(ATTR_ATTEMPT)
        self.traces = RunTraces(settings.run_id, attempt if isinstance(attempt, int) else 0)
        self._builder = SpanBuilder(
            targets,
            resource,
            self._clock,
            cuda_timer=self._cuda,
            version=version,
            trace_budget=settings.trace_budget,
            traces=self.traces,
            head_fraction=settings.trace_head_fraction,
            anomaly_budget=settings.trace_anomaly_budget,
        )
        self._bridge = Bridge() if (self._torch is not None and settings.record_function) else None
        self._kineto: Any = None
        self._schedule = settings.schedule
        self._running = False
        self._finished = False
        self._step = 0
        self._epoch: int | None = None
        self._batch_in_epoch = 0
        self._phase_batches: dict[str, int] = {}  # batches begun per phase other than train
        self._step_start = 0
        self._ctx: rec.StepContext | None = None
        self._kineto_action = ScheduleAction.NONE
        # anomaly-triggered Kineto window: actions queued by the builder thread
        self._capture: deque[ScheduleAction] = deque()
        self._capturing = False
        self._from_capture = False
        self.kineto_captures = 0
        self._builder.sampler.on_anomaly = self._on_anomaly
        self._schedule_errors = 0
        self.range_cost_s = 0.0  # one timing() range on the opening thread (`calibrate`)
        self._step_from_start = True  # the current step began at start(), not at step()
        self._phase = PHASE_TRAIN
        self._ctx_is_block = False  # the current context began when its phase was entered
        # training time of the current step, phases excluded (for throughput listeners)
        self._train_t0: int | None = None
        self._train_acc_ns = 0
        self._step_listeners: list[Callable[[int, int, bool], None]] = []
        self._phase_listeners: list[Callable[[str, str], None]] = []
        self._stepping: rec.ThreadState | None = None  # the thread that calls step()

    # ---- lifecycle ----
    def start(self) -> None:
        """Begin step 0: start the builder thread, install the bridge, start Kineto if asked."""
        with _lock:
            if self._running or self._finished:
                raise RuntimeError("a TimingsEngine can be started once")
            # the recorder is process-wide: it refuses a second engine
            rec.recorder.start(
                self._settings.max_queued_spans, self.traces, wake_builder=self._builder.wake
            )
            self._running = True
        rec.on_thread.reset()
        if self._calibrate is not None:
            # for the overhead gauge: what one range costs this thread (before the builder runs)
            self.range_cost_s = self._calibrate()
        rec.recorder.set_cuda_timer(self._cuda)
        torch = self._torch
        if torch is not None:  # what `timing()` needs to open torch.profiler ranges too
            ops = _torch_compat.record_function_ops(torch)
            flag = None if ops is None else _torch_compat.profiler_flag(torch)
            rec.recorder.set_torch_hooks(flag, *(ops or (None, None)))
        self._builder.start()
        if self._bridge is not None:
            self._bridge.install()
        if self._settings.kineto and torch is not None:
            from otelprof._timings._kineto import KinetoSession

            self._kineto = KinetoSession(torch, self._builder, self._settings.run_dir / "kineto")
            self._kineto_action = self._kineto_action_for(0)
            self._kineto.start(self._kineto_action)
        self._train_t0 = perf_counter_ns()
        self._begin_step(self._train_t0)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Restore torch, end the trailing step, and hand every queued span to the provider."""
        with _lock:
            if not self._running:
                return
            self._running = False
            self._finished = True
        timeout = self._settings.export_timeout_s if timeout_s is None else timeout_s
        end = perf_counter_ns()
        ctx = self._ctx
        rec.recorder.record(None)
        self._ctx = None
        try:
            rec.on_thread.publish({})
            if self._stepping is not None:  # the stepping thread's sampled-out rows
                rec.on_thread.hand_rows(self._stepping)
            if self._bridge is not None:
                self._bridge.uninstall()
            if self._kineto is not None:
                self._kineto.stop(self._window_step(ctx, end))
            self._builder.drain(final=True, timeout_s=timeout)
            if (
                ctx is not None
                and (ctx.has_children or ctx.frames)
                and not (self._step > 0 and _only_torch_steps(ctx))
            ):
                ctx.trim_end = True
                if ctx.phase == PHASE_TRAIN and self._step > 0:
                    ctx.phase = PHASE_AFTER_TRAINING  # after the last step(): no step
                rec.recorder.emit_step(ctx, end)
            self._builder.stop(timeout)
        finally:
            rec.recorder.stop()

    # ---- steps ----
    def step(self) -> None:
        """End the current step and begin the next (like `torch.profiler.profile.step()`)."""
        if not self._running:
            return
        try:
            end = perf_counter_ns()
            ctx = self._ctx
            recorder = rec.recorder
            if ctx is not None:  # sampled out on this thread if the sampler is quiet, else queued
                self._stepping = recorder.end_step(ctx, end)
            if self._phase != PHASE_TRAIN:
                # a batch of validation (etc.): its own trace, the training step stays
                self._begin_step(perf_counter_ns(), trim_start=False)
                self._ctx_is_block = False
                return
            if self._step_listeners:
                self._notify_step(end)
            else:  # no one asks for the step's training time: only restart its clock
                self._train_acc_ns = 0
                self._train_t0 = end
            self._step += 1
            self._batch_in_epoch += 1
            self._step_from_start = False
            if self._kineto is None and self._schedule is None:  # the common case, inlined
                start = self._step_start = perf_counter_ns()
                self._ctx = recorder.begin_step(self._step, self._epoch, start, False, PHASE_TRAIN)
                return
            if self._kineto is not None:
                finished = self._window_step(ctx, end)
                self._kineto_action = self._kineto_action_for(self._step)
                self._kineto.step(finished, self._kineto_action)
            self._begin_step(perf_counter_ns())
            if self._kineto is not None and self._kineto_action.records and self._ctx is not None:
                # a Kineto window's step is kept in full: its operator spans are its children
                self._ctx.kept = True
                if self._from_capture:  # an anomaly's window: linked from the slow step
                    self._ctx.kineto_capture = True
        except Exception as error:  # telemetry never breaks training
            _log.warning("otelprof: step() failed: %r", error)

    def set_epoch(self, epoch: int | None) -> None:
        """Tag this and later steps with `otelprof.epoch`; a new epoch restarts per-epoch
        schedules (`cyclic_schedule`) at the current step."""
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
            raise TypeError(f"set_epoch: epoch must be an int or None, got {epoch!r}")
        if epoch == self._epoch:
            return
        self._epoch = epoch
        self._batch_in_epoch = 0
        if not self._running:
            return
        if self._ctx is not None:
            self._ctx.epoch = epoch
        if getattr(self._schedule, "restarts_each_epoch", False):
            self._begin_step(self._step_start, keep=True)

    @property
    def step_number(self) -> int:
        return self._step

    @property
    def running(self) -> bool:
        """Between `start()` and `shutdown()`."""
        return self._running

    def add_step_listener(self, listener: Callable[[int, int, bool], None]) -> Callable[[], None]:
        """Call `listener(step, train_ns, first)` on the training thread at each training
        `step()`: the step's number, its wall time without other phases, and whether it is
        the first step (timed from `start()`, so it includes set-up). Returns a remover.
        A listener that raises is removed (telemetry never breaks training)."""
        self._step_listeners.append(listener)
        return functools.partial(_remove_listener, self._step_listeners, listener)

    def _notify_step(self, end_ns: int) -> None:
        t0 = self._train_t0
        train_ns = self._train_acc_ns + (end_ns - t0 if t0 is not None else 0)
        self._train_acc_ns = 0
        self._train_t0 = end_ns
        for listener in tuple(self._step_listeners):
            try:
                listener(self._step, train_ns, self._step_from_start)
            except Exception as error:
                _log.warning("otelprof: step listener %r failed: %r; removed", listener, error)
                _remove_listener(self._step_listeners, listener)

    @property
    def phase(self) -> str:
        """The current phase: "train" unless `set_phase` said otherwise."""
        return self._phase

    def set_phase(self, phase: str) -> str:
        """Enter `phase` ("train", "validation", "checkpoint", ...) and return the previous
        one. Ranges recorded from now on carry `otelprof.phase`; another phase ends the
        training step and roots its ranges at a span named after it (`step()` in it
        separates batches); back in "train", the step resumes with the same number."""
        check_phase(phase)
        previous = self._phase
        if phase == previous:
            return previous
        self._phase = phase
        if not self._running:
            return previous
        try:
            end = perf_counter_ns()
            if previous == PHASE_TRAIN and self._train_t0 is not None:
                self._train_acc_ns += end - self._train_t0
                self._train_t0 = None
            elif phase == PHASE_TRAIN:
                self._train_t0 = end
            ctx = self._ctx
            rec.recorder.record(None)
            if ctx is not None:
                ctx.trim_end = True
                # an empty training step or trailing phase batch was no real one; a whole
                # phase block without ranges (a checkpoint save) is still the phase's time
                ctx.drop_if_empty = ctx.phase == PHASE_TRAIN or not self._ctx_is_block
                rec.recorder.emit_step(ctx, end)
            self._begin_step(perf_counter_ns(), trim_start=True)
            self._ctx_is_block = phase != PHASE_TRAIN
            for listener in tuple(self._phase_listeners):
                listener(previous, phase)
        except Exception as error:  # telemetry never breaks training
            _log.warning("otelprof: set_phase() failed: %r", error)
        return previous

    def add_phase_listener(self, listener: Callable[[str, str], None]) -> Callable[[], None]:
        """Call `listener(previous, phase)` on the calling thread at each change of phase
        while the engine runs. Returns a remover."""
        self._phase_listeners.append(listener)
        return functools.partial(_remove_listener, self._phase_listeners, listener)

    @property
    def aggregates(self) -> Any:
        """Per-(timing, phase) duration histograms of every recorded range."""
        return self._builder.aggregates

    def flush(self, timeout_s: float = 10.0) -> None:
        """Hand every span recorded so far to the provider's processors (tests, shutdown)."""
        ctx = self._ctx
        state = rec.thread_state_if_any()
        if state is not None and state is self._stepping:
            rec.on_thread.hand_rows(state)  # steps sampled out on this thread so far
        if ctx is not None and ctx.owner is not None and ctx.owner is state:
            rec.recorder.hand_off(ctx)  # the running step's ranges so far (only its thread may)
        self._builder.drain(final=True, timeout_s=timeout_s)

    def stats(self) -> dict[str, int]:
        builder = self._builder
        stats = {
            "spans_recorded": builder.built + builder.job_spans,
            "spans_dropped": rec.recorder.dropped + builder.failed,
            "spans_queued": rec.recorder.queued_frames()
            + row_spans(self._stepping.rows if self._stepping else []),
            "steps": self._step,
            "cuda_pending": builder.pending_cuda(),
            "cuda_unresolved": builder.cuda_unresolved,
            "schedule_errors": self._schedule_errors,
            "ranges_exhausted": rec.recorder.exhausted,
            "span_names": len(builder.names.known),
            "span_names_folded": builder.names.folded,
            "bridge_installed": int(self._bridge is not None and self._bridge.installed),
            # recorded, aggregated, and not written (the trace budget): not a loss
            "spans_sampled_out": builder.sampler.sampled_out,
            "steps_sampled_out_on_thread": builder.steps_on_thread,
            "anomalies": builder.sampler.anomalies,
            # ... that the anomaly budget refused (not a loss: histograms have them)
            "anomalies_refused": builder.sampler.anomalies_refused,
            # head-selected steps the head budget had no room for (this rank lacks them)
            "head_steps_refused": builder.sampler.head_refused,
        }
        stats.update({f"steps_kept.{why}": n for why, n in builder.sampler.kept_steps.items()})
        if self._kineto is not None:
            stats["kineto_traces"] = self._kineto.traces
            stats["kineto_spans"] = self._kineto.spans
            stats["kineto_events_dropped"] = self._kineto.events_dropped
            stats["kineto_captures"] = self.kineto_captures
            stats["kineto_steps_skipped"] = self._kineto.steps_skipped
        return stats

    # ---- internals ----
    def _begin_step(
        self, start_ns: int, keep: bool = False, trim_start: bool | None = None
    ) -> None:
        schedule = self._schedule
        action = (
            ScheduleAction.RECORD if schedule is None else self._call_schedule(schedule, self._step)
        )
        previous = self._ctx if keep else None
        self._step_start = start_ns
        if not action.records:
            self._ctx = None
            rec.recorder.record(None)
        elif previous is not None:
            rec.recorder.record(previous)
        else:
            self._ctx = rec.recorder.begin_step(
                self._step,
                self._epoch,
                start_ns,
                self._step_from_start if trim_start is None else trim_start,
                self._phase,
            )
            if self._phase != PHASE_TRAIN:  # numbered by its batch (`_trace_ids`)
                batch = self._phase_batches.get(self._phase, 0)
                self._phase_batches[self._phase] = batch + 1
                self._ctx.batch = batch

    def _call_schedule(self, fn: Any, step: int) -> ScheduleAction:
        arg = self._batch_in_epoch if getattr(fn, "restarts_each_epoch", False) else step
        try:
            return as_action(fn(arg))
        except Exception as error:
            self._schedule_errors += 1
            if self._schedule_errors == 1:
                _log.warning("otelprof: the schedule raised %r; not recording this step", error)
            return ScheduleAction.NONE

    def _kineto_action_for(self, step: int) -> ScheduleAction:
        action = self._call_schedule(self._schedule or DEFAULT_KINETO_SCHEDULE, step)
        # an anomaly's window runs between the schedule's windows, never inside one
        self._from_capture = False
        if self._capture and (
            self._capturing
            or (action is ScheduleAction.NONE and self._kineto_action is ScheduleAction.NONE)
        ):
            self._capturing = True
            self._from_capture = True
            action = self._capture.popleft()
            if not self._capture:
                self._capturing = False
        return action

    def _on_anomaly(self, _ctx: Any, _ratio: float) -> bool:
        """Builder thread: a step far above the norm; with Kineto on, queue a torch.profiler
        window for the next steps (True: the slow step's span waits to link to it)."""
        if self._kineto is None or self._capture or self._capturing:
            return False
        recorded = [ScheduleAction.RECORD] * (KINETO_WINDOW_STEPS - 1)
        # one extend: the training thread never sees part of the window
        self._capture.extend([ScheduleAction.WARMUP, *recorded, ScheduleAction.RECORD_AND_SAVE])
        self.kineto_captures += 1
        return True

    def _window_step(self, ctx: rec.StepContext | None, end_ns: int) -> Any:
        from otelprof._timings._kineto import WindowStep

        if ctx is None or not self._kineto_action.records:
            return None
        return WindowStep(ctx, self._clock.to_wall(ctx.start_ns), self._clock.to_wall(end_ns))


def _remove_listener(listeners: list[Any], listener: Any) -> None:
    with contextlib.suppress(ValueError):
        listeners.remove(listener)


def _only_torch_steps(ctx: rec.StepContext) -> bool:
    """Whether the ranges after the last `step()` are only the `ProfilerStep#N` that a
    user's torch.profiler.profile opened at its own last `step()`: the marker of a step that
    never ran, not work after training (no `after_training` phase for it)."""
    return not ctx.has_children and all(is_torch_step_range(f[F_NAME]) for f in ctx.frames)
