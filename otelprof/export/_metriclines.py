"""The detached metrics file with a size cap: each export line is written whole or dropped.

Why: the SDK's `FileMetricExporter` appends one OTLP JSON line per export (every `interval`
seconds, for as long as the job runs) and has no bound, so a long job could fill its disk
with metrics alone. Rather than fork the SDK package, `MetricLineStream` is the text stream
it writes to: the exporter writes a whole line and flushes, and the flush either appends
that line (gzip'd as one member with `compress`) or, if it would take the file past
`max_bytes`, drops it. `CappedMetricExporter` turns a dropped line into `ExportDropped`,
which `CountingMetricExporter` counts as `<name>.metric_points_dropped_size_cap`, so the
drop shows in `prof.stats()`, the end-of-run warning and the report's problems. The file
keeps only whole lines, so it stays valid OTLP JSON Lines for `report`, `trace`, `replay`
and the collector's otlpjsonfile receiver; lines already written are never touched.
"""

from __future__ import annotations

import gzip
import threading
from pathlib import Path
from typing import IO, Any

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

from otelprof.export.counters import ExportDropped


class MetricLineStream:
    """A text stream that turns each flush into one whole write, or none past `max_bytes`.

    `max_bytes` counts bytes in the file (the compressed size with `compress`, like the trace
    file's cap), including what an earlier process appended to the same file. With
    `compress`, each flush is one gzip member, so a crash loses at most the member being
    written and every earlier line stays readable. `capped` counts the flushes dropped.
    """

    def __init__(self, path: Path, *, compress: bool = False, max_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._compress = compress
        self._buffer: list[str] = []
        self._raw: IO[bytes] | None = None
        self.bytes_written = 0
        self.capped = 0
        self.closed = False
        if not compress:
            self._file()  # a plain file exists from the start, as the SDK exporter made it

    def _file(self) -> IO[bytes]:
        if self._raw is None:
            self._raw = self.path.open("ab")
            self.bytes_written = self._raw.tell()
        return self._raw

    def write(self, text: str) -> int:
        self._buffer.append(text)
        return len(text)

    def flush(self) -> None:
        if not self._buffer or self.closed:
            return
        data = "".join(self._buffer).encode("utf-8")
        self._buffer = []
        if self._compress:
            data = gzip.compress(data, compresslevel=6)
        handle = self._file()
        if self.max_bytes is not None and self.bytes_written + len(data) > self.max_bytes:
            self.capped += 1
            return
        handle.write(data)
        handle.flush()
        self.bytes_written += len(data)

    def close(self) -> None:
        self.flush()
        self.closed = True
        if self._raw is not None:
            self._raw.close()
            self._raw = None


class CappedMetricExporter(MetricExporter):
    """Wraps the SDK's file exporter writing to a `MetricLineStream`; an export the cap
    refused raises `ExportDropped("size_cap")` for the counting wrapper to count."""

    def __init__(self, inner: MetricExporter, stream: MetricLineStream) -> None:
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self._inner = inner
        self.stream = stream
        self._lock = threading.Lock()

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        with self._lock:
            capped = self.stream.capped
            result = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
            if self.stream.capped != capped:
                raise ExportDropped(
                    "size_cap",
                    f"otelprof: {self.stream.path} reached its size cap "
                    f"({self.stream.max_bytes} bytes); later metric exports are dropped and "
                    "counted",
                )
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)
