"""`step_work()`: the public function that declares a step's work to the running profiler.

It sits above the Profiler because it looks the running one up (only public functions do);
the throughput figures themselves are the run's `ThroughputTracker` (`_throughput`).
"""

from __future__ import annotations

from otelprof import _profiler
from otelprof._schema import ATTR_FLOPS, ATTR_PEAK_FLOPS, ATTR_SAMPLES, ATTR_TOKENS, PHASE_TRAIN
from otelprof._throughput import _check_amount
from otelprof._timings import _recorder as rec


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
    profiler = _profiler._active
    if profiler is None:
        return
    tracker = profiler._session.throughput()
    if tracker is None:
        return
    if f is not None:
        peak = tracker.resolve_peak()
        if ctx is not None and peak is not None:
            ctx.attrs[ATTR_PEAK_FLOPS] = peak  # type: ignore[index]
    if tracker.engine.phase == PHASE_TRAIN:
        tracker.add(s, t, f)
