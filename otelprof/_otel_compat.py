"""Every use of the OpenTelemetry Python packages' private parts, in one place.

otelprof pins the OpenTelemetry packages as a matched set (pyproject.toml); this module is
what an upgrade has to review. Each use names the version it was checked against and is
guarded: where the private part is gone, otelprof loses that one refinement (a log line
says so) instead of failing. Public APIs are used everywhere else (`Exemplar` from
`opentelemetry.sdk.metrics`, `TracerProvider(active_span_processor=)`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("otelprof")

CHECKED_SDK = "1.45"
"""The opentelemetry-sdk (and exporter 0.66b) version the uses below were checked against."""

GAUGE_ENCODERS = (
    ("opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder", "_encode_metric"),
    (
        "opentelemetry.exporter.otlp.json.common._internal.metrics_encoder",
        "_encode_gauge_data_point",
    ),
)
"""(module, function) of the OTLP encoders (protobuf, JSON) that drop a gauge point's start
time; `system/_gauge_start.py` wraps them. A module or function that is gone is skipped."""


class _DropCountingMetrics:
    """Stands in for the SDK's processor self-metrics to see its queue-full decisions."""

    def __init__(self, inner: Any, on_drop: Callable[[int, str], None]) -> None:
        self._inner = inner
        self._on_drop = on_drop

    def drop_items(self, count: int, error_type: str = "queue_full") -> None:
        self._on_drop(count, error_type)
        self._inner.drop_items(count, error_type)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._inner, attribute)


def count_span_queue_drops(processor: Any, on_drop: Callable[[int, str], None]) -> bool:
    """Call `on_drop(count, reason)` whenever a `BatchSpanProcessor` drops spans.

    The SDK reports its queue-full drops only to its optional self-metrics
    (`processor._batch_processor._metrics.drop_items`, SDK 1.45); they are intercepted
    there. False when this SDK has no such hook (drops then go uncounted)."""
    batch = getattr(processor, "_batch_processor", None)
    metrics = getattr(batch, "_metrics", None)
    if batch is None or not callable(getattr(metrics, "drop_items", None)):
        _log.info(
            "otelprof: this OpenTelemetry SDK (checked: %s) has no span-drop hook; "
            "queue-full drops are not counted",
            CHECKED_SDK,
        )
        return False
    batch._metrics = _DropCountingMetrics(metrics, on_drop)
    return True


OTLP_EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.grpc.exporter",)
"""Loggers of the OTLP gRPC exporter's per-export failure and retry records (checked:
exporter 1.45.1); `export/_outage.py` filters those about otelprof's destination. A logger
that moved only lets the SDK's lines through again."""


def otlp_log_destination(exporter: Any) -> str | None:
    """The destination as the OTLP gRPC exporter names it in its log records (its
    `_endpoint`: host:port, the scheme stripped; checked: 1.45.1); None when unknown."""
    destination = getattr(exporter, "_endpoint", None)
    return destination if isinstance(destination, str) and destination else None


def stop_reader_thread(reader: Any) -> bool:
    """End a PeriodicExportingMetricReader's collection thread without a last collection or
    export: set the event its loop waits on (`_shutdown_event`, SDK 1.45). Used in a forked
    child, where the SDK's own at-fork hook has just restarted that thread. False where the
    reader has no such event (another reader kind, or an SDK without it)."""
    event = getattr(reader, "_shutdown_event", None)
    if not isinstance(event, threading.Event):
        return False
    # The thread's loop ends with one last `collect()`, which would run every observable
    # callback in the child, and block for good on a lock another thread of the parent
    # held at the fork; this reader collects nothing any more.
    reader.collect = _collect_nothing
    event.set()
    return True


def _collect_nothing(timeout_millis: float = 0.0) -> None:
    """A stopped reader's `collect`: nothing is read and nothing exported."""
