"""`otelprof replay`: send a detached run to a collector over OTLP gRPC, as it was recorded.

Each JSON line is already an OTLP export request: parsed into the protobuf message (hex ids
turned into the base64 proto3 JSON expects), merged with the next lines up to about
`batch_bytes`, sent with retries on transient errors. Timestamps and resources are kept
exactly, unless `shift_to_now` moves every timestamp so the run ends now
(docs/guide/detached-runs.md, "Prometheus and old samples").
"""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from otelprof._run.closing_record import is_closing_request
from otelprof.analysis.reader import MALFORMED, ReadStats, RunFiles, Warn, iter_lines, keyed

_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId"})
_TIME_KEYS = frozenset(
    {"startTimeUnixNano", "endTimeUnixNano", "timeUnixNano", "observedTimeUnixNano"}
)
_RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    }
)
_REQUESTS = {
    "traces": trace_service_pb2.ExportTraceServiceRequest,
    "metrics": metrics_service_pb2.ExportMetricsServiceRequest,
}
_STUBS: dict[str, Any] = {
    "traces": trace_service_pb2_grpc.TraceServiceStub,
    "metrics": metrics_service_pb2_grpc.MetricsServiceStub,
}
PROMETHEUS_HEAD_WINDOW_S = 3600.0  # Prometheus rejects samples older than ~1 h behind its head


class ReplayError(Exception):
    """Replay cannot proceed (collector unreachable, nothing to send)."""


@dataclass
class ReplayOptions:
    endpoint: str
    tls: bool = False
    shift_to_now: bool = False
    batch_bytes: int = 1 << 20
    retries: int = 5
    timeout_s: float = 10.0
    signals: str = "all"  # "all" | "traces" | "metrics"
    backoff_s: float = 0.5


@dataclass
class ReplayResult:
    lines: int = 0
    requests: int = 0
    spans: int = 0
    points: int = 0
    failed_requests: int = 0
    failed_spans: int = 0
    failed_points: int = 0
    rejected_spans: int = 0
    rejected_points: int = 0
    retries: int = 0
    skipped_lines: int = 0
    shift_ns: int = 0
    oldest_point_ns: int | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failed_requests == 0

    def describe(self) -> list[str]:
        out = [
            f"replayed {self.lines:,} lines in {self.requests:,} requests: "
            f"{self.spans:,} spans, {self.points:,} metric data points"
            + (f" ({self.retries} retries)" if self.retries else "")
        ]
        if self.shift_ns:
            out.append(f"timestamps shifted by {self.shift_ns / 1e9:+.3f} s so the run ends now")
        if self.rejected_spans or self.rejected_points:
            out.append(
                f"the collector rejected {self.rejected_spans:,} spans and "
                f"{self.rejected_points:,} data points (partial success)"
            )
        if self.failed_requests:
            out.append(
                f"FAILED: {self.failed_requests} requests ({self.failed_spans:,} spans, "
                f"{self.failed_points:,} data points) were not delivered: "
                + "; ".join(self.errors[:3])
            )
        if self.skipped_lines:
            out.append(f"{self.skipped_lines} bad lines skipped (see warnings)")
        if self.oldest_point_ns is not None and not self.shift_ns:
            age = time.time() - self.oldest_point_ns / 1e9
            if age > PROMETHEUS_HEAD_WINDOW_S:
                out.append(
                    f"note: the oldest metric point is {age / 3600:.1f} h old; Prometheus keeps "
                    "only the latest value per series from the collector's scrape endpoint and "
                    "refuses remote-written samples older than about 1 h behind its newest "
                    "sample unless out_of_order_time_window is set; use --shift-to-now to "
                    "see the run's time series in Prometheus"
                )
        return out


def _fix_ids(node: Any) -> None:
    """Hex ids (file format) to base64 (proto3 JSON), in place, at any depth."""
    for obj, key in keyed(node, _ID_KEYS):
        if isinstance(obj[key], str):
            obj[key] = base64.b64encode(bytes.fromhex(obj[key])).decode("ascii")


def _shift_times(node: Any, shift_ns: int) -> None:
    # startTimeUnixNano of cumulative metric points moves too (same key), keeping rates right
    for obj, key in keyed(node, _TIME_KEYS):
        if obj[key] not in (None, "0", 0):
            obj[key] = str(int(obj[key]) + shift_ns)


def _max_time(node: Any) -> int:
    best = 0
    for obj, key in keyed(node, _TIME_KEYS):
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            best = max(best, int(obj[key]))
    return best


def _count_spans(req: trace_service_pb2.ExportTraceServiceRequest) -> int:
    return sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)


def _data_points(req: metrics_service_pb2.ExportMetricsServiceRequest) -> Iterator[Any]:
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                if kind:
                    yield from getattr(m, kind).data_points


