"""The bridge's OTLP gRPC receiver (metrics and traces services of opentelemetry-proto).

Requests are parsed here rather than by grpcio so a malformed message is answered with
INVALID_ARGUMENT and a message naming the problem (grpcio's own deserializer failure is
an opaque INTERNAL). Data that cannot be tied to a trial is refused: the whole request
with INVALID_ARGUMENT when nothing in it maps, otherwise through OTLP partial success.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from otelprof.determined.mapping import Extracted
from otelprof.determined.pipeline import Pipeline

log = logging.getLogger("otelprof.determined")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def _service_name(module: Any, service: str) -> str:
    return str(module.DESCRIPTOR.services_by_name[service].full_name)


class MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """OTLP MetricsService.Export → pipeline."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def Export(self, request: bytes, context: grpc.ServicerContext) -> Any:
        message = _parse(metrics_service_pb2.ExportMetricsServiceRequest, request, context)
        extracted = _guard(lambda: self.pipeline.ingest_metrics(message), context)
        response = metrics_service_pb2.ExportMetricsServiceResponse()
        if extracted.rejected:
            _refuse_if_nothing_mapped(extracted, context, "data points")
            response.partial_success.rejected_data_points = extracted.rejected
            response.partial_success.error_message = "; ".join(extracted.errors)[:2000]
        return response


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """OTLP TraceService.Export → pipeline."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def Export(self, request: bytes, context: grpc.ServicerContext) -> Any:
        message = _parse(trace_service_pb2.ExportTraceServiceRequest, request, context)
        extracted = _guard(lambda: self.pipeline.ingest_traces(message), context)
        response = trace_service_pb2.ExportTraceServiceResponse()
        if extracted.rejected:
            _refuse_if_nothing_mapped(extracted, context, "spans")
            response.partial_success.rejected_spans = extracted.rejected
            response.partial_success.error_message = "; ".join(extracted.errors)[:2000]
        return response


def _parse(cls: Any, raw: bytes, context: grpc.ServicerContext) -> Any:
    try:
        return cls.FromString(raw)
    except (DecodeError, ValueError) as exc:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"malformed OTLP {cls.DESCRIPTOR.name} ({len(raw)} bytes): {exc}",
        )


def _guard(ingest: Callable[[], Extracted], context: grpc.ServicerContext) -> Extracted:
    try:
        return ingest()
    except Exception as exc:  # a mapping bug must not take the receiver down
        log.exception("could not map an OTLP request")
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"could not map request: {exc}")
        raise  # unreachable: abort raises


def _refuse_if_nothing_mapped(
    extracted: Extracted, context: grpc.ServicerContext, what: str
) -> None:
    if not extracted.gauges and not extracted.timings:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"refused {extracted.rejected} {what}: " + "; ".join(extracted.errors)[:2000],
        )


def _handler(service: str, export: Callable[..., Any], response_cls: Any) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        service,
        {
            "Export": grpc.unary_unary_rpc_method_handler(
                export,
                request_deserializer=None,  # raw bytes: parsed in _parse
                response_serializer=response_cls.SerializeToString,
            )
        },
    )


class BridgeServer:
    """A grpc.Server with both OTLP services bound to one listen address."""

    def __init__(
        self, pipeline: Pipeline, listen: str = "127.0.0.1:4327", workers: int = 8
    ) -> None:
        self.pipeline = pipeline
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="otelprof-otlp"),
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        self._server.add_generic_rpc_handlers(
            (
                _handler(
                    _service_name(metrics_service_pb2, "MetricsService"),
                    MetricsReceiver(pipeline).Export,
                    metrics_service_pb2.ExportMetricsServiceResponse,
                ),
                _handler(
                    _service_name(trace_service_pb2, "TraceService"),
                    TraceReceiver(pipeline).Export,
                    trace_service_pb2.ExportTraceServiceResponse,
                ),
            )
        )
        try:
            self.port = self._server.add_insecure_port(listen)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {listen}: {exc}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {listen} (address in use or invalid)")
        self.listen = listen

    def start(self) -> None:
        self.pipeline.start()
        self._server.start()
        log.info("Determined bridge receiving OTLP gRPC on port %d", self.port)

    def stop(self, grace_s: float = 2.0, drain_timeout_s: float = 5.0) -> None:
        """Stop accepting, finish in-flight calls, close the last window, drain delivery."""
        self._server.stop(grace_s).wait(grace_s + 1)
        self.pipeline.shutdown(drain_timeout_s)

    def wait(self) -> None:
        self._server.wait_for_termination()
