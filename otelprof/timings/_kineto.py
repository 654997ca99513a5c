"""Optional torch.profiler (Kineto) windows: operator events and CUDA kernels as child spans.

During the schedule's active steps a real `torch.profiler.profile` session runs (warming up
on WARMUP steps, like torch). When its window ends torch hands us the trace: the Chrome trace
file is kept in `<run_dir>/kineto/`, and the builder thread parses it and turns each CPU
operator / GPU kernel / memcpy event into a span under the step it ran in (CPU operators
nested by time containment per thread). `record_function` ranges already are spans through
the bridge, so Kineto's copies of them (`user_annotation`) are not repeated.
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

from otelprof.timings import _recorder as rec
from otelprof.timings._builder import (
    ATTR_EPOCH,
    ATTR_PHASE,
    ATTR_SOURCE,
    ATTR_STEP,
    Clock,
    SpanBuilder,
)
from otelprof.timings._schedule import ScheduleAction

_log = logging.getLogger("otelprof")

KEPT_CATEGORIES = frozenset(
    {"cpu_op", "kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver"}
)
_LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
_DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
MAX_EVENTS_PER_WINDOW = 50_000
"""Spans one window may produce; the rest are counted in `kineto_events_dropped`."""


@dataclass(frozen=True)
class WindowStep:
    ctx: rec.StepContext
    start_ns: int  # Unix epoch ns
    end_ns: int


class KinetoSession:
    """One torch.profiler.profile driven step by step by the engine's schedule."""

    def __init__(self, torch: Any, builder: SpanBuilder, clock: Clock, directory: Path) -> None:
        self._torch = torch
        self._builder = builder
        self._clock = clock
        self._directory = directory
        self._next = ScheduleAction.NONE
        self._window: list[WindowStep] = []
        self._profile: Any = None
        self.traces = 0
        self.spans = 0
        self.events_dropped = 0
        self.failed = 0

    def _torch_action(self, _step: int) -> Any:
        return self._torch.profiler.ProfilerAction[self._next.name]

    def start(self, action: ScheduleAction) -> None:
        torch = self._torch
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._next = action
        self._profile = torch.profiler.profile(
            activities=activities, schedule=self._torch_action, on_trace_ready=self._on_ready
        )
        self._profile.start()

    def step(self, finished: WindowStep | None, next_action: ScheduleAction) -> None:
        """Close one step (kept for the window if it recorded) and move torch's profiler on."""
        if finished is not None:
            self._window.append(finished)
        self._next = next_action
        try:
            self._profile.step()
        except Exception as error:
            self.failed += 1
            _log.warning("otelprof: torch.profiler step failed: %r", error)

    def stop(self, finished: WindowStep | None) -> None:
        if finished is not None:
            self._window.append(finished)
        if self._profile is not None:
            try:
                self._profile.stop()
            except Exception as error:
                self.failed += 1
                _log.warning("otelprof: stopping torch.profiler failed: %r", error)
            self._profile = None

    def _on_ready(self, profile: Any) -> None:
        """torch's on_trace_ready (training thread): save the trace, convert it elsewhere."""
        window, self._window = self._window, []
        try:
            self._directory.mkdir(parents=True, exist_ok=True)
            rank = os.environ.get("RANK", "0")
            last = window[-1].ctx.step if window else profile.step_num
            path = self._directory / f"rank{rank}.step{last}.pt.trace.json"
            profile.export_chrome_trace(str(path))
        except Exception as error:
            self.failed += 1
            _log.warning("otelprof: saving the torch.profiler trace failed: %r", error)
            return
        self.traces += 1
        if window:
            self._builder.submit(lambda: self._convert(path, window))

    def _convert(self, path: Path, window: list[WindowStep]) -> Iterator[ReadableSpan]:
        for span in trace_file_spans(path, window, self._builder, self):
            self.spans += 1
            yield span


def trace_file_spans(
    path: Path, window: list[WindowStep], builder: SpanBuilder, counts: KinetoSession
) -> Iterator[ReadableSpan]:
    """Spans for the kept events of one Chrome trace file, each under its step span."""
    with open(path, encoding="utf-8") as handle:
        trace = json.load(handle)
    base = int(trace.get("baseTimeNanoseconds", 0) or 0)
    events = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or event.get("cat") not in KEPT_CATEGORIES:
            continue
        try:
            start = base + round(float(event["ts"]) * 1000.0)
            end = start + round(float(event.get("dur", 0)) * 1000.0)
        except (KeyError, TypeError, ValueError):
            continue
        events.append((start, -end, end, event))
    events.sort(key=lambda item: (item[0], item[1]))
    if len(events) > MAX_EVENTS_PER_WINDOW:
        counts.events_dropped += len(events) - MAX_EVENTS_PER_WINDOW
        events = events[:MAX_EVENTS_PER_WINDOW]
    launched: dict[Any, WindowStep] = {}  # correlation id -> step of the CPU-side launch
    for start, _neg_end, _end, event in events:
        if event.get("cat") in _LAUNCH_CATEGORIES:
            correlation = (event.get("args") or {}).get("correlation")
            step = _step_of(window, start)
            if correlation is not None and step is not None:
                launched[correlation] = step
    stacks: dict[tuple[Any, Any, int], list[tuple[int, int]]] = {}
    for start, _neg_end, end, event in events:
        step = None
        if event.get("cat") in _DEVICE_CATEGORIES:
            step = launched.get((event.get("args") or {}).get("correlation"))
        if step is None:
            step = _step_of(window, start)
        if step is None:
            counts.events_dropped += 1
            continue
        ctx = step.ctx
        key = (event.get("pid"), event.get("tid"), ctx.step)
        stack = stacks.setdefault(key, [])
        while stack and stack[-1][1] <= start:
            stack.pop()
        parent = stack[-1][0] if stack and event.get("cat") == "cpu_op" else ctx.span_id
        span_id = rec._getrandbits(64) or 1
        if event.get("cat") == "cpu_op":
            stack.append((span_id, end))
        attributes: dict[str, Any] = {
            ATTR_STEP: ctx.step,
            ATTR_PHASE: ctx.phase,
            ATTR_SOURCE: "kineto",
            "otelprof.kineto.category": str(event.get("cat")),
        }
        if ctx.epoch is not None:
            attributes[ATTR_EPOCH] = ctx.epoch
        args = event.get("args") or {}
        for key_in, key_out in (("device", "otelprof.kineto.device"), ("stream", "gpu.stream")):
            if isinstance(args.get(key_in), (int, str)):
                attributes[key_out] = args[key_in]
        yield builder.make_span(
            name=str(event.get("name", "?")),
            trace_id=ctx.trace_id,
            span_id=span_id,
            parent_id=parent,
            start_ns=start,
            end_ns=end,
            attributes=attributes,
        )


def _step_of(window: list[WindowStep], wall_ns: int) -> WindowStep | None:
    for step in window:
        if step.start_ns <= wall_ns < step.end_ns:
            return step
    return None
