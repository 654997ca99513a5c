"""OTLP data shaped like otelprof's (the design brief's names), for feeding the Determined bridge.

Two ways in: `seed_metrics_request`/`timing_spans_request` build OTLP protobuf requests
with exact values (unit tests, the kill -9 test), and `SdkFeeder` runs the OpenTelemetry
SDK with observable gauges and the OTLP gRPC exporters, like a training process would.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1 import trace_pb2

from otelprof.determined.ingest_auth import IngestTokens, Scope
from tests.spec import DETERMINED_TIMINGS

TIMING_NAMES = DETERMINED_TIMINGS


def kv(key: str, value: Any) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def trial_resource(
    trial_id: int | None, run_id: int | None = 1, agent: str | None = "agent-1", **extra: Any
) -> dict[str, Any]:
    attrs: dict[str, Any] = {"service.name": "train", "host.name": "host-a", "otelprof.rank": 0}
    if trial_id is not None:
        attrs["determined.experiment.id"] = 7
        attrs["determined.trial.id"] = trial_id
    if run_id is not None and trial_id is not None:
        attrs["determined.trial.run_id"] = run_id
    if agent is not None:
        attrs["determined.agent.id"] = agent
    attrs.update(extra)
    return attrs


@dataclass
class SeedValues:
    """One sample of every seed metric, in otelprof's units (utilizations 0–1)."""

    gpus: dict[str, tuple[float, float]] = field(
        default_factory=lambda: {
            "GPU-11111111-aaaa-bbbb-cccc-000000000000": (0.875, 12884901888.0),
            "GPU-22222222-aaaa-bbbb-cccc-000000000000": (0.25, 4294967296.0),
        }
    )  # uuid -> (utilization 0–1, free bytes)
    net_tx: float = 2048.0
    net_rx: float = 4096.0
    disk_read_iops: float = 100.0
    disk_write_iops: float = 20.0
    disk_read_bps: float = 1048576.0
    disk_write_bps: float = 524288.0
    mem_available: float = 101234567168.0
    cpu: float = 0.421


def _gauge(name: str, unit: str, points: Iterable[tuple[float, dict[str, Any]]], t: int) -> Any:
    return metrics_pb2.Metric(
        name=name,
        unit=unit,
        gauge=metrics_pb2.Gauge(
            data_points=[
                metrics_pb2.NumberDataPoint(
                    time_unix_nano=t,
                    as_double=value,
                    attributes=[kv(k, v) for k, v in attrs.items()],
                )
                for value, attrs in points
            ]
        ),
    )


def seed_metrics(values: SeedValues, t: int) -> list[Any]:
    gpu_items = list(values.gpus.items())
    return [
        _gauge("hw.gpu.utilization", "1",
               [(u, {"hw.id": uuid, "gpu.index": i}) for i, (uuid, (u, _)) in enumerate(gpu_items)],
               t),
        _gauge("hw.gpu.memory.free", "By",
               [(f, {"hw.id": uuid, "gpu.index": i}) for i, (uuid, (_, f)) in enumerate(gpu_items)],
               t),
        _gauge("system.network.throughput", "By/s",
               [(values.net_tx, {"network.io.direction": "transmit"}),
                (values.net_rx, {"network.io.direction": "receive"})], t),
        _gauge("system.disk.iops", "{operation}/s",
               [(values.disk_read_iops, {"disk.io.direction": "read"}),
                (values.disk_write_iops, {"disk.io.direction": "write"})], t),
        _gauge("system.disk.throughput", "By/s",
               [(values.disk_read_bps, {"disk.io.direction": "read"}),
                (values.disk_write_bps, {"disk.io.direction": "write"})], t),
        _gauge("system.memory.linux.available", "By", [(values.mem_available, {})], t),
        _gauge("system.cpu.utilization", "1", [(values.cpu, {})], t),
    ]  # fmt: skip


def seed_metrics_request(
    resource: dict[str, Any], values: SeedValues | None = None, t: int | None = None
) -> metrics_service_pb2.ExportMetricsServiceRequest:
    t = t or time.time_ns()
    return metrics_service_pb2.ExportMetricsServiceRequest(
        resource_metrics=[
            metrics_pb2.ResourceMetrics(
                resource=Resource(attributes=[kv(k, v) for k, v in resource.items()]),
                scope_metrics=[
                    metrics_pb2.ScopeMetrics(metrics=seed_metrics(values or SeedValues(), t))
                ],
            )
        ]
    )


