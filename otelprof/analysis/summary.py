"""One streaming pass over a run: timing statistics, step breakdown, hardware gauges.

Memory is bounded whatever the run's size: durations go to `DurationStats` (exact up to a
cap), gauges to their count, sum and extremes, and the "is this span a direct child of a
step?" question is answered with a bounded window of recently seen span ids (exporters write
children and their step within a few batches of each other; a child whose parent is not seen
within the window is counted as unresolved, not guessed).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otelprof._schema import ATTR_PHASE as PHASE_ATTR
from otelprof._schema import (
    ATTR_REASON,
    ATTR_SOURCE,
    ATTR_STEP,
    MODULE_PREFIXES,
    PHASE_AFTER_TRAINING,
    PHASE_TRAIN,
    STEP_SPAN,
    TELEMETRY_DROPPED,
    TORCH_STEP_RANGE,
    is_torch_step_range,
)
from otelprof.analysis.aggregates import HistRec, keep_latest
from otelprof.analysis.aggregates import SeriesKey as HistKey
from otelprof.analysis.aggregates import apply as apply_aggregates
from otelprof.analysis.parallel_summary import read_in_workers, read_serially
from otelprof.analysis.quantiles import DurationStats
from otelprof.analysis.reader import (
    DEFAULT_MAX_LINE,
    ReadPlan,
    ReadStats,
    Resource,
    RunFiles,
    SpanRec,
    Warn,
    device_label,
    iter_records,
    union,
)
from otelprof.analysis.stragglers import StragglerPass, StragglerReport
from otelprof.analysis.throughput_pass import PhaseThroughput, ThroughputPass, in_steps


def timing_key(name: str, phase: Any) -> str:
    """Timings are keyed by (name, phase): `forward` in training, `forward (validation)`
    in another phase, so validation never mixes into the training rows."""
    if phase is None or phase in (PHASE_TRAIN, name):
        return name
    return f"{name} ({phase})"


_MAX_SERIES = 5_000


PARENT_STEP = ""  # TimingAgg.by_parent keys of a step's direct children and of root spans
PARENT_ROOT = "\0root"
PARENT_WRAPS = "\0wraps"  # ... and of spans that wrap their step (see _StepResolver)
_MAX_PARENTS = 50
_MAX_NESTED_IN = 50


@dataclass
class TimingAgg:
    """Statistics of one timing name (seconds)."""

    name: str
    stats: DurationStats = field(default_factory=DurationStats)
    direct_total_s: float = 0.0  # summed over spans that are direct children of a step
    direct_count: int = 0
    nested_count: int = 0
    root_count: int = 0
    unresolved_count: int = 0
    wrapper_count: int = 0  # spans that wrapped their step: no part of it (_StepResolver)
    nested_in: dict[str, int] = field(default_factory=dict)
    # durations by where the span sat: PARENT_STEP, PARENT_ROOT or the parent's timing key
    by_parent: dict[str, DurationStats] = field(default_factory=dict)

    def add_in(self, parent: str, dur_s: float) -> None:
        stats = self.by_parent.get(parent)
        if stats is None:
            if len(self.by_parent) >= _MAX_PARENTS:
                return
            stats = self.by_parent[parent] = DurationStats(self.stats.exact_cap)
        stats.add(dur_s)

    def count_nested(self, parent: str, n: int = 1) -> None:
        """`n` more spans nested in `parent` (a bounded set of parents)."""
        if parent in self.nested_in or len(self.nested_in) < _MAX_NESTED_IN:
            self.nested_in[parent] = self.nested_in.get(parent, 0) + n

    def merge(self, other: TimingAgg) -> None:
        """Fold in the same timing's aggregates from later files."""
        self.stats.merge(other.stats)
        self.direct_total_s += other.direct_total_s
        self.direct_count += other.direct_count
        self.nested_count += other.nested_count
        self.root_count += other.root_count
        self.unresolved_count += other.unresolved_count
        self.wrapper_count += other.wrapper_count
        for parent, n in other.nested_in.items():
            self.count_nested(parent, n)
        for parent, stats in other.by_parent.items():
            have = self.by_parent.get(parent)
            if have is not None:
                have.merge(stats)
            elif len(self.by_parent) < _MAX_PARENTS:
                self.by_parent[parent] = stats


