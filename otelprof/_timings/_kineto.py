"""Optional torch.profiler (Kineto) windows: operator events and CUDA kernels as child spans.

During the schedule's active steps a real `torch.profiler.profile` session runs (warming up
on WARMUP steps, like torch). When its window ends torch hands us the trace: the Chrome trace
file is kept in `<run_dir>/kineto/`, and the builder thread parses it and turns each CPU
operator / GPU kernel / memcpy event into a span under the step it ran in (CPU operators
nested by time containment per thread). `record_function` ranges already are spans through
the bridge, so Kineto's copies of them (`user_annotation`) are not repeated.

Kineto's clock is not ours: its conversion to Unix time is measured when the profiler
starts, and on a busy machine it is off by tens of µs. So an event goes to the step that
torch's own marks (`ProfilerStep#N`, on Kineto's clock) say it ran in, and a step's events
move together by the least that starts them inside it (`_fit`); without marks, an event
goes by Kineto's Unix times.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan

from otelprof import _torch_compat
from otelprof._patch import Patch
from otelprof._schema import (
    ATTR_EPOCH,
    ATTR_KINETO_CATEGORY,
    ATTR_KINETO_DEVICE,
    ATTR_PHASE,
    ATTR_SOURCE,
    ATTR_STEP,
    is_torch_step_range,
)
from otelprof._timings import _recorder as rec
from otelprof._timings._builder import SpanBuilder
from otelprof._timings._schedule import ScheduleAction

_log = logging.getLogger("otelprof")

_LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
_DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
KEPT_CATEGORIES = _LAUNCH_CATEGORIES | _DEVICE_CATEGORIES | {"cpu_op"}
MAX_EVENTS_PER_WINDOW = 50_000
"""Spans one window may produce; the rest are counted in `kineto_events_dropped`."""


@dataclass(frozen=True)
class WindowStep:
    ctx: rec.StepContext
    start_ns: int  # Unix epoch ns
    end_ns: int


@dataclass
class _Placed:
    """A step of the window, its `ProfilerStep` mark on Kineto's clock, and how far its
    events' Kineto times move to start inside the step (`_fit`)."""

    step: WindowStep
    start: int
    end: int
    shift: int = 0


