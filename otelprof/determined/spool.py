"""Where reports wait for the master: a bounded, crash-safe on-disk queue (or memory).

A spool directory holds:

- ``journal-<window>.jsonl``: a window's samples, appended before the OTLP call is
  answered, so data acknowledged to the collector survives a kill -9 (replayed at start);
- ``batch-<window>.json``: a closed window's reports, written whole (temporary file, fsync,
  rename);
- ``batch-<window>.ack``: indices answered, and ``i<index>`` for posted ones, so a restart
  resumes mid-batch and asks the master before resending a report posted at the crash;
- ``state.json``: the last closed window and the step counts reported per trial;
- ``refused.jsonl``: reports the master refused for good, with its answer; never resent.

Reports are answered in any order; a batch's files go once all are answered. Past
``max_bytes`` the oldest batches are dropped, counted and logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from otelprof._run import private_files as private
from otelprof.determined.aggregate import Report
from otelprof.determined.mapping import GaugeSample, TimingSample

log = logging.getLogger("otelprof.determined")

_WIDTH = 12
DAMAGED_DIR = "damaged"


@dataclass
class Recovered:
    """What a spool hands back at start: where to resume and what to replay."""

    window: int = 0
    last_steps: dict[tuple[int, int], int] = field(default_factory=dict)
    gauges: list[GaugeSample] = field(default_factory=list)
    timings: list[TimingSample] = field(default_factory=list)
    pending_reports: int = 0


@dataclass
class SpoolStats:
    reports_spooled: int = 0
    reports_dropped: int = 0  # oldest batches dropped because the spool was full
    journal_overflow: int = 0  # ingests not journaled because the journal hit its cap
    reports_refused: int = 0  # refused by the master for good, moved aside
    refused_not_kept: int = 0  # refused ones beyond the refused file's cap (counted only)
    damaged_files: int = 0  # spool files found damaged at start, moved into damaged/
    damaged_lines: int = 0  # journal lines found damaged at start, skipped


Item = tuple[int, int, Report]  # (window, index in the window's batch, report)


@dataclass
class _Batch:
    window: int
    size: int
    count: int  # reports in the batch
    reports: list[Report] | None = None  # loaded lazily for the disk spool
    acked: set[int] = field(default_factory=set)
    # Posted but unanswered when the process died: the master may already hold them.
    maybe_sent: set[int] = field(default_factory=set)
    handed: bool = False  # given to the deliverer by take_new()

    def unanswered(self) -> list[Item]:
        assert self.reports is not None
        return [(self.window, i, r) for i, r in enumerate(self.reports) if i not in self.acked]

    def left(self) -> int:
        return self.count - len(self.acked)


def _append_refused(path: Path, entry: dict[str, Any], used: int | None, max_bytes: int,
                    shared: bool = False, fsync: bool = False) -> int:  # fmt: skip
    """Append a refused report to `path` (JSON Lines) unless that would take the file (of
    `used` bytes; None: as big as it is) past its cap, an eighth of the spool's; the bytes
    written (0: not kept)."""
    line = json.dumps(entry, separators=(",", ":")).encode() + b"\n"
    try:
        if used is None:
            used = path.stat().st_size if path.exists() else 0
        if used + len(line) > max(max_bytes // 8, 1 << 20):
            return 0
        private.make_dir(path.parent, shared)
        with private.open_append(path, shared) as fh:
            fh.write(line)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
    except OSError as exc:
        log.error("Determined spool: cannot keep a refused report in %s: %s", path, exc)
        return 0
    return len(line)


class _SpoolBase:
    """The delivery side shared by both spools: batches by window, answered in any order."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.stats = SpoolStats()
        self._lock = threading.Lock()
        self._batches: dict[int, _Batch] = {}
        self._bytes = 0
        self.dropped_generation = 0  # bumped whenever the cap drops batches

    # hooks for the disk spool
    def _load(self, batch: _Batch) -> bool:
        return batch.reports is not None

    def _write_ack(self, window: int, line: str) -> None:
        """Memory does not outlive the process: nothing to remember."""

    def _remove_files(self, window: int) -> None:
        """Nothing on disk."""

    def _keep_refused(self, entry: dict[str, Any]) -> bool:
        return False

    # -- delivery side ----------------------------------------------------------------------
    def take_new(self) -> list[Item]:
        """Unanswered reports of the batches not handed out yet, in window and report order."""
        out: list[Item] = []
        with self._lock:
            for w in list(self._batches):
                batch = self._batches[w]
                if batch.handed:
                    continue
                if not self._load(batch):
                    self._pop(w)
                    continue
                batch.handed = True
                out.extend(batch.unanswered())
        return out

    def is_live(self, window: int) -> bool:
        """False once the batch is gone (answered, or dropped because the spool was full)."""
        with self._lock:
            return window in self._batches

    def mark_inflight(self, window: int, index: int) -> None:
        """About to POST this report: after a crash, ask the master before resending it."""
        with self._lock:
            if window in self._batches:
                self._write_ack(window, f"i{index}\n")

    def maybe_delivered(self, window: int, index: int) -> bool:
        """Was this report posted by a process that died before hearing the answer?"""
        with self._lock:
            batch = self._batches.get(window)
            return batch is not None and index in batch.maybe_sent

    def ack(self, window: int, index: int) -> None:
        """The master answered this report (accepted, or refused for good): never resend it."""
        with self._lock:
            batch = self._batches.get(window)
            if batch is None or index in batch.acked:
                return
            self._write_ack(window, f"{index}\n")
            batch.acked.add(index)
            batch.maybe_sent.discard(index)
            if batch.left() <= 0:
                self._pop(window)

    def refuse(self, window: int, index: int, report: Report, status: int | None,
               message: str) -> None:  # fmt: skip
        """Move a report the master will never take aside: kept with the master's answer
        (the disk spool's refused.jsonl, or memory), counted, and never sent again."""
        entry = {"time": time.time(), "status": status, "message": message,
                 "report": report.to_json()}  # fmt: skip
        with self._lock:
            self.stats.reports_refused += 1
            if not self._keep_refused(entry):
                self.stats.refused_not_kept += 1
        self.ack(window, index)

    def _pop(self, window: int) -> None:
        batch = self._batches.pop(window)
        self._bytes -= batch.size
        self._remove_files(window)

    def _add(self, window: int, size: int, reports: list[Report]) -> None:
        with self._lock:
            self._batches[window] = _Batch(window, size, len(reports), list(reports))
            self._bytes += size
            self.stats.reports_spooled += len(reports)
            self._enforce_cap()

    def _enforce_cap(self) -> None:
        """Drop the oldest batches (never the newest) until the spool fits max_bytes."""
        dropped = 0
        while len(self._batches) > 1 and self._bytes > self.max_bytes:
            oldest = next(iter(self._batches.values()))
            dropped += oldest.left()
            self._pop(oldest.window)
        if dropped:
            self.dropped_generation += 1
            self.stats.reports_dropped += dropped
            log.warning(
                "Determined spool full (%d bytes max): dropped the %d oldest reports "
                "(%d dropped so far)",
                self.max_bytes,
                dropped,
                self.stats.reports_dropped,
            )

    def pending(self) -> int:
        with self._lock:
            return sum(b.left() for b in self._batches.values())


