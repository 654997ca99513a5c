"""Steps sampled out on their own thread, at `step()`, while the sampler is quiet.

Why: at fast step rates almost every step is sampled out (its trace is not kept; only its
durations go into the histograms). Handing each such step to the span builder costs the
builder several µs of GIL time per step, touches every range on another core, and keeps
the ranges alive long enough to be promoted by the garbage collector. So the builder
publishes, once per drain, what a step needs to be kept (`publish`): no more spans than
the head budget now holds, or than the tail budget holds while slower than every recent
step the builder has seen, or a duration at or above the anomaly threshold. Any other step
without errors is decided on the thread that ran it: one row of durations
(its ranges' in close order, then its own, then its layout: `_frames.pack_row`) joins the
thread's batch of rows, its ranges
are freed at once, and every `ROWS_PER_ITEM` steps the batch goes to the builder as one
queue item, which folds it into the histograms in C. Every other step (the first ones,
anything the budget could keep, errors, anomalies and the `CAPTURE_STEPS` after a step
over the threshold) goes to the builder whole, as before, so the sampler's decisions are
the same; only their timing differs (tokens refilled within a drain are seen at the next).
Steps of `LONG_STEP_NS` or more go to the builder whole too: in them, deciding here costs
more than it saves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from operator import itemgetter
from typing import Any

from otelprof._schema import PHASE_TRAIN, STEP_SPAN
from otelprof._timings import _recorder as rec
from otelprof._timings._frames import F_CUDA, F_NAME, pack_row
from otelprof._timings._sampling import CAPTURE_STEPS

ROWS_PER_ITEM = 64
"""Sampled-out steps per queue item: the histograms lag the training thread by at most this."""

LONG_STEP_NS = 10_000_000
"""A step this long (10 ms) or longer goes to the builder whole, and holds the next
`CAPTURE_STEPS` there too (it may be an anomaly, which the builder alone can tell without
reading the published limits). Why: in a step that long, torch's work has evicted from the
caches everything the decision here reads (the limits, every range, the layouts), so
deciding on the thread cost about 8 µs of a 30 ms step. The builder decides at most 100 such
steps a second, mostly while torch's operators have released the interpreter lock; at 30 ms
steps that is about 1.4 ms/s more of its CPU (BENCHMARKS.md). Shorter steps would each cost
the builder as much for a smaller saving: with warmer caches the thread decides a 1 ms step
in about 2 µs."""

quiet: dict[str, list[Any]] = {}
"""Published by the span builder: phase -> [the first step (batch) number head selection
is not known for, tail tokens, the slowest recent step in ns, the anomaly threshold in ns,
the numbers below the first that head sampling selects (a frozenset)]. A step whose number
is selected or not known, or of `n` spans with `n` <= tail tokens and slower than the
slowest recent one, or at or over the threshold, goes to the builder (which may keep it);
tail tokens so handed over are subtracted here until the next publication. A phase not in
it: every step goes to the builder."""

layouts: dict[int, tuple[str, str, tuple[str, ...]]] = {}
"""Row layout id -> (phase, root span name, range names in close order); written on the
training thread before the first row of that layout is queued."""
_layout_ids: dict[str, dict[tuple[str, ...], int]] = {}
MAX_LAYOUTS = 256
_get_name = itemgetter(F_NAME)


def publish(quiet_by_phase: dict[str, list[Any]]) -> None:
    """Replace what steps must exceed to go to the builder (one atomic rebinding)."""
    global quiet
    quiet = quiet_by_phase


def reset() -> None:
    """A new engine: nothing published, no layouts."""
    publish({})
    layouts.clear()
    _layout_ids.clear()


def sample_out(ctx: rec.StepContext, end_ns: int, state: rec.ThreadState) -> bool:
    """At `step()`: True if the step was sampled out here (its row queued or batched, its
    ranges freed), False if it must go to the builder. Only `state`'s own thread decides:
    ended from another thread, a step goes to the builder."""
    if state is not rec._local.state:
        return False
    duration = end_ns - ctx.start_ns
    if duration >= LONG_STEP_NS:
        state.hold = CAPTURE_STEPS
        return False
    phase = ctx.phase
    limits = quiet.get(phase)
    if limits is None:
        return False
    if duration >= limits[3]:
        state.hold = CAPTURE_STEPS  # maybe an anomaly: the next steps may be captured
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
    if number >= limits[0] or number in limits[4]:  # head sampling may keep it (every rank)
        return False
    spans = len(frames) + 1
    if spans <= limits[1] and duration > limits[2]:  # maybe the slowest lately: tail's
        limits[1] -= spans
        return False
    names = tuple(map(_get_name, frames))
    by_names = _layout_ids.get(phase)
    if by_names is None:
        by_names = _layout_ids[phase] = {}
    layout = by_names.get(names)
    if layout is None:
        if len(layouts) >= MAX_LAYOUTS:
            return False
        layout = len(layouts)
        root = STEP_SPAN if phase == PHASE_TRAIN else phase
        layouts[layout] = (phase, root, names)
        by_names[names] = layout
    # one bytes object (`_frames.pack_row`): no container for the collector to track, so
    # rows waiting for the builder never set off collections (a GIL stall each)
    try:
        row = pack_row([f[7] - f[6] for f in frames], duration, layout)
    except (OverflowError, TypeError):  # a clock that gives no int64 ns: the builder's
        return False
    cuda = rec.recorder.cuda_timer
    if cuda is not None:  # its CUDA events are reused by later ranges
        for frame in frames:
            if frame[F_CUDA] is not None:
                cuda.release(frame[F_CUDA])
    ctx.owner = None  # ranges of it that close late are queued singly ...
    ctx.kept = False  # ... and counted as sampled out
    frames.clear()  # its ranges are freed now, on this thread (no cycle left to collect)
    rows = state.rows
    rows.append(row)
    if len(rows) >= ROWS_PER_ITEM:
        hand_rows(state)
    return True


def hand_rows(state: rec.ThreadState) -> None:
    """Queue the thread's batch of rows (from that thread, or once it no longer steps)."""
    rows = state.rows
    if not rows:
        return
    state.rows = []
    rec.recorder.enqueue_rows(rows)


def limits_for(
    roots: dict[str, Any],
    quiet_of: Callable[[str], tuple[float, float, Any] | None],
    head_of: Callable[[str], tuple[float, frozenset[int]]],
) -> dict[str, list[Any]]:
    """What the builder publishes: per phase, from `TraceSampler.quiet(root)` of its root
    and `head_of(phase)` (`TraceSampler.head_window` from the phase's current number)."""
    out: dict[str, list[Any]] = {}
    for root in roots:
        found = quiet_of(root)
        if found is None:
            continue
        tail, anomaly_ns, recent = found
        phase = PHASE_TRAIN if root == STEP_SPAN else root
        unknown, selected = head_of(phase)
        if unknown > -math.inf:  # else every step may be head sampling's
            slowest = max(recent) * 1e9 if recent else 0.0
            out[phase] = [unknown, tail, slowest, anomaly_ns, selected]
    return out


_py_sample_out = sample_out


def use_compiled(on: bool) -> bool:
    """Decide steps with the compiled `sample_out` (when built) or the Python one above;
    returns whether it runs compiled now."""
    global sample_out
    speedups = rec.speedups
    if on and speedups is not None:
        speedups.bind_quiet(globals())
        sample_out = speedups.sample_out
        return True
    sample_out = _py_sample_out
    return False


use_compiled(rec.compiled)
