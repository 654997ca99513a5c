"""Training timings as OTel spans: record_function bridge, step spans, schedules, CUDA events.

The training thread only records names and timestamps (`_recorder`); a builder thread turns
them into ReadableSpans for the provider's span processors (`_builder`). `TimingsEngine`
(`_engine`) owns steps, schedules, the torch bridge (`_bridge`), CUDA-event timing (`_cuda`)
and optional Kineto windows (`_kineto`). Importing this package never imports torch.
"""

from otelprof._schema import (
    ATTR_CUDA_DURATION,
    ATTR_EPOCH,
    ATTR_PHASE,
    ATTR_SOURCE,
    ATTR_STEP,
    PHASE_CHECKPOINT,
    PHASE_TRAIN,
    PHASE_VALIDATION,
)
from otelprof._timings._api import (
    DATALOADER_NEXT,
    DETERMINED_TIMINGS,
    FROM_DEVICE,
    OPTIMIZER_STEP,
    REDUCE_METRICS,
    STEP_LR_SCHEDULERS,
    TO_DEVICE,
    TRAIN_BATCH,
    HookHandle,
    current_phase,
    from_device,
    instrument_lr_scheduler,
    instrument_optimizer,
    phase,
    reduce_metrics,
    set_epoch,
    set_phase,
    step,
    timed_dataloader,
    to_device,
    train_batch,
)
from otelprof._timings._engine import TimingsEngine
from otelprof._timings._recorder import Timing, timing
from otelprof._timings._schedule import (
    CyclicSchedule,
    Schedule,
    ScheduleAction,
    cyclic_schedule,
    schedule,
)

__all__ = [
    "ATTR_CUDA_DURATION",
    "ATTR_EPOCH",
    "ATTR_PHASE",
    "ATTR_SOURCE",
    "ATTR_STEP",
    "DATALOADER_NEXT",
    "DETERMINED_TIMINGS",
    "FROM_DEVICE",
    "OPTIMIZER_STEP",
    "PHASE_CHECKPOINT",
    "PHASE_TRAIN",
    "PHASE_VALIDATION",
    "REDUCE_METRICS",
    "STEP_LR_SCHEDULERS",
    "TO_DEVICE",
    "TRAIN_BATCH",
    "CyclicSchedule",
    "HookHandle",
    "Schedule",
    "ScheduleAction",
    "Timing",
    "TimingsEngine",
    "current_phase",
    "cyclic_schedule",
    "from_device",
    "instrument_lr_scheduler",
    "instrument_optimizer",
    "phase",
    "reduce_metrics",
    "schedule",
    "set_epoch",
    "set_phase",
    "step",
    "timed_dataloader",
    "timing",
    "to_device",
    "train_batch",
]
