"""Detached-mode span files without SDK objects: recorded ranges straight to OTLP JSON Lines.

Why: the SDK path (a ReadableSpan per range, a batch processor, a dict tree per span) costs
many times this path's background CPU, holding the GIL the training thread needs
(BENCHMARKS.md, "Helpers and ranges"). The builder hands each span's fields to
`encode_span` (one f-string, cached JSON for names and keys) and `SpanLineWriter` writes
them in batched lines: the same ExportTraceServiceRequest JSON the SDK exporter writes, so
every reader takes them unchanged. SDK spans reach the same file through
`SpanLineExporter`, so the file has one writer and whole lines.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otelprof._run.appendfile import GONE, WRITTEN, WholeRecordFile

_log = logging.getLogger("otelprof.export")

BATCH_SPANS = 512
"""Spans per OTLP request line at most: big enough to amortize the resource header, small
enough that a reader never holds a huge line."""
LINE_SECONDS = 5.0
"""Spans wait at most this long for a line to fill, so the resource header is a small share
of each line rather than of each builder drain's few spans."""

_key_cache: dict[str, str] = {}
_name_cache: dict[str, str] = {}
_text_cache: dict[str, str] = {}  # short string attribute values: phases, thread names
_MAX_CACHE = 8192
MAX_CACHED_TEXT = 64
"""Longer string values (exception messages and stack traces) are encoded every time: the
cache holds what repeats on every span, not one copy of each distinct error."""
MAX_HELD_BYTES = 4 << 20
"""Encoded spans held for a fuller line are written once they reach this many bytes, so a
span with large attributes cannot make the held line grow past it (memory is bounded in
bytes, not only in spans)."""
MAX_CACHED_KEY = 256
"""Names and keys longer than this are encoded every time: the caches stay bounded in bytes
(at most `_MAX_CACHE` entries of at most this many characters each)."""


def _json_str(text: str, cache: dict[str, str]) -> str:
    cached = cache.get(text)
    if cached is None:
        cached = json.dumps(text, ensure_ascii=False)
        if len(cache) < _MAX_CACHE and len(text) <= MAX_CACHED_KEY:
            cache[text] = cached
    return cached


def encode_value(value: Any) -> str:
    """One OTLP JSON AnyValue (int64 as a decimal string, as protobuf's JSON mapping says)."""
    if value is True or value is False:
        return '{"boolValue":true}' if value else '{"boolValue":false}'
    if isinstance(value, int):
        return f'{{"intValue":"{value}"}}'
    if isinstance(value, float):
        if math.isfinite(value):
            return f'{{"doubleValue":{value!r}}}'
        text = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        return f'{{"doubleValue":"{text}"}}'
    if isinstance(value, str):
        return f'{{"stringValue":{json.dumps(value, ensure_ascii=False)}}}'
    if isinstance(value, (list, tuple)):
        inner = ",".join(encode_value(v) for v in value)
        return f'{{"arrayValue":{{"values":[{inner}]}}}}'
    return f'{{"stringValue":{json.dumps(str(value), ensure_ascii=False)}}}'


def encode_attributes(attributes: Mapping[str, Any]) -> str:
    parts = []
    for key, value in attributes.items():
        if type(value) is int:  # the common cases, inlined: step and thread id ...
            parts.append(f'{{"key":{_json_str(key, _key_cache)},"value":{{"intValue":"{value}"}}}}')
        elif type(value) is str and len(value) <= MAX_CACHED_TEXT:  # ... phase, thread name
            text = _json_str(value, _text_cache)
            parts.append(f'{{"key":{_json_str(key, _key_cache)},"value":{{"stringValue":{text}}}}}')
        else:
            parts.append(f'{{"key":{_json_str(key, _key_cache)},"value":{encode_value(value)}}}')
    return ",".join(parts)


