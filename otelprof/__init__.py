"""otelprof: OpenTelemetry profiling for deep-learning training.

    import otelprof
    with otelprof.instrument() as prof:          # detached mode: OTLP JSON Lines files
        for batch in otelprof.timed_dataloader(loader):
            with otelprof.timing("train_batch"):
                ...
            prof.step()

Hardware metrics become OTel observable gauges, training timings become OTel spans
(bridged from `torch.profiler.record_function`), exported over OTLP, to files, or to a
Prometheus endpoint.
"""

from typing import TYPE_CHECKING, Any

from otelprof._profiler import Profiler, active_profiler, instrument, uninstrument
from otelprof.config import ConfigError, Settings

if TYPE_CHECKING:
    from otelprof.timings import (
        HookHandle,
        ScheduleAction,
        Timing,
        cyclic_schedule,
        from_device,
        instrument_lr_scheduler,
        instrument_optimizer,
        reduce_metrics,
        schedule,
        set_epoch,
        step,
        timed_dataloader,
        timing,
        to_device,
        train_batch,
    )

# Timing helpers load on first use, so `import otelprof` (and its config/CLI modules) stays
# light and never imports torch by itself.
_TIMINGS_NAMES = frozenset(
    {
        "HookHandle",
        "ScheduleAction",
        "Timing",
        "cyclic_schedule",
        "from_device",
        "instrument_lr_scheduler",
        "instrument_optimizer",
        "reduce_metrics",
        "schedule",
        "set_epoch",
        "step",
        "timed_dataloader",
        "timing",
        "to_device",
        "train_batch",
    }
)


def __getattr__(name: str) -> Any:
    if name in _TIMINGS_NAMES:
        from otelprof import timings

        value = getattr(timings, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'otelprof' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "HookHandle",
    "Profiler",
    "ScheduleAction",
    "Settings",
    "Timing",
    "active_profiler",
    "cyclic_schedule",
    "from_device",
    "instrument",
    "instrument_lr_scheduler",
    "instrument_optimizer",
    "reduce_metrics",
    "schedule",
    "set_epoch",
    "step",
    "timed_dataloader",
    "timing",
    "to_device",
    "train_batch",
    "uninstrument",
]