@dataclass
class RankAgg:
    """Per-process (rank) step statistics, for stragglers."""

    resource: Resource
    steps: DurationStats = field(default_factory=DurationStats)
    spans: int = 0


SeriesKey = tuple[str, str, str, tuple[tuple[str, Any], ...]]  # host, scope, name, attrs


@dataclass
class SeriesAgg:
    """One hardware time series (a gauge with its attributes on one host or process)."""

    host: str
    scope: str  # "" for host/GPU-wide metrics, else the process label
    name: str
    unit: str
    attrs: tuple[tuple[str, Any], ...]
    count: int = 0
    total: float = 0.0
    min: float = math.inf
    max: float = -math.inf

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    @property
    def device(self) -> str:
        return device_label(self.attrs)

    @property
    def gpu(self) -> str | None:
        a = dict(self.attrs)
        if "gpu.index" in a or "hw.id" in a:
            return str(a.get("hw.id", a.get("gpu.index")))
        return None


@dataclass
class RunSummary:
    """Everything the text and JSON reports and the verdict need."""

    files: RunFiles
    read: ReadStats
    timings: dict[str, TimingAgg]
    step: DurationStats
    ranks: dict[Resource, RankAgg]
    series: dict[SeriesKey, SeriesAgg]
    counters: dict[str, float]  # monotonic sum -> its value at the end (all series summed)
    first_ns: int | None
    last_ns: int | None
    unresolved_children: int = 0
    failed_spans: dict[str, int] = field(default_factory=dict)  # name -> spans with ERROR status
    step0_s: list[float] = field(default_factory=list)  # durations of step 0 (one per process)
    steps_range: tuple[int | None, int | None] | None = None  # --steps A:B, when given
    stragglers: StragglerReport | None = None  # per-rank waiting vs own work (stragglers.py)
    timings_from_histograms: bool = False  # timing figures from otelprof.timing.duration
    series_over_limit: int = 0  # metric points of series beyond the report's series cap
    throughput: list[PhaseThroughput] = field(default_factory=list)  # throughput_pass.py
    plan: ReadPlan = field(default_factory=lambda: ReadPlan({}))  # the parts of the files read
    dropped_counted: dict[tuple[str, int], dict[str, int]] = field(default_factory=dict)
    """(host, pid) -> the drops its last `otelprof.telemetry.dropped` export counted, by
    `source.reason`: what a process whose final counts were never recorded had lost."""
    processes: int = 0  # processes whose spans or metric points were read
    # (host, pid) -> the step running when that process crashed or was stopped
    unfinished_steps: dict[tuple[str, Any], int] = field(default_factory=dict)

    def share(self, name: str) -> float | None:
        """Share of summed step time spent in direct-child spans of this name."""
        agg = self.timings.get(name)
        if agg is None or not self.step.total or not agg.direct_count:
            return None
        return agg.direct_total_s / self.step.total

    @property
    def untimed_share(self) -> float | None:
        """Share of step time in no direct-child span (< 0 when children overlap)."""
        if not self.step.total:
            return None
        timed = sum(a.direct_total_s for a in self.timings.values())
        return 1.0 - timed / self.step.total

    def gauge_mean(self, name: str) -> float | None:
        """Sample-weighted mean of one gauge over all its series."""
        count = sum(s.count for s in self.series.values() if s.name == name)
        if not count:
            return None
        return sum(s.total for s in self.series.values() if s.name == name) / count


MAX_INTERVALS = 20_000


