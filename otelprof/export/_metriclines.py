"""The detached metrics file with a size cap: each export line is written whole or dropped.

Why: the SDK's `FileMetricExporter` has no bound, so a long job could fill its disk with
metrics. Rather than fork the SDK, `MetricLineStream` is the text stream it writes to: each
whole line's flush appends it (one gzip member with `compress`) or, past `max_bytes`, drops
it; `CappedMetricExporter` turns a drop into `ExportDropped`, counted as
`<name>.metric_points_dropped_size_cap`. Lines written are never touched, so the file stays
valid OTLP JSON Lines. The run's last export (the cumulative histograms the report reads)
matters most: periodic exports stop `reserve_bytes` short of the cap, and the newest refused
line is held and written at close if it fits (its points then count as exported).
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

from otelprof._run.appendfile import WRITTEN, WholeRecordFile
from otelprof._schema import ATTR_END, ATTR_STATS, CLOSING_RECORD
from otelprof.export._spanlines import encode_attributes
from otelprof.export.counters import ExportCounters, ExportDropped, count_points, preferences_of

MAX_RESERVE_BYTES = 16 << 20
SIZE_CAP = "size_cap"


def default_reserve(max_bytes: int | None) -> int:
    """Room kept for the run's final export: a quarter of the cap, at most 16 MiB."""
    return 0 if max_bytes is None else min(max_bytes // 4, MAX_RESERVE_BYTES)


class MetricLineStream:
    """A text stream that turns each flush into one whole write, or none past `max_bytes`.

    `max_bytes` counts bytes in the file (the compressed size with `compress`, like the trace
    file's cap), including what an earlier process appended to the same file. With
    `compress`, each flush is one gzip member, so a crash loses at most the member being
    written and every earlier line stays readable. `capped` counts the flushes dropped.
    Flushes stop `reserve_bytes` short of `max_bytes`; the newest dropped one is held and
    `close()` writes it if it fits under `max_bytes` (`held_written` then says so).
    """

    def __init__(
        self,
        path: Path,
        *,
        compress: bool = False,
        max_bytes: int | None = None,
        reserve_bytes: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.reserve_bytes = default_reserve(max_bytes) if reserve_bytes is None else reserve_bytes
        self._held: bytes | None = None
        self.held_written = False
        self._compress = compress
        self._buffer: list[str] = []
        self.file = WholeRecordFile(self.path)  # its size, last error and loss messages too
        self.capped = 0
        self.lost: str | None = None
        """Why the last flush wrote nothing (`write_error`, `run_dir_gone`), else None: a
        failed write leaves nothing of the line in the file (see `WholeRecordFile`)."""
        self.closed = False
        self._lock = threading.Lock()  # the closing record may come from another thread
        # The file exists, and its descriptor is held, from the start: the closing record is
        # written through it at the end, whatever happened to the directory's permissions or
        # mount meanwhile (a read-only remount).
        self.file.open()

    def write(self, text: str) -> int:
        self._buffer.append(text)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        if not self._buffer or self.closed:
            return
        data = "".join(self._buffer).encode("utf-8")
        self._buffer = []
        if self._compress:
            data = gzip.compress(data, compresslevel=6)
        self.lost = None
        if (
            self.max_bytes is not None
            and self.file.size + len(data) > self.max_bytes - self.reserve_bytes
        ):
            self.capped += 1
            self._held = data
            return
        self._held = None  # a newer line made it in (or was lost: it is newer still)
        outcome = self.file.append(data)
        if outcome != WRITTEN:
            self.lost = outcome

    def close(self) -> None:
        """No more exports: write what is buffered and the held line (if it fits). The
        descriptor stays open for the closing record (`end`)."""
        with self._lock:
            self._flush()
            held, self._held = self._held, None
            if (
                held is not None
                and not self.closed
                and self.max_bytes is not None
                and self.file.size + len(held) <= self.max_bytes
            ):
                self.held_written = self.file.append(held) == WRITTEN
            self.closed = True

    def end(self, closing: bytes | None) -> str:
        """Append the closing record `closing` (one whole line, gzip'd as its own member with
        `compress`; never past `max_bytes`), then close the file. Returns WRITTEN, or why
        not: `size_cap`, `write_error` (`file.last_error` says which), `run_dir_gone`, `closed`
        (ended before), `none` (no record given)."""
        with self._lock:
            if self.file.closed:
                return "closed"
            self.closed = True
            try:
                if closing is None:
                    return "none"
                data = gzip.compress(closing, compresslevel=6) if self._compress else closing
                if self.max_bytes is not None and self.file.size + len(data) > self.max_bytes:
                    return SIZE_CAP
                return self.file.append(data)
            finally:
                self.file.close()


def closing_line(
    resource: Mapping[str, Any], end: Mapping[str, Any], stats: Mapping[str, int]
) -> bytes:
    """The metrics file's closing record: the run's end and drop counts, in the data file.

    Why: when run.json's final rewrite fails (a read-only remount, a full disk), the report
    must still tell a clean close from a SIGKILL and show the drops. `shutdown()` appends
    this line after the last export, before run.json, through the descriptor held since the
    run began (`MetricLineStream.end`): a gauge `otelprof.run.end` = 1 whose point carries
    `otelprof.end` and `otelprof.stats` (JSON). Ordinary OTLP, whole or not at all, never
    past the cap; read by otelprof/_run/closing_record.py.
    """
    point_attrs = encode_attributes(
        {
            ATTR_END: json.dumps(dict(end), default=str, sort_keys=True),
            ATTR_STATS: json.dumps(dict(stats), sort_keys=True),
        }
    )
    metric = (
        f'{{"name":"{CLOSING_RECORD}","unit":"1","description":"The run ended: how, and what '
        f'telemetry it lost (written at shutdown)","gauge":{{"dataPoints":[{{"asInt":"1",'
        f'"timeUnixNano":"{time.time_ns()}","attributes":[{point_attrs}]}}]}}}}'
    )
    line = (
        f'{{"resourceMetrics":[{{"resource":{{"attributes":[{encode_attributes(resource)}]}},'
        f'"scopeMetrics":[{{"scope":{{"name":"otelprof"}},"metrics":[{metric}]}}]}}]}}\n'
    )
    return line.encode("utf-8")


class CappedMetricExporter(MetricExporter):
    """Wraps the SDK's file exporter writing to a `MetricLineStream`; an export the cap
    refused raises `ExportDropped("size_cap")` for the counting wrapper to count.
    `close()` closes the stream; if that wrote the held line, its points move from
    `<name>.metric_points_dropped_size_cap` to `<name>.metric_points_exported`."""

    def __init__(
        self,
        inner: MetricExporter,
        stream: MetricLineStream,
        counters: ExportCounters,
        name: str = "files",
    ) -> None:
        super().__init__(**preferences_of(inner))
        self._inner = inner
        self.stream = stream
        self._counters = counters
        self._name = name
        self._held_points = 0
        self._lock = threading.Lock()

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        with self._lock:
            capped = self.stream.capped
            result = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
            lost = self.stream.lost
            if lost is not None:
                self.stream.lost = None
                raise ExportDropped(lost, self.stream.file.loss_message(lost, "metric exports"))
            if self.stream.capped != capped:
                self._held_points = count_points(metrics_data)
                raise ExportDropped(
                    "size_cap",
                    f"otelprof: {self.stream.path} reached its size cap "
                    f"({self.stream.max_bytes} bytes, the last {self.stream.reserve_bytes} kept "
                    "for the run's final export); later metric exports are dropped and counted",
                )
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)

    def close(self) -> None:
        """Close the file, writing the held last export if it fits (see the module doc)."""
        with self._lock:
            self.stream.close()
            if self.stream.held_written:
                points, self._held_points = self._held_points, 0
                self._counters.add(f"{self._name}.metric_points_dropped_size_cap", -points)
                self._counters.add(f"{self._name}.metric_exports_size_cap", -1)
                self._counters.add(f"{self._name}.metric_points_exported", points)
