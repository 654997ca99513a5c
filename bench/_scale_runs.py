"""Many ranks' one-hour detached runs, derived from one real short run (for scale_report.py).

A real run is a few minutes of a real job (tests/ddp_job.py under torchrun, default
settings). One hour of a rank is built from it as a real hour looks at default settings:

- traces: the run's start as written (the traces of its first tenth, at most 5,000 spans:
  head sampling keeps more of a run's first steps), then the steady part tiled over the
  hour: the steps the budget keeps (head and tail samples, captures) at the rate the real
  run kept them, and at most one anomaly per
  minute (a loaded machine fires the anomaly rule far more often than a healthy job; each
  one is kept whatever the budget, so a burst of them is not what an hour looks like);
- metrics: the real lines (hardware gauges every interval, the timing histograms every
  30 s) tiled over the hour, cumulative points (histograms, monotonic sums) growing tile by
  tile as a longer run's do; the run's closing record at the end.

Every tile gets fresh trace and span ids and step numbers that go on counting. Rank
identity (rank, local rank, world size, host, pid, run id) is a placeholder in one template
per source rank, so writing a rank's files is a few byte replacements: a source rank with
host metrics (local rank 0) stands for each node's local rank 0, the other for the rest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOUR_S = 3600.0
RANKS_PER_NODE = 8
_STEADY_AFTER_SPANS = 5_000  # the run's start as written: at most its first 5,000 spans
_ANOMALY_EVERY_S = 60.0
_SPANS_PER_LINE = 512  # the span exporter's batch

_PLACEHOLDERS = {
    "service.instance.id": ("stringValue", "@@SID@@"),
    "host.name": ("stringValue", "@@HOST@@"),
    "process.pid": ("intValue", "@@PID@@"),
    "otelprof.run_id": ("stringValue", "@@RUN@@"),
    "otelprof.rank": ("intValue", "@@RANK@@"),
    "otelprof.local_rank": ("intValue", "@@LRANK@@"),
    "otelprof.world_size": ("intValue", "@@WS@@"),
}
_CLOSING = "otelprof.run.end"  # otelprof._schema.CLOSING_RECORD
_ID_MARK = "QQQQ"  # first 4 characters of every id, replaced by the rank in hex


def _lines(path: Path) -> list[dict[str, Any]]:
    with path.open("rb") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _template_resource(resource: dict[str, Any]) -> dict[str, Any]:
    out = []
    for item in resource.get("attributes", []):
        if item["key"] in _PLACEHOLDERS:
            kind, mark = _PLACEHOLDERS[item["key"]]
            item = {"key": item["key"], "value": {kind: mark}}
        out.append(item)
    return {"attributes": out}


def _attr(span: dict[str, Any], key: str) -> Any:
    for item in span.get("attributes") or ():
        if item["key"] == key:
            return next(iter(item["value"].values()))
    return None


def _set_attr(span: dict[str, Any], key: str, kind: str, value: Any) -> None:
    for item in span.get("attributes") or ():
        if item["key"] == key:
            item["value"] = {kind: value}


@dataclass
class _Ids:
    """Fresh ids per tile: same length as real ones, rank placeholder first."""

    spans: int = 0
    traces: int = 0

    def new_maps(self) -> tuple[dict[str, str], dict[str, str]]:
        return {}, {}

    def span(self, table: dict[str, str], old: str) -> str:
        if old not in table:
            self.spans += 1
            table[old] = f"{_ID_MARK}{self.spans:012x}"
        return table[old]

    def trace(self, table: dict[str, str], old: str) -> str:
        if old not in table:
            self.traces += 1
            table[old] = f"{_ID_MARK}{self.traces:028x}"
        return table[old]


def _trace_template(path: Path, hour_s: float) -> tuple[bytes, dict[str, int]]:
    lines = _lines(path)
    resource = _template_resource(lines[0]["resourceSpans"][0]["resource"])
    scope = lines[0]["resourceSpans"][0]["scopeSpans"][0]["scope"]
    spans = [
        s
        for line in lines
        for rs in line["resourceSpans"]
        for ss in rs["scopeSpans"]
        for s in ss["spans"]
    ]
    traces: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        traces.setdefault(span["traceId"], []).append(span)
    order = sorted(traces.values(), key=lambda t: min(int(s["startTimeUnixNano"]) for s in t))
    t0 = int(min(int(s["startTimeUnixNano"]) for s in spans))
    # the run's start as written: its first spans, at most a tenth of the source run
    head_ns = (max(int(s["endTimeUnixNano"]) for s in spans) - t0) // 10
    head: list[list[dict[str, Any]]] = []

    def span_start(trace: list[dict[str, Any]]) -> int:
        return min(int(s["startTimeUnixNano"]) for s in trace)

    steady: list[list[dict[str, Any]]] = []
    ending: list[list[dict[str, Any]]] = []
    seen = 0
    last_anomaly = -1e18
    for trace in order:
        step = next((s for s in trace if s["name"] == "step"), None)
        if step is None:
            ending.append(trace)  # end-of-run spans (barrier, after_training)
            continue
        if seen < _STEADY_AFTER_SPANS and span_start(trace) - t0 < head_ns:
            head.append(trace)
            seen += len(trace)
            continue
        if _attr(step, "otelprof.sampled") == "anomaly":
            start_s = int(step["startTimeUnixNano"]) / 1e9
            if start_s - last_anomaly < _ANOMALY_EVERY_S:
                continue
            last_anomaly = start_s
        steady.append(trace)
    if not steady:
        raise SystemExit(f"{path}: the run is too short to have a steady part; run it longer")

    def step_no(trace: list[dict[str, Any]]) -> int:
        return int(_attr(next(s for s in trace if s["name"] == "step"), "otelprof.step"))

    s_start = span_start(steady[0])
    s_end = max(int(s["endTimeUnixNano"]) for t in steady for s in t)
    period = s_end - s_start + 1
    first_step = min(step_no(t) for t in steady)
    step_period = max(step_no(t) for t in steady) - first_step + 1
    ids = _Ids()
    out: list[dict[str, Any]] = []
    kept = 0

    def emit(trace: list[dict[str, Any]], shift_ns: int, step_shift: int) -> None:
        span_ids, trace_ids = ids.new_maps()
        for span in trace:
            new = json.loads(json.dumps(span))
            new["traceId"] = ids.trace(trace_ids, span["traceId"])
            new["spanId"] = ids.span(span_ids, span["spanId"])
            if span.get("parentSpanId"):
                new["parentSpanId"] = ids.span(span_ids, span["parentSpanId"])
            for link in new.get("links") or ():
                link["traceId"] = ids.trace(trace_ids, link["traceId"])
                link["spanId"] = ids.span(span_ids, link["spanId"])
            for key in ("startTimeUnixNano", "endTimeUnixNano"):
                new[key] = str(int(span[key]) + shift_ns)
            for event in new.get("events") or ():
                event["timeUnixNano"] = str(int(event["timeUnixNano"]) + shift_ns)
            number = _attr(span, "otelprof.step")
            if number is not None and step_shift:
                _set_attr(new, "otelprof.step", "intValue", str(int(number) + step_shift))
            out.append(new)

    for trace in head:
        emit(trace, 0, 0)
    end_ns = t0 + int(hour_s * 1e9)
    tile = 0
    while s_start + tile * period < end_ns:
        for trace in steady:
            shift = tile * period
            if span_start(trace) + shift >= end_ns:
                break
            emit(trace, shift, tile * step_period)
        tile += 1
    last_end = max(int(s["endTimeUnixNano"]) for s in out)
    for trace in ending:
        emit(trace, last_end - span_start(trace) + 1_000_000, 0)
    kept = len(out)
    out.sort(key=lambda s: int(s["endTimeUnixNano"]))  # exporters write spans as they end
    body = bytearray()
    for i in range(0, len(out), _SPANS_PER_LINE):
        line = {
            "resourceSpans": [
                {
                    "resource": resource,
                    "scopeSpans": [{"scope": scope, "spans": out[i : i + _SPANS_PER_LINE]}],
                }
            ]
        }
        body += json.dumps(line, separators=(",", ":")).encode() + b"\n"
    return bytes(body), {"spans": kept, "tiles": tile, "head_spans": seen}


def _points(metric: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    for kind in ("gauge", "sum", "histogram"):
        if kind in metric:
            return kind, metric[kind].get("dataPoints") or []
    return "", []


def _series_key(metric: dict[str, Any], dp: dict[str, Any]) -> str:
    return metric["name"] + json.dumps(dp.get("attributes") or [], sort_keys=True)


def _metrics_template(path: Path, hour_s: float) -> tuple[bytes, dict[str, int]]:
    lines = _lines(path)
    closing = [ln for ln in lines if _CLOSING in json.dumps(ln)]
    body_lines = [ln for ln in lines if ln not in closing]

    def line_times(line: dict[str, Any]) -> list[int]:
        return [
            int(dp["timeUnixNano"])
            for rm in line["resourceMetrics"]
            for sm in rm["scopeMetrics"]
            for m in sm["metrics"]
            for dp in _points(m)[1]
        ]

    first = min(min(line_times(ln)) for ln in body_lines)
    last = max(max(line_times(ln)) for ln in body_lines)
    interval = 5_000_000_000  # the span of one line (the exporter's 5 s batch)
    period = last - first + interval
    # the end value of every cumulative series: each tile starts where the last one ended
    end_values: dict[str, dict[str, Any]] = {}
    for line in body_lines:
        for rm in line["resourceMetrics"]:
            for sm in rm["scopeMetrics"]:
                for m in sm["metrics"]:
                    kind, dps = _points(m)
                    cumulative = kind == "histogram" or (
                        kind == "sum" and m["sum"].get("isMonotonic")
                    )
                    for dp in dps if cumulative else ():
                        end_values[_series_key(m, dp)] = dp
    out = bytearray()
    end_ns = first + int(hour_s * 1e9)
    tile = 0
    lines_out = 0
    while first + tile * period < end_ns:
        for line in body_lines:
            if min(line_times(line)) + tile * period >= end_ns:
                break
            new = json.loads(json.dumps(line))
            for rm in new["resourceMetrics"]:
                rm["resource"] = _template_resource(rm["resource"])
                for sm in rm["scopeMetrics"]:
                    for m in sm["metrics"]:
                        kind, dps = _points(m)
                        cumulative = kind == "histogram" or (
                            kind == "sum" and m["sum"].get("isMonotonic")
                        )
                        for dp in dps:
                            dp["timeUnixNano"] = str(int(dp["timeUnixNano"]) + tile * period)
                            if not cumulative:
                                if "startTimeUnixNano" in dp:
                                    start = int(dp["startTimeUnixNano"]) + tile * period
                                    dp["startTimeUnixNano"] = str(start)
                                continue
                            _grow(dp, end_values[_series_key(m, dp)], tile)
            out += json.dumps(new, separators=(",", ":")).encode() + b"\n"
            lines_out += 1
        tile += 1
    for line in closing:
        new = json.loads(json.dumps(line))
        for rm in new["resourceMetrics"]:
            rm["resource"] = _template_resource(rm["resource"])
            for sm in rm["scopeMetrics"]:
                for m in sm["metrics"]:
                    for dp in _points(m)[1]:
                        dp["timeUnixNano"] = str(int(dp["timeUnixNano"]) + (tile - 1) * period)
        out += json.dumps(new, separators=(",", ":")).encode() + b"\n"
    return bytes(out), {"lines": lines_out + len(closing), "tiles": tile}


def _grow(dp: dict[str, Any], end: dict[str, Any], tiles: int) -> None:
    """A cumulative point `tiles` source-runs later: the end values added `tiles` times."""
    if not tiles:
        return
    if "bucketCounts" in dp:
        dp["count"] = str(int(dp.get("count", 0)) + tiles * int(end.get("count", 0)))
        dp["sum"] = float(dp.get("sum", 0.0)) + tiles * float(end.get("sum", 0.0))
        dp["bucketCounts"] = [
            str(int(c) + tiles * int(e))
            for c, e in zip(dp["bucketCounts"], end["bucketCounts"], strict=True)
        ]
    elif "asInt" in dp:
        dp["asInt"] = str(int(dp["asInt"]) + tiles * int(end["asInt"]))
    elif "asDouble" in dp:
        dp["asDouble"] = float(dp["asDouble"]) + tiles * float(end["asDouble"])


@dataclass
class RankTemplate:
    """One source rank's hour, with placeholders for the rank's identity."""

    traces: bytes
    metrics: bytes
    run_info: dict[str, Any]
    facts: dict[str, int]
    hour_s: float


def build_templates(source_run: Path, hour_s: float = HOUR_S) -> dict[bool, RankTemplate]:
    """{has host metrics: template} from a real run directory with ranks 0 and 1."""
    out: dict[bool, RankTemplate] = {}
    for rank in (0, 1):
        traces, tfacts = _trace_template(source_run / f"traces.rank{rank}.jsonl", hour_s)
        metrics, mfacts = _metrics_template(source_run / f"metrics.rank{rank}.jsonl", hour_s)
        info = json.loads((source_run / f"run.rank{rank}.json").read_text())
        facts = {f"trace_{k}": v for k, v in tfacts.items()}
        facts.update({f"metrics_{k}": v for k, v in mfacts.items()})
        out[rank == 0] = RankTemplate(traces, metrics, info, facts, hour_s)
    return out


def _identity(rank: int, world: int, run_id: str) -> dict[str, str]:
    node, local = divmod(rank, RANKS_PER_NODE)
    host = f"node{node:04d}"
    pid = 10_000 + local
    return {
        "@@SID@@": f"{host}:{pid}",
        "@@HOST@@": host,
        "@@PID@@": str(pid),
        "@@RUN@@": run_id,
        "@@RANK@@": str(rank),
        "@@LRANK@@": str(local),
        "@@WS@@": str(world),
        _ID_MARK: f"{rank:04x}",
    }


def _fill(template: bytes, identity: dict[str, str]) -> bytes:
    for mark, value in identity.items():
        template = template.replace(mark.encode(), value.encode())
    return template


def write_ranks(
    templates: dict[bool, RankTemplate],
    run_dir: Path,
    world: int,
    run_id: str,
    jobs: int = 1,
) -> Iterator[int]:
    """Write every rank's files into one shared run directory; yields bytes per rank.

    `jobs` > 1 writes in that many forked processes (each rank's files are independent; the
    templates are shared by fork, not copied): generation is CPU-bound byte replacement and,
    on a compressing file system, the kernel's compression, so it scales with cores."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if jobs > 1 and world > 1:
        import multiprocessing

        global _FORKED  # handed to forked workers by fork, never pickled
        _FORKED = (templates, run_dir, world, run_id)
        try:
            with multiprocessing.get_context("fork").Pool(jobs) as pool:
                yield from pool.imap(_write_forked, range(world), chunksize=4)
        finally:
            _FORKED = None
        return
    for rank in range(world):
        yield _write_rank(templates, run_dir, world, run_id, rank)


