"""OTLP → Determined samples: which trial, which group, which key, which unit.

One module serves the bridge (protobuf straight off the wire) and the in-process exporter
(SDK data encoded to the same protobuf), so both speak the same Determined dialect. The
output is a list of small, JSON-able samples; windowing and report building live in
`aggregate.py`.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from otelprof._schema import ATTR_DETERMINED_AGENT_ID as ATTR_AGENT_ID
from otelprof._schema import (
    ATTR_DETERMINED_DIRECT,
    ATTR_PHASE,
    ATTR_RANK,
    ATTR_STEP,
    ATTR_STEPS_PER_BATCH,
    ATTR_TIMING,
    PHASE_TRAIN,
    STEP_SPAN,
    TIMING_HISTOGRAM,
    TRAIN_MFU,
    TRAIN_THROUGHPUT_SAMPLES,
    TRAIN_THROUGHPUT_TOKENS,
)
from otelprof._schema import ATTR_DETERMINED_STEPS_COMPLETED as ATTR_STEPS_OFFSET
from otelprof._schema import ATTR_DETERMINED_TRIAL_ID as ATTR_TRIAL_ID
from otelprof._schema import ATTR_DETERMINED_TRIAL_RUN_ID as ATTR_RUN_ID

ATTR_HOST_NAME = "host.name"

# Determined's profiling groups and, for each, the full key set every report must carry:
# the Web UI's series dropdown is built from the latest report only (reference §3).
PROFILING_KEYS: dict[str, tuple[str, ...]] = {
    "gpu": ("gpu_util", "gpu_free_memory"),
    "cpu": ("cpu_util_simple",),
    "memory": ("memory_free",),
    "disk": ("disk_iops", "disk_throughput_read", "disk_throughput_write"),
    "network": ("net_throughput_sent", "net_throughput_recv"),
}
PROFILING_GROUPS = frozenset(PROFILING_KEYS)

# disk_iops is read + write; the two halves are carried separately until the report is built.
DISK_IOPS_READ = "_disk_iops_read"
DISK_IOPS_WRITE = "_disk_iops_write"

# `otelprof.step` numbers steps from 0, so spans of step k mean k + 1 steps completed.
STEP_INDEX_BASE = 0

_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9]+")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
MAX_TIMING_KEY = 40  # the Metrics tab titles each chart with the key: keep it readable
# Determined 0.38.1's Metrics tab (TrialDetailsMetrics.tsx) strips a leading `t_`, `train_`
# or `training_`, then `v_`, `val_` or `validation_`, from each key and uses the rest as the
# chart's title and as the key grouping charts across groups: `validation_s` would be
# titled "s", `t_step_s` drawn into the `step_s` chart. No key starts with these words.
_UI_PREFIX_WORDS = frozenset(("t", "train", "training", "v", "val", "validation"))
# torch.profiler / record_function range names → short keys people recognise. torch's own
# DataLoader range runs inside otelprof's `dataloader_next` (timed_dataloader): its own key,
# so each key has one producer.
_KNOWN_RANGES = (
    (re.compile(r"^enumerate\(DataLoader\)#"), "torch_dataloader_next"),
    (re.compile(r"^Optimizer\.step#"), "optimizer_step"),
    (re.compile(r"^Optimizer\.zero_grad#"), "optimizer_zero_grad"),
    (re.compile(r"^## ?(forward|backward) ?##$"), r"\1"),
)


class GaugeSample(NamedTuple):
    """The sum of `n` gauge values for one trial/agent/group key (sub = GPU UUID in group
    gpu): one request's points of a key arrive folded, so neither the journal nor the window
    grows with the points of a request (an OTLP request of 4 MB holds ~300,000)."""

    trial_id: int
    run_id: int
    agent: str
    group: str
    sub: str
    key: str
    value: float
    time_ns: int  # the latest point's
    n: int = 1


class TimingSample(NamedTuple):
    """Spans of one name for one trial, pre-summed per request."""

    trial_id: int
    run_id: int
    name: str
    total_s: float
    n: int
    max_step: int  # -1 when no span carried otelprof.step
    time_ns: int
    offset: int = -1  # DET_STEPS_COMPLETED of the process (-1: not known)
    per_batch: int = 1  # otelprof steps per Determined batch
    from_histogram: bool = False  # a histogram delta (exact), not a sum of kept spans


class HistogramPoint(NamedTuple):
    """One `otelprof.timing.duration` point of one producer; deltas are taken by the
    aggregator (`WindowAggregator.histogram_deltas`), which remembers cumulative points."""

    trial_id: int
    run_id: int
    series: str  # producer (resource) + timing + phase: what a cumulative point continues
    name: str  # the Determined key stem (same rule as spans: `forward_validation`)
    calls: int
    sum_s: float
    start_ns: int
    time_ns: int
    cumulative: bool
    is_step: bool  # the training root span's histogram: its count is steps completed
    offset: int = -1
    per_batch: int = 1


@dataclass(frozen=True)
class Route:
    """Where data lacking Determined ids goes (the bridge's --trial-id/--trial-run-id)."""

    trial_id: int | None = None
    run_id: int | None = None
    agent: str | None = None
    steps_offset: int | None = None  # DET_STEPS_COMPLETED when no resource carries it
    steps_per_batch: int | None = None


@dataclass
class Extracted:
    """Result of mapping one OTLP request: samples plus what was refused and why."""

    gauges: list[GaugeSample] = field(default_factory=list)
    timings: list[TimingSample] = field(default_factory=list)
    histograms: list[HistogramPoint] = field(default_factory=list)
    rejected: int = 0
    errors: list[str] = field(default_factory=list)
    ignored: int = 0  # points of metrics Determined has no key for
    skipped_direct: int = 0  # from processes that post to Determined themselves
    by_reason: dict[str, int] = field(default_factory=dict)  # rejected, per reason

    def reject(self, count: int, message: str, reason: str = "unmappable") -> None:
        self.rejected += count
        self.by_reason[reason] = self.by_reason.get(reason, 0) + count
        if message not in self.errors:
            self.errors.append(message)


class Cancelled(Exception):
    """The request's caller went away (deadline passed, connection closed): stop mapping."""


CHECK_EVERY = 1024
"""Points (or spans, or resources) mapped between two looks at whether the caller is still
there: a few milliseconds of work, so an abandoned request stops that soon."""

MAX_TIME_BUCKETS = 4096
"""Timestamps of one metric held at once while its points of one timestamp are combined
(summed across interfaces, say); past that the ones held are folded into the key's sum,
so mapping a request needs memory for this many, not for all of its points."""

Stop = Callable[[], bool]


def never() -> bool:
    return False


@dataclass(frozen=True)
class _GaugeRule:
    group: str
    key: str | None  # fixed key, or None when chosen by a direction attribute
    direction_attr: str | None = None
    by_direction: Mapping[str, str] = field(default_factory=dict)
    units: Mapping[str, float] = field(default_factory=lambda: {"": 1.0})
    combine: str = "mean"  # how points of one timestamp combine (e.g. several interfaces)
    per_gpu: bool = False
    skip_attrs: tuple[str, ...] = ()


_UTIL_UNITS = {"1": 100.0, "": 100.0, "%": 1.0}
_BYTES = {"By": 1.0, "": 1.0}
_BYTES_PER_S = {"By/s": 1.0, "": 1.0}

# Gauges that join the timings report (Metrics tab) instead of a Profiler-tab group: the
# Profiler groups keep exactly PROFILING_KEYS. Their window mean is charted per key.
TIMINGS_GROUP = "timings"

GAUGE_RULES: dict[str, _GaugeRule] = {
    # joules per training step of the process's GPUs (otelprof/system/_gpu_steps.py)
    "otelprof.gpu.energy.per_step": _GaugeRule(
        TIMINGS_GROUP, "gpu_energy_per_step_j", units={"J": 1.0, "": 1.0}
    ),
    # throughput and MFU over the last training steps (otelprof/_throughput.py)
    TRAIN_THROUGHPUT_SAMPLES: _GaugeRule(
        TIMINGS_GROUP, "samples_per_second", units={"{sample}/s": 1.0, "": 1.0}
    ),
    TRAIN_THROUGHPUT_TOKENS: _GaugeRule(
        TIMINGS_GROUP, "tokens_per_second", units={"{token}/s": 1.0, "": 1.0}
    ),
    TRAIN_MFU: _GaugeRule(TIMINGS_GROUP, "mfu", units={"1": 1.0, "": 1.0}),
    "hw.gpu.utilization": _GaugeRule("gpu", "gpu_util", units=_UTIL_UNITS, per_gpu=True),
    "hw.gpu.memory.free": _GaugeRule("gpu", "gpu_free_memory", units=_BYTES, per_gpu=True),
    "system.network.throughput": _GaugeRule(
        "network",
        None,
        direction_attr="network.io.direction",
        by_direction={"transmit": "net_throughput_sent", "receive": "net_throughput_recv"},
        units=_BYTES_PER_S,
        combine="sum",
    ),
    "system.disk.iops": _GaugeRule(
        "disk",
        "disk_iops",
        direction_attr="disk.io.direction",
        by_direction={"read": DISK_IOPS_READ, "write": DISK_IOPS_WRITE},
        units={"{operation}/s": 1.0, "{operations}/s": 1.0, "1/s": 1.0, "": 1.0},
        combine="sum",
    ),
    "system.disk.throughput": _GaugeRule(
        "disk",
        None,
        direction_attr="disk.io.direction",
        by_direction={"read": "disk_throughput_read", "write": "disk_throughput_write"},
        units=_BYTES_PER_S,
        combine="sum",
    ),
    "system.memory.linux.available": _GaugeRule("memory", "memory_free", units=_BYTES),
    # The collector's hostmetrics receiver spells it this way.
    "system.linux.memory.available": _GaugeRule("memory", "memory_free", units=_BYTES),
    # Per-core / per-mode points (hostmetrics) are not "all cores"; only the plain series maps.
    "system.cpu.utilization": _GaugeRule(
        "cpu",
        "cpu_util_simple",
        units=_UTIL_UNITS,
        skip_attrs=("cpu.mode", "state", "cpu.logical_number", "cpu"),
    ),
}


def _any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def attributes_dict(items: Iterable[KeyValue]) -> dict[str, Any]:
    """Flatten OTLP attributes to plain values (arrays and maps are kept as protobuf)."""
    return {item.key: _any_value(item.value) for item in items}


class RouteError(ValueError):
    """The resource cannot be tied to a Determined trial; `reason` names why in one word
    (counted per reason: `Extracted.by_reason`)."""

    def __init__(self, message: str, reason: str = "unrouted") -> None:
        super().__init__(message)
        self.reason = reason


_INTEGER = re.compile(r"[+-]?[0-9]{1,12}")  # ASCII digits only: "²".isdigit() is True
_SHOWN = 40  # characters of a refused value quoted in a message (a sender's value is any size)


def _shown(raw: Any) -> str:
    text = repr(raw)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


def _as_int(attrs: Mapping[str, Any], key: str) -> int | None:
    """An id attribute as an int32, None when absent; RouteError (reason `bad_id`) for
    anything else: a bool, a fraction, `"²"` or `"--4242"` (which `str.isdigit` and
    `lstrip("-")` let through to a ValueError), a string of a thousand digits."""
    raw = attrs.get(key)
    if raw is None or raw == "":
        return None
    value: int | None = None
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif isinstance(raw, float) and raw.is_integer():
        value = int(raw)
    elif isinstance(raw, str) and _INTEGER.fullmatch(raw.strip()):
        value = int(raw.strip())
    if value is None:
        raise RouteError(f"resource attribute {key}={_shown(raw)} is not an integer", "bad_id")
    if not -(2**31) <= value < 2**31:
        raise RouteError(
            f"resource attribute {key}={_shown(raw)} does not fit Determined's int32", "bad_id"
        )
    return value


def _describe(attrs: Mapping[str, Any]) -> str:
    keys = ("service.name", "host.name", "process.pid")
    parts = [f"{k}={_shown(attrs[k])}" for k in keys if k in attrs]
    return ", ".join(parts) or "no identifying attributes"


def resolve_route(attrs: Mapping[str, Any], default: Route) -> tuple[int, int, str]:
    """(trial id, run id, agent id) for a resource, or RouteError naming what is missing."""
    trial = _as_int(attrs, ATTR_TRIAL_ID)
    run = _as_int(attrs, ATTR_RUN_ID)
    if trial is None and default.trial_id is not None:
        trial = default.trial_id
        run = default.run_id if run is None else run
    if trial is None:
        raise RouteError(
            f"resource ({_describe(attrs)}) has no {ATTR_TRIAL_ID} attribute; run the job "
            "under Determined (DET_TRIAL_ID is read by otelprof.instrument) or start the "
            "bridge with --trial-id/--trial-run-id to route such data to one trial",
            "no_trial_id",
        )
    if trial < 1:
        raise RouteError(f"resource attribute {ATTR_TRIAL_ID}={trial} is not a trial id "
                         "(Determined's start at 1)", "bad_id")  # fmt: skip
    if run is None:
        raise RouteError(
            f"resource ({_describe(attrs)}) has {ATTR_TRIAL_ID}={trial} but no "
            f"{ATTR_RUN_ID}; Determined refuses reports without the trial's run id",
            "no_run_id",
        )
    if run < 0:
        raise RouteError(f"resource attribute {ATTR_RUN_ID}={run} is not a run id", "bad_id")
    agent = attrs.get(ATTR_AGENT_ID) or attrs.get(ATTR_HOST_NAME) or default.agent
    if not agent:
        raise RouteError(
            f"resource ({_describe(attrs)}) has neither {ATTR_AGENT_ID} nor {ATTR_HOST_NAME}; "
            "Determined nests system metrics under an agent id (or pass --agent-id)",
            "no_agent",
        )
    return trial, run, str(agent)


def _clear_of_ui_prefixes(words: str) -> str:
    """Leading words the Web UI would strip move to the end (`train_batch` → `batch_train`,
    `t_step` → `step_t`); a key made only of such words gets `phase_` in front
    (`validation` → `phase_validation`), so the title is always the whole key."""
    parts = words.split("_")
    for _ in range(len(parts)):
        if parts[0] not in _UI_PREFIX_WORDS:
            return "_".join(parts)
        parts = parts[1:] + parts[:1]
    return "phase_" + "_".join(parts)


def timing_name(name: str) -> str:
    """A span name as a short Determined metric key the Web UI shows as is.

    Known torch ranges get their short name (`enumerate(DataLoader)#...__next__` →
    `torch_dataloader_next`); others become snake_case words with no leading word the UI
    strips (`_clear_of_ui_prefixes`), and a key longer than 40 characters keeps its first
    33 plus a 6-hex hash of the full name, so two long names never merge.
    """
    for pattern, short in _KNOWN_RANGES:
        match = pattern.search(name)
        if match:
            return match.expand(short)
    words = _NAME_UNSAFE.sub("_", _CAMEL.sub("_", name)).strip("_").lower() or "unnamed"
    words = _clear_of_ui_prefixes(words)
    if len(words) > MAX_TIMING_KEY:
        digest = hashlib.blake2s(name.encode(), digest_size=3).hexdigest()
        words = f"{words[: MAX_TIMING_KEY - 7].rstrip('_')}_{digest}"
    return words


def phase_timing_name(name: str, phase: Any) -> str:
    """Timings outside training keep their own keys (`forward` of validation batches is
    `forward_validation`; a phase's root span is the phase's name), so validation never
    folds into the training timings."""
    if not phase or phase in (PHASE_TRAIN, name):
        return timing_name(name)
    return timing_name(f"{timing_name(name)} {phase}")


def _direct(attrs: Mapping[str, Any]) -> bool:
    return attrs.get(ATTR_DETERMINED_DIRECT) in (True, "true", "1", 1)


def step_claims(attrs: Mapping[str, Any], default: Route) -> tuple[int, int]:
    """(DET_STEPS_COMPLETED, otelprof steps per batch) a producer's resource claims (-1: no
    offset known); RouteError (reason `bad_steps`) for a malformed or negative one rather
    than a silent "unknown". The offset is only a claim: the aggregator bounds a trial's
    first report by what the master holds, not by it (`WindowAggregator._first_baseline`)."""
    try:
        offset = _as_int(attrs, ATTR_STEPS_OFFSET)
        per_batch = _as_int(attrs, ATTR_STEPS_PER_BATCH)
    except RouteError as exc:
        raise RouteError(str(exc), "bad_steps") from None
    offset = default.steps_offset if offset is None else offset
    per_batch = default.steps_per_batch if per_batch is None else per_batch
    if offset is not None and offset < 0:
        raise RouteError(f"resource attribute {ATTR_STEPS_OFFSET}={offset} is negative",
                         "bad_steps")  # fmt: skip
    if per_batch is not None and per_batch < 1:
        raise RouteError(f"resource attribute {ATTR_STEPS_PER_BATCH}={per_batch} is not a "
                         "positive count", "bad_steps")  # fmt: skip
    return (-1 if offset is None else offset), (per_batch or 1)


def extract_metrics(
    request: ExportMetricsServiceRequest,
    default: Route,
    skip_direct: bool = False,
    stop: Stop = never,
) -> Extracted:
    """Gauge samples for every data point Determined has a key for, one per key of each
    resource (the sum of its points' values per timestamp, and how many timestamps).

    `skip_direct` (the bridge): resources of processes that post to Determined themselves
    are left out, counted in `skipped_direct`, so no trial's data is reported twice.
    `stop()` is asked every `CHECK_EVERY` points; when true, mapping raises `Cancelled`.
    """
    out = Extracted()
    for resource_metrics in request.resource_metrics:
        if stop():
            raise Cancelled
        attrs = attributes_dict(resource_metrics.resource.attributes)
        points = resource_items(resource_metrics)
        if skip_direct and _direct(attrs):
            out.skipped_direct += points
            continue
        try:
            trial, run, agent = resolve_route(attrs, default)
        except RouteError as exc:
            out.reject(points, str(exc), exc.reason)
            continue
        folded: dict[tuple[str, str, str], list[float]] = {}  # (group, sub, key) -> sum, n, t
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == TIMING_HISTOGRAM:
                    _map_histogram(metric, attrs, default, trial, run, out)
                else:
                    _map_metric(metric, folded, out, stop)
        for (group, sub, key), (total, n, time_ns) in folded.items():
            out.gauges.append(
                GaugeSample(trial, run, agent, group, sub, key, total, int(time_ns), int(n))
            )
    return out


def _rank(attrs: Mapping[str, Any]) -> int | None:
    try:
        return _as_int(attrs, ATTR_RANK)
    except RouteError:
        return None


_CUMULATIVE = 2  # AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
_DELTA = 1


def _map_histogram(
    metric: Any, attrs: Mapping[str, Any], default: Route, trial: int, run: int, out: Extracted
) -> None:
    """Histogram points of otelprof's timing durations → `out.histograms`; global rank 0's
    only (Determined charts one timing series per trial, as with spans)."""
    kind = metric.WhichOneof("data")
    points = getattr(metric, kind).data_points if kind else ()
    if kind != "histogram" or _rank(attrs) not in (None, 0):
        out.ignored += len(points)
        return
    temporality = metric.histogram.aggregation_temporality
    if metric.unit not in ("s", "") or temporality not in (_CUMULATIVE, _DELTA):
        out.reject(
            len(points),
            f"metric {TIMING_HISTOGRAM} has unit {_shown(metric.unit)} and temporality "
            f"{temporality}; expected unit 's', delta or cumulative",
            "bad_unit",
        )
        return
    try:
        offset, per_batch = step_claims(attrs, default)
    except RouteError as exc:
        out.reject(len(points), str(exc), exc.reason)
        return
    producer = repr(sorted((k, str(v)) for k, v in attrs.items()))
    for point in points:
        point_attrs = attributes_dict(point.attributes)
        timing = point_attrs.get(ATTR_TIMING)
        phase = point_attrs.get(ATTR_PHASE) or PHASE_TRAIN
        count, total = int(point.count), float(point.sum)
        if not isinstance(timing, str) or not timing:
            out.reject(1, f"metric {TIMING_HISTOGRAM} point has no {ATTR_TIMING} attribute",
                       "bad_value")  # fmt: skip
            continue
        if count < 0 or not math.isfinite(total) or total < 0:
            out.reject(1, f"metric {TIMING_HISTOGRAM} point of {_shown(timing)} has a bad "
                       "count/sum", "bad_value")  # fmt: skip
            continue
        out.histograms.append(
            HistogramPoint(
                trial,
                run,
                f"{producer}\0{timing}\0{phase}",
                phase_timing_name(timing, phase),
                count,
                total,
                int(point.start_time_unix_nano),
                int(point.time_unix_nano),
                temporality == _CUMULATIVE,
                timing == STEP_SPAN and phase == PHASE_TRAIN,
                offset,
                per_batch,
            )
        )


def point_count(metric: Any) -> int:
    kind = metric.WhichOneof("data")
    return len(getattr(metric, kind).data_points) if kind else 0


def resource_items(resource: Any) -> int:
    """The points of a ResourceMetrics, the spans of a ResourceSpans."""
    if hasattr(resource, "scope_metrics"):
        return sum(point_count(m) for sm in resource.scope_metrics for m in sm.metrics)
    return sum(len(ss.spans) for ss in resource.scope_spans)


def _map_metric(
    metric: Any,
    folded: dict[tuple[str, str, str], list[float]],
    out: Extracted,
    stop: Stop,
) -> None:
    kind = metric.WhichOneof("data")
    rule = GAUGE_RULES.get(metric.name)
    if rule is None or kind not in ("gauge", "sum"):
        out.ignored += point_count(metric)
        return
    data_points = getattr(metric, kind).data_points
    factor = rule.units.get(metric.unit)
    if factor is None:
        out.reject(
            len(data_points),
            f"metric {metric.name} has unit {_shown(metric.unit)}; expected one of "
            f"{sorted(u for u in rule.units if u)}",
            "bad_unit",
        )
        return
    # (sub, key, time) -> [sum, count] of the points of one timestamp, combined per the rule
    buckets: dict[tuple[str, str, int], list[float]] = {}
    for i, point in enumerate(data_points):
        if i % CHECK_EVERY == CHECK_EVERY - 1 and stop():
            raise Cancelled
        attrs = attributes_dict(point.attributes)
        if any(a in attrs for a in rule.skip_attrs):
            out.ignored += 1
            continue
        key = rule.key
        if rule.direction_attr and rule.direction_attr in attrs:
            key = rule.by_direction.get(str(attrs[rule.direction_attr]))
        if key is None:
            out.ignored += 1
            continue
        sub = ""
        if rule.per_gpu:
            sub = str(attrs.get("hw.id") or "")
            if not sub:
                index = attrs.get("gpu.index")
                if index is None:
                    out.reject(1, f"metric {metric.name} point has neither hw.id nor gpu.index",
                               "no_gpu_id")  # fmt: skip
                    continue
                sub = f"GPU-{index}"
        point_kind = point.WhichOneof("value")
        if point_kind is None:
            out.ignored += 1
            continue
        value = float(getattr(point, point_kind)) * factor
        if not math.isfinite(value):
            out.reject(1, f"metric {metric.name} has a non-finite value", "bad_value")
            continue
        when = (sub, key, int(point.time_unix_nano))
        bucket = buckets.get(when)
        if bucket is None:  # (no list made per point for setdefault to throw away)
            if len(buckets) >= MAX_TIME_BUCKETS:
                _fold(buckets, rule, folded)
            buckets[when] = [value, 1]
        else:
            bucket[0] += value
            bucket[1] += 1
    _fold(buckets, rule, folded)


def _fold(
    buckets: dict[tuple[str, str, int], list[float]],
    rule: _GaugeRule,
    folded: dict[tuple[str, str, str], list[float]],
) -> None:
    """Each timestamp's combined value into its key's sum (and count, and latest time)."""
    for (sub, key, time_ns), (total, count) in buckets.items():
        value = total if rule.combine == "sum" else total / count
        add_up(folded, (rule.group, sub, key), value, 1, time_ns)
    buckets.clear()


def add_up(sums: dict[Any, list[float]], key: Any, value: float, n: int, time_ns: int) -> None:
    """`n` values summing to `value`, the latest at `time_ns`, into `sums[key]`: [sum, count,
    latest time]."""
    acc = sums.get(key)
    if acc is None:  # (no list made per sample for setdefault to throw away)
        sums[key] = [value, n, time_ns]
    else:
        acc[0] += value
        acc[1] += n
        acc[2] = max(acc[2], time_ns)


def extract_spans(
    request: ExportTraceServiceRequest,
    default: Route,
    skip_direct: bool = False,
    stop: Stop = never,
) -> Extracted:
    """Timing samples (sum of seconds, count, highest step) per trial and span name.
    `stop()` is asked every `CHECK_EVERY` spans; when true, mapping raises `Cancelled`."""
    out = Extracted()
    for resource_spans in request.resource_spans:
        if stop():
            raise Cancelled
        attrs = attributes_dict(resource_spans.resource.attributes)
        n_spans = resource_items(resource_spans)
        if not n_spans:
            continue
        if skip_direct and _direct(attrs):
            out.skipped_direct += n_spans
            continue
        if _rank(attrs) not in (None, 0):
            # Determined charts one timing series per trial: global rank 0's, on every
            # path (the in-process exporter and the histograms keep rank 0 alone too).
            out.ignored += n_spans
            continue
        try:
            trial, run, _agent = resolve_route(attrs, default)
            offset, per_batch = step_claims(attrs, default)
        except RouteError as exc:
            out.reject(n_spans, str(exc), exc.reason)
            continue
        sums: dict[str, list[float]] = {}  # name -> [total_s, count, max_step, max_end]
        seen = 0
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                seen += 1
                if seen % CHECK_EVERY == 0 and stop():
                    raise Cancelled
                _add_span(span, sums, out)
        out.timings.extend(
            TimingSample(trial, run, name, total, int(n), int(step), int(t_end), offset, per_batch)
            for name, (total, n, step, t_end) in sums.items()
        )
    return out


def _add_span(span: Any, sums: dict[str, list[float]], out: Extracted) -> None:
    start, end = int(span.start_time_unix_nano), int(span.end_time_unix_nano)
    if start <= 0 or end < start:
        out.reject(1, f"span {_shown(span.name)} has end time before start time", "bad_span")
        return
    step = -1
    phase = None
    for kv in span.attributes:
        if kv.key == ATTR_STEP:
            raw = _any_value(kv.value)
            if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
                step = raw
        elif kv.key == ATTR_PHASE:
            phase = _any_value(kv.value)
    acc = sums.setdefault(phase_timing_name(span.name, phase), [0.0, 0, -1, 0])
    acc[0] += (end - start) / 1e9
    acc[1] += 1
    acc[2] = max(acc[2], step)
    acc[3] = max(acc[3], end)