def _target(endpoint: str, tls: bool) -> tuple[str, bool]:
    """Accept host:port, http://host:port and https://host:port."""
    if endpoint.startswith("https://"):
        return endpoint[len("https://") :].rstrip("/"), True
    if endpoint.startswith("http://"):
        return endpoint[len("http://") :].rstrip("/"), tls
    return endpoint, tls


class _Sender:
    """One signal's batching and sending."""

    def __init__(
        self, kind: str, call: Callable[..., Any], options: ReplayOptions, result: ReplayResult
    ) -> None:
        self.kind = kind
        self.call = call
        self.options = options
        self.result = result
        self.request: Any = _REQUESTS[kind]()
        self.size = 0

    def add(self, message: Any) -> None:
        self.request.MergeFrom(message)  # one more line's resources
        self.size += message.ByteSize()
        if self.size >= self.options.batch_bytes:
            self.flush()

    def flush(self) -> None:
        request, self.request, self.size = self.request, _REQUESTS[self.kind](), 0
        traces = self.kind == "traces"
        items = _count_spans(request) if traces else sum(1 for _ in _data_points(request))
        if not items:
            return
        r = self.result
        if not traces:
            times = (dp.time_unix_nano for dp in _data_points(request))
            oldest = min((t for t in times if t), default=None)
            if oldest is not None and (r.oldest_point_ns is None or oldest < r.oldest_point_ns):
                r.oldest_point_ns = oldest
        delay = self.options.backoff_s
        for attempt in range(1, max(1, self.options.retries) + 1):
            try:
                response = self.call(request, timeout=self.options.timeout_s)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code in _RETRYABLE and attempt < self.options.retries:
                    r.retries += 1
                    time.sleep(delay)
                    delay = min(delay * 2, 10.0)
                    continue
                r.failed_requests += 1
                if traces:
                    r.failed_spans += items
                else:
                    r.failed_points += items
                details = exc.details() if hasattr(exc, "details") else str(exc)
                r.errors.append(f"{self.kind}: {code}: {details}")
                if r.requests == 0 and code == grpc.StatusCode.UNAVAILABLE:
                    raise ReplayError(
                        f"collector at {self.options.endpoint} is unavailable: {details}"
                    ) from exc
                return
            r.requests += 1
            partial = response.partial_success
            if traces:
                r.spans += items
                r.rejected_spans += partial.rejected_spans
            else:
                r.points += items
                r.rejected_points += partial.rejected_data_points
            if partial.error_message:
                r.errors.append(f"{self.kind}: partial success: {partial.error_message}")
            return


def replay(files: RunFiles, options: ReplayOptions, warn: Warn) -> ReplayResult:
    """Send every intact line of a run to the collector; return the counts."""
    result = ReplayResult()
    kinds = {"traces", "metrics"} if options.signals == "all" else {options.signals}
    if options.shift_to_now:
        newest = 0
        for line in iter_lines(files.jsonl, lambda _msg: None, ReadStats()):
            if line.kind in kinds:
                with contextlib.suppress(*MALFORMED):  # the sending pass names the line
                    newest = max(newest, _max_time(line.body))
        if newest:
            result.shift_ns = time.time_ns() - newest
    target, tls = _target(options.endpoint, options.tls)
    channel = (
        grpc.secure_channel(target, grpc.ssl_channel_credentials())
        if tls
        else grpc.insecure_channel(target)
    )
    try:
        try:
            grpc.channel_ready_future(channel).result(timeout=options.timeout_s)
        except grpc.FutureTimeoutError as exc:
            raise ReplayError(
                f"no OTLP gRPC server answered at {target} within {options.timeout_s:g} s"
            ) from exc
        senders = {
            kind: _Sender(kind, stub(channel).Export, options, result)
            for kind, stub in _STUBS.items()
        }
        stats = ReadStats()
        for line in iter_lines(files.jsonl, warn, stats):
            if line.kind not in kinds:
                continue
            if line.kind == "metrics" and is_closing_request(line.body):
                continue  # the run's end, which a live run never sends
            body = line.body
            try:
                _fix_ids(body)
                if result.shift_ns:
                    _shift_times(body, result.shift_ns)
                message = json_format.ParseDict(
                    body, _REQUESTS[line.kind](), ignore_unknown_fields=True
                )
            except (json_format.ParseError, *MALFORMED) as exc:
                result.skipped_lines += 1
                warn(f"{line.path}:{line.number}: not a valid OTLP request ({exc}); skipped")
                continue
            result.lines += 1
            senders[line.kind].add(message)
        for sender in senders.values():
            sender.flush()
        result.skipped_lines += stats.bad_lines
    finally:
        channel.close()
    if result.lines == 0 and result.skipped_lines == 0:
        raise ReplayError("the run holds no trace or metric lines to replay")
    return result
