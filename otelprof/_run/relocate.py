"""Moving a data file's lines into another, relabelled with the process's final ranks.

Why: a process that learns its ranks from a process group after `instrument()` has already
written telemetry under a provisional identity; those lines belong to the run it turns out
to be part of. `move_lines` appends every whole line (plain or gzip'd, as the name says) to
the new file with its resource's rank attributes and run id replaced, then removes the old
file. A line that cannot be moved is counted by the caller as dropped, never raised. The
metrics file's closing record (the old identity's end) is left out.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from otelprof._run.appendfile import WRITTEN, WholeRecordFile
from otelprof._run.closing_record import is_closing_request
from otelprof._schema import (
    ATTR_ATTEMPT,
    ATTR_LOCAL_RANK,
    ATTR_RANK,
    ATTR_RUN_ID,
    ATTR_WORLD_SIZE,
    CLOSING_RECORD,
)

RANK_KEYS = (ATTR_RANK, ATTR_LOCAL_RANK, ATTR_WORLD_SIZE, ATTR_ATTEMPT)
CHUNK_BYTES = 1 << 20
"""Relabelled lines are written in pieces of about this size (one gzip member each)."""
_CLOSING_NAME = f'"{CLOSING_RECORD}"'.encode()


class Moved:
    """What `move_lines` did: lines moved, lines lost (`error` says why, if any were)."""

    def __init__(self) -> None:
        self.lines = 0
        self.lost = 0
        self.error: BaseException | None = None


def move_lines(source: Path, target: Path, resource: Mapping[str, Any]) -> Moved:
    """Append `source`'s lines to `target` relabelled with `resource`'s ranks, then remove
    `source`. What cannot be moved is counted in `Moved.lost` (a damaged or unreadable end of
    `source` as one line; every line a failed write did not take) and `source` then stays."""
    moved = Moved()
    compress = target.name.endswith(".gz")
    out: WholeRecordFile | None = None
    try:
        out = WholeRecordFile(target)  # as private as its directory
        out.open()
    except OSError as error:
        moved.error = error
        out = None
    pending: list[bytes] = []
    size = 0
    try:
        for line in _lines(source, moved):
            if out is None:  # the target cannot be written: count what it would have held
                moved.lost += 1
                continue
            pending.append(relabel(line, resource))
            size += len(pending[-1])
            if size >= CHUNK_BYTES:
                out = _write(out, pending, compress, moved)
                pending, size = [], 0
    except OSError as error:  # reading the source failed part-way
        moved.lost += 1
        moved.error = error
    if out is not None:
        out = _write(out, pending, compress, moved)
    if out is not None:
        out.close()
        if not moved.lost:
            try:
                source.unlink()
            except OSError as error:
                moved.error = error  # moved all the same; the old copy stays behind
    return moved


def _write(
    out: WholeRecordFile, lines: list[bytes], compress: bool, moved: Moved
) -> WholeRecordFile | None:
    """Append `lines` whole (one gzip member with `compress`) or not at all: a failed write
    leaves nothing of them in the target, counts them lost and closes the target (None)."""
    if not lines:
        return out
    data = b"".join(lines)
    if compress:
        data = gzip.compress(data, compresslevel=6)
    if out.append(data) != WRITTEN:
        moved.lost += len(lines)
        moved.error = out.last_error or FileNotFoundError(f"{out.path} is gone")
        out.close()
        return None
    moved.lines += len(lines)
    return out


def _lines(source: Path, moved: Moved) -> Iterator[bytes]:
    """Whole lines of `source` (closing records left out); a damaged end counts as lost."""
    opener = gzip.open if source.name.endswith(".gz") else open
    try:
        with opener(source, "rb") as lines:
            for line in lines:
                if not line.strip():
                    continue
                if _CLOSING_NAME in line and is_closing_request(_parse(line)):
                    continue
                yield line
    except (EOFError, gzip.BadGzipFile) as error:  # cut off mid-member: the rest is unreadable
        moved.lost += 1
        moved.error = error


def _parse(line: bytes) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


def relabel(line: bytes, resource: Mapping[str, Any]) -> bytes:
    """One OTLP JSON line with every resource's rank attributes and run id set from
    `resource` (a line that is not JSON is kept as it is: the reader names it)."""
    request = _parse(line)
    if not isinstance(request, dict):
        return line if line.endswith(b"\n") else line + b"\n"
    for key in ("resourceMetrics", "resourceSpans"):
        for item in request.get(key, ()):
            attrs = item.setdefault("resource", {}).setdefault("attributes", [])
            kept = [a for a in attrs if a.get("key") not in (*RANK_KEYS, ATTR_RUN_ID)]
            for name in RANK_KEYS:
                if isinstance(resource.get(name), int):
                    kept.append({"key": name, "value": {"intValue": str(resource[name])}})
            if isinstance(resource.get(ATTR_RUN_ID), str):
                kept.append({"key": ATTR_RUN_ID, "value": {"stringValue": resource[ATTR_RUN_ID]}})
            item["resource"]["attributes"] = kept
    return (json.dumps(request, separators=(",", ":")) + "\n").encode()