class IntervalSet:
    """Union of [start, end) intervals (ns), bounded in size, with the true covered time."""

    def __init__(self, cap: int = MAX_INTERVALS) -> None:
        self._cap = cap
        self._raw: list[tuple[int, int]] = []
        self._merged: list[tuple[int, int]] = []
        self.true_ns = 0  # summed durations as added (exact if the spans do not overlap)
        self.lossy = False

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        self._raw.append((start, end))
        self.true_ns += end - start
        if len(self._raw) >= 4 * self._cap:
            self._normalize()

    def _normalize(self) -> None:
        merged = [list(iv) for iv in union(self._merged + self._raw)]
        self._raw = []
        while len(merged) > self._cap:  # join the closest neighbours (rare, bounded)
            self.lossy = True
            gaps = sorted(range(len(merged) - 1), key=lambda i: merged[i + 1][0] - merged[i][1])
            drop = set(gaps[: len(merged) - self._cap])
            out: list[list[int]] = []
            for i, iv in enumerate(merged):
                if out and (i - 1) in drop:
                    out[-1][1] = max(out[-1][1], iv[1])
                else:
                    out.append(list(iv))
            merged = out
        self._merged = [(s, e) for s, e in merged]

    def intervals(self) -> list[tuple[int, int]]:
        self._normalize()
        return self._merged

    def covered_ns(self) -> int:
        return sum(e - s for s, e in self.intervals())

    def scale(self) -> float:
        """True time / merged time: 1 unless closest intervals had to be joined."""
        covered = self.covered_ns()
        return min(1.0, self.true_ns / covered) if self.lossy and covered else 1.0


_Waiting = tuple[str, str, str, float, int, "list[_Waiting] | None"]
"""A span whose place waits on its parent's: (timing key, name as exported, span id,
duration s, end ns, its own waiting children or None). A tuple: one is made per span."""