class KinetoSession:
    """One torch.profiler.profile driven step by step by the engine's schedule.

    Torch allows one profiler per process; two at once crash it (a segfault in
    `export_chrome_trace`). So a window never starts while another torch profiler is
    active (the window is skipped, counted in `steps_skipped`, logged once), and a program
    that starts its own profiler during one of our windows gets the profiler: our window is
    closed first (its trace kept) and Kineto windows stop for the rest of the run. Any error
    from torch turns Kineto off for the run rather than risk the process.
    """

    def __init__(self, torch: Any, builder: SpanBuilder, directory: Path) -> None:
        self._torch = torch
        self._builder = builder
        self._directory = directory
        self._next = ScheduleAction.NONE
        self._window: list[WindowStep] = []
        self._profile: Any = None
        self.traces = 0
        self.spans = 0
        self.events_dropped = 0
        self.steps_skipped = 0
        self._ours = False  # our torch session holds the profiler (WARMUP/RECORD)
        self._transitioning = False  # inside our own calls into torch's profiler
        self._disabled = False
        self._warned = False
        self._patched: Patch | None = None

    def _torch_action(self, _step: int) -> Any:
        return self._torch.profiler.ProfilerAction[self._next.name]

    def _admit(self, action: ScheduleAction) -> ScheduleAction:
        """The action torch gets: NONE when Kineto is off or another profiler is active."""
        if self._disabled:
            return ScheduleAction.NONE
        if (
            action is not ScheduleAction.NONE
            and not self._ours
            and _torch_compat.profiler_enabled(self._torch)
        ):
            self.steps_skipped += 1
            if not self._warned:
                self._warned = True
                _log.warning(
                    "otelprof: another torch profiler is active; kineto windows are "
                    "skipped while it runs (timing spans are unaffected)"
                )
            return ScheduleAction.NONE
        return action

    def start(self, action: ScheduleAction) -> None:
        torch = self._torch
        try:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._next = self._admit(action)
            self._profile = torch.profiler.profile(
                activities=activities, schedule=self._torch_action, on_trace_ready=self._on_ready
            )
            self._patch_foreign_start()
            self._call(self._profile.start)
        except Exception as error:
            self._fail("starting", error)

    def step(self, finished: WindowStep | None, next_action: ScheduleAction) -> None:
        """Close one step (kept for the window if it recorded) and move torch's profiler on."""
        if self._disabled or self._profile is None:
            return
        if finished is not None and self._ours:
            self._window.append(finished)
        self._next = self._admit(next_action)
        try:
            self._call(self._profile.step)
        except Exception as error:
            self._fail("stepping", error)

    def stop(self, finished: WindowStep | None) -> None:
        if finished is not None and self._ours:
            self._window.append(finished)
        patched, self._patched = self._patched, None
        if patched is not None:
            patched.restore()
        profile, self._profile = self._profile, None
        if profile is not None and not self._disabled:
            try:
                self._call(profile.stop)
            except Exception as error:
                _log.warning("otelprof: stopping torch.profiler failed: %r", error)
        self._ours = False

    def _call(self, action: Any) -> None:
        """Call into torch's profiler as ourselves; afterwards torch is in `self._next`."""
        self._transitioning = True
        try:
            action()
        finally:
            self._transitioning = False
        self._ours = self._next is not ScheduleAction.NONE

    def _fail(self, what: str, error: Exception) -> None:
        self._disabled = True
        self._window = []
        _log.warning(
            "otelprof: %s torch.profiler failed (%r); kineto is off for this run", what, error
        )

    def _patch_foreign_start(self) -> None:
        """See a program's own profiler start: it must not run beside one of our windows."""
        cls = _torch_compat.profile_class(self._torch)
        if cls is None:
            return  # this torch starts its profiler another way: the guard is off
        original = getattr(cls, _torch_compat.PROFILE_START)
        session = self

        def _prepare_trace(profile: Any, *args: Any, **kwargs: Any) -> Any:
            if session._ours and not session._transitioning:
                session._yield_to_foreign()
            return original(profile, *args, **kwargs)

        self._patched = Patch(cls, _torch_compat.PROFILE_START, _prepare_trace)

    def _yield_to_foreign(self) -> None:
        """Another profiler starts during our window: close ours (trace kept), then stand down."""
        if not self._warned:
            self._warned = True
            _log.warning(
                "otelprof: the program started a torch profiler during a kineto window; the "
                "window is closed early and kineto windows stop for this run"
            )
        profile, self._profile = self._profile, None
        self.steps_skipped += 1
        try:
            if profile is not None:
                self._call(profile.stop)
        except Exception as error:
            _log.debug("otelprof: closing the kineto window early failed: %r", error)
        self._ours = False
        self._disabled = True
        self._window = []

    def _on_ready(self, profile: Any) -> None:
        """torch's on_trace_ready (training thread): save the trace, convert it elsewhere."""
        window, self._window = self._window, []
        if self._disabled and not window:
            return
        try:
            self._directory.mkdir(parents=True, exist_ok=True)
            rank = os.environ.get("RANK", "0")
            last = window[-1].ctx.step if window else profile.step_num
            path = self._directory / f"rank{rank}.step{last}.pt.trace.json"
            profile.export_chrome_trace(str(path))
        except Exception as error:
            _log.warning("otelprof: saving the torch.profiler trace failed: %r", error)
            return
        self.traces += 1
        if window:
            self._builder.submit(lambda: self._convert(path, window))

    def _convert(self, path: Path, window: list[WindowStep]) -> Iterator[ReadableSpan]:
        """Spans for the kept events of one Chrome trace file, each under its step span."""
        with open(path, encoding="utf-8") as handle:
            trace = json.load(handle)
        base = int(trace.get("baseTimeNanoseconds", 0) or 0)
        events = []
        marks = []
        for event in trace.get("traceEvents", []):
            mark = event.get("cat") == "user_annotation" and is_torch_step_range(
                str(event.get("name"))
            )
            if event.get("ph") != "X" or not (mark or event.get("cat") in KEPT_CATEGORIES):
                continue
            try:
                start = base + round(float(event["ts"]) * 1000.0)
                end = start + round(float(event.get("dur", 0)) * 1000.0)
            except (KeyError, TypeError, ValueError):
                continue
            if mark:
                marks.append((start, end))
            else:
                events.append((start, -end, end, event))
        placed = _place(window, marks)
        events.sort(key=lambda item: (item[0], item[1]))
        if len(events) > MAX_EVENTS_PER_WINDOW:
            self.events_dropped += len(events) - MAX_EVENTS_PER_WINDOW
            events = events[:MAX_EVENTS_PER_WINDOW]
        launched: dict[Any, _Placed] = {}  # correlation id -> step of the CPU-side launch
        for start, _neg_end, _end, event in events:
            if event.get("cat") in _LAUNCH_CATEGORIES:
                correlation = (event.get("args") or {}).get("correlation")
                step = _step_of(placed, start)
                if correlation is not None and step is not None:
                    launched[correlation] = step
        steps = []
        for start, _neg_end, _end, event in events:
            step = None
            if event.get("cat") in _DEVICE_CATEGORIES:
                step = launched.get((event.get("args") or {}).get("correlation"))
            steps.append(step if step is not None else _step_of(placed, start))
        _fit(events, steps)
        stacks: dict[tuple[Any, Any, int], list[tuple[int, int]]] = {}
        for (start, _neg_end, end, event), step in zip(events, steps, strict=True):
            if step is None:
                self.events_dropped += 1
                continue
            ctx = step.step.ctx
            key = (event.get("pid"), event.get("tid"), ctx.step)
            stack = stacks.setdefault(key, [])
            while stack and stack[-1][1] <= start:
                stack.pop()
            parent = stack[-1][0] if stack and event.get("cat") == "cpu_op" else ctx.span_id
            span_id = rec.new_span_id()
            if event.get("cat") == "cpu_op":
                stack.append((span_id, end))
            attributes: dict[str, Any] = {
                ATTR_STEP: ctx.step,
                ATTR_PHASE: ctx.phase,
                ATTR_SOURCE: "kineto",
                ATTR_KINETO_CATEGORY: str(event.get("cat")),
            }
            if ctx.epoch is not None:
                attributes[ATTR_EPOCH] = ctx.epoch
            args = event.get("args") or {}
            for key_in, key_out in (("device", ATTR_KINETO_DEVICE), ("stream", "gpu.stream")):
                if isinstance(args.get(key_in), (int, str)):
                    attributes[key_out] = args[key_in]
            span = self._builder.make_span(
                name=str(event.get("name", "?")),
                trace_id=ctx.trace_id,
                span_id=span_id,
                parent_id=parent,
                start_ns=start + step.shift,
                end_ns=end + step.shift,
                attributes=attributes,
            )
            self.spans += 1
            yield span


