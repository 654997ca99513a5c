"""The public per-step functions: step boundaries, epochs, phases and each step's work.

They sit above the Profiler because they look the running one up (`running_session`; only
public functions do) and act on its timings engine and throughput tracker. Each is a cheap
no-op while no profiler runs, so the same training code runs unprofiled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from otelprof._profiler import running_session
from otelprof._schema import ATTR_FLOPS, ATTR_PEAK_FLOPS, ATTR_SAMPLES, ATTR_TOKENS, PHASE_TRAIN
from otelprof._throughput import _check_amount
from otelprof._timings import _recorder as rec
from otelprof._timings._engine import check_phase

_F = TypeVar("_F", bound=Callable[..., Any])


def step() -> None:
    """Mark a training-step boundary on the running profiler, like
    `torch.profiler.profile.step()` (no-op when none runs)."""
    session = running_session()
    if session is not None and session.timings is not None:
        session.timings.step()


def set_epoch(epoch: int | None) -> None:
    """Tag this and the following steps' spans with `otelprof.epoch` (no-op when no
    profiler runs); a new epoch restarts per-epoch schedules (`cyclic_schedule`)."""
    session = running_session()
    if session is not None and session.timings is not None:
        session.timings.set_epoch(epoch)


def set_phase(name: str) -> str:
    """Enter a phase on the running profiler and return the previous one (what
    `phase.__enter__` does; integrations whose callbacks enter and leave it call this)."""
    check_phase(name)
    session = running_session()
    if session is None or session.timings is None:
        return PHASE_TRAIN
    return str(session.timings.set_phase(name))


def current_phase() -> str:
    """The running profiler's phase ("train" when none runs)."""
    session = running_session()
    if session is None or session.timings is None:
        return PHASE_TRAIN
    return str(session.timings.phase)


class phase:  # lower-case: used like a function, `with otelprof.phase("validation"):`
    """`with otelprof.phase("validation"):` (or as a decorator): the block's ranges carry
    `otelprof.phase` and are recorded in traces of their own, never inside a training step;
    the previous phase is restored after. In callback-style code, call the object's
    `__enter__()` and `__exit__()` where the phase starts and ends."""

    __slots__ = ("_previous", "name")

    def __init__(self, name: str) -> None:
        self.name = check_phase(name)
        self._previous: list[str] = []

    current = staticmethod(current_phase)

    def __enter__(self) -> phase:
        self._previous.append(set_phase(self.name))
        return self

    def __exit__(self, *_exc: object) -> None:
        set_phase(self._previous.pop() if self._previous else PHASE_TRAIN)

    def __call__(self, func: _F) -> _F:
        @functools.wraps(func)
        def in_phase(*args: Any, **kwargs: Any) -> Any:
            with phase(self.name):
                return func(*args, **kwargs)

        return in_phase  # type: ignore[return-value]


def timings_running() -> bool:
    """Whether a profiler runs with timings (an integration's extra work feeds them only)."""
    session = running_session()
    return session is not None and session.timings is not None


def step_work(
    samples: float | None = None, tokens: float | None = None, flops: float | None = None
) -> None:
    """Declare work done in the current step (adds up over calls, e.g. micro-batches):
    `samples` (batch size), `tokens`, and the step's `flops` (forward + backward). Feeds
    samples/s, tokens/s and MFU; no-op when no profiler runs. Raises ValueError on a
    negative or non-numeric amount."""
    s = _check_amount("samples", samples)
    t = _check_amount("tokens", tokens)
    f = _check_amount("flops", flops)
    ctx = rec.recorder.current
    if ctx is not None:
        attrs = ctx.attrs
        if attrs is None:
            attrs = ctx.attrs = {}
        for key, value in ((ATTR_SAMPLES, s), (ATTR_TOKENS, t), (ATTR_FLOPS, f)):
            if value is not None:
                attrs[key] = attrs.get(key, 0.0) + value
    session = running_session()
    tracker = None if session is None else session.throughput()
    if tracker is None:
        return
    if f is not None:
        peak = tracker.resolve_peak()
        if ctx is not None and peak is not None:
            ctx.attrs[ATTR_PEAK_FLOPS] = peak  # type: ignore[index]
    if tracker.engine.phase == PHASE_TRAIN:
        tracker.add(s, t, f)