def encode_span(
    name: str,
    trace_id: int,
    span_id: int,
    parent_id: int,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, Any],
    error: tuple[str, str, str] | None = None,
    links: Sequence[tuple[int, int, Mapping[str, Any]]] = (),
) -> str:
    """One span (kind INTERNAL) as OTLP JSON, the same fields the SDK's exporter writes.

    `error` = (type, message, stack trace): status ERROR plus an `exception` event.
    `links` = (trace id, span id, attributes) of spans this one points at.
    """
    parent = f'"parentSpanId":"{parent_id:016x}",' if parent_id else ""
    tail = ',"status":{}'
    if error is not None:
        type_name, message, stack = error
        event_attrs = encode_attributes(
            {
                "exception.type": type_name,
                "exception.message": message,
                "exception.stacktrace": stack,
                "exception.escaped": "True",
            }
        )
        status = json.dumps(f"{type_name}: {message}", ensure_ascii=False)
        tail = (
            f',"events":[{{"timeUnixNano":"{end_ns}","name":"exception",'
            f'"attributes":[{event_attrs}]}}],"status":{{"message":{status},"code":2}}'
        )
    if links:
        encoded = ",".join(
            f'{{"traceId":"{t:032x}","spanId":"{s:016x}","attributes":[{encode_attributes(a)}]}}'
            for t, s, a in links
        )
        tail = f',"links":[{encoded}]' + tail
    return (
        f'{{"traceId":"{trace_id:032x}","spanId":"{span_id:016x}",{parent}"flags":256,'
        f'"name":{_json_str(name, _name_cache)},"kind":1,'
        f'"startTimeUnixNano":"{start_ns}","endTimeUnixNano":"{end_ns}",'
        f'"attributes":[{encode_attributes(attributes)}]{tail}}}'
    )


def encode_readable(span: ReadableSpan) -> str:
    """An SDK span (user code, Kineto ops) in the same encoding."""
    ctx = span.get_span_context()
    parent = span.parent.span_id if span.parent is not None else 0
    error = None
    status = span.status
    events = list(span.events)
    if status is not None and status.status_code.value == 2:
        exc = next((e for e in events if e.name == "exception"), None)
        attrs = dict(exc.attributes or {}) if exc is not None else {}
        error = (
            str(attrs.get("exception.type", "")),
            str(attrs.get("exception.message", status.description or "")),
            str(attrs.get("exception.stacktrace", "")),
        )
    links = [
        (link.context.trace_id, link.context.span_id, dict(link.attributes or {}))
        for link in span.links
    ]
    return encode_span(
        span.name,
        ctx.trace_id if ctx else 0,
        ctx.span_id if ctx else 0,
        parent,
        span.start_time or 0,
        span.end_time or 0,
        dict(span.attributes or {}),
        error,
        links,
    )