class MemorySpool(_SpoolBase):
    """Bounded in-memory queue with the spool interface (in-process exporter default)."""

    def __init__(
        self,
        max_bytes: int = 64 * 1024 * 1024,
        refused_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """`refused_path`: also append refused reports there (owner-only JSON Lines, e.g.
        the run directory's determined-refused.jsonl, read by `otelprof report`)."""
        super().__init__(max_bytes)
        self.refused_path = None if refused_path is None else Path(refused_path)
        self._refused_file_bytes = 0
        self._refused: deque[dict[str, Any]] = deque(maxlen=1000)

    def recover(self) -> Recovered:
        return Recovered()

    def journal(self, window: int, gauges: list[GaugeSample], timings: list[TimingSample]) -> None:
        """Nothing to journal: memory does not survive a restart anyway."""

    def commit_window(
        self, window: int, reports: list[Report], last_steps: dict[tuple[int, int], int]
    ) -> None:
        if reports:
            self._add(window, sum(len(json.dumps(r.body)) for r in reports), reports)

    def _keep_refused(self, entry: dict[str, Any]) -> bool:
        full = len(self._refused) == self._refused.maxlen
        self._refused.append(entry)  # the oldest refused one goes when full
        if self.refused_path is None:
            return not full
        used = self._refused_file_bytes
        self._refused_file_bytes += _append_refused(self.refused_path, entry, used, self.max_bytes)
        return self._refused_file_bytes > used

    def refused_reports(self) -> list[dict[str, Any]]:
        """The refused reports kept, oldest first: {time, status, message, report}."""
        with self._lock:
            return list(self._refused)

    def close(self) -> None:
        """Nothing to release."""


def _atomic_write(path: Path, data: bytes, fsync: bool, shared: bool = False) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with private.open_new(tmp, shared) as fh:
        fh.write(data)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)


