"""Which parts of a run over the read budget `otelprof trace` reads: the same time windows on
every rank, and whole steps in them (user view: docs/guide/detached-runs.md).

Why not `ReadPlan`'s byte windows: evenly spaced bytes are different moments on different
ranks, so the "all ranks" track would show pieces. Here the windows are chosen in time, once
for the run, and each file is read at the bytes that hold them:

- Time to bytes: lines are appended in time order and carry their times as text, so a few
  bisected reads find a moment (`byte_offset_at`), no JSON decoded.
- Widths are planned on one reference rank (the first plain traces and metrics files, indexed
  whole), scaled to all files of a kind: the start, then windows centred in equal segments,
  each as wide as an equal share of the budget buys; fewer windows rather than ones under
  `GOOD_WIDTH_S`.
- Whole steps: a window keeps, per phase, the step numbers whose step spans start in it on
  the reference rank, and every rank keeps exactly those steps (a span with no step and a
  gauge, by its time); a window ends at its steps' latest end, and files are read `MARGIN_S`
  past it for ranks a little behind.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otelprof._schema import ATTR_PHASE, ATTR_STEP, PHASE_TRAIN
from otelprof.analysis.reader import (
    DEFAULT_MAX_LINE,
    ReadPlan,
    ReadStats,
    SpanRec,
    Warn,
    bounded_lines,
    file_size,
    iter_records,
    line_start,
    open_lines,
    union,
)

GOOD_WIDTH_S = 5.0
"""Windows narrower than this (seconds) are traded for fewer, wider ones."""
MAX_WINDOWS = 16
MARGIN_S = 0.25
_PROBE = 4 << 10
_CLOSE_ENOUGH = 4 << 10
_START = re.compile(rb'"startTimeUnixNano"\s*:\s*"?(\d+)')  # a traces file's index only
_TIME = re.compile(rb'"(?:endTimeUnixNano|timeUnixNano)"\s*:\s*"?(\d+)')


@dataclass(frozen=True)
class Window:
    """One time window [start_ns, end_ns) and the step numbers it keeps, per phase."""

    start_ns: int
    end_ns: int
    steps: dict[str, tuple[int, int]] = field(default_factory=dict)  # phase -> [lo, hi]

    def describe(self, origin: int) -> dict[str, Any]:
        return {
            "from_s": round((self.start_ns - origin) / 1e9, 3),
            "to_s": round((self.end_ns - origin) / 1e9, 3),
            "steps": {phase: list(bounds) for phase, bounds in sorted(self.steps.items())},
        }


@dataclass(frozen=True)
class TracePlan:
    """The parts of a run a trace reads: `plan` (byte windows of every file, or all of it)
    and, when sampled, the time windows and step ranges every rank keeps."""

    plan: ReadPlan
    windows: tuple[Window, ...] = ()
    read_budget: int | None = None

    @property
    def sampled(self) -> bool:
        return bool(self.windows)

    def keeps_span(self, rec: SpanRec) -> bool:
        if not self.windows:
            return True
        of_step = _step_of(rec)
        if of_step is None:
            return self.keeps_time(rec.start_ns)
        phase, step = of_step
        for window in self.windows:
            bounds = window.steps.get(phase)
            if bounds is not None and bounds[0] <= step <= bounds[1]:
                return True
        return False

    def keeps_time(self, time_ns: int) -> bool:
        return not self.windows or any(w.start_ns <= time_ns < w.end_ns for w in self.windows)


def _step_of(rec: SpanRec) -> tuple[str, int] | None:
    """(phase, step number) of a span that belongs to a step (None: one that does not)."""
    step = rec.attr(ATTR_STEP)
    if not isinstance(step, int):
        return None
    phase = rec.attr(ATTR_PHASE)
    return (phase if isinstance(phase, str) else PHASE_TRAIN), step


def _time_after(handle: Any, offset: int) -> int | None:
    """The first span end or point time written at or after `offset` (None: none)."""
    handle.seek(offset)
    data = b""
    for _ in range(16):  # a span's attributes may be long: look up to 64 KiB on
        chunk = handle.read(_PROBE)
        if not chunk:
            return None
        data = data[-64:] + chunk
        found = _TIME.findall(data)
        if found:  # the latest: a metrics line's exemplars carry older times than its points
            return max(int(t) for t in found)
    return None


def byte_offset_at(handle: Any, size: int, time_ns: int) -> int:
    """An offset of a plain run file before the first record of `time_ns` or later, within
    `_CLOSE_ENOUGH` of it (lines are written in time order; a few small reads: interpolation
    on the times found, every other step a bisection so a lumpy file costs at most twice
    a bisection)."""
    low, high = 0, size
    t_low = _time_after(handle, 0)
    if t_low is None or t_low >= time_ns:
        return 0
    t_high = _time_after(handle, max(0, size - _PROBE))
    if t_high is None or t_high < time_ns:
        return max(0, size - _PROBE)
    high = max(0, size - _PROBE)
    turn = 0
    while high - low > _CLOSE_ENOUGH:
        turn += 1
        quarter = (high - low) // 8
        if turn % 2 and t_high > t_low:
            guess = low + int((time_ns - t_low) / (t_high - t_low) * (high - low))
            middle = min(max(guess, low + quarter), high - quarter)
        else:
            middle = (low + high) // 2
        found = _time_after(handle, middle)
        if found is None or found >= time_ns:
            high, t_high = middle, found if found is not None else t_high
        else:
            low, t_low = middle, found
    return low


@dataclass
class _LineIndex:
    """Lines of one reference file: (start offset, end offset, first time, last time)."""

    lines: list[tuple[int, int, int, int]]
    size: int

    @classmethod
    def of(cls, path: Path, max_line: int, exported_at: bool = False) -> _LineIndex:
        """`exported_at`: a line is one moment, its latest time (a metrics export: its
        points' time; the exemplars in it are older). A line over `max_line` is left out
        (its bytes counted: the reading pass skips it with a warning)."""
        lines = []
        offset = 0
        with open_lines(path) as handle:
            for raw in bounded_lines(handle, max_line):
                if isinstance(raw, int):
                    offset += raw
                    continue
                times = [int(m) for m in _TIME.findall(raw)]
                if times:
                    last = max(times)
                    first = (
                        last if exported_at else min(times + [int(m) for m in _START.findall(raw)])
                    )
                    lines.append((offset, offset + len(raw), first, last))
                offset += len(raw)
        return cls(lines, offset)

    def bytes_in(self, start_ns: int, end_ns: int) -> int:
        """Bytes of the lines a read of [start_ns, end_ns) takes (those overlapping it)."""
        return sum(e - s for s, e, t0, t1 in self.lines if t1 >= start_ns and t0 < end_ns)

    @property
    def span(self) -> tuple[int, int] | None:
        if not self.lines:
            return None
        return min(t for _, _, t, _ in self.lines), max(t for *_, t in self.lines)


def _reference(files: Iterable[Path], prefix: str) -> Path | None:
    """The first plain (indexable) file of a kind: the rank the windows are planned on."""
    plain = (p for p in files if p.name.startswith(prefix) and not p.name.endswith(".gz"))
    return next(plain, None)


def _place(start: int, end: int, count: int, index: int, width: int) -> tuple[int, int]:
    """Window `index` of `count`: the first at the start, the others centred in equal
    segments of the rest of the run."""
    if index == 0:
        return start, start + width
    segment = (end - start) / (count - 1)
    centre = start + round((index - 0.5) * segment)
    begin = max(start, centre - width // 2)
    return begin, begin + width


def plan_trace(
    files: tuple[Path, ...], budget: int | None, warn: Warn, max_line: int = DEFAULT_MAX_LINE
) -> TracePlan:
    """Read everything when the run fits `budget` (or it is None); else choose the windows
    (no line over `max_line` bytes held, in planning or reading)."""
    whole = ReadPlan.for_files(files, budget, max_line)
    if budget is None or not whole.partial:
        return TracePlan(whole, read_budget=budget)
    ref_traces = _reference(files, "traces")
    indexes: list[tuple[_LineIndex, float]] = []  # (reference, scale to all files of its kind)
    sizes = {p: file_size(p) for p in files}
    for ref, prefix in ((ref_traces, "traces"), (_reference(files, "metrics"), "metrics")):
        if ref is None:
            continue
        try:
            index = _LineIndex.of(ref, max_line, exported_at=prefix == "metrics")
        except OSError:
            continue
        kind_bytes = sum(n for p, n in sizes.items() if p.name.startswith(prefix))
        if index.size:
            indexes.append((index, kind_bytes / index.size))
    spans = [s for index, _ in indexes if (s := index.span) is not None]
    if not spans:  # no file with times we can find: the byte windows of a report
        return TracePlan(whole, read_budget=budget)
    margin = int(MARGIN_S * 1e9)
    # the training's span: from the first span's start to the last span's end (the metrics
    # run on before the first step and after the last one); without spans, the metrics'
    start, end = spans[0]
    end += 1

    def cost(bounds: tuple[int, int]) -> float:
        return sum(
            index.bytes_in(bounds[0] - margin, bounds[1] + margin) * scale
            for index, scale in indexes
        )

    def widest(count: int, index: int, share: float) -> int:
        """The widest window `index` of `count` within `share` bytes (at least 1 ns)."""
        high = (end - start) // (2 * count - 2) if index == 0 else (end - start) // (count - 1)
        low = 1
        while high - low > max(1, high // 1000):
            middle = (low + high) // 2
            if cost(_place(start, end, count, index, middle)) <= share:
                low = middle
            else:
                high = middle
        return low

    chosen: list[tuple[int, int]] = []
    for count in (MAX_WINDOWS, 12, 8, 6, 4, 3, 2):
        if (end - start) // (2 * count - 2) <= 0:
            continue
        least = [cost(_place(start, end, count, i, 1)) for i in range(count)]
        over = sum(least) > budget
        if over and count > 2:
            continue
        # each window its least cost (the whole lines a moment takes) and an equal part of
        # what is left; over the budget even so (a few lines per file): as wide as free
        left = 0.0 if over else (budget - sum(least)) / count
        widths = [widest(count, i, least[i] + left) for i in range(count)]
        chosen = [_place(start, end, count, i, w) for i, w in enumerate(widths)]
        if over:
            warn(
                f"the read budget ({budget:,} bytes) is smaller than the whole lines that "
                f"hold two moments of every file; reading about {sum(least) / 1e6:,.0f} MB"
            )
        if over or min(widths[1:]) >= GOOD_WIDTH_S * 1e9:
            break  # each window after the start wide enough: as many as that
    if ref_traces is not None:
        windows = _step_ranges(ref_traces, sizes[ref_traces], chosen, warn, max_line)
    else:
        windows = [Window(a, b) for a, b in chosen]
    # a .gz file cannot be read in parts: read whole, filtered by the windows
    byte_windows = {
        p: _byte_windows(p, sizes[p], windows, margin) for p in files if not p.name.endswith(".gz")
    }
    return TracePlan(
        ReadPlan(byte_windows, whole.total_bytes, budget, max_line), tuple(windows), budget
    )


def _step_ranges(
    ref: Path, size: int, bounds: list[tuple[int, int]], warn: Warn, max_line: int
) -> list[Window]:
    """Each window with the step numbers (per phase) whose step spans start in it on the
    reference rank; its end grows to the latest end of those steps (so "in the window"
    means the whole step)."""
    margin = int(MARGIN_S * 1e9)
    with ref.open("rb") as handle:
        parts = _byte_windows_of(handle, size, [(a - margin, b + margin) for a, b in bounds])
    found: list[dict[str, tuple[int, int]]] = [{} for _ in bounds]
    ends = [b for _, b in bounds]
    plan = ReadPlan({ref: parts}, size, max_line=max_line)
    for rec in iter_records([ref], warn, ReadStats(), frozenset({"traces"}), plan):
        if not isinstance(rec, SpanRec) or rec.parent_span_id:
            continue
        of_step = _step_of(rec)
        if of_step is None:
            continue
        phase, step = of_step
        for i, (a, b) in enumerate(bounds):
            if a <= rec.start_ns < b:
                lo, hi = found[i].get(phase, (step, step))
                found[i][phase] = (min(lo, step), max(hi, step))
                ends[i] = max(ends[i], rec.end_ns)
    return [Window(a, ends[i], found[i]) for i, (a, _) in enumerate(bounds)]


def _byte_windows_of(
    handle: Any, size: int, times: list[tuple[int, int]]
) -> tuple[tuple[int, int], ...]:
    reach = _CLOSE_ENOUGH + _PROBE
    ends = [(byte_offset_at(handle, size, a), byte_offset_at(handle, size, b)) for a, b in times]
    return tuple(union((line_start(handle, lo), min(size, hi + reach)) for lo, hi in ends))


def _byte_windows(
    path: Path, size: int, windows: list[Window], reach: int
) -> tuple[tuple[int, int], ...]:
    try:
        with path.open("rb") as handle:
            return _byte_windows_of(
                handle, size, [(w.start_ns - reach, w.end_ns + reach) for w in windows]
            )
    except OSError:
        return ((0, size),)  # iter_lines names the unreadable file
