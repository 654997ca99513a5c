"""Build the span processors and metric readers for the exporters the settings ask for.

Exporters compose: attached (OTLP gRPC to a collector), detached (OTLP JSON Lines files in
the run directory) and Determined can all be on at once. Each is wrapped so its failures
are counted (`ExportCounters`) and never reach training code.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.trace import SpanProcessor

from otelprof._otel_compat import otlp_log_destination, stop_reader_thread
from otelprof._run.appendfile import GONE, WRITE_ERROR, WRITTEN
from otelprof._run.layout import RunLayout
from otelprof.config import Settings
from otelprof.export._metricbatch import MetricLineBatcher, exports_per_line
from otelprof.export._metriclines import (
    SIZE_CAP,
    CappedMetricExporter,
    MetricLineStream,
    closing_line,
)
from otelprof.export._outage import OutageLog, quiet_sdk_logs
from otelprof.export._spanlines import SpanLineExporter, SpanLineWriter
from otelprof.export.counters import (
    CountingBatchSpanProcessor,
    CountingMetricExporter,
    CountingSpanExporter,
    ExportCounters,
)

_log = logging.getLogger("otelprof.export")

# Bounded queue between span creation and export; drops beyond it are counted.
SPAN_QUEUE_SIZE = 8192
# Small batches: encoding one holds the GIL, and a training thread that wants it back waits
# up to the switch interval; small ones keep those stalls short at the same OTLP throughput
# (BENCHMARKS.md, "OTLP export throughput").
SPAN_BATCH_SIZE = 128
SPAN_SCHEDULE_DELAY_MS = 1000
_SPAN_BATCHING: dict[str, Any] = {
    "max_queue_size": SPAN_QUEUE_SIZE,
    "max_export_batch_size": SPAN_BATCH_SIZE,
    "schedule_delay_millis": SPAN_SCHEDULE_DELAY_MS,
}


@dataclass
class ExportPipelines:
    """What the providers are built from, plus how to stop what the providers do not own."""

    span_processors: list[SpanProcessor] = field(default_factory=list)
    frame_sinks: dict[SpanProcessor, SpanLineWriter] = field(default_factory=dict)
    """processor -> the writer the span builder encodes recorded ranges into, for the
    processors that have one (the trace file)."""
    metric_readers: list[MetricReader] = field(default_factory=list)
    closers: list[Callable[[], None]] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)
    exporters: list[CountingSpanExporter | CountingMetricExporter] = field(default_factory=list)
    """Exporters to a peer (collector, Determined): what shutdown's watchdog abandons."""
    file_writers: list[SpanLineWriter | CountingMetricExporter] = field(default_factory=list)
    """The run's files: abandoned only when the flush itself is stuck, so a collector that
    is down never costs the metrics file its final export."""
    metrics_stream: MetricLineStream | None = None
    """The metrics file's stream (detached mode): its descriptor stays open after `close()`
    for the closing record (`end_files`)."""

    def abandon_exports(self) -> None:
        """Stop exports to a peer still retrying (shutdown's time is up); what they held is
        counted. The files keep being written."""
        for exporter in self.exporters:
            exporter.abandon()

    def abandon_files(self) -> None:
        """The flush is stuck (a hung file system): count what the file writers still hold
        as dropped and let them write nothing more."""
        for writer in self.file_writers:
            writer.abandon()

    def close(self) -> None:
        for closer in self.closers:
            try:
                closer()
            except Exception as error:
                _log.warning("otelprof: closing exporter resource raised %r", error)

    def end_files(
        self,
        resource: Mapping[str, Any] | None = None,
        end: Mapping[str, Any] | None = None,
        stats: Mapping[str, int] | None = None,
    ) -> bool:
        """The metrics file's closing record (the run's `end` and `stats`), written through
        the descriptor the writer holds since the run began (a remount read-only or a
        permission change since does not stop it), then the descriptor closed; False
        (logged, with the reason) if it could not be written. No `end`: just close it (the
        session ended for a new identity, not the run)."""
        stream = self.metrics_stream
        if stream is None:
            return False
        if end is None or resource is None or stats is None:
            stream.end(None)
            return False
        outcome = stream.end(closing_line(resource, end, stats))
        if outcome != WRITTEN:
            why = {
                SIZE_CAP: "it is at its size cap",
                GONE: "the file is gone (its run directory removed)",
                WRITE_ERROR: str(stream.file.last_error or "write error"),
            }.get(outcome, f"the file was {outcome} before")
            _log.warning(
                "otelprof: cannot write the closing record (the run's end and drop counts) "
                "to %s: %s",
                stream.path,
                why,
            )
        return outcome == WRITTEN


def _span_processor(
    pipelines: ExportPipelines,
    name: str,
    exporter: Any,
    counters: ExportCounters,
    outage: OutageLog | None = None,
) -> SpanProcessor:
    counting = CountingSpanExporter(name, exporter, counters, outage)
    pipelines.exporters.append(counting)
    return CountingBatchSpanProcessor(name, counting, counters, **_SPAN_BATCHING)


def _metric_reader(
    pipelines: ExportPipelines,
    name: str,
    exporter: Any,
    settings: Settings,
    counters: ExportCounters,
    outage: OutageLog | None = None,
) -> MetricReader:
    counting = CountingMetricExporter(name, exporter, counters, outage)
    (pipelines.file_writers if name == "files" else pipelines.exporters).append(counting)
    return PeriodicExportingMetricReader(
        counting,
        export_interval_millis=settings.interval_s * 1000,
        export_timeout_millis=settings.export_timeout_s * 1000,
    )


