"""otelprof: OpenTelemetry profiling for deep-learning training.

    import otelprof
    with otelprof.instrument():                  # detached mode: OTLP JSON Lines files
        for batch in otelprof.timed_dataloader(loader):
            with otelprof.timing("train_batch"):
                ...
            otelprof.step()

Hardware metrics become OTel observable gauges, training timings become OTel spans
(bridged from `torch.profiler.record_function`), exported over OTLP, to files, or to
Determined. Importing otelprof never imports torch by itself.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from otelprof._profiler import Profiler, instrument, uninstrument
from otelprof._steps import phase, set_epoch, step, step_work
from otelprof._throughput import set_peak_flops
from otelprof._timings._api import instrument_optimizer, timed_dataloader
from otelprof._timings._recorder import timing
from otelprof._timings._schedule import cyclic_schedule, schedule
from otelprof.config import ConfigError

__all__ = [
    "ConfigError",
    "Profiler",
    "cyclic_schedule",
    "instrument",
    "instrument_optimizer",
    "phase",
    "schedule",
    "set_epoch",
    "set_peak_flops",
    "step",
    "step_work",
    "timed_dataloader",
    "timing",
    "uninstrument",
]

_DEPRECATED = {
    # name: (its module, the replacement a warning names)
    "train_batch": ("otelprof.determined_timings", None),
    "reduce_metrics": ("otelprof.determined_timings", None),
    "to_device": ("otelprof.determined_timings", None),
    "from_device": ("otelprof.determined_timings", None),
    "instrument_lr_scheduler": ("otelprof.determined_timings", None),
    "set_phase": ("otelprof._steps", "with otelprof.phase(name):"),
    "current_phase": ("otelprof._steps", "otelprof.phase.current()"),
    "active_profiler": ("otelprof._profiler", "the Profiler instrument() returns"),
    "Settings": ("otelprof.config", None),
    "Timing": ("otelprof._timings._recorder", "otelprof.timing(name)"),
    "HookHandle": ("otelprof._timings._api", "instrument_optimizer()'s result"),
    "ScheduleAction": ("otelprof._timings._schedule", "otelprof.schedule()"),
}
"""Names `otelprof` exported before 0.2: they keep working for one release, with a warning."""


def __getattr__(name: str) -> Any:
    found = _DEPRECATED.get(name)
    if found is None:
        raise AttributeError(f"module 'otelprof' has no attribute {name!r}")
    module, replacement = found
    warnings.warn(
        f"otelprof.{name} is deprecated; use {replacement or f'{module}.{name}'}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)
