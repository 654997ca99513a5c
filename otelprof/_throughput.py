"""Throughput and efficiency of training steps: samples/s, tokens/s and MFU.

A step's work is only known in the training process: `step_work()` puts it on the step's
span and feeds counters and Σwork / Σstep time over the last `window` training steps.
Like Lightning's ThroughputMonitor and Composer's SpeedMonitor (whole steps, other phases
excluded, MFU against one device's peak), except that the first step (warm-up) is never in
the window. The training thread only adds per step; the metric reader's thread reads the
instruments (an SDK call per step would cost the training thread).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

from otelprof._schema import (
    ATTR_PHASE,
    PHASE_TRAIN,
    THROUGHPUT_SCOPE,
    TRAIN_MFU,
    TRAIN_SAMPLES,
    TRAIN_THROUGHPUT_SAMPLES,
    TRAIN_THROUGHPUT_TOKENS,
    TRAIN_TOKENS,
)

_log = logging.getLogger("otelprof")

PEAK_FLOPS_ENV = "OTELPROF_PEAK_FLOPS"
DEFAULT_WINDOW = 100

# Dense (no sparsity) peak FLOP/s of one device from the vendors' datasheets:
# (16-bit tensor math: bf16/fp16, 32-bit: TF32 tensor math where the GPU has it, else FP32).
PEAK_FLOPS_TABLE: dict[str, tuple[float, float]] = {
    "b200": (2250e12, 1100e12),
    "h200": (989.4e12, 494.7e12),
    "gh200": (989.4e12, 494.7e12),
    "h100 nvl": (835.5e12, 417.5e12),
    "h100 pcie": (756e12, 378e12),
    "h100": (989.4e12, 494.7e12),
    "h800": (989.4e12, 494.7e12),
    "a100": (312e12, 156e12),
    "a800": (312e12, 156e12),
    "a10": (125e12, 62.5e12),
    "a30": (165e12, 82e12),
    "l40s": (362.05e12, 183e12),
    "l40": (181e12, 90.5e12),
    "l4": (121e12, 60e12),
    "v100": (125e12, 15.7e12),
    "t4": (65e12, 8.1e12),
    "mi300x": (1307.4e12, 653.7e12),
    "mi325x": (1307.4e12, 653.7e12),
    "mi250x": (383e12, 95.7e12),
    "mi250": (362.1e12, 90.5e12),
}
_PRECISIONS = ("16-bit", "32-bit")


def peak_flops_for(device_name: str, precision: str = "16-bit") -> float | None:
    """Peak dense FLOP/s of the device named `device_name` (as torch / NVML name it) for
    `precision` ("16-bit" or "32-bit"), or None when the table does not know it."""
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
    words = f" {' '.join(device_name.lower().replace('-', ' ').replace('_', ' ').split())} "
    for key in sorted(PEAK_FLOPS_TABLE, key=len, reverse=True):  # "h100 pcie" before "h100"
        if f" {key} " in words:
            return PEAK_FLOPS_TABLE[key][_PRECISIONS.index(precision)]
    return None


def _check_amount(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if type(value) is int and value >= 0:  # the common case, checked cheaply
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"step_work: {name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"step_work: {name} must be finite and >= 0, got {value!r}")
    return float(value)


def parse_peak(value: Any, source: str) -> float:
    """A declared peak FLOP/s: a positive finite number (strings like '312e12' accepted)."""
    try:
        peak = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: peak FLOP/s must be a number, got {value!r}") from None
    if not math.isfinite(peak) or peak <= 0:
        raise ValueError(f"{source}: peak FLOP/s must be > 0, got {value!r}")
    return peak


_lock = threading.Lock()
_declared_peak: float | None = None
_precision = "16-bit"
_peak_generation = 0  # bumped when the declared peak or precision changes


def set_peak_flops(flops_per_s: float | None) -> None:
    """Declare one device's peak FLOP/s for MFU (e.g. 312e12 for an A100 in bf16); None goes
    back to `OTELPROF_PEAK_FLOPS`, then to the table of common GPUs."""
    global _declared_peak, _peak_generation
    _declared_peak = None if flops_per_s is None else parse_peak(flops_per_s, "set_peak_flops")
    _peak_generation += 1  # resolved again at the next step_work(flops=...)


def set_precision(precision: str) -> None:
    """Which column of the peak table applies ("16-bit" or "32-bit"); set by integrations
    from the framework's precision setting."""
    global _precision, _peak_generation
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
    _precision = precision
    _peak_generation += 1


