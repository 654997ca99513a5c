"""Counting wrappers around SDK exporters, so drops and failures are visible, never silent.

The SDK's batch processor and periodic reader already keep exporting off the training
thread; these wrappers add what they do not give us: per-exporter counts of what was
exported, what failed, and what the span queue dropped, and a guarantee that an exporter
raising never propagates (the SDK logs it, we also count it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from otelprof._otel_compat import count_span_queue_drops
from otelprof._schema import is_loss as is_loss  # the rule, shared with the report
from otelprof.export._outage import OutageLog
from otelprof.system._stamps import apply_read_times

_log = logging.getLogger("otelprof.export")


class ExportCounters:
    """Thread-safe named counters, grouped by exporter name (`otlp.spans_exported`, ...)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = defaultdict(int)
        self._warned: set[str] = set()
        self._sources: list[Callable[[], dict[str, int]]] = []
        self._metric_extras: list[Callable[[str, MetricsData], MetricsData]] = []

    def add(self, key: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[key] += amount

    def add_source(self, source: Callable[[], dict[str, int]]) -> None:
        """Counts an exporter keeps itself (e.g. Determined deliveries), read at snapshot."""
        with self._lock:
            self._sources.append(source)

    def add_metric_extra(self, extra: Callable[[str, MetricsData], MetricsData]) -> None:
        """Data merged into every metrics export, per exporter name (timing histograms)."""
        with self._lock:
            self._metric_extras.append(extra)

    def merge_metric_extras(self, exporter: str, data: MetricsData) -> MetricsData:
        with self._lock:
            extras = list(self._metric_extras)
        for extra in extras:
            try:
                data = extra(exporter, data)
            except Exception as error:  # never lose the SDK's own points over ours
                _log.debug("otelprof: merging extra metrics raised %r", error)
        return data

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self._counts)
            sources = list(self._sources)
        for source in sources:
            try:
                counts.update(source())
            except Exception as error:  # a stats bug must not break stats()
                _log.debug("otelprof: a stats source raised %r", error)
        return counts

    def warn_once(self, key: str, message: str, *args: Any) -> None:
        """Log a failure the first time it happens for `key`; later ones are only counted."""
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        _log.warning(message, *args)


class ExportDropped(Exception):
    """Raised by an inner metric exporter that refused a whole export on purpose (a size
    cap): `CountingMetricExporter` counts its points as `<name>.metric_points_dropped_<reason>`
    and its exports as `<name>.metric_exports_<reason>` (not a loss key, so `dropped_total`
    stays a count of points), and logs `message` once, instead of reporting a failure."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def count_points(data: MetricsData) -> int:
    """Data points in an export (what the point counters count)."""
    return sum(
        len(getattr(metric.data, "data_points", ()))
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
    )


class _Counting:
    """Shared by the counting exporters: each export's outcome counted, failures logged
    (once per outage with an `OutageLog`, else the first one), and the inner exporter shut
    down once, on demand.

    `abandon()` is called when shutdown runs out of time: it interrupts an export that is
    still retrying (the OTLP exporters stop backing off when shut down) and makes every later
    export fail fast, counted, so flushing a dead collector cannot hold the job hostage.
    """

    kind: str  # "span" or "metric": what the logs name
    items: str  # what the counts count: "spans" or "metric_points"

    def __init__(
        self, name: str, inner: Any, counters: ExportCounters, outage: OutageLog | None = None
    ) -> None:
        self.name = name
        self._inner = inner
        self._counters = counters
        self._outage = outage
        self._abandoned = False
        self._inner_shut = False
        self._shut_lock = threading.Lock()
        self._pid = os.getpid()

    @property
    def _forked(self) -> bool:
        """In a process forked from the one that made it (a DataLoader worker, which the SDK
        hands its readers' and processors' threads): it does nothing there, so no worker
        writes its own samples into the parent's files or exports under its identity."""
        return os.getpid() != self._pid

    def _failed(self, count: int) -> None:
        self._counters.add(f"{self.name}.{self.items}_failed", count)
        if self.kind == "metric":
            self._counters.add(f"{self.name}.metric_exports_failed")

    def _counted(self, export: Callable[[], Any], success: Any, count: int) -> bool:
        """Run the inner exporter's `export`, counting its `count` items as exported or
        failed: True if it succeeded. An exception is a failure (logged once), except
        `ExportDropped`, which the caller counts."""
        if self._abandoned:
            self._failed(count)
            return False
        try:
            ok = export() is success
        except ExportDropped:
            raise
        except Exception as error:  # an exporter bug must not kill the export thread
            self._counters.warn_once(
                f"{self.name}.{self.kind}_error",
                "otelprof: %s %s exporter raised %r",
                self.name,
                self.kind,
                error,
            )
            ok = False
        if ok:
            self._counters.add(f"{self.name}.{self.items}_exported", count)
            if self._outage is not None:
                self._outage.succeeded()
            return True
        self._failed(count)
        if self._outage is not None:
            self._outage.failed(self.items.replace("_", " "), count)
        else:
            self._counters.warn_once(
                f"{self.name}.{self.kind}_failure",
                "otelprof: %s %s export failed; %s are dropped and counted "
                "(see Profiler.stats()); further failures are not logged",
                self.name,
                self.kind,
                "spans" if self.kind == "span" else "points",
            )
        return False

    def force_flush(self, timeout_millis: float = 30_000) -> bool:
        if self._forked:
            return True
        try:
            return bool(self._inner.force_flush(timeout_millis=timeout_millis))
        except Exception:
            return False

    def _shutdown_inner_once(self, **kwargs: Any) -> None:
        with self._shut_lock:
            if self._inner_shut:
                return
            self._inner_shut = True
        try:
            self._inner.shutdown(**kwargs)
        except Exception as error:
            _log.warning("otelprof: %s exporter shutdown raised %r", self.name, error)

    def abandon(self) -> None:
        """Waits for nothing: the inner exporter is shut down on a thread of its own, since
        a file exporter's shutdown flushes and may block on the write that made shutdown
        give up (a frozen file system) or on the lock that write holds."""
        self._abandoned = True
        inner_abandon = getattr(self._inner, "abandon", None)
        if callable(inner_abandon):  # e.g. the Determined exporter: stop waiting for answers
            inner_abandon()
        stopper = threading.Thread(
            target=self._shutdown_inner_once, name=f"otelprof-abandon-{self.name}", daemon=True
        )
        with contextlib.suppress(RuntimeError):  # no threads at interpreter exit: flag alone
            stopper.start()