def timing_spans_request(
    resource: dict[str, Any],
    steps: Iterable[int],
    durations: dict[str, float] | None = None,
    start_ns: int | None = None,
    step_span_name: str = "train_step",
) -> trace_service_pb2.ExportTraceServiceRequest:
    """For each step: a step span with `otelprof.step`, and one child per timing name."""
    durations = durations or {name: 0.001 * (i + 1) for i, name in enumerate(TIMING_NAMES)}
    t = start_ns or time.time_ns()
    spans = []
    for step in steps:
        trace_id = (step + 1).to_bytes(16, "big")
        parent = (step + 1).to_bytes(8, "big")
        step_start, cursor = t, t
        children = []
        for i, (name, seconds) in enumerate(durations.items()):
            end = cursor + int(seconds * 1e9)
            children.append(
                trace_pb2.Span(
                    trace_id=trace_id,
                    span_id=(step * 64 + i + 1000).to_bytes(8, "big"),
                    parent_span_id=parent,
                    name=name,
                    start_time_unix_nano=cursor,
                    end_time_unix_nano=end,
                    attributes=[kv("otelprof.step", step)],
                )
            )
            cursor = end
        spans.append(
            trace_pb2.Span(
                trace_id=trace_id,
                span_id=parent,
                name=step_span_name,
                start_time_unix_nano=step_start,
                end_time_unix_nano=cursor,
                attributes=[kv("otelprof.step", step)],
            )
        )
        spans.extend(children)
        t = cursor
    return trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[
            trace_pb2.ResourceSpans(
                resource=Resource(attributes=[kv(k, v) for k, v in resource.items()]),
                scope_spans=[trace_pb2.ScopeSpans(spans=spans)],
            )
        ]
    )


def dense_metrics_request(
    resource: dict[str, Any], n_bytes: int
) -> metrics_service_pb2.ExportMetricsServiceRequest:
    """One CPU gauge with as many points (one timestamp each) as fit in `n_bytes`: the
    request that costs the bridge the most per byte (~200,000 points in 3.8 MB)."""
    request = metrics_service_pb2.ExportMetricsServiceRequest()
    rm = request.resource_metrics.add()
    rm.resource.attributes.extend(kv(k, v) for k, v in resource.items())
    metric = rm.scope_metrics.add().metrics.add(name="system.cpu.utilization", unit="1")
    t = time.time_ns()
    template = metrics_pb2.NumberDataPoint(time_unix_nano=t, as_double=0.5)
    chunk = max(1, (n_bytes - request.ByteSize()) // (template.ByteSize() + 2) // 8)
    while True:
        points = metric.gauge.data_points
        for i in range(chunk):
            points.add(time_unix_nano=t + len(points) + i, as_double=0.5)
        size = request.ByteSize()
        if size >= n_bytes:
            del points[len(points) - (size - n_bytes) // (template.ByteSize() + 2) - 1 :]
            return request
        chunk = max(1, (n_bytes - size) // (template.ByteSize() + 2))


# The bridge's ingest credential in tests: a token allowed into every trial (the
# operator's collector), unless a test gives a narrower one.
BRIDGE_TOKEN = "test-ingest-token-everything-0123456789"
OTLP_HEADERS_ENV = f"authorization=Bearer%20{BRIDGE_TOKEN}"  # OTEL_EXPORTER_OTLP_HEADERS


def bridge_tokens(lines: Iterable[str] = (f"{BRIDGE_TOKEN} *",)) -> IngestTokens:
    """Ingest tokens from token-file lines (`TOKEN scope...`), as the bridge reads them."""
    scopes = {}
    for line in lines:
        token, *words = line.split()
        scopes[token] = Scope.parse(words, "test")
    return IngestTokens(scopes)


def write_token_file(path: Path, lines: Iterable[str] = (f"{BRIDGE_TOKEN} *",)) -> Path:
    """A token file readable by its owner only (the bridge refuses any other)."""
    path.write_text("".join(f"{line}\n" for line in lines))
    path.chmod(0o600)
    return path


class OtlpClient:
    """A plain OTLP gRPC client (the stubs from opentelemetry-proto) with a bearer token."""

    def __init__(
        self, port: int, token: str | None = BRIDGE_TOKEN, channel: grpc.Channel | None = None
    ) -> None:
        self.channel = channel or grpc.insecure_channel(f"127.0.0.1:{port}")
        self.metrics = metrics_service_pb2_grpc.MetricsServiceStub(self.channel)
        self.traces = trace_service_pb2_grpc.TraceServiceStub(self.channel)
        self.metadata = None if token is None else (("authorization", f"Bearer {token}"),)

    def send_metrics(self, request: Any, timeout: float = 5.0) -> Any:
        return self.metrics.Export(request, timeout=timeout, metadata=self.metadata)

    def send_traces(self, request: Any, timeout: float = 5.0) -> Any:
        return self.traces.Export(request, timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class BridgeProcess:
    """`otelprof determined-bridge` as a child process on a fixed port."""

    def __init__(
        self,
        master_url: str,
        token_file: Path,
        spool: Path,
        log: Path,
        window_s: float = 0.5,
        tokens: Iterable[str] = (f"{BRIDGE_TOKEN} *",),
        args: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.log = log
        self.argv = [
            sys.executable, "-m", "otelprof", "determined-bridge",
            "--listen", f"127.0.0.1:{self.port}", "--master", master_url,
            "--token-file", str(token_file), "--spool-dir", str(spool),
            "--ingest-tokens", str(write_token_file(spool.parent / "ingest-tokens", tokens)),
            "--report-interval", str(window_s), "--retry-max-delay", "1",
            "--log-level", "INFO", *args,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        self.starts += 1
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if b"listening on port" in self.log.read_bytes()[offset:]:
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"bridge did not start:\n{self.log.read_text()[-3000:]}")

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(20)
