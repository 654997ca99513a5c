"""Report windows: average samples per trial/agent/group and build Determined reports.

Determined's own profiler averages ten 1 s samples and posts one report per group every
~10 s; this does the same over whatever arrives in a window. A group is reported only
with its full key set (the Web UI's series list comes from the latest report), filling a
key that missed this window with its last value from a recent window.

A timings report's stepsCompleted strictly increases per (trial, run), never falls below
what earlier runs reported (the master would archive their rows above it) and never
exceeds what was really trained (the master keeps the highest as the trial's batch count).
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from otelprof.config import INT32_MAX
from otelprof.determined.mapping import (
    DISK_IOPS_READ,
    DISK_IOPS_WRITE,
    PROFILING_KEYS,
    STEP_INDEX_BASE,
    GaugeSample,
    HistogramPoint,
    TimingSample,
    add_up,
)


@dataclass(frozen=True)
class Report:
    """One `POST /api/v1/trials/{trial_id}/metrics` body, ready to send."""

    trial_id: int
    run_id: int
    group: str
    body: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"trial_id": self.trial_id, "run_id": self.run_id, "group": self.group,
                "body": self.body}  # fmt: skip


def build_body(
    trial_id: int,
    run_id: int,
    group: str,
    avg_metrics: dict[str, Any],
    report_time_ns: int,
    steps_completed: int | None = None,
    batch_metrics: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The ReportTrialMetricsRequest JSON (lowerCamel names, reference §1)."""
    metrics: dict[str, Any] = {"trialId": trial_id, "trialRunId": run_id}
    if steps_completed is not None:
        metrics["stepsCompleted"] = steps_completed
    stamp = _dt.datetime.fromtimestamp(report_time_ns / 1e9, tz=_dt.timezone.utc)
    metrics["reportTime"] = stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    metrics["metrics"] = {"avgMetrics": avg_metrics}
    if batch_metrics:
        metrics["metrics"]["batchMetrics"] = batch_metrics
    return {"group": group, "metrics": metrics}


@dataclass
class _Trial:
    # (agent, group, sub, key) -> [sum, n, max time]
    gauges: dict[tuple[str, str, str, str], list[float]] = field(default_factory=dict)
    # (agent, group, sub, key) -> (value, window it was fresh in)
    last: dict[tuple[str, str, str, str], tuple[float, int]] = field(default_factory=dict)
    timings: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum_s, count]
    timing_gauges: dict[str, list[float]] = field(default_factory=dict)  # key -> [sum, n]
    max_step: int = -1
    offset: int = -1  # DET_STEPS_COMPLETED (-1: not known)
    per_batch: int = 1
    timing_time_ns: int = 0
    last_seen: int = 0
    # Timings come from otelprof's duration histograms (exact over every step); spans of
    # this trial then only move the step count, so no range is counted twice.
    from_histograms: bool = False
    agents: set[str] = field(default_factory=set)  # bounded by max_agents_per_trial
    # When this trial's step count was last checked against max_steps_per_s (monotonic s).
    steps_clock: float = field(default_factory=time.monotonic)


@dataclass
class AggregatorStats:
    """Counters a human can read to see what was not reported and why (named as in
    `Pipeline.stats()`)."""

    windows: int = 0
    reports: int = 0
    incomplete_groups: int = 0  # a group skipped because a key had no recent value
    timings_held: int = 0  # timing windows waiting for a higher step count
    dropped_trials: int = 0  # samples refused because max_trials was reached
    dropped_timing_names: int = 0  # timing names beyond max_timing_names per trial
    timings_unsafe_steps: int = 0  # windows of a restarted trial not reported: no step offset
    invalid_values: int = 0  # NaN/inf left out of a report (the master cannot read them)
    dropped_agents: int = 0  # samples of agents beyond max_agents_per_trial
    dropped_series: int = 0  # histogram points of series beyond max_series_per_trial
    steps_clamped: int = 0  # timing reports whose step count grew faster than possible