def _place(window: list[WindowStep], marks: list[tuple[int, int]]) -> list[_Placed]:
    """The window's steps with their marks, paired from the last (a trace holds the marks of
    its recorded steps, not of the warm-up ones before them); else by Kineto's Unix times."""
    if not marks or len(marks) > len(window):
        return [_Placed(step, step.start_ns, step.end_ns) for step in window]
    pairs = zip(reversed(window), reversed(sorted(marks)), strict=False)
    return [_Placed(step, start, end) for step, (start, end) in pairs][::-1]


def _fit(events: list[tuple[int, int, int, Any]], steps: list[_Placed | None]) -> None:
    """Move each step's events, together, by the least that puts their starts inside the step
    (the earliest first): torch's marks say they ran in it, only Kineto's Unix times are off.
    Device events may run past their step, so only the CPU's bound the move."""
    bounds: dict[int, tuple[_Placed, int, int]] = {}
    for (start, _neg_end, _end, event), step in zip(events, steps, strict=True):
        if step is not None and event.get("cat") not in _DEVICE_CATEGORIES:
            _, low, high = bounds.get(id(step), (step, start, start))
            bounds[id(step)] = (step, min(low, start), max(high, start))
    for step, low, high in bounds.values():
        early = step.step.start_ns - low  # > 0: the first starts before the step
        late = step.step.end_ns - high  # < 0: the last starts after it
        step.shift = max(early, min(late, 0))


def _step_of(placed: list[_Placed], kineto_ns: int) -> _Placed | None:
    for step in placed:
        if step.start <= kineto_ns < step.end:
            return step
    return None