class SpanLineWriter:
    """Appends encoded spans to one OTLP JSON Lines file, whole lines only, thread-safe; also
    the span builder's frame sink (`_timings/_targets.py`).

    Holds at most `line_spans` spans, until that many wait or the oldest has waited
    `line_seconds` (checked at `write()` and `flush_due()`), so a SIGKILL loses at most that.
    `max_bytes` caps the file (compressed size with gzip, one member per line): a line past
    it is dropped, counted as `<name>.spans_dropped_size_cap`. Spans count as
    `<name>.spans_exported` once their line is written.
    """

    encode_span = staticmethod(encode_span)

    def __init__(
        self,
        path: Path,
        counters: Any,
        *,
        name: str = "files",
        compress: bool = False,
        max_bytes: int | None = None,
        line_spans: int = BATCH_SPANS,
        line_seconds: float = LINE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.name = name
        self._counters = counters
        self._compress = compress
        self._max_bytes = max_bytes
        self._line_spans = max(1, line_spans)
        self._line_seconds = line_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._out = WholeRecordFile(self.path)
        # the file and its descriptor from the start: a directory remounted read-only or
        # made unwritable later does not stop the lines (an error here is retried at the
        # first line, and counted there if it persists)
        with contextlib.suppress(OSError):
            self._out.open()
        self._headers: dict[tuple[int, int], str] = {}
        self._held: dict[tuple[int, int], tuple[Any, Any, list[str]]] = {}
        self._held_spans = 0
        self._held_since = 0.0
        self._held_bytes = 0
        self._closed = False
        self._abandoned = False
        self._writing = 0  # spans of the line being written now (see `abandon`)
        self._count_lock = threading.Lock()  # never held across I/O

    def _header(self, resource: Any, scope: Any) -> str:
        key = (id(resource), id(scope))
        header = self._headers.get(key)
        if header is None:
            attrs = encode_attributes(dict(getattr(resource, "attributes", {}) or {}))
            name = json.dumps(getattr(scope, "name", "") or "")
            version = getattr(scope, "version", None)
            if version:
                name += f',"version":{json.dumps(version)}'
            header = (
                f'{{"resourceSpans":[{{"resource":{{"attributes":[{attrs}]}},'
                f'"scopeSpans":[{{"scope":{{"name":{name}}},"spans":['
            )
            if len(self._headers) < 256:
                self._headers[key] = header
        return header

    def write(self, resource: Any, scope: Any, spans: Sequence[str]) -> bool:
        """Take `spans` (encoded) for the file; False if refused (the writer is closed).
        Losses after that (size cap, write errors) are counted when the line is written."""
        if not spans:
            return True
        key = (id(resource), id(scope))
        with self._lock:
            if self._closed:
                self._counters.add(f"{self.name}.spans_failed", len(spans))
                return False
            entry = self._held.setdefault(key, (resource, scope, []))
            now = self._clock()
            if not self._held_spans:
                self._held_since = now
            entry[2].extend(spans)
            self._held_spans += len(spans)
            self._held_bytes += sum(map(len, spans))
            if (
                self._held_spans >= self._line_spans
                or self._held_bytes >= MAX_HELD_BYTES
                or now - self._held_since >= self._line_seconds
            ):
                self._write_held()
        return True

    def flush_due(self) -> None:
        """Write the held spans if the oldest has waited `line_seconds` (a periodic tick)."""
        with self._lock:
            if self._held_spans and self._clock() - self._held_since >= self._line_seconds:
                self._write_held()

    def flush(self) -> None:
        """Write every held span now."""
        with self._lock:
            self._write_held()

    def _write_held(self) -> None:
        held, self._held = self._held, {}
        self._held_bytes = 0  # (`_held_spans` goes down line by line: see `abandon`)
        for resource, scope, spans in held.values():
            header = self._header(resource, scope)
            step = self._line_spans
            for i in range(0, len(spans), step):
                self._write_line(header, spans[i : i + step])

    def _write_line(self, header: str, spans: list[str]) -> None:
        with self._count_lock:
            if self._abandoned:  # shutdown gave up on this file: `abandon` counted these
                return
            self._held_spans -= len(spans)
            self._writing = len(spans)
        data = (header + ",".join(spans) + "]}]}]}\n").encode("utf-8")
        if self._compress:
            data = gzip.compress(data, compresslevel=6)
        if self._max_bytes is not None and self._out.size + len(data) > self._max_bytes:
            self._writing = 0
            self._counters.add(f"{self.name}.spans_dropped_size_cap", len(spans))
            self._counters.warn_once(
                f"{self.name}.size_cap",
                "otelprof: %s reached its size cap (%d bytes); later spans are dropped and counted",
                self.path,
                self._max_bytes,
            )
            return
        outcome = self._out.append(data)
        with self._count_lock:
            self._writing = 0
            if self._abandoned:
                return  # counted as dropped by `abandon()` meanwhile (a hung write)
        if outcome == WRITTEN:
            self._counters.add(f"{self.name}.spans_exported", len(spans))
            return
        lost = "spans_dropped_run_dir_gone" if outcome == GONE else "spans_failed"
        self._counters.add(f"{self.name}.{lost}", len(spans))
        message = self._out.loss_message(outcome, "spans")
        self._counters.warn_once(f"{self.name}.traces_{outcome}", "%s", message)

    def abandon(self) -> None:
        """Shutdown ran out of time (a hung file system): count the spans held and the
        line being written as dropped, and write nothing more. Without the writer's lock on
        purpose: the thread holding it may be the one stuck in a write."""
        with self._count_lock:
            if self._abandoned:
                return
            self._abandoned = True
            self._closed = True
            lost = self._held_spans + self._writing
        if lost:
            self._counters.add(f"{self.name}.spans_dropped_shutdown_timeout", lost)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._write_held()
            self._closed = True
            try:
                self._out.close()
            except OSError as error:
                _log.warning("otelprof: closing %s raised %r", self.path, error)


class SpanLineExporter(SpanExporter):
    """SDK spans (user code, Kineto) into a SpanLineWriter, so the file has one writer.

    Counting of exported spans is the writer's; this exporter reports success or failure
    to the SDK's batch processor only.
    """

    def __init__(self, writer: SpanLineWriter) -> None:
        self.writer = writer

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        groups: dict[tuple[int, int], tuple[Any, Any, list[str]]] = {}
        for span in spans:
            key = (id(span.resource), id(span.instrumentation_scope))
            group = groups.setdefault(key, (span.resource, span.instrumentation_scope, []))
            group[2].append(encode_readable(span))
        ok = True
        for resource, scope, encoded in groups.values():
            ok = self.writer.write(resource, scope, encoded) and ok
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        """The writer is closed by the pipeline (after the span builder's last write)."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Write the spans the writer holds (the builder's and this exporter's)."""
        self.writer.flush()
        return True