class _StepResolver:
    """Decides where each span sat (directly in a step, nested in another span, at the top
    level, or around its step), within a bounded window of recently seen span ids.

    A span that wraps its step (ARCHITECTURE.md, "Reading a run") is counted in
    `TimingAgg.wrapper_count` and its children are the step's parts. Children usually come
    before their parent in a file, so a span whose parent is not seen yet waits, with its
    own children, until the parent says where they belong.
    """

    def __init__(self, timings: dict[str, TimingAgg], window: int = 50_000) -> None:
        self.window = window
        self.timings = timings
        self.steps: OrderedDict[str, int] = OrderedDict()  # step span id -> its end (ns)
        # span id -> timing key of the other spans; None: it wraps its step
        self.others: OrderedDict[str, str | None] = OrderedDict()
        self.pending: OrderedDict[str, list[_Waiting]] = OrderedDict()
        self.unresolved = 0

    @staticmethod
    def _remember(od: OrderedDict[str, Any], key: str, value: Any, window: int) -> None:
        od[key] = value
        if len(od) > window:
            od.popitem(last=False)

    def _direct(self, name: str, dur_s: float) -> None:
        if name.startswith(MODULE_PREFIXES):  # a model's parts: its own section, no share
            self._nested(name, STEP_SPAN, dur_s)
            return
        agg = self.timings[name]
        agg.direct_total_s += dur_s
        agg.direct_count += 1
        agg.add_in(PARENT_STEP, dur_s)

    def _nested(self, name: str, parent: str, dur_s: float) -> None:
        agg = self.timings[name]
        agg.nested_count += 1
        agg.count_nested(parent)
        agg.add_in(parent, dur_s)

    def span(self, rec: SpanRec, dur_s: float, is_step: bool, name: str | None = None) -> None:
        children = self.pending.pop(rec.span_id, None)
        if is_step:
            self._remember(self.steps, rec.span_id, rec.end_ns, self.window)
            for child in children or ():
                self._in_step(child, rec.end_ns)
            return
        key = rec.name if name is None else name
        self._remember(self.others, rec.span_id, key, self.window)
        parent = rec.parent_span_id
        if not parent:
            self.timings[key].root_count += 1
            self.timings[key].add_in(PARENT_ROOT, dur_s)
        elif parent in self.steps:
            item = (key, rec.name, rec.span_id, dur_s, rec.end_ns, children)
            self._in_step(item, self.steps[parent])
            return
        elif parent in self.others:
            above = self.others[parent]
            if above is None:  # its parent wraps a step: it is a part of that step
                self._direct(key, dur_s)
            else:
                self._nested(key, above, dur_s)
        else:
            waiting = self.pending.setdefault(parent, [])
            waiting.append((key, rec.name, rec.span_id, dur_s, rec.end_ns, children))
            if len(self.pending) > self.window:
                _, lost = self.pending.popitem(last=False)
                self._lost(lost)
            return
        if children:
            self._nest(key, children)

    def _in_step(self, item: _Waiting, step_end_ns: int) -> None:
        """A direct child of a step (ending at `step_end_ns`): a part of it, or its wrapper."""
        key, name, span_id, dur_s, end_ns, children = item
        if (children and end_ns > step_end_ns) or (
            name.startswith(TORCH_STEP_RANGE) and is_torch_step_range(name)
        ):
            agg = self.timings[key]
            agg.wrapper_count += 1
            agg.add_in(PARENT_WRAPS, dur_s)
            if span_id in self.others:
                self.others[span_id] = None
            for child in children or ():
                self._in_step(child, step_end_ns)
            return
        self._direct(key, dur_s)
        if children:
            self._nest(key, children)

    def _nest(self, parent_key: str, children: list[_Waiting]) -> None:
        """Waiting children, and theirs, as nested in their parents."""
        todo = [(parent_key, children)]
        while todo:
            above, waiting = todo.pop()
            for key, _name, _span_id, dur_s, _end_ns, theirs in waiting:
                self._nested(key, above, dur_s)
                if theirs:
                    todo.append((key, theirs))

    def _lost(self, items: list[_Waiting]) -> None:
        for key, _name, _span_id, _dur_s, _end_ns, children in items:
            self.timings[key].unresolved_count += 1
            self.unresolved += 1
            if children:
                self._nest(key, children)

    def finish(self) -> None:
        for items in self.pending.values():
            self._lost(items)
        self.pending.clear()


CRASHED_STEP = "crashed step"
INTERRUPTED_STEP = "interrupted step"
ProcessKey = tuple[str, Any]  # (host.name, process.pid)


def unfinished_label(end: Any) -> str | None:
    """What the step running at a process's end is called, from run.json's `end`: the
    crashed step (an exception), an interrupted one (a signal, Ctrl-C, a non-zero exit);
    None for a run that ended normally (its last ranges are after training)."""
    if not isinstance(end, dict):
        return None
    status = end.get("status")
    exception = end.get("exception")
    if status == "exception":
        interrupted = isinstance(exception, dict) and exception.get("type") == "KeyboardInterrupt"
        return INTERRUPTED_STEP if interrupted else CRASHED_STEP
    if status == "signal" or (status == "exit" and end.get("exit_code") not in (0, None)):
        return INTERRUPTED_STEP
    return None


def unfinished_processes(run_info: Sequence[dict[str, Any]]) -> dict[ProcessKey, str]:
    """(host, pid) -> `unfinished_label` of each process that did not end normally."""
    out: dict[ProcessKey, str] = {}
    for info in run_info:
        label = unfinished_label(info.get("end"))
        resource = info.get("resource")
        if label and isinstance(resource, dict) and "process.pid" in resource:
            out[(str(resource.get("host.name", "unknown-host")), resource["process.pid"])] = label
    return out


def process_key(resource: Resource) -> ProcessKey:
    return (resource.host, resource.get("process.pid"))