_FORKED: tuple[dict[bool, RankTemplate], Path, int, str] | None = None


def _write_forked(rank: int) -> int:
    assert _FORKED is not None
    return _write_rank(*_FORKED, rank)


def _write_rank(
    templates: dict[bool, RankTemplate], run_dir: Path, world: int, run_id: str, rank: int
) -> int:
    template = templates[rank % RANKS_PER_NODE == 0]
    identity = _identity(rank, world, run_id)
    written = 0
    for kind, data in (("traces", template.traces), ("metrics", template.metrics)):
        path = run_dir / f"{kind}.rank{rank}.jsonl"
        filled = _fill(data, identity)
        with path.open("wb") as handle:
            handle.write(filled)
        written += len(filled)
    info = json.loads(_fill(json.dumps(template.run_info).encode(), identity))
    info["run_id"] = run_id
    info["resource"].update(
        {
            "otelprof.rank": rank,
            "otelprof.local_rank": rank % RANKS_PER_NODE,
            "otelprof.world_size": world,
            "host.name": identity["@@HOST@@"],
            "process.pid": int(identity["@@PID@@"]),
            "service.instance.id": identity["@@SID@@"],
            "otelprof.run_id": run_id,
        }
    )
    info["files"] = {
        "metrics": f"metrics.rank{rank}.jsonl",
        "traces": f"traces.rank{rank}.jsonl",
    }
    (run_dir / f"run.rank{rank}.json").write_text(json.dumps(info, indent=2))
    started = int(info.get("started_unix_nano", 0))
    if started:
        info["finished_unix_nano"] = started + int(templates[True].hour_s * 1e9)
    return written


def record_source_run(out: Path, steps: int = 12_000) -> Path:
    """The real short run: tests/ddp_job.py under torchrun, 2 ranks, gloo on CPU, default
    settings, detached (about 1.5 minutes); returns its run directory."""
    import socket
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTELPROF_", "OTEL_"))}
    env.update(OTELPROF_OUTPUT_DIR=str(out), PYTHONPATH=str(repo), GLOO_SOCKET_IFNAME="lo")
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={port}",
         str(repo / "tests" / "ddp_job.py"), "--steps", str(steps)],
        env=env, check=True, timeout=1800, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    [run] = [p for p in out.iterdir() if p.is_dir()]
    return run