def resolve_peak_flops(configured: float | None = None) -> tuple[float | None, str]:
    """The peak FLOP/s MFU is computed against, and where it came from: declared, else
    `configured` (`OTELPROF_PEAK_FLOPS`, checked with the settings), else the table."""
    if _declared_peak is not None:
        return _declared_peak, "declared"
    if configured is not None:
        return configured, PEAK_FLOPS_ENV
    import sys

    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            name = torch.cuda.get_device_name(torch.cuda.current_device())
            peak = peak_flops_for(name, _precision)
            if peak is not None:
                return peak, f"table: {name}, {_precision}"
            return None, f"{name} is not in the peak table (declare it)"
    except Exception as error:  # a broken CUDA setup: no MFU, training goes on
        return None, f"no device name ({error!r})"
    return None, "no GPU (declare the peak with set_peak_flops or OTELPROF_PEAK_FLOPS)"


class ThroughputTracker:
    """Work per step on the training thread; window figures for the gauges. The Profiler
    owns one per run, made at the first `step_work()`."""

    def __init__(
        self,
        engine: Any,
        meter_provider: Any,
        window: int = DEFAULT_WINDOW,
        configured_peak: float | None = None,
    ) -> None:
        self.engine = engine
        self.configured_peak = configured_peak  # Settings.peak_flops
        self.pending = [0.0, 0.0, 0.0]  # samples, tokens, flops of the running training step
        self.declared = [False, False, False]
        self.totals = [0.0, 0.0]  # samples, tokens of every training step so far
        self.window: deque[tuple[int, float, float, float]] = deque(maxlen=window)
        self.peak: float | None = None
        self.peak_source = ""
        self._peak_generation = -1  # the `_peak_generation` `peak` was resolved under
        engine.add_step_listener(self.on_step)  # for the engine's life: the run's
        if meter_provider is not None:
            self._make_instruments(meter_provider)

    def _make_instruments(self, meter_provider: Any) -> None:
        from opentelemetry.metrics import CallbackOptions, Observation

        meter = meter_provider.get_meter(THROUGHPUT_SCOPE)
        attrs = {ATTR_PHASE: PHASE_TRAIN}

        def total(index: int) -> Any:
            def observe(_options: CallbackOptions) -> Iterable[Observation]:
                declared = self.declared[index]
                return [Observation(self.totals[index], attrs)] if declared else []

            return observe

        meter.create_observable_counter(TRAIN_SAMPLES, [total(0)], "{sample}", "samples trained on")
        meter.create_observable_counter(TRAIN_TOKENS, [total(1)], "{token}", "tokens trained on")

        def gauge(index: int) -> Any:
            def observe(_options: CallbackOptions) -> Iterable[Observation]:
                value = self.rate(index)
                return [Observation(value, attrs)] if value is not None else []

            return observe

        per_s = "per second of training-step time, over the last steps"
        mfu = "model FLOP utilization: achieved FLOP/s over one device's peak, last steps"
        for name, index, unit, description in (
            (TRAIN_THROUGHPUT_SAMPLES, 0, "{sample}/s", f"samples {per_s}"),
            (TRAIN_THROUGHPUT_TOKENS, 1, "{token}/s", f"tokens {per_s}"),
            (TRAIN_MFU, 3, "1", mfu),
        ):
            meter.create_observable_gauge(name, [gauge(index)], unit, description)

    def finish(self) -> None:
        """Before the last collection: a run that never called `step()` is one step, so its
        pending work counts; after a last `step()`, what is pending is no step's."""
        if self.engine.step_number == 0:
            samples, tokens, _flops = self.pending
            self.pending = [0.0, 0.0, 0.0]
            self.totals = [self.totals[0] + samples, self.totals[1] + tokens]

    def resolve_peak(self) -> float | None:
        """The peak FLOP/s, resolved again after `set_peak_flops`/`set_precision` (a
        missing peak is logged once per resolution)."""
        if self._peak_generation != _peak_generation:
            self._peak_generation = _peak_generation
            self.peak, self.peak_source = resolve_peak_flops(self.configured_peak)
            if self.peak is None:
                _log.warning("otelprof: no MFU: %s", self.peak_source)
        return self.peak

    def add(self, samples: float | None, tokens: float | None, flops: float | None) -> None:
        for i, value in enumerate((samples, tokens, flops)):
            if value is not None:
                self.pending[i] += value
                self.declared[i] = True

    def on_step(self, _step: int, train_ns: int, first: bool) -> None:
        samples, tokens, flops = self.pending
        self.pending = [0.0, 0.0, 0.0]
        # a new list, swapped in whole: the reader's thread sees both totals of the same step
        self.totals = [self.totals[0] + samples, self.totals[1] + tokens]
        if not first and train_ns > 0:  # the first step holds set-up and warm-up
            self.window.append((train_ns, samples, tokens, flops))

    def rate(self, index: int) -> float | None:
        """Σwork / Σtime over the window; index 3 = MFU (FLOP/s over the peak)."""
        steps = list(self.window)
        if not steps:
            return None
        seconds = sum(s[0] for s in steps) / 1e9
        if index == 3:
            if not self.declared[2] or not self.peak:
                return None
            return sum(s[3] for s in steps) / seconds / self.peak
        if not self.declared[index]:
            return None
        return sum(s[index + 1] for s in steps) / seconds
