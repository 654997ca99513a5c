"""Benchmark: N synthetic ranks into the real collector and Prometheus (64, 256, 1,024 ranks).

Each rank sends what otelprof sends in attached mode at default settings, derived from a
real run's own files (`otelprof` wrote them; rank attributes rewritten, timestamps now):
every `interval` (1 s) one metrics export (every hardware gauge, the timing histograms,
the collective counters, overhead gauges: one point per series, as the periodic reader
exports them) and one kept step trace (the spans of one step, ~10 spans/s: the default
`trace_budget`), over OTLP gRPC, into the shipped collector config (span_metrics, the
prometheus exporter, and the straggler path: the metrics/straggler pipeline's small
endpoint) scraped by Prometheus every 5 s (the shipped prometheus.yml's jobs).

Measured per rank count, after a warm-up: collector CPU (utime+stime over the window) and
memory (RSS, peak), Prometheus active series (TSDB status API, and per rank by label),
the straggler panel's query time (the dashboard's PromQL, instant and 15-min range), and,
once one rank starts waiting less in collectives (a straggler), how long until the live
straggler panel names it, in scrape intervals: the dashboard's query (the straggler path's
series, falling back to the full endpoint's) and, beside it, the same query on the full
endpoint's series alone (the panel before the straggler path). Also the straggler
endpoint's series count and scrape duration, and how old the newest sample of each copy is.

--collectors K models the sharded deployment of a cluster (deploy/collector/: an agent per
node, samplers sharded by resource): K collectors with the shipped config, each taking the
exports of whole nodes (node i goes to collector i mod K), Prometheus scraping every one's
full and straggler endpoints; CPU and RSS are the collectors' sums.
--without-straggler-path runs the shipped config minus that pipeline (the path's cost, A/B).

    .venv/bin/python bench/scale_live.py --source RUN_DIR            # 64 256 1024
    .venv/bin/python bench/scale_live.py --source RUN_DIR --ranks 64 --measure-s 30

RUN_DIR: a detached run of tests/ddp_job.py under torchrun with 2 ranks (ranks 0 and 1;
rank 0 has host metrics and stands for each node's local rank 0); without --source one is
recorded first (about 1.5 minutes). `make bench-scale` runs this and scale_report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import yaml
from _machine import cpu_model
from _scale_runs import record_source_run
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from otelprof.analysis.replay import _fix_ids  # noqa: E402
from tests.dashboard_queries import DASHBOARD_DIR, load, queries  # noqa: E402
from tests.services import (  # noqa: E402
    COLLECTOR_CONFIG,
    running,
    start_collector,
    start_prometheus,
)

RANKS_PER_NODE = 8
COLLECTIVE = "otelprof.collective.duration"
COLLECTIVE_PROM = "otelprof_collective_duration_seconds_total"
STRAGGLER_WAIT = 0.3  # the straggler's collective waiting, as a share of the others'
RANK_NOISE = 0.05  # ranks' collective waiting differs by up to ±5 %
_METRICS_METHOD = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
_TRACES_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _json_lines(path: Path) -> list[dict[str, Any]]:
    with path.open("rb") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _points(metric: Any) -> Any:
    kind = metric.WhichOneof("data")
    return kind, getattr(metric, kind).data_points


def _series(metric: Any, point: Any) -> str:
    return metric.name + repr(sorted((a.key, str(a.value)) for a in point.attributes))


@dataclass
class Cumulative:
    """A cumulative point: its value grows by `rate` per second from `base`."""

    point: Any
    kind: str  # "int" | "double" | "histogram"
    base: Any
    rate: Any
    collective: bool


@dataclass
class MetricsTemplate:
    """One periodic export of one rank: every series once, cumulative ones growing."""

    request: Any
    gauges: list[Any] = field(default_factory=list)
    cumulative: list[Cumulative] = field(default_factory=list)
    resource: Any = None
    shared_scopes: list[Any] = field(default_factory=list)  # the same for every rank
    rank_scopes: list[Any] = field(default_factory=list)  # the collective counters, per rank

    @classmethod
    def from_file(cls, path: Path) -> MetricsTemplate:
        lines = _json_lines(path)
        requests = []
        for line in lines:
            _fix_ids(line)  # exemplars' trace and span ids
            msg = metrics_service_pb2.ExportMetricsServiceRequest()
            json_format.ParseDict(line, msg)
            requests.append(msg)
        first: dict[str, tuple[int, Any]] = {}
        last: dict[str, tuple[int, Any]] = {}
        for msg in requests:
            for rm in msg.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        _kind, dps = _points(m)
                        for dp in dps:
                            key = _series(m, dp)
                            first.setdefault(key, (dp.time_unix_nano, dp))
                            last[key] = (dp.time_unix_nano, dp)
        # the export: the line with the most metrics (histograms included), one point each
        template = max(
            requests,
            key=lambda r: sum(
                len(sm.metrics) for rm in r.resource_metrics for sm in rm.scope_metrics
            ),
        )
        out = cls(metrics_service_pb2.ExportMetricsServiceRequest())
        out.request.CopyFrom(template)
        [rm] = out.request.resource_metrics
        out.resource = rm.resource
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                _kind, dps = _points(m)
                seen: dict[str, Any] = {}
                for dp in dps:
                    seen[_series(m, dp)] = dp
                keep = [type(dp)() for dp in seen.values()]
                for new, key in zip(keep, seen, strict=True):
                    new.CopyFrom(last[key][1])
                del dps[:]
                dps.extend(keep)
            own = type(sm)()
            own.scope.CopyFrom(sm.scope)
            own.metrics.extend(m for m in sm.metrics if m.name == COLLECTIVE)
            shared = type(sm)()
            shared.scope.CopyFrom(sm.scope)
            shared.metrics.extend(m for m in sm.metrics if m.name != COLLECTIVE)
            out.shared_scopes.append(shared)
            if own.metrics:
                out.rank_scopes.append(own)
        for sm in out.shared_scopes + out.rank_scopes:
            for m in sm.metrics:
                kind, dps = _points(m)
                cumulative = kind == "histogram" or (kind == "sum" and m.sum.is_monotonic)
                for dp in dps:
                    if not cumulative:
                        out.gauges.append(dp)
                        continue
                    key = _series(m, dp)
                    t0, p0 = first[key]
                    t1, p1 = last[key]
                    seconds = max((t1 - t0) / 1e9, 1.0)
                    if kind == "histogram":
                        base = (p1.count, p1.sum, list(p1.bucket_counts))
                        rate = (
                            (p1.count - p0.count) / seconds,
                            (p1.sum - p0.sum) / seconds,
                            [
                                (b - a) / seconds
                                for a, b in zip(p0.bucket_counts, p1.bucket_counts, strict=True)
                            ],
                        )
                        out.cumulative.append(Cumulative(dp, "histogram", base, rate, False))
                    else:
                        field_ = dp.WhichOneof("value")
                        kind_ = "int" if field_ == "as_int" else "double"
                        value1 = getattr(p1, field_)
                        rate_ = (value1 - getattr(p0, field_)) / seconds
                        out.cumulative.append(
                            Cumulative(dp, kind_, value1, rate_, m.name == COLLECTIVE)
                        )
        return out


@dataclass
class TraceTemplate:
    """One kept step's trace of one rank (the spans of a step, as the span exporter sends)."""

    request: Any
    spans: list[Any]
    offsets: list[tuple[int, int]]  # (start, end) relative to the step's start, ns
    parents: list[int]  # index of each span's parent in `spans`, -1 for the root
    resource: Any

    @classmethod
    def from_file(cls, path: Path) -> TraceTemplate:
        lines = _json_lines(path)
        # a head-sampled step in the steady part (not one of the first traces kept whole)
        spans: dict[str, list[dict[str, Any]]] = {}
        for line in lines[len(lines) // 2 :]:
            for rs in line["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for s in ss["spans"]:
                        spans.setdefault(s["traceId"], []).append(s)
        trace = next(
            t for t in spans.values() if any(s["name"] == "step" for s in t) and len(t) >= 5
        )
        body = {
            "resourceSpans": [
                {
                    "resource": lines[0]["resourceSpans"][0]["resource"],
                    "scopeSpans": [
                        {
                            "scope": lines[0]["resourceSpans"][0]["scopeSpans"][0]["scope"],
                            "spans": trace,
                        }
                    ],
                }
            ]
        }
        _fix_ids(body)
        msg = trace_service_pb2.ExportTraceServiceRequest()
        json_format.ParseDict(body, msg)
        out_spans = list(msg.resource_spans[0].scope_spans[0].spans)
        start = min(s.start_time_unix_nano for s in out_spans)
        by_id = {s.span_id: i for i, s in enumerate(out_spans)}
        return cls(
            msg,
            out_spans,
            [(s.start_time_unix_nano - start, s.end_time_unix_nano - start) for s in out_spans],
            [by_id.get(s.parent_span_id, -1) for s in out_spans],
            msg.resource_spans[0].resource,
        )


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _ld(tag: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (tag byte, length, payload)."""
    return bytes([tag]) + _varint(len(payload)) + payload


def _set_identity(resource: Any, rank: int, world: int, run_id: str) -> None:
    node, local = divmod(rank, RANKS_PER_NODE)
    host = f"node{node:04d}"
    values = {
        "host.name": host,
        "service.instance.id": f"{host}:{10_000 + local}",
        "otelprof.run_id": run_id,
        "process.pid": 10_000 + local,
        "otelprof.rank": rank,
        "otelprof.local_rank": local,
        "otelprof.world_size": world,
    }
    for attr in resource.attributes:
        if attr.key in values:
            value = values[attr.key]
            if isinstance(value, int):
                attr.value.int_value = value
            else:
                attr.value.string_value = value


class Feed:
    """Every rank's export each interval, sent over a few gRPC channels (raw bytes)."""

    def __init__(
        self, endpoints: list[str], source: Path, world: int, run_id: str, seed: int = 1
    ) -> None:
        self.world = world
        self.run_id = run_id
        self.metrics = {
            h: MetricsTemplate.from_file(source / f"metrics.rank{r}.jsonl")
            for h, r in ((True, 0), (False, 1))
        }
        self.traces = {
            h: TraceTemplate.from_file(source / f"traces.rank{r}.jsonl")
            for h, r in ((True, 0), (False, 1))
        }
        rng = random.Random(seed)
        self.wait_factor = [1.0 + rng.uniform(-RANK_NOISE, RANK_NOISE) for _ in range(world)]
        self.resources: dict[bool, list[bytes]] = {}
        for host_rank, mt in self.metrics.items():
            out = []
            for rank in range(world):
                _set_identity(mt.resource, rank, world, run_id)
                out.append(_ld(0x0A, mt.resource.SerializeToString()))
            self.resources[host_rank] = out
        self.wait_clock = [0.0] * world  # each rank's seconds of collective waiting, scaled
        self._last_tick: float | None = None
        self.straggler: int | None = None
        # ranks of node i go to endpoints[i % len(endpoints)], each over a few channels
        per = max(1, 8 // len(endpoints))
        self.per_endpoint = per
        self.n_endpoints = len(endpoints)
        self.channels = [grpc.insecure_channel(e) for e in endpoints for _ in range(per)]
        identity = lambda b: b  # noqa: E731  (requests are serialized here, once per rank)
        self.send_metrics = [
            c.unary_unary(
                _METRICS_METHOD, request_serializer=identity, response_deserializer=identity
            )
            for c in self.channels
        ]
        self.send_traces = [
            c.unary_unary(
                _TRACES_METHOD, request_serializer=identity, response_deserializer=identity
            )
            for c in self.channels
        ]
        self.started = time.time()
        self.ticks = 0
        self.failed = 0
        self.tick_s: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _update(self, template: MetricsTemplate, now_ns: int, elapsed: float) -> None:
        for dp in template.gauges:
            if dp.start_time_unix_nano:
                dp.start_time_unix_nano = now_ns - 1_000_000_000
            dp.time_unix_nano = now_ns
        for c in template.cumulative:
            c.point.time_unix_nano = now_ns
            if c.kind == "histogram":
                count, total, buckets = c.base
                rcount, rsum, rbuckets = c.rate
                c.point.count = int(count + rcount * elapsed)
                c.point.sum = total + rsum * elapsed
                c.point.bucket_counts[:] = [
                    int(b + r * elapsed) for b, r in zip(buckets, rbuckets, strict=True)
                ]
            elif c.kind == "int":
                c.point.as_int = int(c.base + c.rate * elapsed)
            else:
                c.point.as_double = c.base + c.rate * elapsed

    def tick(self) -> None:
        begun = time.perf_counter()
        now_ns = time.time_ns()
        elapsed = now_ns / 1e9 - self.started
        for template in self.metrics.values():
            self._update(template, now_ns, elapsed)
        for tt in self.traces.values():
            for span, (start, end) in zip(tt.spans, tt.offsets, strict=True):
                span.start_time_unix_nano = now_ns - 1_000_000_000 + start
                span.end_time_unix_nano = now_ns - 1_000_000_000 + end
        dt = 0.0 if self._last_tick is None else now_ns / 1e9 - self._last_tick
        self._last_tick = now_ns / 1e9
        # one rank's request = its resource (bytes made once) + the shared scopes + its own
        # collective counters: protobuf messages concatenate, so only those are per rank
        shared_metrics = {
            h: b"".join(_ld(0x12, sm.SerializeToString()) for sm in mt.shared_scopes)
            for h, mt in self.metrics.items()
        }
        trace_id = os.urandom(16)  # one trace per step across ranks (as issue #25 designs)
        shared_spans = {}
        for h, tt in self.traces.items():
            ids = [os.urandom(8) for _ in tt.spans]
            for span, sid, parent in zip(tt.spans, ids, tt.parents, strict=True):
                span.trace_id = trace_id
                span.span_id = sid
                span.parent_span_id = ids[parent] if parent >= 0 else b""
            shared_spans[h] = b"".join(
                _ld(0x12, ss.SerializeToString()) for ss in tt.request.resource_spans[0].scope_spans
            )
        futures = []
        for rank in range(self.world):
            host_rank = rank % RANKS_PER_NODE == 0
            mt = self.metrics[host_rank]
            # collective waiting: every rank its own rate, the straggler waits less
            factor = self.wait_factor[rank] * (STRAGGLER_WAIT if rank == self.straggler else 1.0)
            self.wait_clock[rank] += factor * dt
            for c in mt.cumulative:
                if c.collective:
                    value = c.base + c.rate * self.wait_clock[rank]
                    if c.kind == "int":
                        c.point.as_int = int(value)
                    else:
                        c.point.as_double = value
            own = b"".join(_ld(0x12, sm.SerializeToString()) for sm in mt.rank_scopes)
            resource = self.resources[host_rank][rank]
            node = rank // RANKS_PER_NODE
            channel = (node % self.n_endpoints) * self.per_endpoint + rank % self.per_endpoint
            body = _ld(0x0A, resource + shared_metrics[host_rank] + own)
            futures.append(self.send_metrics[channel].future(body, timeout=10))
            body = _ld(0x0A, resource + shared_spans[host_rank])
            futures.append(self.send_traces[channel].future(body, timeout=10))
        for future in futures:
            try:
                future.result()
            except grpc.RpcError:
                self.failed += 1
        self.ticks += 1
        self.tick_s.append(time.perf_counter() - begun)

    def run(self, interval_s: float = 1.0) -> None:
        deadline = time.monotonic()
        while not self._stop.is_set():
            self.tick()
            deadline += interval_s
            delay = deadline - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
            else:
                deadline = time.monotonic()  # behind: send the next one at once

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        for channel in self.channels:
            channel.close()


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_mem(pid: int) -> tuple[float, float]:
    status = dict(
        line.split(":", 1)
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if ":" in line
    )
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024


def straggler_expr(run_id: str, rate_interval: str) -> str:
    from dashboards.build import STRAGGLER_PANEL

    [query] = [
        q
        for q in queries(load(DASHBOARD_DIR / "otelprof-training.json"))
        if q.panel == STRAGGLER_PANEL
    ]
    expr = query.expr.replace("$__rate_interval", rate_interval)
    expr = expr.replace('"$run"', f'"{run_id}"')
    for var in ("service", "rank", "host", "trial"):
        expr = expr.replace(f'"${var}"', '".*"')
    return expr


def _timed(fn: Any, repeat: int = 5) -> tuple[float, Any]:
    times = []
    result = None
    for _ in range(repeat):
        begun = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - begun)
    return statistics.median(times), result


def _straggler_top(prom: Any, expr: str, target: int) -> bool:
    result = prom.query(expr)
    if not result:
        return False
    top = max(result, key=lambda s: float(s["value"][1]))
    return bool(top["metric"].get("otelprof_rank") == str(target))


def _get(url: str) -> tuple[float, Any]:
    """One scrape of an exporter's /metrics, timed: (seconds, (MB, series) or an error)."""
    begun = time.perf_counter()
    try:
        body = httpx.get(url, timeout=300).content
    except httpx.HTTPError as error:  # the exporter gave up on the request
        return time.perf_counter() - begun, f"failed: {error!r:.100}"
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return time.perf_counter() - begun, (round(len(body) / 1e6, 3), series)


def measure(
    world: int,
    source: Path,
    workdir: Path,
    warmup_s: float,
    measure_s: float,
    remote_write: bool = False,
    n_collectors: int = 1,
    straggler_path: bool = True,
) -> dict[str, Any]:
    scrape_s = 5.0
    run_id = f"scale-{world}"
    config = COLLECTOR_CONFIG
    if not straggler_path:  # the shipped config without the metrics/straggler pipeline
        shipped = yaml.safe_load(COLLECTOR_CONFIG.read_text())
        del shipped["service"]["pipelines"]["metrics/straggler"]
        config = workdir / "otelcol-without-straggler-path.yaml"
        workdir.mkdir(parents=True, exist_ok=True)
        config.write_text(yaml.safe_dump(shipped))
    if remote_write:  # the collector pushes to Prometheus (OTELCOL_*_EXPORTERS)
        collectors = [
            start_collector(
                workdir / f"otelcol{i}",
                metrics_exporters=["prometheus_remote_write"],
                straggler_exporters=["prometheus_remote_write/straggler"],
                config=config,
                wait=False,
            )
            for i in range(n_collectors)
        ]
        targets: dict[str, list[str]] = {"otelcol-self": [c.telemetry_target for c in collectors]}
    else:  # the shipped setup: Prometheus scrapes the full and the straggler endpoints
        collectors = [
            start_collector(workdir / f"otelcol{i}", config=config) for i in range(n_collectors)
        ]
        targets = {
            "otelcol": [c.prometheus_target for c in collectors],
            "otelcol-straggler": [c.straggler_target for c in collectors],
            "otelcol-self": [c.telemetry_target for c in collectors],
        }
        if not straggler_path:
            del targets["otelcol-straggler"]
    prom = start_prometheus(
        workdir / "prom", scrape_targets=targets, scrape_interval=f"{scrape_s:g}s"
    )
    prom.client.timeout = httpx.Timeout(120.0)  # counting 0.8 M series takes a while here
    if remote_write:
        for collector in collectors:
            collector.env["OTELCOL_REMOTE_WRITE_URL"] = prom.remote_write_url
            collector.start()
    with running(*collectors, prom):
        pids = [c.process.process.pid for c in collectors]  # type: ignore[union-attr]
        feed = Feed(
            [c.otlp_endpoint.removeprefix("http://") for c in collectors], source, world, run_id
        )
        feed.start()
        try:
            time.sleep(warmup_s)
            ppid = prom.process.process.pid  # type: ignore[union-attr]
            pcpu0 = _proc_cpu_s(ppid)
            cpu0, t0, ticks0 = sum(map(_proc_cpu_s, pids)), time.monotonic(), feed.ticks
            rss = []
            while time.monotonic() - t0 < measure_s:
                time.sleep(1.0)
                rss.append(sum(_proc_mem(pid)[0] for pid in pids))
            cpu1, t1, ticks1 = sum(map(_proc_cpu_s, pids)), time.monotonic(), feed.ticks
            pcpu1 = _proc_cpu_s(ppid)
            peak = sum(_proc_mem(pid)[1] for pid in pids)
            prom_rss, prom_peak = _proc_mem(ppid)
            tsdb = prom._api("status/tsdb", {})
            scrapes: dict[str, list[Any]] = {}
            for t in prom.targets():
                scrapes.setdefault(t["labels"].get("job"), []).append(
                    (t["health"], round(t["lastScrapeDuration"], 3), t["lastError"][:120])
                )
            exporter = straggler_endpoint = None
            if not remote_write and straggler_path:
                straggler_endpoint = _get(f"http://{collectors[0].straggler_target}/metrics")
            if not remote_write:  # one scrape of collector 0's endpoints, timed here
                exporter = _get(f"http://{collectors[0].prometheus_target}/metrics")
            run = f'otelprof_run_id="{run_id}"'
            run_series = prom.values(f"count({{{run}}})")
            path_series = prom.values(f"count(straggler_{COLLECTIVE_PROM}{{{run}}})")
            # how old each copy's newest sample is (a backlog shows here)
            ages = {
                name: prom.values(f"time() - max(timestamp({name}{{{run}}}))")
                for name in (COLLECTIVE_PROM, "straggler_" + COLLECTIVE_PROM)
            }
            one_rank = prom.query(f'count by (__name__) ({{{run}, otelprof_rank="1"}})')
            one_node0 = prom.query(f'count by (__name__) ({{{run}, otelprof_rank="0"}})')
            expr = straggler_expr(run_id, f"{4 * scrape_s:g}s")
            # the panel before the straggler path: the full endpoint's copy alone
            full_expr = expr.replace("straggler_" + COLLECTIVE_PROM, COLLECTIVE_PROM)
            instant_s, now_result = _timed(lambda: prom.query(expr))
            end = time.time()
            range_s, _ = _timed(lambda: prom.query_range(expr, end - 900, end, 15.0))
            # a straggler appears: how long until the panel names it?
            target = world // 2 + 3
            feed.straggler = target
            changed = time.time()
            named: dict[str, float | None] = {"panel": None, "full_endpoint_only": None}
            while time.time() - changed < 12 * scrape_s and None in named.values():
                for key, query in (("panel", expr), ("full_endpoint_only", full_expr)):
                    if named[key] is None and _straggler_top(prom, query, target):
                        named[key] = time.time() - changed
                time.sleep(0.25)
        finally:
            feed.stop()
    ticks = ticks1 - ticks0

    def scrapes_of(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds / scrape_s, 2)

    return {
        "ranks": world,
        "collectors": n_collectors,
        "straggler_path": straggler_path,
        "sends_per_s": round(ticks / (t1 - t0), 2),
        "tick_s_median": round(statistics.median(feed.tick_s), 3),
        "failed_requests": feed.failed,
        "collector_cpu_s_per_s": round((cpu1 - cpu0) / (t1 - t0), 3),
        "collector_cpu_ms_per_rank_export": round(
            1e3 * (cpu1 - cpu0) / max(1, world * (ticks1 - ticks0)), 3
        ),
        "collector_rss_mib_median": round(statistics.median(rss), 1),
        "collector_rss_mib_peak": round(peak, 1),
        "collector_rss_kib_per_rank": round(1024 * statistics.median(rss) / world, 1),
        "prometheus_cpu_s_per_s": round((pcpu1 - pcpu0) / (t1 - t0), 3),
        "prometheus_rss_mib": round(prom_rss, 1),
        "prometheus_rss_mib_peak": round(prom_peak, 1),
        "prometheus_head_series": tsdb["headStats"]["numSeries"],
        "run_series": int(run_series[0]) if run_series else 0,
        "series_per_rank": round(run_series[0] / world, 1) if run_series else 0,
        "straggler_path_series": int(path_series[0]) if path_series else 0,
        "newest_sample_age_s": {k: round(v[0], 1) if v else None for k, v in ages.items()},
        "series_rank1": {s["metric"]["__name__"]: int(s["value"][1]) for s in one_rank},
        "series_rank0": sum(int(s["value"][1]) for s in one_node0),
        "straggler_instant_query_s": round(instant_s, 3),
        "straggler_range_query_s_15min_15s_step": round(range_s, 3),
        "straggler_panel_rows": len(now_result or []),
        "straggler_named_after_s": {
            k: None if v is None else round(v, 2) for k, v in named.items()
        },
        "straggler_named_after_scrapes": {k: scrapes_of(v) for k, v in named.items()},
        "scrape_interval_s": scrape_s,
        "metrics_path": "remote write" if remote_write else "scrape of the prometheus exporters",
        "targets (health, last scrape s, error)": scrapes,
        "straggler_endpoint_scrape (s, (MB, series))": straggler_endpoint,
        "full_endpoint_scrape (s, (MB, series))": exporter,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--source", type=Path, help="a real 2-rank detached run (default: record one now)"
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--warmup-s", type=float, default=40.0)
    parser.add_argument("--measure-s", type=float, default=60.0)
    parser.add_argument(
        "--collectors",
        type=int,
        default=1,
        help="collectors sharing the ranks by node (a sharded deployment's agents)",
    )
    parser.add_argument(
        "--without-straggler-path",
        action="store_true",
        help="the shipped collector config without its metrics/straggler pipeline (A/B)",
    )
    parser.add_argument(
        "--remote-write",
        action="store_true",
        help="the collector pushes with prometheus_remote_write instead of being scraped",
    )
    args = parser.parse_args()
    load_avg = os.getloadavg()
    print(
        f"# {platform.node()} {cpu_model()} {os.cpu_count()} CPUs; load {load_avg[0]:.1f}",
        flush=True,
    )
    with contextlib.ExitStack() as stack:
        if args.source is None:
            recorded = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            args.source = record_source_run(recorded)
        for world in args.ranks:
            _measure_one(args, world)
    return 0


def _measure_one(args: argparse.Namespace, world: int) -> None:
    with tempfile.TemporaryDirectory(prefix=f"scale{world}-") as tmp:
        result = measure(
            world,
            args.source,
            Path(tmp),
            args.warmup_s,
            args.measure_s,
            args.remote_write,
            args.collectors,
            not args.without_straggler_path,
        )
    result["load_avg_after"] = round(os.getloadavg()[0], 1)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