class DamagedEntry(ValueError):
    """A spool file that is not what otelprof wrote (cut short, edited, not a file)."""


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DamagedEntry(f"{what} is {value!r}, not an integer")
    return value


def _report_from_json(raw: Any) -> Report:
    """A spooled report, checked field by field (a damaged one raises DamagedEntry)."""
    if not isinstance(raw, dict):
        raise DamagedEntry(f"a report is a {type(raw).__name__}, not an object")
    body, group = raw.get("body"), raw.get("group")
    if not isinstance(group, str) or not group:
        raise DamagedEntry("a report has no group")
    metrics = body.get("metrics") if isinstance(body, dict) else None
    if not isinstance(metrics, dict) or not isinstance(metrics.get("metrics"), dict):
        raise DamagedEntry("a report has no metrics body")
    if not isinstance(metrics["metrics"].get("avgMetrics"), dict):
        raise DamagedEntry("a report has no avgMetrics object")
    steps = metrics.get("stepsCompleted")
    if steps is not None:
        _int(steps, "stepsCompleted")
    assert isinstance(body, dict)
    return Report(_int(raw.get("trial_id"), "trial_id"), _int(raw.get("run_id"), "run_id"),
                  group, body)  # fmt: skip


_NUMBER = (int, float)
# The type of each field of the journaled samples (mapping.GaugeSample / TimingSample).
_FIELD_TYPES: dict[type, tuple[Any, ...]] = {
    GaugeSample: (int, int, str, str, str, str, _NUMBER, int),
    TimingSample: (int, int, str, _NUMBER, int, int, int, int, int, bool),
}


def _sample(cls: Any, raw: Any) -> Any:
    """A journaled GaugeSample/TimingSample with every field of the type it must have."""
    types = _FIELD_TYPES[cls]
    required = len(cls._fields) - len(cls._field_defaults)
    if not isinstance(raw, list) or not required <= len(raw) <= len(cls._fields):
        raise DamagedEntry(f"a journaled {cls.__name__} has {raw!r}")
    for name, kind, value in zip(cls._fields, types, raw, strict=False):
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise DamagedEntry(f"a journaled {cls.__name__} has {name}={value!r}")
    return cls(*raw)


