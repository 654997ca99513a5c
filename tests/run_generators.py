"""Synthetic detached run directories for the analysis tests and benchmarks.

`write_sdk_run` goes through the real writer: the OpenTelemetry SDK's spans (with explicit,
deterministic timestamps) and MetricsData, exported by `opentelemetry-exporter-otlp-json-file`,
so the files have exactly the shape a detached run has. `write_big_run` templates lines
directly (same shape, copied from a real line) to make gigabyte runs quickly for benchmarks,
and `write_one_span_files` the other extreme: many files of one span each.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.exporter.otlp.json.file import FileMetricExporter, FileSpanExporter
from opentelemetry.sdk.metrics.export import (
    Gauge,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import set_span_in_context

T0_NS = 1_800_000_000_000_000_000  # a fixed epoch start keeps the files deterministic
GiB = 1 << 30


@dataclass
class RunSpec:
    """What a synthetic training run looks like (durations in seconds)."""

    steps: int = 40
    epochs: int = 2
    ranks: int = 1
    host: str = "node0"
    gpus: int = 1
    dataloader_s: float = 0.004
    slow_dataloader_s: float = 0.0  # added to every dataloader_next: the deliberate bottleneck
    to_device_s: float = 0.002
    train_batch_s: float = 0.030
    lr_s: float = 0.0005
    reduce_every: int = 10
    reduce_s: float = 0.003
    untimed_s: float = 0.001
    jitter: float = 0.2  # relative random variation of each duration
    gpu_busy_util: float = 0.9
    metric_interval_s: float = 0.5
    straggler_rank: int | None = None  # this rank's train_batch is 2x slower
    validation: bool = True  # a top-level "validation" span after each epoch
    seed: int = 7
    service: str = "train"
    t0_ns: int = T0_NS  # when the run starts (wall-clock ns)
    first_rank: int = 0  # global rank of this directory's first process (multi-node runs)
    world_size: int | None = None  # defaults to `ranks`
    extra_resource: dict[str, Any] = field(default_factory=dict)
    shared_trace_ids: bool = False  # step N of every rank in one trace, as otelprof writes it
    slow_steps: dict[int, float] = field(default_factory=dict)  # step -> untimed s more, all ranks
    extra_roots: tuple[tuple[str, int], ...] = ()  # (phase, after step): a 20 ms phase span


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _resource(spec: RunSpec, rank: int) -> Resource:
    attrs: dict[str, Any] = {
        "service.name": spec.service,
        "host.name": spec.host,
        "process.pid": 1000 + rank,
        "otelprof.rank": rank,
        "otelprof.local_rank": rank - spec.first_rank,
        "otelprof.world_size": spec.world_size or spec.ranks,
    }
    attrs.update(spec.extra_resource)
    return Resource.create(attrs)


class _StepTraceIds(RandomIdGenerator):
    """Random ids, but the trace id of a root span set beforehand (`next_trace`)."""

    next_trace: int | None = None

    def generate_trace_id(self) -> int:
        return self.next_trace if self.next_trace is not None else super().generate_trace_id()


def _write_spans(spec: RunSpec, rank: int, path: Path, rng: random.Random) -> list[tuple]:
    """Write one rank's spans; return the step windows (start, end, dl_share) for metrics."""
    ids = _StepTraceIds()
    provider = TracerProvider(resource=_resource(spec, rank), id_generator=ids)
    # a queue that holds every span: the default (2,048) drops spans when the export thread
    # falls behind on a loaded machine ("Queue full, dropping Span"), and a rank's file then
    # lacks steps the others have; batches of 256 keep every file's lines the same run to run
    provider.add_span_processor(
        BatchSpanProcessor(
            FileSpanExporter(path),
            max_queue_size=1 << 20,
            max_export_batch_size=256,
            schedule_delay_millis=60_000,
        )
    )
    tracer = provider.get_tracer("otelprof.timings")

    def d(base: float) -> int:
        return _ns(base * (1 + spec.jitter * (2 * rng.random() - 1)))

    def child(name: str, parent: Any, start: int, dur: int, attrs: dict[str, Any]) -> int:
        span = tracer.start_span(
            name, context=set_span_in_context(parent), start_time=start, attributes=attrs
        )
        span.end(end_time=start + dur)
        return start + dur

    t = spec.t0_ns
    windows = []
    steps_per_epoch = max(1, spec.steps // spec.epochs)
    for i in range(spec.steps):
        epoch = i // steps_per_epoch
        attrs = {"otelprof.step": i, "otelprof.epoch": epoch}
        ids.next_trace = (1 << 100) + i if spec.shared_trace_ids else None
        step = tracer.start_span("step", start_time=t, attributes=attrs)
        start = t
        t = child("dataloader_next", step, t, d(spec.dataloader_s + spec.slow_dataloader_s), attrs)
        dl_end = t
        t = child("to_device", step, t, d(spec.to_device_s), attrs)
        tb = tracer.start_span(
            "train_batch", context=set_span_in_context(step), start_time=t, attributes=attrs
        )
        slow = 2.0 if rank == spec.straggler_rank else 1.0
        total = d(spec.train_batch_s * slow)
        fwd = total // 3
        child("forward", tb, t, fwd, attrs)
        child("backward", tb, t + fwd, total - fwd - total // 10, attrs)
        t += total
        tb.end(end_time=t)
        t = child("step_lr_schedulers", step, t, d(spec.lr_s), attrs)
        if spec.reduce_every and (i + 1) % spec.reduce_every == 0:
            t = child("reduce_metrics", step, t, d(spec.reduce_s), attrs)
        t += d(spec.untimed_s) + _ns(spec.slow_steps.get(i, 0.0))
        step.end(end_time=t)
        windows.append((start, t, (dl_end - start) / max(1, t - start)))
        for phase, after in spec.extra_roots:
            if after == i:
                root = tracer.start_span(phase, start_time=t, attributes={"otelprof.phase": phase})
                t += _ns(0.02)
                root.end(end_time=t)
        if spec.validation and (i + 1) % steps_per_epoch == 0:
            ids.next_trace = (1 << 101) + epoch if spec.shared_trace_ids else None
            val = tracer.start_span(
                "validation", start_time=t, attributes={"otelprof.epoch": epoch}
            )
            t += d(0.05)
            val.end(end_time=t)
            windows.append((val.start_time, t, 0.0))
    provider.force_flush()
    provider.shutdown()
    return windows


def _gauge(name: str, unit: str, points: list[NumberDataPoint]) -> Metric:
    return Metric(name=name, description="", unit=unit, data=Gauge(data_points=points))


def _write_metrics(
    spec: RunSpec, rank: int, path: Path, windows: list[tuple], rng: random.Random
) -> None:
    """Gauges sampled every metric_interval_s over the run, GPU busy when not loading data."""
    exporter = FileMetricExporter(path)
    resource = _resource(spec, rank)
    scope = InstrumentationScope("otelprof.system")
    end = windows[-1][1]
    t = spec.t0_ns + _ns(spec.metric_interval_s)
    w = 0
    while t <= end + _ns(spec.metric_interval_s):
        while w < len(windows) - 1 and windows[w][1] < t:
            w += 1
        loading = windows[w][2]
        gpu_util = max(0.0, min(1.0, spec.gpu_busy_util * (1 - loading) + 0.02 * rng.random()))

        def pt(value: float, attrs: dict[str, Any] | None = None, t: int = t) -> NumberDataPoint:
            return NumberDataPoint(
                attributes=attrs or {},
                start_time_unix_nano=spec.t0_ns,
                time_unix_nano=t,
                value=value,
            )

        metrics = []
        local_rank0 = rank == spec.first_rank  # host metrics come from local rank 0
        if spec.gpus and local_rank0:
            gpu_points = [(f"GPU-{g:04d}-uuid", g) for g in range(spec.gpus)]
            metrics.append(
                _gauge(
                    "hw.gpu.utilization",
                    "1",
                    [
                        pt(gpu_util * (1 - 0.1 * g), {"hw.id": u, "gpu.index": g})
                        for u, g in gpu_points
                    ],
                )
            )
            metrics.append(
                _gauge(
                    "hw.gpu.memory.free",
                    "By",
                    [
                        pt(int(30 * GiB - 2 * GiB * rng.random()), {"hw.id": u, "gpu.index": g})
                        for u, g in gpu_points
                    ],
                )
            )
        if local_rank0:
            metrics.append(
                _gauge(
                    "system.cpu.utilization", "1", [pt(0.3 + 0.4 * loading + 0.05 * rng.random())]
                )
            )
            metrics.append(
                _gauge(
                    "system.memory.linux.available", "By", [pt(int(20 * GiB + GiB * rng.random()))]
                )
            )
            metrics.append(
                _gauge(
                    "system.disk.throughput",
                    "By/s",
                    [
                        pt(50e6 * rng.random(), {"disk.io.direction": "read"}),
                        pt(5e6 * rng.random(), {"disk.io.direction": "write"}),
                    ],
                )
            )
            metrics.append(
                _gauge(
                    "system.network.throughput",
                    "By/s",
                    [
                        pt(1e6 * rng.random(), {"network.io.direction": "transmit"}),
                        pt(2e6 * rng.random(), {"network.io.direction": "receive"}),
                    ],
                )
            )
        metrics.append(_gauge("process.memory.usage", "By", [pt(int(2 * GiB * (1 + rank / 10)))]))
        exporter.export(
            MetricsData(
                resource_metrics=[
                    ResourceMetrics(
                        resource=resource,
                        scope_metrics=[ScopeMetrics(scope=scope, metrics=metrics, schema_url="")],
                        schema_url="",
                    )
                ]
            )
        )
        t += _ns(spec.metric_interval_s)
    exporter.shutdown()


def write_sdk_run(run_dir: Path, spec: RunSpec | None = None, run_json: bool = True) -> Path:
    """A run directory as the detached exporters write it (per-rank files when ranks > 1)."""
    spec = spec or RunSpec()
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(spec.seed)
    for rank in range(spec.first_rank, spec.first_rank + spec.ranks):
        suffix = f".rank{rank}" if (spec.world_size or spec.ranks) > 1 else ""
        windows = _write_spans(spec, rank, run_dir / f"traces{suffix}.jsonl", rng)
        _write_metrics(spec, rank, run_dir / f"metrics{suffix}.jsonl", windows, rng)
    if run_json:
        (run_dir / "run.json").write_text(
            json.dumps(
                {
                    "run_id": run_dir.name,
                    "started_unix_nano": spec.t0_ns,
                    "resource": {"service.name": spec.service, "host.name": spec.host},
                }
            )
        )
    return run_dir


# --- big runs for benchmarks: templated lines, same shape as the SDK's ---------------------

_SPAN_TMPL = (
    '{{"traceId":"{tid}","spanId":"{sid}","parentSpanId":"{pid}","flags":256,"name":"{name}",'
    '"kind":1,"startTimeUnixNano":"{start}","endTimeUnixNano":"{end}","attributes":['
    '{{"key":"otelprof.step","value":{{"intValue":"{step}"}}}},'
    '{{"key":"otelprof.epoch","value":{{"intValue":"0"}}}}],"status":{{}}}}'
)
_RESOURCE = (
    '{{"attributes":[{{"key":"service.name","value":{{"stringValue":"train"}}}},'
    '{{"key":"host.name","value":{{"stringValue":"node{node}"}}}},'
    '{{"key":"process.pid","value":{{"intValue":"{pid}"}}}},'
    '{{"key":"otelprof.rank","value":{{"intValue":"{rank}"}}}}]}}'
)
_METRIC_TMPL = (
    '{{"name":"hw.gpu.utilization","unit":"1","gauge":{{"dataPoints":[{{"attributes":['
    '{{"key":"hw.id","value":{{"stringValue":"GPU-{rank}"}}}},'
    '{{"key":"gpu.index","value":{{"intValue":"{rank}"}}}}],'
    '"timeUnixNano":"{t}","asDouble":{v}}}]}}}},'
    '{{"name":"system.cpu.utilization","unit":"1","gauge":{{"dataPoints":[{{'
    '"timeUnixNano":"{t}","asDouble":{c}}}]}}}}'
)


def write_big_run(run_dir: Path, target_bytes: int, ranks: int = 4, seed: int = 1) -> int:
    """Write ~target_bytes of per-rank traces and metrics quickly; return bytes written."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    per_rank = target_bytes // ranks
    written = 0
    names = ("dataloader_next", "to_device", "train_batch", "step_lr_schedulers")
    durs = (0.004, 0.002, 0.030, 0.0005)
    for rank in range(ranks):
        resource = _RESOURCE.format(node=rank // 8, pid=1000 + rank, rank=rank)
        trace_head = (
            '{"resourceSpans":[{"resource":' + resource + ',"scopeSpans":[{"scope":'
            '{"name":"otelprof.timings"},"spans":['
        )
        metric_head = (
            '{"resourceMetrics":[{"resource":' + resource + ',"scopeMetrics":[{'
            '"scope":{"name":"otelprof.system"},"metrics":['
        )
        tail = "]}]}]}\n"
        t = T0_NS
        step = 0
        rank_bytes = 0
        next_metric = t
        with (
            (run_dir / f"traces.rank{rank}.jsonl").open("w") as tf,
            (run_dir / f"metrics.rank{rank}.jsonl").open("w") as mf,
        ):
            while rank_bytes < per_rank:
                spans = []
                for _ in range(50):  # 50 steps x 5 spans per line
                    tid = f"{rng.getrandbits(128):032x}"
                    sid = f"{rng.getrandbits(64):016x}"
                    start = t
                    for name, base in zip(names, durs, strict=True):
                        dur = int(base * 1e9 * (0.8 + 0.4 * rng.random()))
                        spans.append(
                            _SPAN_TMPL.format(
                                tid=tid,
                                sid=f"{rng.getrandbits(64):016x}",
                                pid=sid,
                                name=name,
                                start=t,
                                end=t + dur,
                                step=step,
                            )
                        )
                        t += dur
                    t += 1_000_000
                    spans.append(
                        _SPAN_TMPL.format(
                            tid=tid, sid=sid, pid="", name="step", start=start, end=t, step=step
                        ).replace(',"parentSpanId":""', "")
                    )
                    step += 1
                line = trace_head + ",".join(spans) + tail
                tf.write(line)
                rank_bytes += len(line)
                mlines = []
                while next_metric <= t:
                    mlines.append(
                        metric_head
                        + _METRIC_TMPL.format(
                            rank=rank,
                            t=next_metric,
                            v=round(rng.random(), 4),
                            c=round(rng.random(), 4),
                        )
                        + tail
                    )
                    next_metric += 1_000_000_000
                for ml in mlines:
                    mf.write(ml)
                    rank_bytes += len(ml)
        written += rank_bytes
    return written


def step_spans_line(rank: int, first_step: int, steps: int) -> str:
    """One traces line (newline included) of `steps` root step spans of process `rank`."""
    resource = _RESOURCE.format(node=rank // 8, pid=1000 + rank, rank=rank)
    spans = []
    for step in range(first_step, first_step + steps):
        start = T0_NS + step * 10_000_000
        spans.append(
            _SPAN_TMPL.format(
                tid=f"{rank:08x}{step:024x}",
                sid=f"{rank:08x}{step:08x}",
                pid="",
                name="step",
                start=start,
                end=start + 5_000_000,
                step=step,
            ).replace(',"parentSpanId":""', "")
        )
    return (
        '{"resourceSpans":[{"resource":' + resource + ',"scopeSpans":[{"scope":'
        '{"name":"otelprof.timings"},"spans":[' + ",".join(spans) + "]}]}]}\n"
    )


def write_one_span_files(run_dir: Path, count: int) -> Path:
    """`count` traces files of one step span each, every file its own process (rank): the
    many-small-files extreme a report must stay linear on."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(count):
        (run_dir / f"traces.rank{rank}.jsonl").write_text(step_spans_line(rank, 0, 1))
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_dir.name}))
    return run_dir