class CountingSpanExporter(_Counting, SpanExporter):
    """Delegates to `inner`, counting spans exported and spans lost to failed exports."""

    kind, items = "span", "spans"

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._forked:
            return SpanExportResult.SUCCESS
        if self._counted(lambda: self._inner.export(spans), SpanExportResult.SUCCESS, len(spans)):
            return SpanExportResult.SUCCESS
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        if not self._forked:
            self._shutdown_inner_once()


def preferences_of(inner: MetricExporter) -> dict[str, Any]:
    """What a wrapping exporter passes to `MetricExporter.__init__`: the temporality and
    aggregation the exporter it wraps asks for, so wrapping changes neither."""
    return {
        "preferred_temporality": inner._preferred_temporality,
        "preferred_aggregation": inner._preferred_aggregation,
    }


class CountingMetricExporter(_Counting, MetricExporter):
    """Delegates to `inner`, counting data points exported and lost (and failed exports);
    an `ExportDropped` counts as dropped for its reason instead."""

    kind, items = "metric", "metric_points"

    def __init__(
        self,
        name: str,
        inner: MetricExporter,
        counters: ExportCounters,
        outage: OutageLog | None = None,
    ) -> None:
        MetricExporter.__init__(self, **preferences_of(inner))
        _Counting.__init__(self, name, inner, counters, outage)

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        if self._forked:
            return MetricExportResult.SUCCESS
        metrics_data = self._counters.merge_metric_extras(self.name, metrics_data)
        points = count_points(metrics_data)

        def export() -> MetricExportResult:
            # system metrics: each point's time = its read, start = its window (see _stamps)
            data = apply_read_times(metrics_data)
            return self._inner.export(data, timeout_millis=timeout_millis, **kwargs)

        try:
            if self._counted(export, MetricExportResult.SUCCESS, points):
                return MetricExportResult.SUCCESS
        except ExportDropped as dropped:
            self._counters.add(f"{self.name}.metric_points_dropped_{dropped.reason}", points)
            self._counters.add(f"{self.name}.metric_exports_{dropped.reason}")
            self._counters.warn_once(f"{self.name}.{dropped.reason}", "%s", dropped.message)
        return MetricExportResult.FAILURE

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        if not self._forked:
            self._shutdown_inner_once(timeout_millis=timeout_millis, **kwargs)


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """The SDK's BatchSpanProcessor, with its queue-full drops counted per exporter."""

    def __init__(
        self, name: str, exporter: SpanExporter, counters: ExportCounters, **kwargs: Any
    ) -> None:
        super().__init__(exporter, **kwargs)

        def on_drop(count: int, reason: str) -> None:
            counters.add(f"{name}.spans_dropped_{reason}", count)

        count_span_queue_drops(self, on_drop)