class _FilePass:
    """The aggregates of one file's records, or of several files' merged in file order.

    A report is the merge, in file order, of one pass per file, here or in worker processes
    (`parallel_summary`): the same report. A merge replays what one pass over both files
    would do wherever that is exact (durations re-added in order, first-seen order kept, the
    latest cumulative point wins). The windows linking children to steps and gathering a
    step's spans for stragglers close at each file's end (a rank's spans are in its file)."""

    def __init__(
        self,
        window: int,
        exact_cap: int,
        steps: tuple[int | None, int | None] | None,
        unfinished: dict[ProcessKey, str] | None = None,
    ) -> None:
        """`unfinished`: the processes whose last ranges are the step running when they
        crashed or were stopped (`unfinished_processes`), not work after training."""
        self.window = window
        self.unfinished = unfinished or {}
        self.unfinished_steps: dict[ProcessKey, int] = {}
        self.resources: set[Resource] = set()
        self.exact_cap = exact_cap
        self.steps = steps
        self.work = ThroughputPass(steps)
        self.failed: dict[str, int] = {}
        self.step0: list[float] = []
        self.read = ReadStats()
        self.timings: dict[str, TimingAgg] = {}
        self.step = DurationStats(exact_cap)
        self.ranks: dict[Resource, RankAgg] = {}
        self.series: dict[SeriesKey, SeriesAgg] = {}
        self.latest: dict[tuple[str, Resource, Any], tuple[int, float]] = {}
        self.over_limit = 0
        self.unresolved = 0
        self.stragglers = StragglerPass()
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        self.hists: dict[HistKey, HistRec] = {}  # the latest point of each series

    def read_file(self, path: Path, plan: ReadPlan, warn: Warn) -> None:
        """Aggregate one file (`plan`: how it is read, `ReadPlan.for_file`)."""
        steps = self.steps
        exact_cap = self.exact_cap
        work = self.work
        failed = self.failed
        step0 = self.step0
        timings = self.timings
        step = self.step
        ranks = self.ranks
        series = self.series
        latest = self.latest
        hists = self.hists
        resolver = _StepResolver(timings, self.window)
        straggler_pass = StragglerPass()
        first_ns = self.first_ns
        last_ns = self.last_ns
        records = iter_records([path], warn, self.read, histograms=steps is None, plan=plan)
        for rec in records:
            work.feed(rec)
            if isinstance(rec, HistRec):
                keep_latest(hists, rec)
                continue
            if isinstance(rec, SpanRec):
                if steps is not None and not in_steps(rec.attr(ATTR_STEP), steps):
                    continue
                if rec.status_code == 2:  # STATUS_CODE_ERROR
                    failed[rec.name] = failed.get(rec.name, 0) + 1
                start, end = rec.start_ns, rec.end_ns
                if end < start:
                    warn(f"span {rec.name} ({rec.span_id}) ends before it starts; skipped")
                    continue
                dur_s = (end - start) / 1e9
                if first_ns is None or start < first_ns:
                    first_ns = start
                if last_ns is None or end > last_ns:
                    last_ns = end
                rank = ranks.get(rec.resource)
                if rank is None:
                    rank = ranks[rec.resource] = RankAgg(rec.resource, DurationStats(exact_cap))
                rank.spans += 1
                is_step = rec.name == STEP_SPAN
                if is_step:  # training steps only: other phases' roots are named after them
                    step.add(dur_s)
                    rank.steps.add(dur_s)
                    if rec.attr(ATTR_STEP) == 0:
                        step0.append(dur_s)
                name = rec.name
                if not is_step:
                    span_name = rec.name
                    phase = rec.attr(PHASE_ATTR)
                    if phase == PHASE_AFTER_TRAINING and self.unfinished:
                        span_name, phase = self._unfinished(rec, span_name, phase)
                    name = timing_key(span_name, phase)
                    if name not in timings:
                        timings[name] = TimingAgg(name, DurationStats(exact_cap))
                    timings[name].stats.add(dur_s)
                resolver.span(rec, dur_s, is_step, name)
                straggler_pass.span(rec)
            else:
                self.resources.add(rec.resource)
                if rec.kind == "sum" and rec.monotonic:  # cumulative: the latest is the total
                    ckey = (rec.name, rec.resource, rec.attributes)
                    if not _keep_latest(latest, ckey, (rec.time_ns, rec.value)):
                        self.over_limit += 1
                    continue
                # host- and GPU-wide metrics merge across ranks; anything else stays per process
                scope = "" if rec.name.startswith(("hw.", "system.")) else rec.resource.label
                key = (rec.resource.host, scope, rec.name, rec.attributes)
                agg = series.get(key)
                if agg is None:
                    if len(series) >= _MAX_SERIES:
                        self.over_limit += 1
                        continue
                    agg = series[key] = SeriesAgg(
                        rec.resource.host, scope, rec.name, rec.unit, rec.attributes
                    )
                v = rec.value
                agg.count += 1
                agg.total += v
                if v < agg.min:
                    agg.min = v
                if v > agg.max:
                    agg.max = v
                if first_ns is None or rec.time_ns < first_ns:
                    first_ns = rec.time_ns
                if last_ns is None or rec.time_ns > last_ns:
                    last_ns = rec.time_ns
        resolver.finish()
        straggler_pass.close()
        self.unresolved += resolver.unresolved
        self.stragglers.merge(straggler_pass)
        self.first_ns = first_ns
        self.last_ns = last_ns

    def _unfinished(self, rec: SpanRec, name: str, phase: Any) -> tuple[str, Any]:
        """An `after_training` span of a process that crashed or was stopped belongs to the
        step that was running then: its phase is that (`CRASHED_STEP`, ...), and its root
        span, named after the phase, is named so too."""
        key = process_key(rec.resource)
        label = self.unfinished.get(key)
        if label is None:
            return name, phase
        if not rec.parent_span_id:
            number = rec.attr(ATTR_STEP)
            if isinstance(number, int):
                self.unfinished_steps[key] = number
            return label, label
        return name, label

    def merge(self, other: _FilePass) -> None:
        """Fold in the pass over the files after this one's (see the class docstring)."""
        self.work.merge(other.work)
        for name, n in other.failed.items():
            self.failed[name] = self.failed.get(name, 0) + n
        self.step0.extend(other.step0)
        for name in vars(ReadStats()):
            setattr(self.read, name, getattr(self.read, name) + getattr(other.read, name))
        for name, agg in other.timings.items():
            mine = self.timings.get(name)
            if mine is None:
                self.timings[name] = agg
            else:
                mine.merge(agg)
        self.step.merge(other.step)
        for resource, rank in other.ranks.items():
            have = self.ranks.get(resource)
            if have is None:
                self.ranks[resource] = rank
                continue
            have.steps.merge(rank.steps)
            have.spans += rank.spans
        for key, theirs in other.series.items():
            have_series = self.series.get(key)
            if have_series is None:
                if len(self.series) >= _MAX_SERIES:
                    self.over_limit += theirs.count
                    continue
                self.series[key] = theirs
                continue
            have_series.count += theirs.count
            have_series.total += theirs.total
            have_series.min = min(have_series.min, theirs.min)
            have_series.max = max(have_series.max, theirs.max)
        for ckey, point in other.latest.items():
            if not _keep_latest(self.latest, ckey, point):
                self.over_limit += 1
        self.over_limit += other.over_limit
        self.unresolved += other.unresolved
        self.stragglers.merge(other.stragglers)
        self.first_ns = _least(self.first_ns, other.first_ns)
        self.last_ns = _most(self.last_ns, other.last_ns)
        for rec in other.hists.values():
            keep_latest(self.hists, rec)
        self.unfinished_steps.update(other.unfinished_steps)
        self.resources |= other.resources

    def result(self, files: RunFiles, plan: ReadPlan) -> RunSummary:
        counters: dict[str, float] = {}
        dropped: dict[tuple[str, int], dict[str, int]] = {}
        for (name, resource, attrs), (_time, value) in self.latest.items():
            counters[name] = counters.get(name, 0.0) + value
            pid = resource.get("process.pid")
            if name == TELEMETRY_DROPPED and value and isinstance(pid, int):
                point = dict(attrs)
                why = f"{point.get(ATTR_SOURCE, '')}.{point.get(ATTR_REASON, '')}"
                counts = dropped.setdefault((resource.host, pid), {})
                counts[why] = counts.get(why, 0) + int(value)
        self.read.total_bytes += plan.total_bytes
        summary = RunSummary(
            files=files,
            read=self.read,
            timings=self.timings,
            step=self.step,
            ranks=self.ranks,
            series=self.series,
            counters=counters,
            series_over_limit=self.over_limit,
            first_ns=self.first_ns,
            last_ns=self.last_ns,
            unresolved_children=self.unresolved,
            failed_spans=self.failed,
            step0_s=self.step0,
            steps_range=self.steps,
            stragglers=self.stragglers.result(),
            throughput=self.work.result(),
            plan=plan,
            dropped_counted=dropped,
            processes=len(self.resources | set(self.ranks)),
            unfinished_steps=self.unfinished_steps,
        )
        for hist in self.hists.values():  # keyed as the spans are (`_unfinished`)
            if hist.phase == PHASE_AFTER_TRAINING:
                label = self.unfinished.get(process_key(hist.resource))
                if label is not None:
                    hist.phase = label
                    hist.timing = label if hist.timing == PHASE_AFTER_TRAINING else hist.timing
        # in-process histograms cover every step, the kept traces only a sample of them
        summary.timings_from_histograms = apply_aggregates(
            summary, list(self.hists.values()), timing_key, TimingAgg
        )
        return summary


