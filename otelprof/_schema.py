"""The telemetry schema: every attribute key, span, phase and instrument name otelprof writes
and its readers (report, Determined bridge, dashboards' tests) look for.

Imports nothing, so any layer may use it; a name is changed once. System metric instruments
are in `otelprof/system/names.py`. The docs' telemetry reference is generated from the
section comments and the strings after the constants.
"""

from __future__ import annotations

# ---- resource attributes: who wrote the telemetry ----
ATTR_RANK = "otelprof.rank"
ATTR_LOCAL_RANK = "otelprof.local_rank"
ATTR_WORLD_SIZE = "otelprof.world_size"
ATTR_ATTEMPT = "otelprof.attempt"
ATTR_RUN_ID = "otelprof.run_id"
"""One id per job, agreed by its ranks: dashboards keep concurrent jobs apart by it."""
ATTR_DETERMINED_EXPERIMENT_ID = "determined.experiment.id"
ATTR_DETERMINED_TRIAL_ID = "determined.trial.id"
"""The trial a process reports for (from `DET_TRIAL_ID`): the bridge routes its data by it."""
ATTR_DETERMINED_TRIAL_RUN_ID = "determined.trial.run_id"
ATTR_DETERMINED_AGENT_ID = "determined.agent.id"
ATTR_DETERMINED_STEPS_COMPLETED = "determined.trial.steps_completed"
"""A resumed trial's batch count (`DET_STEPS_COMPLETED`): otelprof's steps count on from it."""
ATTR_STEPS_PER_BATCH = "otelprof.determined.steps_per_batch"
"""`otelprof.step()` calls per Determined batch (micro-batches per optimizer step)."""
ATTR_DETERMINED_DIRECT = "otelprof.determined.direct"
"""Set by a process that posts to Determined itself: a bridge leaves its data alone."""

# ---- span attributes ----
ATTR_STEP = "otelprof.step"
ATTR_EPOCH = "otelprof.epoch"
ATTR_PHASE = "otelprof.phase"
ATTR_SOURCE = "otelprof.source"
ATTR_REASON = "otelprof.reason"
ATTR_ATTRIBUTES_DROPPED = "otelprof.attributes_dropped"
"""On a range whose attributes passed the memory budget (`_limits.AttributeBudget`)."""
ATTR_CUDA_DURATION = "otelprof.cuda.duration_s"
ATTR_TIMING = "otelprof.timing"
ATTR_SAMPLED = "otelprof.sampled"
ATTR_ANOMALY_RATIO = "otelprof.anomaly.ratio"
ATTR_COLLECTIVE = "otelprof.collective"
ATTR_KINETO_CATEGORY = "otelprof.kineto.category"
"""A Kineto event's category (`kernel`, `cpu_op`, ...), on the span made from it."""
ATTR_KINETO_DEVICE = "otelprof.kineto.device"
ATTR_NAME_NUMBER = "otelprof.name.number"
"""`ProfilerStep#17`'s 17: the name is exported without it."""
ATTR_NAME_ORIGINAL = "otelprof.name.original"
"""A span's own name, on a span exported as `TIMING_OVERFLOW`."""
# a step's work (`step_work()`), on its span
ATTR_SAMPLES = "otelprof.samples"
ATTR_TOKENS = "otelprof.tokens"
ATTR_FLOPS = "otelprof.flops"
ATTR_PEAK_FLOPS = "otelprof.peak_flops"

# ---- phases (`otelprof.phase`) ----
PHASE_TRAIN = "train"
"""The default phase, and the only one whose steps are training steps."""
PHASE_VALIDATION = "validation"
PHASE_CHECKPOINT = "checkpoint"
PHASE_AFTER_TRAINING = "after_training"
"""The phase of ranges recorded after the last training `step()`: never a step."""

