"""`otelprof trace`: a detached run as a Chrome / Perfetto trace (JSON trace event format).

Each process (rank) becomes a trace process, its spans complete ("X") slices and its
hardware gauges counter ("C") tracks, on one time axis (microseconds since the run's start).
Events are streamed out as they are read, so memory does not grow with the run's spans;
viewers sort events themselves. With several ranks, an "all ranks" process shows each step
of every rank side by side (ARCHITECTURE.md, "Step N of every rank in one trace"), one
small entry per kept step and rank, at most `MAX_STEP_GROUPS` steps (past that, left out and
counted in a warning).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from otelprof._schema import ATTR_STEP
from otelprof.analysis.reader import (
    DEFAULT_MAX_LINE,
    PointRec,
    ReadStats,
    Resource,
    RunFiles,
    SpanRec,
    Warn,
    attributes,
    bounded_lines,
    device_label,
    iter_records,
    keyed,
    open_lines,
)
from otelprof.analysis.trace_windows import TracePlan, plan_trace

SPAN_TID = 1
MAX_STEP_GROUPS = 1_000_000
"""Steps (traces with a root span) the "all ranks" process holds; ~200 bytes each."""
ALL_RANKS = "all ranks"
_TIME_KEYS = frozenset({"timeUnixNano", "startTimeUnixNano"})


@dataclass
class TraceResult:
    processes: int
    slices: int
    counters: int
    origin_ns: int
    steps: int = 0  # steps (and phase batches) in the "all ranks" process
    spans_read: int = 0
    bytes_read: int = 0
    total_bytes: int = 0
    sample: dict[str, Any] | None = None  # the time windows read, when a sample


def _first_timestamp(path: Path, max_line: int) -> int | None:
    """Smallest timestamp in the first intact line of a file (cheap: one line, and none over
    `max_line` held)."""
    try:
        with open_lines(path) as handle:
            for raw in bounded_lines(handle, max_line):
                if isinstance(raw, int):
                    continue  # too long: the reading pass names it
                found: list[int] = []
                try:
                    for obj, key in keyed(json.loads(raw), _TIME_KEYS):
                        # spans' starts, points' times; not metric start times (process start)
                        if key == "timeUnixNano" or "endTimeUnixNano" in obj:
                            with contextlib.suppress(TypeError, ValueError, OverflowError):
                                found.append(int(obj[key]))
                except (ValueError, RecursionError):
                    continue  # the reading pass names the damaged line
                return min(found) if found else None
    except (OSError, EOFError, zlib.error):
        return None
    return None


def time_origin(files: RunFiles, max_line: int = DEFAULT_MAX_LINE) -> int:
    """The trace's zero: the run's start, or the earliest first-line timestamp of any file
    (a span that starts before it gets a negative timestamp, which viewers accept)."""
    candidates = [t for p in files.jsonl if (t := _first_timestamp(p, max_line)) is not None]
    started = files.started_ns
    if started is not None:
        candidates.append(started)
    return min(candidates) if candidates else 0


_compact = json.JSONEncoder(separators=(",", ":"), default=str).encode
"""Events' args as compact JSON (one encoder, not one per `json.dumps` call)."""

GZIP_LEVEL = 3
"""A .gz trace is compressed for speed (level 9 costs much of the conversion's time for a
little less size); `gzip -9` the file for the smallest."""


def _open_output(output: Path) -> IO[str]:
    """The trace file, written in 1 MiB blocks (a .gz one compressed at `GZIP_LEVEL`)."""
    if output.suffix == ".gz":
        raw = gzip.GzipFile(output, "wb", compresslevel=GZIP_LEVEL)
        buffered = io.BufferedWriter(raw, 1 << 20)
        return io.TextIOWrapper(buffered, encoding="utf-8")
    return open(output, "w", encoding="utf-8", buffering=1 << 20)


def _us(ns: int) -> str:
    """Nanoseconds as exact decimal microseconds (no float rounding of nested slices)."""
    sign = "-" if ns < 0 else ""
    q, r = divmod(abs(ns), 1000)
    return f"{sign}{q}.{r:03d}" if r else f"{sign}{q}"