def _keep_latest(
    latest: dict[tuple[str, Resource, Any], tuple[int, float]],
    key: tuple[str, Resource, Any],
    point: tuple[int, float],
) -> bool:
    """Keep `point` (time, value) of a cumulative series if it is that series' latest so
    far; False when the series is new and the table is full (the caller counts it)."""
    seen = latest.get(key)
    if seen is None and len(latest) >= _MAX_SERIES:
        return False
    if seen is None or point[0] >= seen[0]:
        latest[key] = point
    return True


def _least(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _most(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def summarize(
    files: RunFiles,
    warn: Warn,
    window: int = 50_000,
    exact_cap: int = 200_000,
    steps: tuple[int | None, int | None] | None = None,
    read_budget: int | None = None,
    jobs: int = 1,
    max_line: int = DEFAULT_MAX_LINE,
) -> RunSummary:
    """Read the run once and aggregate it (the throughput figures in the same pass).

    `window`: span ids remembered to link children to steps; `exact_cap`: durations kept per
    timing for exact percentiles (then a 0.5% sketch); `steps` (A, B): only steps A <= n < B;
    `read_budget`: `reader.ReadPlan` (None: all); `jobs` > 1: worker processes
    (`parallel_summary`, the same result); `max_line`: longer lines skipped with a warning.
    """
    plan = ReadPlan.for_files(files.jsonl, read_budget, max_line)
    args = (window, exact_cap, steps, unfinished_processes(files.run_info))
    return read_files(files.jsonl, plan, warn, jobs, args).result(files, plan)


def read_files(
    paths: Sequence[Path],
    plan: ReadPlan,
    warn: Warn,
    jobs: int,
    args: tuple[int, int, tuple[int | None, int | None] | None, dict[ProcessKey, str]],
) -> _FilePass:
    """One pass per file (in `jobs` worker processes when > 1), merged in file order."""
    make = functools.partial(_FilePass, *args)
    if jobs > 1 and len(paths) > 1:
        return read_in_workers(paths, plan, warn, jobs, make)
    return read_serially(paths, plan, warn, make(), make)