class WindowAggregator:
    """Accumulates samples between flushes; `drain()` closes a window. Not thread-safe."""

    carry_windows = 3  # a key missing from a window is filled from this many windows back
    max_trials = 100_000
    max_timing_names = 64
    idle_windows = 360  # a trial with no data for this many windows is forgotten
    # One trial's cardinality (agent ids, producers) must not grow every trial's reports
    # and the bridge's memory: beyond these, its new agents and series are refused.
    max_agents_per_trial = 64
    max_series_per_trial = 4096
    max_series = 1_000_000  # cumulative histogram series (and span timings) remembered

    def __init__(
        self,
        timings_group: str = "timings",
        max_steps_per_s: float = 10_000.0,
        window_s: float = 10.0,
        trust_offsets: bool = False,
    ) -> None:
        self.timings_group = timings_group
        self.max_steps_per_s = max_steps_per_s
        self.window_s = window_s
        # DET_STEPS_COMPLETED is trusted in process only; at the bridge a trial's first
        # report is bounded by the master's batch count (`_first_baseline`: `baselines`,
        # filled by the pipeline; until then in `baselines_wanted`, its timings waiting).
        self.trust_offsets = trust_offsets
        self.baselines: OrderedDict[int, int] = OrderedDict()
        self.baselines_wanted: set[int] = set()
        self._series_per_trial: dict[tuple[int, int], int] = {}
        self.window = 0
        self.stats = AggregatorStats()
        self._trials: dict[tuple[int, int], _Trial] = {}
        # Highest stepsCompleted reported per (trial, run): a repeat would be merged by the
        # master and refused on overlapping keys, so steps must strictly increase.
        self.last_steps: OrderedDict[tuple[int, int], int] = OrderedDict()
        # (trial, run, series) -> (start_ns, count, sum) of the last cumulative histogram point
        self._hist_last: OrderedDict[tuple[int, int, str], tuple[int, int, float]] = OrderedDict()
        self._hist_trials: set[tuple[int, int]] = set()  # trials whose histograms we follow
        # (trial, run, timing) -> (calls, seconds) reported from spans, until its histogram
        # series starts: a series that starts later is counted beyond them, not in full
        self._span_calls: OrderedDict[tuple[int, int, str], tuple[int, float]] = OrderedDict()
        self.incomplete: list[str] = []  # descriptions from the last drain, for logging
        self.unsafe: list[str] = []  # restarted trials whose timings cannot be placed

    def _trial(self, trial_id: int, run_id: int) -> _Trial | None:
        key = (trial_id, run_id)
        state = self._trials.get(key)
        if state is None:
            if len(self._trials) >= self.max_trials:
                self.stats.dropped_trials += 1
                return None
            state = self._trials[key] = _Trial()
        state.last_seen = self.window
        return state

    def add_gauges(self, samples: list[GaugeSample]) -> list[GaugeSample]:
        """Add samples to the window; returns those taken (not over a per-trial limit)."""
        taken = []
        for s in samples:
            state = self._trial(s.trial_id, s.run_id)
            if state is None:
                continue
            if s.agent not in state.agents:
                if len(state.agents) >= self.max_agents_per_trial:
                    self.stats.dropped_agents += 1
                    continue
                state.agents.add(s.agent)
            taken.append(s)
            if s.group == self.timings_group:  # e.g. GPU energy per step: rides with timings
                tacc = state.timing_gauges.setdefault(s.key, [0.0, 0])
                tacc[0] += s.value
                tacc[1] += s.n
                continue
            add_up(state.gauges, (s.agent, s.group, s.sub, s.key), s.value, s.n, s.time_ns)
        return taken

    def histogram_deltas(self, points: list[HistogramPoint]) -> list[TimingSample]:
        """Timing samples (seconds and calls since the previous point) from histogram points.

        Cumulative points are differenced per series (a new start time or a lower count is
        a restarted producer: counted in full). A trial's first point is counted in full
        unless its timings were already reported: then beyond the calls reported from
        spans, or (reported before a bridge restart) as a baseline only, so nothing is
        counted twice. The training root span's histogram also carries the step count.
        """
        out: list[TimingSample] = []
        seen: set[tuple[int, int]] = set()
        for p in points:
            trial = (p.trial_id, p.run_id)
            seen.add(trial)
            max_step = -1
            if p.cumulative:
                key = (p.trial_id, p.run_id, p.series)
                last = self._hist_last.pop(key, None)
                if last is None:
                    known = self._series_per_trial.get(trial, 0)
                    if known >= self.max_series_per_trial:
                        self.stats.dropped_series += 1
                        continue
                    self._series_per_trial[trial] = known + 1
                self._hist_last[key] = (p.start_ns, p.calls, p.sum_s)
                while len(self._hist_last) > self.max_series:
                    gone = self._hist_last.popitem(last=False)[0][:2]
                    self._series_per_trial[gone] -= 1
                if last is not None and last[0] == p.start_ns and p.calls >= last[1]:
                    n, total = p.calls - last[1], max(0.0, p.sum_s - last[2])
                elif last is None and (spans := self._span_calls.pop((*trial, p.name), None)):
                    n, total = max(0, p.calls - spans[0]), max(0.0, p.sum_s - spans[1])
                elif last is None and trial not in self._hist_trials and trial in self.last_steps:
                    n, total = 0, 0.0  # baseline: earlier calls were already reported
                else:
                    n, total = p.calls, p.sum_s
                if p.is_step:
                    max_step = p.calls - 1 + STEP_INDEX_BASE
            else:
                n, total = p.calls, p.sum_s
            if n == 0 and max_step < 0:
                continue
            out.append(
                TimingSample(
                    p.trial_id, p.run_id, p.name, total, n, max_step, p.time_ns, p.offset,
                    p.per_batch, True,
                )
            )  # fmt: skip
        self._hist_trials |= seen
        return out

    def add_timings(self, samples: list[TimingSample]) -> None:
        for s in samples:
            state = self._trial(s.trial_id, s.run_id)
            if state is None:
                continue
            if s.from_histogram and not state.from_histograms:
                state.from_histograms = True
                state.timings.clear()  # this window's span sums: the histograms cover them
            if s.n > 0 and (s.from_histogram or not state.from_histograms):
                acc = state.timings.get(s.name)
                if acc is None:
                    if len(state.timings) >= self.max_timing_names:
                        self.stats.dropped_timing_names += 1
                        continue
                    acc = state.timings[s.name] = [0.0, 0]
                acc[0] += s.total_s
                acc[1] += s.n
            state.max_step = max(state.max_step, s.max_step)
            if (
                s.offset > 0
                and not self.trust_offsets
                and s.trial_id not in self.baselines
                and (s.trial_id, s.run_id) not in self.last_steps
            ):
                self.baselines_wanted.add(s.trial_id)
            state.offset = max(state.offset, s.offset)
            state.per_batch = max(1, s.per_batch)
            state.timing_time_ns = max(state.timing_time_ns, s.time_ns)

    def drain(self) -> list[Report]:
        """Close the current window and return its reports (profiling groups, then timings)."""
        self.incomplete = []
        self.unsafe = []
        reports: list[Report] = []
        for (trial_id, run_id), state in list(self._trials.items()):
            reports.extend(self._gauge_reports(trial_id, run_id, state))
            timing = self._timing_report(trial_id, run_id, state)
            if timing is not None:
                reports.append(timing)
            idle = self.window - state.last_seen > self.idle_windows
            if idle and not state.gauges and not state.timings:
                del self._trials[(trial_id, run_id)]
                if (trial_id, run_id) in self._hist_trials:  # forget its histogram series
                    self._hist_trials.discard((trial_id, run_id))
                    for key in [k for k in self._hist_last if k[:2] == (trial_id, run_id)]:
                        del self._hist_last[key]
                    self._series_per_trial.pop((trial_id, run_id), None)
                self.baselines_wanted.discard(trial_id)
        self.window += 1
        self.stats.windows += 1
        self.stats.reports += len(reports)
        return reports

    def _fresh(self, state: _Trial, key: tuple[str, str, str, str]) -> float | None:
        acc = state.gauges.get(key)
        if acc is not None:
            return acc[0] / acc[1]
        carried = state.last.get(key)
        if carried is not None and self.window - carried[1] <= self.carry_windows:
            return carried[0]
        return None

    def _gauge_reports(self, trial_id: int, run_id: int, state: _Trial) -> list[Report]:
        if not state.gauges:
            return []
        # (agent, group) -> {sub: None} in first-seen order, plus the latest point time.
        present: dict[tuple[str, str], tuple[dict[str, None], list[int]]] = {}
        for (agent, group, sub, _key), acc in state.gauges.items():
            subs, newest = present.setdefault((agent, group), ({}, [0]))
            subs[sub] = None
            newest[0] = max(newest[0], int(acc[2]))
        reports = []
        order = {g: i for i, g in enumerate(PROFILING_KEYS)}  # gpu, cpu, memory, disk, network
        for (agent, group), (subs, newest) in sorted(
            present.items(), key=lambda item: (item[0][0], order[item[0][1]])
        ):
            per_sub: dict[str, dict[str, float]] = {}
            for sub in subs:
                values = self._complete_keys(state, agent, group, sub)
                if values is None:
                    self.stats.incomplete_groups += 1
                    self.incomplete.append(f"trial {trial_id} agent {agent} group {group} {sub}")
                    continue
                per_sub[sub] = values
            if not per_sub:
                continue
            if group == "gpu":
                avg: dict[str, Any] = {agent: per_sub}
            else:
                avg = {agent: per_sub.get("", next(iter(per_sub.values())))}
            body = build_body(trial_id, run_id, group, avg, newest[0])
            reports.append(Report(trial_id, run_id, group, body))
        for key, acc in state.gauges.items():
            state.last[key] = (acc[0] / acc[1], self.window)
        state.gauges.clear()
        return reports

    def _complete_keys(
        self, state: _Trial, agent: str, group: str, sub: str
    ) -> dict[str, float] | None:
        values: dict[str, float] = {}
        for key in PROFILING_KEYS[group]:
            if key == "disk_iops":
                read = self._fresh(state, (agent, group, sub, DISK_IOPS_READ))
                write = self._fresh(state, (agent, group, sub, DISK_IOPS_WRITE))
                value = read + write if read is not None and write is not None else None
                if value is None:
                    value = self._fresh(state, (agent, group, sub, key))
            else:
                value = self._fresh(state, (agent, group, sub, key))
            if value is None:
                return None
            if not math.isfinite(value):  # the master would store it and fail to read it
                self.stats.invalid_values += 1
                return None
            values[key] = value
        return values

    def _timing_report(self, trial_id: int, run_id: int, state: _Trial) -> Report | None:
        if not state.timings:
            return None
        if state.max_step < 0:
            self.stats.timings_held += 1
            return None
        steps = self.safe_steps(run_id, state)
        if steps is not None:
            before = self.last_steps.get((trial_id, run_id))
            if before is None:
                before = self._first_baseline(trial_id, state)
                if before is None:  # the master has not said what it holds yet: wait
                    self.baselines_wanted.add(trial_id)
                    self.stats.timings_held += 1
                    return None
            steps = self._bounded_steps(state, steps, before)
        if steps is None:
            # A restarted trial without DET_STEPS_COMPLETED: any step count could archive
            # the user's rows of earlier runs. Not reported (counted, logged once).
            self.stats.timings_unsafe_steps += 1
            self.unsafe.append(
                f"trial {trial_id} run {run_id} was restarted but its DET_STEPS_COMPLETED "
                "is unknown; a stepsCompleted counted from 0 would make Determined archive "
                "the trial's earlier metrics"
            )
            state.timings.clear()
            state.timing_gauges.clear()
            return None
        if steps <= self.last_steps.get((trial_id, run_id), 0):
            # No new batch finished since the last report: keep accumulating.
            self.stats.timings_held += 1
            return None
        # Mean seconds per call are charted (one chart per key); the call counts go in
        # batchMetrics: stored and readable through the API, but not one chart each.
        avg: dict[str, float] = {}
        counts: dict[str, int] = {}
        for name, (total, count) in sorted(state.timings.items()):
            mean = total / count if count else math.nan
            if math.isfinite(mean):
                avg[f"{name}_s"] = mean
                counts[f"{name}_count"] = int(count)
            else:
                self.stats.invalid_values += 1
        for key, (total, n) in sorted(state.timing_gauges.items()):
            if n and math.isfinite(total / n):
                avg[key] = total / n
        state.timing_gauges.clear()
        if not avg:
            state.timings.clear()
            return None
        body = build_body(
            trial_id, run_id, self.timings_group, avg, state.timing_time_ns, steps, [counts]
        )
        self.remember_steps(trial_id, run_id, steps)
        if not state.from_histograms:  # span sums: a histogram series may start later
            for name, (total, count) in state.timings.items():
                calls, seconds = self._span_calls.pop((trial_id, run_id, name), (0, 0.0))
                self._span_calls[(trial_id, run_id, name)] = (calls + int(count), seconds + total)
            while len(self._span_calls) > self.max_series:
                self._span_calls.popitem(last=False)
        state.timings.clear()
        return Report(trial_id, run_id, self.timings_group, body)

    def _first_baseline(self, trial_id: int, state: _Trial) -> int | None:
        """What a trial's first report counts on from: the producer's DET_STEPS_COMPLETED
        where it is trusted (in process) or 0; at the bridge, a claimed offset only up to
        the batch count the master holds (None until known), which no earlier row is above."""
        claimed = max(state.offset, 0)
        if self.trust_offsets or claimed == 0:
            return claimed
        held = self.baselines.get(trial_id)
        return None if held is None else min(claimed, held)

    def set_baseline(self, trial_id: int, batches: int) -> None:
        """The batch count the master holds for a trial (asked by the pipeline)."""
        self.baselines[trial_id] = max(0, batches)
        self.baselines.move_to_end(trial_id)
        self.baselines_wanted.discard(trial_id)
        while len(self.baselines) > self.max_trials:
            self.baselines.popitem(last=False)

    def _bounded_steps(self, state: _Trial, steps: int, before: int) -> int:
        """At most what the trial can really have trained: `before` (the previous report, or
        `_first_baseline`) plus `max_steps_per_s` over the time since the previous report
        (or its first data) plus one window (trained before its first export)."""
        now = time.monotonic()
        elapsed = max(0.0, now - state.steps_clock) + self.window_s
        bound = before + 1 + int(self.max_steps_per_s * elapsed)
        state.steps_clock = now
        if steps > bound:
            self.stats.steps_clamped += 1
            return min(bound, INT32_MAX)
        return steps

    @staticmethod
    def safe_steps(run_id: int, state: _Trial) -> int | None:
        """The stepsCompleted for a timings report, or None when none is safe: this run's
        k-th batch is DET_STEPS_COMPLETED + k (Determined counts batches, otelprof `step()`
        calls, `per_batch` of them per batch)."""
        done = (state.max_step + 1 - STEP_INDEX_BASE) // state.per_batch
        if done < 1:
            return 0  # no whole batch yet: held until one is done
        if state.offset >= 0:
            base = state.offset
        elif run_id <= 1:
            base = 0  # a first run: there are no earlier runs' rows to archive
        else:
            return None
        return min(base + done, INT32_MAX)

    def remember_steps(self, trial_id: int, run_id: int, steps: int) -> None:
        """Record a reported step count (also used to restore state after a restart)."""
        key = (trial_id, run_id)
        self.last_steps[key] = max(steps, self.last_steps.get(key, 0))
        self.last_steps.move_to_end(key)
        while len(self.last_steps) > self.max_trials:
            self.last_steps.popitem(last=False)
