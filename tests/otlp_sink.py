"""A real OTLP gRPC server for tests: records every export request it receives.

It can also be told to answer UNAVAILABLE, to play a collector that is down or overloaded.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class OtlpSink(
    metrics_service_pb2_grpc.MetricsServiceServicer, trace_service_pb2_grpc.TraceServiceServicer
):
    def __init__(self) -> None:
        self.metric_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.trace_requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.refuse = False
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self._server)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpSink:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        if self.refuse:
            context.abort(grpc.StatusCode.UNAVAILABLE, "sink refusing on purpose")
        with self._lock:
            if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
                self.metric_requests.append(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()
            self.trace_requests.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    def metric_names(self) -> set[str]:
        with self._lock:
            return {
                m.name
                for req in self.metric_requests
                for rm in req.resource_metrics
                for sm in rm.scope_metrics
                for m in sm.metrics
            }

    def spans(self) -> list[Any]:
        with self._lock:
            return [
                span
                for req in self.trace_requests
                for rs in req.resource_spans
                for ss in rs.scope_spans
                for span in ss.spans
            ]

    def resources(self) -> list[dict[str, Any]]:
        with self._lock:
            out = []
            for req in self.metric_requests:
                for rm in req.resource_metrics:
                    out.append(
                        {
                            kv.key: getattr(kv.value, kv.value.WhichOneof("value"))
                            for kv in rm.resource.attributes
                        }
                    )
            return out

    def wait_for(self, predicate: Any, timeout_s: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.05)
        return bool(predicate())