# ---- span names ----
STEP_SPAN = "step"
"""The root span of a training step's trace (other phases' roots are named after them)."""
FORWARD = "forward"
BACKWARD = "backward"
DDP_SPAN = "ddp.allreduce"
DDP_COLLECTIVE = "ddp_allreduce"
"""`otelprof.collective` of DDP's gradient all-reduce (a `torch.distributed` call's is its name,
on span `dist.<name>`)."""
COLLECTIVE_SPAN_PREFIX = "dist."
MODULE_FORWARD_PREFIX = "module.forward:"
"""A module's forward (`module_timings`): `module.forward:<Model class>.<path>`, e.g.
`module.forward:Net.encoder.layers.0`."""
MODULE_BACKWARD_PREFIX = "module.backward:"
MODULE_PREFIXES = (MODULE_FORWARD_PREFIX, MODULE_BACKWARD_PREFIX)
TIMING_OVERFLOW = "otelprof.other"
"""The name a span takes past the distinct-name cap (`_timings/_names.py`)."""
TORCH_STEP_RANGE = "ProfilerStep"
"""The range `torch.profiler.profile` opens from one of its `step()` calls to the next
(`ProfilerStep#N`; torch's `PROFILER_STEP_NAME`): a marker around a step, never a part of one."""


def is_torch_step_range(name: str) -> bool:
    """`ProfilerStep`, as exported (the number folded to an attribute) or as torch names it."""
    return name == TORCH_STEP_RANGE or name.startswith(TORCH_STEP_RANGE + "#")


# Determined's PyTorchTrial timing names
DATALOADER_NEXT = "dataloader_next"
TO_DEVICE = "to_device"
FROM_DEVICE = "from_device"
TRAIN_BATCH = "train_batch"
STEP_LR_SCHEDULERS = "step_lr_schedulers"
REDUCE_METRICS = "reduce_metrics"
OPTIMIZER_STEP = "optimizer_step"

# ---- instruments and scopes ----
SCOPE = "otelprof"
TIMINGS_SCOPE = "otelprof.timings"
"""The scope of the timing histograms."""
TIMING_HISTOGRAM = "otelprof.timing.duration"
"""Every range's duration, per (timing, phase), in every metrics export."""
TELEMETRY_DROPPED = "otelprof.telemetry.dropped"
DROPPED_TOTAL = "dropped_total"
"""The `Profiler.stats()` key summing every loss key (`is_loss`)."""
RUN_ENDED = "otelprof.run.ended"
"""1 in the exports after the run's end was recorded (shutdown, exit, exception, SIGTERM), 0
before: Prometheus tells a rank that stopped reporting because its run ended from one that
was killed (prometheus/otelprof-alerts.yml, OtelprofRankLost)."""
CLOSING_RECORD = "otelprof.run.end"
"""The metrics file's last record: how the run ended (`ATTR_END`) and its losses (`ATTR_STATS`)."""
ATTR_END = "otelprof.end"
ATTR_STATS = "otelprof.stats"
OVERHEAD_TRAINING_THREAD = "otelprof.overhead.training_thread"
OVERHEAD_BACKGROUND_CPU = "otelprof.overhead.background_cpu"
COLLECTIVE_DURATION = "otelprof.collective.duration"
THROUGHPUT_SCOPE = "otelprof.throughput"
TRAIN_SAMPLES = "otelprof.train.samples"
TRAIN_TOKENS = "otelprof.train.tokens"
TRAIN_THROUGHPUT_SAMPLES = "otelprof.train.throughput.samples"
TRAIN_THROUGHPUT_TOKENS = "otelprof.train.throughput.tokens"
TRAIN_MFU = "otelprof.train.mfu"
MEMORY_BY_PHASE = "otelprof.process.memory.by_phase"
"""This process's RSS, sampled, with `otelprof.phase` (`system/memory_peaks.py`)."""
CUDA_PEAK_ALLOCATED = "otelprof.torch.cuda.memory.peak.allocated"
CUDA_PEAK_RESERVED = "otelprof.torch.cuda.memory.peak.reserved"
"""The CUDA allocator's peaks by `otelprof.phase` (the `memory_peaks` option)."""


def is_loss(key: str) -> bool:
    """Whether a `Profiler.stats()` key counts lost items (what `dropped_total` sums):
    spans, points, samples, reports, whether "dropped" or "failed". Not `*.metric_exports_*`,
    which counts the exports those points were in. Every message about losses lists the
    keys this rule picks, so none reads "N dropped ()"."""
    if key == DROPPED_TOTAL or ".metric_exports_" in key:
        return False
    return "dropped" in key or "failed" in key