class DiskSpool(_SpoolBase):
    """The crash-safe spool described in the module docstring. Thread-safe.

    Directory and files are the owner's only (0700/0600) unless `shared` (0750/0640). A
    damaged file never stops a start: it is moved into ``damaged/``, counted
    (`stats.damaged_files`) and logged, and everything else is delivered.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int = 256 * 1024 * 1024,
                 fsync: bool = True, shared: bool = False) -> None:  # fmt: skip
        super().__init__(max_bytes)
        self.directory = Path(directory)
        self.shared = shared
        private.make_dir(self.directory, shared)
        self.fsync = fsync
        self._journal_window = -1
        self._journal_fh: IO[bytes] | None = None
        self._journal_bytes = 0
        # Append handles of the .ack files of batches being answered (a few, LRU).
        self._ack_fhs: OrderedDict[int, IO[bytes]] = OrderedDict()
        self._refused_path = self.directory / "refused.jsonl"

    # -- paths ---------------------------------------------------------------------------
    def _path(self, kind: str, window: int, suffix: str) -> Path:
        return self.directory / f"{kind}-{window:0{_WIDTH}d}{suffix}"

    @staticmethod
    def _window_of(path: Path) -> int:
        digits = path.name.split("-", 1)[1].split(".", 1)[0]
        if not digits.isdigit():
            raise DamagedEntry(f"{path.name} is not a spool file name")
        return int(digits)

    def _set_aside(self, path: Path, why: object) -> None:
        """Move a damaged file (or directory) into damaged/, count it and say so."""
        self.stats.damaged_files += 1
        log.error("Determined spool: %s is damaged (%s); moved to %s/ and skipped",
                  path.name, why, DAMAGED_DIR)  # fmt: skip
        try:
            aside = private.make_dir(self.directory / DAMAGED_DIR, self.shared)
            os.replace(path, aside / f"{path.name}.{time.time_ns()}")
        except OSError as exc:
            log.error("Determined spool: cannot move %s aside (%s); removing it", path, exc)
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()

    # -- start -----------------------------------------------------------------------------
    def recover(self) -> Recovered:
        """Reload pending batches, find where to resume, and collect journals to replay."""
        out = Recovered()
        for tmp in self.directory.glob(".*.tmp"):
            try:
                tmp.unlink(missing_ok=True)
            except OSError as exc:
                self._set_aside(tmp, exc)
        flushed = self._read_state(out)
        for path in sorted(self.directory.glob("batch-*.json")):
            try:
                flushed = max(flushed, self._recover_batch(path, out))
            except (OSError, ValueError, DamagedEntry) as exc:
                self._set_aside(path, exc)
        for ack in self.directory.glob("batch-*.ack"):
            try:
                if not self._path("batch", self._window_of(ack), ".json").exists():
                    ack.unlink(missing_ok=True)
            except (OSError, DamagedEntry) as exc:
                self._set_aside(ack, exc)
        journals = sorted(self.directory.glob("journal-*.jsonl"))
        out.window = flushed + 1
        for path in journals:
            try:
                window = self._window_of(path)
                if window <= flushed:
                    path.unlink(missing_ok=True)
                    continue
                self._replay(path, out)
                out.window = max(out.window, window)
            except (OSError, DamagedEntry) as exc:
                self._set_aside(path, exc)
        if self._refused_path.exists() and not self._refused_path.is_file():
            self._set_aside(self._refused_path, "not a file")
        return out

    def _read_state(self, out: Recovered) -> int:
        """The last flushed window from state.json (-1 when none), and the step counts."""
        state_path = self.directory / "state.json"
        if not state_path.exists() and not state_path.is_symlink():
            return -1
        try:
            state = json.loads(state_path.read_bytes())
            if not isinstance(state, dict):
                raise DamagedEntry(f"state is a {type(state).__name__}, not an object")
            flushed = _int(state.get("flushed_window", -1), "flushed_window")
            steps = state.get("last_steps", [])
            if not isinstance(steps, list):
                raise DamagedEntry("last_steps is not a list")
            last: dict[tuple[int, int], int] = {}
            for entry in steps:
                if not isinstance(entry, list) or len(entry) != 3:
                    raise DamagedEntry(f"last_steps entry {entry!r}")
                trial, run, count = (_int(v, "last_steps") for v in entry)
                last[(trial, run)] = count
        except (OSError, ValueError, DamagedEntry) as exc:
            # The batches and journals still tell where to resume (and the steps reported).
            self._set_aside(state_path, exc)
            return -1
        out.last_steps.update(last)
        return flushed

    def _recover_batch(self, path: Path, out: Recovered) -> int:
        window = self._window_of(path)
        raw = json.loads(path.read_bytes())
        if not isinstance(raw, list):
            raise DamagedEntry(f"a batch is a {type(raw).__name__}, not a list")
        reports = [_report_from_json(r) for r in raw]
        acked, inflight = self._read_acks(window)
        for report in reports:
            steps = report.body["metrics"].get("stepsCompleted")
            if steps is not None:
                key = (report.trial_id, report.run_id)
                out.last_steps[key] = max(out.last_steps.get(key, 0), int(steps))
        if len(acked) >= len(reports):
            self._remove_files(window)
            return window
        size = path.stat().st_size
        self._batches[window] = _Batch(window, size, len(reports), None, acked, inflight - acked)
        self._bytes += size
        out.pending_reports += len(reports) - len(acked)
        return window

    def _read_acks(self, window: int) -> tuple[set[int], set[int]]:
        """(answered indices, indices posted at some point) from the batch's .ack file."""
        path = self._path("batch", window, ".ack")
        acked: set[int] = set()
        inflight: set[int] = set()
        if not path.exists():
            return acked, inflight
        try:
            lines = path.read_bytes().splitlines()
        except OSError as exc:  # e.g. a directory: the batch is resent from its start
            self._set_aside(path, exc)
            return acked, inflight
        bad = 0
        for line in lines:
            try:
                if line.startswith(b"i"):
                    inflight.add(int(line[1:]))
                else:
                    acked.add(int(line))
            except ValueError:
                bad += 1  # a line cut short by a crash, or garbage: that index is resent
        if bad:
            self.stats.damaged_lines += bad
            log.warning("Determined spool: skipped %d damaged lines of %s", bad, path.name)
        return acked, inflight

    def _replay(self, path: Path, out: Recovered) -> None:
        bad = 0
        for line in path.read_bytes().splitlines():
            try:
                entry = json.loads(line)
                if not isinstance(entry, dict):
                    raise DamagedEntry("not an object")
                gauges = [_sample(GaugeSample, g) for g in entry.get("g", [])]
                timings = [_sample(TimingSample, t) for t in entry.get("t", [])]
            except (ValueError, TypeError, DamagedEntry):
                bad += 1  # e.g. a line cut short by a crash: it was never acknowledged
                continue
            out.gauges.extend(gauges)
            out.timings.extend(timings)
        if bad:
            self.stats.damaged_lines += bad
            log.warning("Determined spool: skipped %d damaged lines of %s", bad, path.name)

    # -- ingest side -------------------------------------------------------------------------
    def journal(self, window: int, gauges: list[GaugeSample], timings: list[TimingSample]) -> None:
        """Append this request's samples to the window's journal before it is acknowledged."""
        if not gauges and not timings:
            return
        line = json.dumps({"g": gauges, "t": timings}, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            if window != self._journal_window:
                if self._journal_fh is not None:
                    self._journal_fh.close()
                self._journal_fh = private.open_append(
                    self._path("journal", window, ".jsonl"), self.shared
                )
                self._journal_window = window
                self._journal_bytes = 0
            if self._journal_bytes + len(line) > self.max_bytes // 4:
                self.stats.journal_overflow += 1
                return
            fh = self._journal_fh
            assert fh is not None
            fh.write(line)
            fh.flush()  # in the kernel's hands: survives kill -9 of this process
            self._journal_bytes += len(line)

    def commit_window(
        self, window: int, reports: list[Report], last_steps: dict[tuple[int, int], int]
    ) -> None:
        """Persist a closed window's reports, then forget its journal."""
        if reports:
            data = json.dumps([r.to_json() for r in reports], separators=(",", ":")).encode()
            _atomic_write(self._path("batch", window, ".json"), data, self.fsync, self.shared)
        journals = [
            p for p in self.directory.glob("journal-*.jsonl") if self._window_of(p) <= window
        ]
        if reports or journals:
            steps = [[t, r, s] for (t, r), s in last_steps.items()]
            state = json.dumps({"flushed_window": window, "last_steps": steps}).encode()
            _atomic_write(self.directory / "state.json", state, self.fsync, self.shared)
            if self.fsync:  # the renames into place
                fd = os.open(self.directory, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        if reports:
            self._add(window, len(data), reports)
        with self._lock:
            if self._journal_window <= window and self._journal_fh is not None:
                self._journal_fh.close()
                self._journal_fh = None
                self._journal_window = -1
        for path in journals:
            path.unlink(missing_ok=True)

    # -- delivery side hooks -------------------------------------------------------------------
    def _load(self, batch: _Batch) -> bool:
        if batch.reports is not None:
            return True
        path = self._path("batch", batch.window, ".json")
        try:
            raw = json.loads(path.read_bytes())
            if not isinstance(raw, list):
                raise DamagedEntry("not a list")
            batch.reports = [_report_from_json(r) for r in raw]
        except (OSError, ValueError, DamagedEntry) as exc:
            self._set_aside(path, exc)
            return False
        return True

    def _write_ack(self, window: int, line: str) -> None:
        fh = self._ack_fhs.get(window)
        if fh is None:
            fh = private.open_append(self._path("batch", window, ".ack"), self.shared)
            self._ack_fhs[window] = fh
            while len(self._ack_fhs) > 16:
                self._ack_fhs.popitem(last=False)[1].close()
        self._ack_fhs.move_to_end(window)
        fh.write(line.encode())
        fh.flush()  # survives kill -9 once written

    def _keep_refused(self, entry: dict[str, Any]) -> bool:
        path, shared, fsync = self._refused_path, self.shared, self.fsync
        return bool(_append_refused(path, entry, None, self.max_bytes, shared, fsync))

    def refused_reports(self) -> list[dict[str, Any]]:
        """The refused reports kept in refused.jsonl, oldest first."""
        with self._lock:
            if not self._refused_path.exists():
                return []
            try:
                raw = self._refused_path.read_bytes().splitlines()
            except OSError as exc:
                log.error("Determined spool: cannot read %s: %s", self._refused_path, exc)
                return []
        out = []
        for line in raw:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def _remove_files(self, window: int) -> None:
        fh = self._ack_fhs.pop(window, None)
        if fh is not None:
            fh.close()
        self._path("batch", window, ".json").unlink(missing_ok=True)
        self._path("batch", window, ".ack").unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            if self._journal_fh is not None:
                self._journal_fh.close()
                self._journal_fh = None
            for fh in self._ack_fhs.values():
                fh.close()
            self._ack_fhs.clear()
