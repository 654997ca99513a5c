"""Streaming reader of detached run directories (OTLP JSON Lines written by the file exporters).

Why our own reader: files can be gigabytes, a crashed run leaves a truncated last line, and
users still want every intact line. So files are read one line at a time, never more than
`max_line` bytes of one line held (a longer line is read past in bounded chunks and skipped
with a warning), every bad line or item is skipped with a warning naming file and line, and
each line is dispatched on its top-level key, so any `*.jsonl` name (per-rank files, renamed
files) works.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import IO, Any

from otelprof._run.closing_record import completed_by_closing_record
from otelprof._schema import ATTR_RANK, CLOSING_RECORD
from otelprof._schema import TIMING_HISTOGRAM as HIST_METRIC
from otelprof.analysis.aggregates import HistRec
from otelprof.analysis.aggregates import parse_point as parse_hist

Warn = Callable[[str], None]

_KINDS = {"resourceSpans": "traces", "resourceMetrics": "metrics", "resourceLogs": "logs"}


MALFORMED = (AttributeError, KeyError, TypeError, ValueError, OverflowError, RecursionError)
"""What decoding a damaged item can raise: wrong types, missing keys, `inf` where an integer
belongs, nesting deeper than the interpreter recurses. Each is a skipped item, never a crash."""


class RunDirError(Exception):
    """The path given is not a readable run directory."""


def _list(value: Any, what: str) -> list[Any]:
    """`value` when it is a JSON array (a missing one is empty); else TypeError naming it."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise TypeError(f"{what} is a {type(value).__name__}, not a list")
    return value


@dataclass(frozen=True)
class RunFiles:
    """The telemetry files of one or more run directories (several nodes' dirs merge)."""

    dirs: tuple[Path, ...]
    jsonl: tuple[Path, ...]
    run_info: tuple[dict[str, Any], ...]

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.jsonl)

    @property
    def run_ids(self) -> list[str]:
        """The run ids in the run.json files, each once (the ranks of a job share one)."""
        return list(dict.fromkeys(str(i["run_id"]) for i in self.run_info if i.get("run_id")))

    @property
    def started_ns(self) -> int | None:
        """Earliest start time recorded in run.json files, if any."""
        starts = [t for i in self.run_info if isinstance(t := i.get("started_unix_nano"), int)]
        return min(starts) if starts else None


def _looks_like_run(path: Path) -> bool:
    return any(path.glob("run*.json")) or any(_run_files(path))


def _run_files(path: Path, warn: Warn | None = None) -> list[Path]:
    """OTLP JSON Lines files of a run directory, plain or gzip'd (`*.jsonl.gz`); a symbolic
    link that leads nowhere (dangling, or looping back to itself) is named, not skipped
    silently."""
    found = []
    for pattern in ("*.jsonl", "*.jsonl.gz"):
        for p in path.glob(pattern):
            try:
                if p.is_file():
                    found.append(p)
                elif p.is_symlink() and warn:
                    warn(f"{p}: symbolic link to no readable file (dangling or a loop); skipped")
            except OSError as exc:  # ELOOP and the like on some Pythons
                if warn:
                    warn(f"{p}: cannot be read ({exc}); skipped")
    return sorted(found, key=lambda p: p.name)  # one directory: the order of the names, cheaply