class _EventWriter:
    """Writes the comma-separated event list of the traceEvents array."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.separator = "\n"  # before the first event; ",\n" before each later one

    def raw(self, event_json: str) -> None:
        self.out.write(self.separator + event_json)
        self.separator = ",\n"


class _Processes:
    """Maps resources to trace pids (the rank when it is free) and emits their metadata."""

    def __init__(self, out: _EventWriter) -> None:
        self.out = out
        self.pids: dict[Resource, int] = {}
        self.used: set[int] = set()
        self.next_free = 100_000
        self.threads: set[tuple[int, int]] = set()

    def _meta(self, pid: int, name: str, args: dict[str, Any], tid: int = 0) -> None:
        self.out.raw(_compact({"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}))

    def _process(self, pid: int, name: str, sort_index: int) -> int:
        self.used.add(pid)
        self._meta(pid, "process_name", {"name": name})
        self._meta(pid, "process_sort_index", {"sort_index": sort_index})
        return pid

    def _free_pid(self) -> int:
        while self.next_free in self.used:
            self.next_free += 1
        return self.next_free

    def pid(self, resource: Resource) -> int:
        pid = self.pids.get(resource)
        if pid is not None:
            return pid
        rank = resource.rank
        pid = rank if rank is not None and rank not in self.used else self._free_pid()
        self.pids[resource] = pid
        label = resource.label
        service = resource.get("service.name")
        if service:
            label = f"{label} · {service}"
        self._process(pid, label, pid)
        labels = {k: v for k, v in resource.attrs if k.startswith(("otelprof.", "host."))}
        if labels:
            text = ", ".join(f"{k}={v}" for k, v in labels.items())
            self._meta(pid, "process_labels", {"labels": text})
        return pid

    def extra(self, name: str, sort_index: int) -> int:
        """A process that is no resource (the "all ranks" view), on a free pid."""
        return self._process(self._free_pid(), name, sort_index)

    def thread(self, pid: int, tid: int, name: str) -> None:
        if (pid, tid) not in self.threads:
            self.threads.add((pid, tid))
            self._meta(pid, "thread_name", {"name": name}, tid)


class _StepGroups:
    """Root spans (steps, phase batches) by trace id: every rank's part of one step."""

    def __init__(self) -> None:
        # trace id -> [name, step, {(rank order, rank label): (start, end)}]
        self.groups: dict[str, list[Any]] = {}
        self.left_out = 0

    def add(self, rec: SpanRec, who: tuple[int, str]) -> None:
        group = self.groups.get(rec.trace_id)
        if group is None:
            if len(self.groups) >= MAX_STEP_GROUPS:
                self.left_out += 1
                return
            step = rec.attr(ATTR_STEP)
            group = self.groups[rec.trace_id] = [rec.name, step, {}]
        group[2][who] = (rec.start_ns, rec.end_ns)

    def emit(self, out: _EventWriter, procs: _Processes, pid: int, origin: int) -> int:
        """One slice per rank per step, each rank on a track of its own (slices of a track
        must nest: one slice of all ranks would overlap the next step); returns how many."""
        by_rank: dict[tuple[int, str], list[tuple[int, int, str]]] = {}
        for trace_id, (_name, _step, ranks) in self.groups.items():
            for who, (start, end) in ranks.items():
                by_rank.setdefault(who, []).append((start, end, trace_id))
        tid = SPAN_TID
        for who in sorted(by_rank):
            lanes: list[tuple[int, int]] = []  # (tid, end of its last slice)
            for start, end, trace_id in sorted(by_rank[who]):
                lane = next((i for i, (_t, last) in enumerate(lanes) if last <= start), None)
                if lane is None:  # overlaps this rank's previous root span: a track more
                    lane = len(lanes)
                    lanes.append((tid, end))
                    procs.thread(pid, tid, who[1] if lane == 0 else f"{who[1]} ({lane + 1})")
                    tid += 1
                tid_of_lane = lanes[lane][0]
                lanes[lane] = (tid_of_lane, end)
                name, step, ranks = self.groups[trace_id]
                if step is None:
                    title = name
                elif name == "step":
                    title = f"step {step}"
                else:  # a phase batch (or the time after the last step)
                    title = f"{name} (at step {step})"
                ends = [e for _s, e in ranks.values()]
                args: dict[str, Any] = {
                    "trace_id": trace_id,
                    "ranks": len(ranks),
                    "last_to_end": max(ranks, key=lambda w: ranks[w][1])[1],
                    "end_spread_ms": round((max(ends) - min(ends)) / 1e6, 3),
                    "ends_after_first_ms": round((end - min(ends)) / 1e6, 3),
                }
                out.raw(
                    f'{{"ph":"X","cat":"otelprof.steps","name":{json.dumps(title)},"pid":{pid},'
                    f'"tid":{tid_of_lane},"ts":{_us(start - origin)},"dur":{_us(end - start)},'
                    f'"args":{_compact(args)}}}'
                )
        return len(self.groups)


def _counter_name(point: PointRec) -> str:
    where = device_label(point.attributes)
    unit = f" ({point.unit})" if point.unit else ""
    return f"{point.name}{' [' + where + ']' if where else ''}{unit}"


