"""otelprof: OpenTelemetry profiling for deep-learning training.

    import otelprof
    with otelprof.instrument() as prof:          # detached mode: OTLP JSON Lines files
        for batch in otelprof.timed_dataloader(loader):
            with otelprof.timing("train_batch"):
                ...
            prof.step()

Hardware metrics become OTel observable gauges, training timings become OTel spans
(bridged from `torch.profiler.record_function`), exported over OTLP, to files, or to a
Prometheus endpoint. Importing otelprof never imports torch by itself.
"""

import sys

from otelprof._profiler import Profiler, active_profiler, instrument, uninstrument
from otelprof._throughput import set_peak_flops
from otelprof._work import step_work
from otelprof.config import ConfigError, Settings
from otelprof._timings import (
    HookHandle,
    ScheduleAction,
    Timing,
    _helpers,
    current_phase,
    cyclic_schedule,
    from_device,
    instrument_lr_scheduler,
    instrument_optimizer,
    phase,
    reduce_metrics,
    schedule,
    set_epoch,
    set_phase,
    step,
    timed_dataloader,
    timing,
    to_device,
    train_batch,
)

__all__ = [
    "ConfigError",
    "HookHandle",
    "Profiler",
    "ScheduleAction",
    "Settings",
    "Timing",
    "active_profiler",
    "current_phase",
    "cyclic_schedule",
    "from_device",
    "instrument",
    "instrument_lr_scheduler",
    "instrument_optimizer",
    "phase",
    "reduce_metrics",
    "schedule",
    "set_epoch",
    "set_peak_flops",
    "set_phase",
    "step",
    "step_work",
    "timed_dataloader",
    "timing",
    "to_device",
    "train_batch",
    "uninstrument",
]

# while a profiler runs, the per-step helpers above are swapped for compiled twins here
_helpers.provide(
    sys.modules[__name__],
    {
        "timing": timing,
        "train_batch": train_batch,
        "reduce_metrics": reduce_metrics,
        "to_device": to_device,
        "from_device": from_device,
    },
)
