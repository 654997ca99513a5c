"""An OTLP JSON Lines reader written for the tests, independent of otelprof's own reader.

It checks the wire rules the collector's otlpjsonfile receiver relies on (one request
object per line, hex trace/span ids) while flattening the data for assertions.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def _attrs(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        value = item["value"]
        ((kind, raw),) = value.items() if value else (("stringValue", None),)
        if kind in ("intValue",):
            raw = int(raw)
        out[item["key"]] = raw
    return out


@dataclass
class Point:
    name: str
    unit: str
    value: float
    time_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    start_ns: int | None = None  # startTimeUnixNano (gauges: the window a rate averages)


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status_code: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _is_run_end(obj: dict[str, Any]) -> bool:
    """The metrics file's closing record: one gauge `otelprof.run.end` (the run's end)."""
    metrics = [
        m
        for rm in obj.get("resourceMetrics") or []
        for sm in rm.get("scopeMetrics") or []
        for m in sm.get("metrics") or []
    ]
    return len(metrics) == 1 and metrics[0].get("name") == "otelprof.run.end"


def read_lines(path: Path) -> list[dict[str, Any]]:
    """Every line must be one complete JSON object (`*.gz`: gzip'd, members of whole lines);
    the metrics file's closing record (the run's end) is checked and left out."""
    objects = []
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        assert isinstance(obj, dict), f"{path}:{number} is not a JSON object"
        if not _is_run_end(obj):
            objects.append(obj)
    return objects


def read_points(path: Path) -> list[Point]:
    points = []
    for request in read_lines(path):
        assert set(request) == {"resourceMetrics"}, f"not a metrics request: {list(request)}"
        for rm in request["resourceMetrics"]:
            resource = _attrs(rm.get("resource", {}).get("attributes"))
            for sm in rm.get("scopeMetrics", []):
                for metric in sm.get("metrics", []):
                    data = metric.get("gauge") or metric.get("sum")
                    if data is None:
                        continue
                    for dp in data.get("dataPoints", []):
                        raw = dp.get("asDouble", dp.get("asInt"))
                        points.append(
                            Point(
                                name=metric["name"],
                                unit=metric.get("unit", ""),
                                value=float(raw),
                                time_ns=int(dp["timeUnixNano"]),
                                attributes=_attrs(dp.get("attributes")),
                                resource=resource,
                                start_ns=(
                                    int(dp["startTimeUnixNano"])
                                    if "startTimeUnixNano" in dp
                                    else None
                                ),
                            )
                        )
    return points


def read_spans(path: Path) -> list[Span]:
    spans = []
    for request in read_lines(path):
        assert set(request) == {"resourceSpans"}, f"not a traces request: {list(request)}"
        for rs in request["resourceSpans"]:
            resource = _attrs(rs.get("resource", {}).get("attributes"))
            for ss in rs.get("scopeSpans", []):
                for s in ss.get("spans", []):
                    assert _HEX32.match(s["traceId"]), f"traceId not hex: {s['traceId']}"
                    assert _HEX16.match(s["spanId"]), f"spanId not hex: {s['spanId']}"
                    parent = s.get("parentSpanId", "")
                    assert parent == "" or _HEX16.match(parent), f"parent not hex: {parent}"
                    spans.append(
                        Span(
                            name=s["name"],
                            trace_id=s["traceId"],
                            span_id=s["spanId"],
                            parent_span_id=parent,
                            start_ns=int(s["startTimeUnixNano"]),
                            end_ns=int(s["endTimeUnixNano"]),
                            attributes=_attrs(s.get("attributes")),
                            resource=resource,
                            status_code=int(s.get("status", {}).get("code", 0) or 0),
                            events=s.get("events", []),
                        )
                    )
    return spans


def timing_histograms(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The last `otelprof.timing.duration` point (cumulative) per (timing, phase) of a
    metrics file; every one is in seconds."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for request in read_lines(path):
        for rm in request.get("resourceMetrics", []):
            for sm in rm.get("scopeMetrics", []):
                for metric in sm.get("metrics", []):
                    if metric["name"] != "otelprof.timing.duration":
                        continue
                    assert metric["unit"] == "s"
                    for dp in metric["histogram"]["dataPoints"]:
                        attrs = {a["key"]: a["value"]["stringValue"] for a in dp["attributes"]}
                        out[(attrs["otelprof.timing"], attrs["otelprof.phase"])] = dp
    return out