def _sample_note(plan: TracePlan, origin: int) -> dict[str, Any] | None:
    if not plan.sampled:
        return None
    windows = [w.describe(origin) for w in plan.windows]
    spans = ", ".join(f"{w['from_s']:g}-{w['to_s']:g} s" for w in windows)
    return {
        "read_budget": plan.read_budget,
        "run_bytes": plan.plan.total_bytes,
        "windows": windows,
        "note": (
            f"a sample of the run: the run's files ({plan.plan.total_bytes / 1e6:,.0f} MB) "
            f"are over the read budget ({(plan.read_budget or 0) / 1e6:,.0f} MB), so this "
            f"trace holds {len(windows)} time windows, the same on every rank (seconds "
            f"from the run's start): {spans}; each keeps whole steps on every rank. "
            "Everything: otelprof trace --read-all (or a larger --read-budget)"
        ),
    }


def write_trace(
    files: RunFiles,
    output: Path,
    warn: Warn,
    metrics: bool = True,
    read_budget: int | None = None,
    max_line: int = DEFAULT_MAX_LINE,
) -> TraceResult:
    """Write the Chrome trace of a run; return what it holds. A run over `read_budget`
    bytes (None: no limit) is read in time windows common to every rank (`trace_windows`);
    a line over `max_line` bytes is skipped with a warning."""
    origin = time_origin(files, max_line)
    plan = plan_trace(files.jsonl, read_budget, warn, max_line)
    sample = _sample_note(plan, origin)
    slices = counters = 0
    stats = ReadStats()
    with _open_output(output) as out:
        other = {
            "generator": "otelprof trace",
            "origin_unix_nano": str(origin),
            "run_dirs": [str(d) for d in files.dirs],
            **({"sample": sample} if sample else {}),
        }
        out.write(f'{{"displayTimeUnit":"ms","otherData":{json.dumps(other)},"traceEvents":[')
        events = _EventWriter(out)
        procs = _Processes(events)
        steps = _StepGroups()
        kinds = frozenset({"traces", "metrics"} if metrics else {"traces"})
        for rec in iter_records(files.jsonl, warn, stats, kinds, plan.plan):
            if plan.sampled and not (
                plan.keeps_span(rec) if isinstance(rec, SpanRec) else plan.keeps_time(rec.time_ns)
            ):
                continue
            pid = procs.pid(rec.resource)
            if isinstance(rec, SpanRec):
                if rec.end_ns < rec.start_ns:
                    warn(f"span {rec.name} ({rec.span_id}) ends before it starts; skipped")
                    continue
                args = attributes(rec.raw_attributes)
                tid = args.get("thread.id")
                if isinstance(tid, int):  # otelprof leaves the main thread's name out
                    procs.thread(pid, tid, str(args.get("thread.name", "MainThread")))
                else:  # step and phase root spans carry no thread
                    tid = SPAN_TID
                    procs.thread(pid, tid, "steps")
                args["span_id"] = rec.span_id
                args["trace_id"] = rec.trace_id
                if rec.parent_span_id:
                    args["parent_span_id"] = rec.parent_span_id
                else:  # a step's (or phase batch's) root: this rank's part of the step
                    rank = rec.resource.rank
                    who = (rank, f"rank {rank}") if rank is not None else (pid, f"pid {pid}")
                    steps.add(rec, who)
                if rec.status_code == 2:
                    args["status"] = "ERROR"
                start = _us(rec.start_ns - origin)
                dur = _us(rec.end_ns - rec.start_ns)
                # ts/dur written as raw decimals: exact to the nanosecond
                events.raw(
                    f'{{"ph":"X","cat":"otelprof","name":{json.dumps(rec.name)},"pid":{pid},'
                    f'"tid":{tid},"ts":{start},"dur":{dur},'
                    f'"args":{_compact(args)}}}'
                )
                slices += 1
            elif isinstance(rec, PointRec):  # no HistRec without histograms=True
                if (rec.kind == "sum" and rec.monotonic) or not math.isfinite(rec.value):
                    continue  # cumulative counters make poor counter tracks; JSON has no NaN
                events.raw(
                    f'{{"ph":"C","cat":"otelprof.metrics",'
                    f'"name":{json.dumps(_counter_name(rec))},"pid":{pid},'
                    f'"ts":{_us(rec.time_ns - origin)},"args":{{"value":{rec.value!r}}}}}'
                )
                counters += 1
        step_slices = 0
        if len(procs.pids) > 1 and steps.groups:
            step_slices = steps.emit(events, procs, procs.extra(ALL_RANKS, -1), origin)
        if steps.left_out:
            warn(
                f"{steps.left_out} steps past the first {MAX_STEP_GROUPS:,} are not in the "
                f'"{ALL_RANKS}" view (each rank\'s own tracks have them)'
            )
        out.write("\n]}\n")
    return TraceResult(
        len(procs.pids),
        slices,
        counters,
        origin,
        step_slices,
        stats.spans,
        stats.bytes,
        stats.total_bytes,
        sample,
    )