class _FileSpanProcessor(CountingBatchSpanProcessor):
    """The trace file's processor. Its writer is also the span builder's frame sink
    (recorded ranges skip the SDK: `ExportPipelines.frame_sinks`), and `force_flush()` also
    writes the spans the writer holds (the SDK's batch processor does not flush its
    exporter)."""

    def __init__(self, writer: SpanLineWriter, counters: ExportCounters) -> None:
        super().__init__("files", SpanLineExporter(writer), counters, **_SPAN_BATCHING)
        self._writer = writer

    def force_flush(self, timeout_millis: int | None = None) -> bool:
        ok = super().force_flush(timeout_millis)
        self._writer.flush()
        return ok


def _add_files(
    pipelines: ExportPipelines, settings: Settings, counters: ExportCounters, layout: RunLayout
) -> None:
    """The run's files, named by its layout (made and claimed before: otelprof/_run/)."""
    from opentelemetry.exporter.otlp.json.file import FileMetricExporter

    compress = layout.compress
    pipelines.files = layout.files
    stream = MetricLineStream(
        pipelines.files["metrics"], compress=compress, max_bytes=settings.max_metrics_bytes
    )
    pipelines.metrics_stream = stream
    capped = CappedMetricExporter(
        FileMetricExporter(stream=stream),  # type: ignore[call-overload]
        stream,
        counters,
        "files",
    )
    # several exports per line: the resource and metric descriptions once per line
    metric_exporter = MetricLineBatcher(
        capped, exports_per_line(settings.interval_s), counters, "files"
    )
    pipelines.closers.append(metric_exporter.close)
    pipelines.metric_readers.append(
        _metric_reader(pipelines, "files", metric_exporter, settings, counters)
    )
    if settings.timings:
        # one writer: the builder's frame sink, and SDK spans through the batch processor
        writer = SpanLineWriter(
            pipelines.files["traces"],
            counters,
            name="files",
            compress=compress,
            max_bytes=settings.max_trace_bytes,
        )
        processor = _FileSpanProcessor(writer, counters)
        pipelines.span_processors.append(processor)
        pipelines.frame_sinks[processor] = writer
        pipelines.file_writers.append(writer)
        # the writer holds spans for fuller lines; the metrics reader's tick (every
        # interval) writes them when due even if no new span comes
        metric_exporter.on_export.append(writer.flush_due)
        pipelines.closers.append(writer.close)


def _add_otlp(pipelines: ExportPipelines, settings: Settings, counters: ExportCounters) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    common: dict[str, Any] = {
        "endpoint": settings.endpoint,
        "insecure": settings.insecure,
        "headers": dict(settings.headers) or None,
        "timeout": settings.export_timeout_s,
    }
    metric_exporter = OTLPMetricExporter(**common)
    # one line per outage of the collector instead of the SDK's per export and retry
    destination = otlp_log_destination(metric_exporter) or str(settings.endpoint)
    outage = OutageLog("otlp", destination)
    pipelines.closers.append(quiet_sdk_logs(outage, destination))
    pipelines.metric_readers.append(
        _metric_reader(pipelines, "otlp", metric_exporter, settings, counters, outage)
    )
    if settings.timings:
        pipelines.span_processors.append(
            _span_processor(pipelines, "otlp", OTLPSpanExporter(**common), counters, outage)
        )


def _add_determined(
    pipelines: ExportPipelines, settings: Settings, counters: ExportCounters
) -> None:
    from otelprof.export.determined import REFUSED_FILE, DeterminedMetricExporter

    exporter = DeterminedMetricExporter.from_environment(
        export_timeout_s=settings.export_timeout_s,
        refused_path=str(settings.run_dir / REFUSED_FILE),  # the job's, not one process's
    )
    counters.add_source(exporter.pipeline.delivery_counts)
    pipelines.metric_readers.append(
        _metric_reader(pipelines, "determined", exporter, settings, counters)
    )
    if settings.timings:
        pipelines.span_processors.append(
            _span_processor(pipelines, "determined", exporter.span_exporter(), counters)
        )


def build_pipelines(
    settings: Settings,
    counters: ExportCounters,
    *,
    layout: RunLayout | None = None,
) -> ExportPipelines:
    """Create every exporter the settings enable; raises only on setup errors.
    `layout`: the run's files (detached mode), claimed by the caller."""
    pipelines = ExportPipelines()
    try:
        if settings.detached:
            if layout is None:
                raise ValueError("detached mode needs the run's layout")
            _add_files(pipelines, settings, counters, layout)
        if settings.endpoint:
            _add_otlp(pipelines, settings, counters)
        if settings.determined:
            _add_determined(pipelines, settings, counters)
    except Exception:
        for reader in pipelines.metric_readers:
            reader.shutdown()
        for processor in pipelines.span_processors:
            processor.shutdown()
        pipelines.close()
        raise
    _quiet_in_forked_children(pipelines)
    return pipelines


def _quiet_in_forked_children(pipelines: ExportPipelines) -> None:
    """A process forked from this one (a DataLoader worker under Linux's default `fork`)
    collects and exports nothing: the SDK restarts each periodic reader's thread in the
    child (its at-fork hook, registered with the reader, runs before this one), and this
    stops it again, so workers spend nothing on samples; the counting exporters export
    nothing from a child either (`counters._Counting._forked`). The worker's CPU and
    memory are in the host's metrics."""
    if not hasattr(os, "register_at_fork"):
        return
    owner = weakref.ref(pipelines)

    def after_in_child() -> None:
        current = owner()
        if current is not None:
            for reader in current.metric_readers:
                stop_reader_thread(reader)

    os.register_at_fork(after_in_child=after_in_child)