def open_run(paths: Sequence[str | Path], warn: Warn | None = None) -> RunFiles:
    """Validate run directories and list their files; raise RunDirError with the reason."""
    if not paths:
        raise RunDirError("no run directory given")
    dirs: list[Path] = []
    files: list[Path] = []
    infos: list[dict[str, Any]] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise RunDirError(f"{path}: no such directory")
        if not path.is_dir():
            raise RunDirError(f"{path}: not a directory (expected a run directory)")
        if not _looks_like_run(path):
            children = sorted(p.name for p in path.iterdir() if p.is_dir() and _looks_like_run(p))
            hint = ""
            if children:
                shown = ", ".join(children[:5]) + (", ..." if len(children) > 5 else "")
                hint = f"; it contains run directories ({shown}): pass one of them"
            raise RunDirError(
                f"{path} is not an otelprof run directory: no *.jsonl telemetry files "
                f"and no run.json{hint}"
            )
        dirs.append(path)
        files.extend(_run_files(path, warn))
        for info_path in sorted(path.glob("run*.json")):  # run.json, run.rank<N>.json
            try:
                info = json.loads(info_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                if warn:
                    warn(f"{info_path}: unreadable ({exc}); ignored")
                continue
            if isinstance(info, dict):
                # a failed final rewrite: the data file tells the end
                infos.append(
                    completed_by_closing_record(_checked_run_info(info, info_path, warn), path)
                )
            elif warn:
                warn(f"{info_path}: not a JSON object; ignored")
    return RunFiles(tuple(dirs), tuple(files), tuple(infos))


_RUN_INFO_FIELDS: dict[str, tuple[type, ...]] = {
    "run_id": (str,),
    "started_unix_nano": (int,),
    "finished_unix_nano": (int,),
    "attempt": (int,),
    "interval_s": (int, float),
    "end": (dict,),
    "stats": (dict,),
    "resource": (dict,),
    "files": (dict,),
}
"""The run.json fields the report reads, and their JSON types (anything else is ignored)."""


def _checked_run_info(info: dict[str, Any], path: Path, warn: Warn | None) -> dict[str, Any]:
    """`info` without the fields of a wrong type (a damaged run.json), each named once."""
    kept = dict(info)
    for key, types in _RUN_INFO_FIELDS.items():
        value = kept.get(key)
        if key not in kept or value is None:
            continue
        bad = isinstance(value, bool) or not isinstance(value, types)
        if not bad and isinstance(value, float):
            bad = not math.isfinite(value)
        if key == "stats" and not bad and isinstance(value, dict):
            bad = not all(isinstance(n, int) and not isinstance(n, bool) for n in value.values())
        if bad:
            del kept[key]
            if warn:
                warn(f"{path}: field {key!r} holds {value!r:.60}, not a valid value; ignored")
    return kept


def latest_run(output_dir: str | Path | None = None) -> Path:
    """The most recently started run directory under `output_dir` (default: where
    `instrument()` writes, ./otelprof-runs or $OTELPROF_OUTPUT_DIR)."""
    if output_dir is None:
        output_dir = os.environ.get("OTELPROF_OUTPUT_DIR") or "otelprof-runs"
    root = Path(output_dir)
    if not root.is_dir():
        raise RunDirError(f"no run directory given and {root} does not exist; pass RUN_DIR")
    runs = [p for p in root.iterdir() if p.is_dir() and _looks_like_run(p)]
    if not runs:
        raise RunDirError(f"no run directory given and {root} holds no runs; pass RUN_DIR")

    def started(path: Path) -> tuple[int, float]:
        best = 0
        for info_path in path.glob("run*.json"):
            with contextlib.suppress(Exception):
                best = max(best, int(json.loads(info_path.read_text())["started_unix_nano"]))
        return best, path.stat().st_mtime

    return max(runs, key=started)


class WarningLog:
    """Counts warnings and prints the first `limit` of them (to stderr by default)."""

    def __init__(self, limit: int = 20, sink: Callable[[str], None] | None = None) -> None:
        self.limit = limit
        self.count = 0
        self.messages: list[str] = []
        self._sink = sink or (lambda msg: print(f"warning: {msg}", file=sys.stderr))

    def __call__(self, message: str) -> None:
        self.count += 1
        if self.count <= self.limit:
            self.messages.append(message)
            self._sink(message)
        elif self.count == self.limit + 1:
            self._sink("more warnings follow; only their count is reported")

    def summary(self) -> str | None:
        if self.count <= self.limit:
            return None
        return f"{self.count} warnings in total ({self.count - self.limit} not shown)"


DEFAULT_READ_BUDGET = 512 << 20
"""Bytes of run files a report reads at most by default (`ReadPlan`): it bounds the report's
time and memory whatever the run's size."""

DEFAULT_MAX_LINE = 32 << 20
"""Longest line (bytes, newline not counted) a reader decodes by default (`--max-line`); a
longer one is skipped with a warning. otelprof's exporters write lines of a few MiB at most,
so only a damaged or foreign file has longer ones; the limit bounds the reader's memory."""

_TAIL = 64 << 10  # every file's last lines: the final export (exact histograms), the end
_WINDOW_MIN = 16 << 10
_MAX_WINDOWS = 64


@dataclass(frozen=True)
class ReadPlan:
    """Which parts of each run file are read: every file whole when the run fits the budget;
    else, per uncompressed file, a share of the budget proportional to its size in evenly
    spaced windows, plus its tail. A window yields the whole lines that start in it; the tail
    of a metrics file (the final export: the exact cumulative histograms), or of a file whose
    other windows held no line start, yields every line that ends in it. So the budget is
    exceeded by at most one line per file. Compressed files are read whole."""

    windows: dict[Path, tuple[tuple[int, int], ...]]  # files read in parts; others whole
    total_bytes: int = 0  # size of every file (compressed size for *.gz)
    budget: int | None = None
    max_line: int = DEFAULT_MAX_LINE

    @property
    def partial(self) -> bool:
        return bool(self.windows)

    def for_file(self, path: Path) -> ReadPlan:
        """The plan of one file (what a worker process is handed for it)."""
        windows = self.windows.get(path)
        return ReadPlan({path: windows} if windows else {}, max_line=self.max_line)

    @classmethod
    def for_files(
        cls, files: Iterable[Path], budget: int | None, max_line: int = DEFAULT_MAX_LINE
    ) -> ReadPlan:
        sizes = {path: file_size(path) for path in files}
        total = sum(sizes.values())
        if budget is None or total <= budget:
            return cls({}, total, budget, max_line)
        plain = {p: n for p, n in sizes.items() if not p.name.endswith(".gz")}
        left = max(0, budget - (total - sum(plain.values())))
        plain_total = sum(plain.values()) or 1
        windows: dict[Path, tuple[tuple[int, int], ...]] = {}
        for path, size in plain.items():
            share = max(left * size // plain_total, _TAIL)
            if share >= size:
                continue
            body = size - _TAIL  # the windows before the tail
            count = min(_MAX_WINDOWS, (share - _TAIL) // _WINDOW_MIN)
            parts: list[tuple[int, int]] = []
            if count:
                width = (share - _TAIL) // count
                step = (body - width) / max(1, count - 1)
                parts = [(round(i * step), round(i * step) + width) for i in range(count)]
            windows[path] = (*parts, (body, size))
        return cls(windows, total, budget, max_line)


def union(intervals: Iterable[Any]) -> list[tuple[int, int]]:
    """(start, end) pairs, overlapping ones as one, whatever order they came in (a span that
    overlaps two kept intervals joins them)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def file_size(path: Path) -> int:
    """A run file's size for read planning; 0 for one that cannot be stat'ed (the reading
    pass, `iter_lines`, names it)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


@dataclass
class ReadStats:
    """What was read and skipped, for the report's footer."""

    files: int = 0
    bytes: int = 0  # bytes of the lines read
    total_bytes: int = 0  # size of the files (more than `bytes` when read in parts)
    partial_files: int = 0  # files read in evenly spaced parts (a ReadPlan over budget)
    lines: int = 0
    bad_lines: int = 0
    spans: int = 0
    points: int = 0
    skipped_items: int = 0
    other_lines: int = 0


@dataclass(frozen=True)
class Line:
    path: Path
    number: int
    kind: str  # "traces" | "metrics" | "logs"
    body: dict[str, Any]
    raw: bytes


_READ_BUFFER = 64 << 10  # lines are export batches (100s of KB); a window reads little past its end


def open_lines(path: Path) -> IO[bytes]:
    """A run file for reading lines: `*.gz` files (detached mode's `compress=True`) are
    decompressed on the fly."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return path.open("rb", buffering=_READ_BUFFER)


_SKIP_CHUNK = 1 << 20  # a line over the limit is read past this much at a time


def read_line(handle: IO[bytes], limit: int) -> bytes | int:
    """The next line of `handle` (b"" at its end), holding at most `limit` bytes of it; a
    longer line is read past in bounded chunks and its length returned instead (an int), so
    no line, however long, is held whole."""
    raw = handle.readline(limit + 1)
    if len(raw) <= limit or raw.endswith(b"\n"):
        return raw
    length = len(raw)
    while not raw.endswith(b"\n"):
        raw = handle.readline(_SKIP_CHUNK)
        if not raw:
            break
        length += len(raw)
    return length


def bounded_lines(handle: IO[bytes], limit: int) -> Iterator[bytes | int]:
    """`read_line` to the end of the file: each line, or the length of one over `limit`."""
    while raw := read_line(handle, limit):
        yield raw


def _raw_lines(handle: IO[bytes], path: Path, warn: Warn, limit: int) -> Iterator[bytes | int]:
    """Lines of a file (or lengths of lines over `limit`); a gzip stream cut short (the
    writer crashed mid-member) ends the file with a warning, keeping every whole line
    before it."""
    try:
        yield from bounded_lines(handle, limit)
    except (EOFError, OSError, zlib.error) as exc:
        warn(f"{path}: compressed data ends early ({exc}); lines after it skipped")


_METRICS_START = b'{"resourceMetrics"'  # how the exporters' metrics lines begin


def line_start(handle: IO[bytes], position: int) -> int:
    """Where the line holding byte `position` starts (scanning back for a newline)."""
    while position > 0:
        begin = max(0, position - (64 << 10))
        handle.seek(begin)
        newline = handle.read(position - begin).rfind(b"\n")
        if newline >= 0:
            return begin + newline + 1
        position = begin
    return 0


def _first_line_start(handle: IO[bytes], start: int, end: int) -> int | None:
    """Where the first line that starts in [start, end) starts (None: none does), looking no
    further than `end` (a long line that covers the window is not read to its end here)."""
    if start == 0:
        return 0
    handle.seek(start - 1)
    position = start - 1
    while position < end - 1:
        chunk = handle.read(min(64 << 10, end - 1 - position))
        if not chunk:
            return None
        newline = chunk.find(b"\n")
        if newline >= 0:
            return position + newline + 1
        position += len(chunk)
    return None


def _window_lines(
    handle: IO[bytes], windows: tuple[tuple[int, int], ...], limit: int
) -> Iterator[bytes | int]:
    """The lines of each (start, end) byte window of a plain file, as `ReadPlan` says (the
    tail's rule included); a line over `limit` comes as its length (`read_line`)."""
    done = 0  # lines before this offset were read already (windows may touch)
    metrics = handle.read(len(_METRICS_START)) == _METRICS_START
    handle.seek(0)
    for index, (start, end) in enumerate(windows):
        if index == len(windows) - 1 and (metrics or not done):
            position = max(done, line_start(handle, start))
        elif start <= done:
            position = done
        else:
            found = _first_line_start(handle, start, end)
            if found is None:
                continue  # a line that started before the window covers it
            position = found
        handle.seek(position)
        while position < end:
            raw = read_line(handle, limit)
            if not raw:
                break
            position += raw if isinstance(raw, int) else len(raw)
            done = position
            yield raw


def iter_lines(
    files: Iterable[Path], warn: Warn, stats: ReadStats, plan: ReadPlan | None = None
) -> Iterator[Line]:
    """Yield every intact OTLP request line (of the parts `plan` reads; default: all);
    skip and report the others."""
    plan = plan if plan is not None else ReadPlan({})
    stats.total_bytes += plan.total_bytes
    for path in files:
        stats.files += 1
        try:
            handle = open_lines(path)
        except OSError as exc:
            warn(f"{path}: cannot open ({exc}); skipped")
            continue
        windows = plan.windows.get(path)
        if windows:
            stats.partial_files += 1
        with handle:
            number = 0  # in a file read in parts: the number among the lines read
            source = (
                _window_lines(handle, windows, plan.max_line)
                if windows
                else _raw_lines(handle, path, warn, plan.max_line)
            )
            for raw in source:
                number += 1
                stats.lines += 1
                if isinstance(raw, int):
                    stats.bytes += raw
                    stats.bad_lines += 1
                    warn(
                        f"{path}:{number}: line of {raw:,} bytes skipped: longer than the "
                        f"line limit ({plan.max_line:,} bytes, --max-line)"
                    )
                    continue
                stats.bytes += len(raw)
                if not raw.strip():
                    continue
                try:
                    body = json.loads(raw)
                except RecursionError:
                    stats.bad_lines += 1
                    warn(f"{path}:{number}: line nested too deeply to read; skipped")
                    continue
                except ValueError as exc:
                    stats.bad_lines += 1
                    if not raw.endswith(b"\n"):
                        warn(
                            f"{path}:{number}: truncated last line skipped "
                            f"(the writer stopped mid-line, e.g. a crash): {exc}"
                        )
                    else:
                        warn(f"{path}:{number}: corrupt line skipped (not JSON: {exc})")
                    continue
                kind = None
                if isinstance(body, dict) and len(body) == 1:
                    kind = _KINDS.get(next(iter(body)))
                if kind is None or not isinstance(next(iter(body.values())), list):
                    stats.bad_lines += 1
                    what = list(body)[:3] if isinstance(body, dict) else type(body).__name__
                    warn(f"{path}:{number}: not an OTLP request line (top level: {what}); skipped")
                    continue
                yield Line(path, number, kind, body, raw)


def any_value(value: Any) -> Any:
    """Decode an OTLP JSON AnyValue (int64 as decimal strings) into a Python value."""
    if not isinstance(value, dict) or not value:
        return None
    kind, raw = next(iter(value.items()))
    if kind == "stringValue":
        return raw
    if kind == "intValue":
        if isinstance(raw, float | bool):
            raise ValueError(f"intValue {raw!r} is not an integer")
        return int(raw)
    if kind == "doubleValue":
        if isinstance(raw, bool | list | dict):
            raise ValueError(f"doubleValue {raw!r} is not a number")
        return float(raw)
    if kind == "boolValue":
        return bool(raw)
    if kind == "arrayValue":
        return [any_value(v) for v in _list(raw.get("values"), "arrayValue.values")]
    if kind == "kvlistValue":
        pairs = _list(raw.get("values"), "kvlistValue.values")
        return {_key(kv): any_value(kv.get("value")) for kv in pairs}
    return raw  # bytesValue stays base64 text


def keyed(node: Any, keys: frozenset[str]) -> Iterator[tuple[dict[str, Any], str]]:
    """(object, key) for every key of `keys` in a decoded JSON document, at any depth (the
    value of such a key is not searched further); the caller may set `object[key]`."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in keys:
                yield node, key
            elif isinstance(value, (dict, list)):
                yield from keyed(value, keys)
    elif isinstance(node, list):
        for item in node:
            yield from keyed(item, keys)


def _key(item: Any) -> str:
    key = item["key"]
    if not isinstance(key, str):
        raise TypeError(f"attribute key {key!r} is not a string")
    return key


def attributes(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Decode an OTLP JSON attribute list into a dict (raises one of `MALFORMED` if damaged)."""
    out: dict[str, Any] = {}
    for item in _list(items, "attributes"):
        key = _key(item)
        value = item.get("value")
        if type(value) is dict and len(value) == 1:  # the common cases inline (hot path)
            raw = value.get("stringValue")
            if raw is not None:
                out[key] = raw
                continue
            raw = value.get("intValue")
            if type(raw) is str:
                out[key] = int(raw)
                continue
        out[key] = any_value(value)
    return out


def _check_attributes(items: Any) -> None:
    """Raise one of `MALFORMED` if `attributes(items)` would; cheaper (the reading hot path
    keeps span attributes raw until asked for)."""
    if type(items) is not list:
        _list(items, "attributes")
        return
    for item in items:
        if type(item) is not dict or type(item.get("key")) is not str:
            _key(item)  # raises, naming what is wrong
        value = item.get("value")
        if type(value) is dict and len(value) == 1:  # the common cases inline (hot path)
            if "stringValue" in value:
                continue
            raw = value.get("intValue")
            if type(raw) is str:
                int(raw)  # raises ValueError as any_value would
                continue
        any_value(value)


def attribute(items: list[dict[str, Any]] | None, key: str) -> Any:
    """One attribute without decoding the whole list (the hot path reads a few keys)."""
    for item in items or ():
        if item.get("key") == key:
            value = item.get("value")
            if type(value) is dict and len(value) == 1:  # the common cases inline (hot path)
                raw = value.get("stringValue")
                if raw is not None:
                    return raw
                raw = value.get("intValue")
                if type(raw) is str:
                    return int(raw)
            return any_value(value)
    return None


@dataclass(frozen=True)
class Resource:
    """A process's resource: the identity of a rank (host, pid, rank)."""

    attrs: tuple[tuple[str, Any], ...]

    def __hash__(self) -> int:
        # every record looks its process up by resource: hash the attributes once
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(self.attrs)
            object.__setattr__(self, "_hash", cached)
        return cached

    def __reduce__(self) -> tuple[Any, ...]:
        # the attributes only: a cached hash is only valid in the process that made it
        return (Resource, (self.attrs,))

    def get(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def host(self) -> str:
        return str(self.get("host.name", "unknown-host"))

    @property
    def rank(self) -> int | None:
        rank = self.get(ATTR_RANK)
        return rank if isinstance(rank, int) else None

    @cached_property
    def label(self) -> str:
        """Short human name: 'rank 3 @ node1 (pid 42)'."""
        parts = []
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        parts.append(f"@ {self.host}" if parts else self.host)
        pid = self.get("process.pid")
        if pid is not None:
            parts.append(f"(pid {pid})")
        return " ".join(parts)


class _ResourceCache:
    def __init__(self) -> None:
        self._by_attrs: dict[tuple[tuple[str, Any], ...], Resource] = {}

    def get(self, raw: dict[str, Any] | None) -> Resource:
        if raw is not None and not isinstance(raw, dict):
            raise TypeError(f"resource is a {type(raw).__name__}, not an object")
        decoded = attributes((raw or {}).get("attributes"))
        key = tuple(sorted((k, _hashable(v)) for k, v in decoded.items()))
        res = self._by_attrs.get(key)
        if res is None:
            if len(self._by_attrs) > 100_000:  # pathological input: keep memory bounded
                self._by_attrs.clear()
            res = self._by_attrs[key] = Resource(key)
        return res


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


@dataclass(slots=True)
class SpanRec:
    """One span, flattened; attributes stay raw until asked for."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    raw_attributes: list[dict[str, Any]]
    resource: Resource
    status_code: int = 0

    def attr(self, key: str) -> Any:
        return attribute(self.raw_attributes, key)


@dataclass(slots=True)
class PointRec:
    """One gauge or sum data point."""

    name: str
    unit: str
    kind: str  # "gauge" | "sum"
    monotonic: bool
    time_ns: int
    value: float
    attributes: tuple[tuple[str, Any], ...]
    resource: Resource


def device_label(attrs: tuple[tuple[str, Any], ...]) -> str:
    """'gpu 0', a device's hw.id, else the attributes' values ('read', ...): what tells the
    series of one metric apart (the report's device column, the trace's counter tracks)."""
    a = dict(attrs)
    if "gpu.index" in a:
        return f"gpu {a['gpu.index']}"
    if "hw.id" in a:
        return str(a["hw.id"])
    return ", ".join(str(v) for _, v in attrs)


def _is_id(text: Any, length: int) -> bool:
    """Cheap id check for the hot path: the length tells hex (32/16) from base64 (24/12)."""
    return isinstance(text, str) and len(text) == length


def _skipped(what: str, exc: BaseException, warn: Warn, stats: ReadStats) -> None:
    """Count and name a malformed item (`what`: where it is and what it was)."""
    stats.skipped_items += 1
    warn(f"{what} skipped ({type(exc).__name__}: {exc})")


def _items_of(
    line: Line, signal: str, key: str, cache: _ResourceCache, warn: Warn, stats: ReadStats
) -> Iterator[tuple[Resource, Any]]:
    """(resource, item) for every span or metric of a line; a malformed resource or scope
    is skipped, warned."""
    where = f"{line.path}:{line.number}"
    for entry in line.body[f"resource{signal}"]:
        try:
            resource = cache.get(entry.get("resource"))
            scopes = _list(entry.get(f"scope{signal}"), f"scope{signal}")
        except MALFORMED as exc:
            _skipped(f"{where}: malformed resource", exc, warn, stats)
            continue
        for scope in scopes:
            try:
                items = _list(scope.get(key), key)
            except MALFORMED as exc:
                _skipped(f"{where}: malformed scope", exc, warn, stats)
                continue
            for item in items:
                yield resource, item


def _spans_of(line: Line, cache: _ResourceCache, warn: Warn, stats: ReadStats) -> Iterator[SpanRec]:
    where = f"{line.path}:{line.number}"
    for resource, s in _items_of(line, "Spans", "spans", cache, warn, stats):
        try:
            parent = s.get("parentSpanId") or ""
            if not (_is_id(s["traceId"], 32) and _is_id(s["spanId"], 16)) or (
                parent and not _is_id(parent, 16)
            ):
                raise ValueError("trace/span ids are not 32/16 hex digits")
            raw_attributes = s.get("attributes") or []
            _check_attributes(raw_attributes)  # damaged: skip the span here, not later
            rec = SpanRec(
                name=str(s["name"]),
                trace_id=s["traceId"],
                span_id=s["spanId"],
                parent_span_id=parent,
                start_ns=int(s["startTimeUnixNano"]),
                end_ns=int(s["endTimeUnixNano"]),
                raw_attributes=raw_attributes,
                resource=resource,
                status_code=int((s.get("status") or {}).get("code", 0) or 0),
            )
        except MALFORMED as exc:
            _skipped(f"{where}: malformed span", exc, warn, stats)
            continue
        stats.spans += 1
        yield rec


def _points_of(
    line: Line, cache: _ResourceCache, warn: Warn, stats: ReadStats, histograms: bool = False
) -> Iterator[PointRec | HistRec]:
    where = f"{line.path}:{line.number}"
    for resource, metric in _items_of(line, "Metrics", "metrics", cache, warn, stats):
        try:
            name = str(metric["name"])
            unit = str(metric.get("unit", ""))
            if name == CLOSING_RECORD:
                continue  # the run's end (read with run.json), no telemetry (replay skips it)
            if "gauge" in metric:
                kind, data, mono = "gauge", metric["gauge"], False
            elif "sum" in metric:
                kind, data = "sum", metric["sum"]
                mono = bool(data.get("isMonotonic", False))
            elif histograms and name == HIST_METRIC and "histogram" in metric:
                yield from _histograms_of(metric, resource, where, warn, stats)
                continue
            else:  # other histograms/summaries: not hardware gauges, counted all the same
                stats.points += _point_count(metric)
                continue
            dps = _list(data.get("dataPoints"), "dataPoints")
        except MALFORMED as exc:
            _skipped(f"{where}: malformed metric", exc, warn, stats)
            continue
        for dp in dps:
            try:
                raw = dp["asDouble"] if "asDouble" in dp else dp["asInt"]
                attrs = dp.get("attributes")
                rec = PointRec(
                    name=name,
                    unit=unit,
                    kind=kind,
                    monotonic=mono,
                    time_ns=int(dp["timeUnixNano"]),
                    value=float(raw),
                    attributes=tuple((k, _hashable(v)) for k, v in attributes(attrs).items())
                    if attrs
                    else (),
                    resource=resource,
                )
            except MALFORMED as exc:
                _skipped(f"{where}: malformed data point of {name}", exc, warn, stats)
                continue
            stats.points += 1
            yield rec


def _histograms_of(
    metric: dict[str, Any], resource: Resource, where: str, warn: Warn, stats: ReadStats
) -> Iterator[HistRec]:
    try:
        points = _list(metric["histogram"].get("dataPoints"), "dataPoints")
    except MALFORMED as exc:
        _skipped(f"{where}: malformed histogram {HIST_METRIC}", exc, warn, stats)
        return
    for dp in points:
        try:
            hist = parse_hist(dp, attributes(dp.get("attributes")), resource)
        except MALFORMED as exc:
            _skipped(f"{where}: malformed histogram point of {HIST_METRIC}", exc, warn, stats)
            continue
        stats.points += 1
        yield hist


def _point_count(metric: dict[str, Any]) -> int:
    """Data points of a metric the reader does not summarize (what `replay` sends of it)."""
    for kind in ("gauge", "sum", "histogram", "exponentialHistogram", "summary"):
        data = metric.get(kind)
        if isinstance(data, dict) and isinstance(data.get("dataPoints"), list):
            return len(data["dataPoints"])
    return 0


def iter_records(
    files: Iterable[Path],
    warn: Warn,
    stats: ReadStats | None = None,
    kinds: frozenset[str] = frozenset({"traces", "metrics"}),
    plan: ReadPlan | None = None,
    histograms: bool = False,
) -> Iterator[SpanRec | PointRec | HistRec]:
    """Spans and gauge/sum points of every intact line, file by file, in file order; with
    `histograms`, the points of the timing histograms (`HistRec`) too."""
    stats = stats if stats is not None else ReadStats()
    cache = _ResourceCache()
    for line in iter_lines(files, warn, stats, plan):
        if line.kind not in kinds:
            stats.other_lines += 1
            continue
        if line.kind == "traces":
            yield from _spans_of(line, cache, warn, stats)
        else:
            yield from _points_of(line, cache, warn, stats, histograms)
