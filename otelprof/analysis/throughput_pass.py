"""Throughput and MFU per phase, from the work `otelprof.step_work()` puts on step spans
(the rules a user sees: docs/guide/timings.md, "Throughput and MFU").

Per phase and process: Σwork / Σ(root span durations), MFU = FLOP/s / peak; training step 0
left out unless it is a process's only step with work. A job's samples/s and tokens/s are
the sum over its processes, its MFU their mean. Where the step histogram counts more steps
than were kept (sampled traces), the training row comes from the counters over the
histogram's total step time instead (`_from_aggregates`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from otelprof._schema import (
    ATTR_FLOPS,
    ATTR_SAMPLES,
    ATTR_STEP,
    ATTR_TOKENS,
    PHASE_TRAIN,
    STEP_SPAN,
    TRAIN_SAMPLES,
    TRAIN_TOKENS,
)
from otelprof._schema import ATTR_PEAK_FLOPS as PEAK_ATTR
from otelprof._schema import ATTR_PHASE as PHASE_ATTR
from otelprof.analysis.aggregates import HistRec, SeriesKey, keep_latest
from otelprof.analysis.reader import PointRec, Resource, SpanRec

WORK_ATTRS = (ATTR_SAMPLES, ATTR_TOKENS, ATTR_FLOPS)
COUNTERS = {TRAIN_SAMPLES: "samples", TRAIN_TOKENS: "tokens"}


@dataclass
class _Acc:
    steps: int = 0
    seconds: float = 0.0
    samples: float | None = None
    tokens: float | None = None
    flops: float | None = None
    peak: float | None = None

    def add_work(self, name: str, amount: float | None) -> None:
        """Add to `samples`, `tokens` or `flops`: None until some step declares it."""
        if amount is not None:
            setattr(self, name, (getattr(self, name) or 0.0) + amount)


_WORK = ("samples", "tokens", "flops")  # _Acc's fields, in WORK_ATTRS' order
_COUNTED = ("samples", "tokens")  # _Acc's fields the COUNTERS total


@dataclass
class PhaseThroughput:
    phase: str
    processes: int
    steps: int
    seconds: float
    samples_per_s: float | None
    tokens_per_s: float | None
    flops_per_s: float | None
    mfu: float | None
    peak_flops: float | None
    from_aggregates: bool = False  # counters + step histogram: traces were sampled
    step0_only: bool = False  # a process's only training step was step 0 (no step() calls)


def in_steps(number: Any, steps: tuple[int | None, int | None]) -> bool:
    """Whether a span of step `number` is in [A, B) = `steps` (one without a step stays)."""
    if not isinstance(number, int):
        return True
    low, high = steps
    return (low is None or number >= low) and (high is None or number < high)


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


class ThroughputPass:
    """The throughput figures fed one record at a time, so the summary's single pass over
    the files computes them too."""

    def __init__(self, steps: tuple[int | None, int | None] | None = None) -> None:
        self.steps = steps
        self.accs: dict[tuple[str, Resource], _Acc] = {}
        self.kept_steps: dict[Resource, int] = {}  # kept training step spans, step 0 included
        self.step_hists: dict[SeriesKey, HistRec] = {}  # latest cumulative step histogram
        self.counters: dict[tuple[Resource, str], tuple[int, float]] = {}  # latest (time, total)
        # training step 0's work per process: the rate of a run that is that one step
        self.first_steps: dict[tuple[str, Resource], _Acc] = {}

    def feed(self, rec: SpanRec | PointRec | HistRec) -> None:
        steps = self.steps
        if isinstance(rec, HistRec):
            if rec.timing == STEP_SPAN and rec.phase == PHASE_TRAIN:
                keep_latest(self.step_hists, rec)
            return
        if isinstance(rec, PointRec):
            what = COUNTERS.get(rec.name)
            if (
                what
                and rec.kind == "sum"
                and dict(rec.attributes).get(PHASE_ATTR, PHASE_TRAIN) == PHASE_TRAIN
            ):
                key = (rec.resource, what)
                if rec.time_ns >= self.counters.get(key, (0, 0.0))[0]:
                    self.counters[key] = (rec.time_ns, rec.value)
            return
        if not isinstance(rec, SpanRec) or rec.parent_span_id:
            return
        if rec.name == STEP_SPAN and (rec.attr(PHASE_ATTR) or PHASE_TRAIN) == PHASE_TRAIN:
            self.kept_steps[rec.resource] = self.kept_steps.get(rec.resource, 0) + 1
        phase = rec.attr(PHASE_ATTR)
        number = rec.attr(ATTR_STEP)
        if steps is not None and not in_steps(number, steps):
            return
        first = False
        if rec.name == STEP_SPAN:
            phase = phase or PHASE_TRAIN
            first = phase == PHASE_TRAIN and number == 0 and steps is None
        elif not phase or phase != rec.name:
            return  # a root span that is no phase's batch
        work = [_number(rec.attr(key)) for key in WORK_ATTRS]
        if all(w is None for w in work):
            return
        accs = self.first_steps if first else self.accs
        acc = accs.setdefault((str(phase), rec.resource), _Acc())
        acc.steps += 1
        acc.seconds += max(0, rec.end_ns - rec.start_ns) / 1e9
        for name, amount in zip(_WORK, work, strict=True):
            acc.add_work(name, amount)
        peak = _number(rec.attr(PEAK_ATTR))
        if peak:
            acc.peak = peak

    def merge(self, other: ThroughputPass) -> None:
        """Fold in the pass over later files (the same as feeding their records here)."""
        for accs, theirs in ((self.accs, other.accs), (self.first_steps, other.first_steps)):
            for key, acc in theirs.items():
                mine = accs.get(key)
                if mine is None:
                    accs[key] = acc
                    continue
                mine.steps += acc.steps
                mine.seconds += acc.seconds
                for name in _WORK:
                    mine.add_work(name, getattr(acc, name))
                if acc.peak:
                    mine.peak = acc.peak
        for resource, kept in other.kept_steps.items():
            self.kept_steps[resource] = self.kept_steps.get(resource, 0) + kept
        for rec in other.step_hists.values():
            keep_latest(self.step_hists, rec)
        for ckey, latest in other.counters.items():
            if latest[0] >= self.counters.get(ckey, (0, 0.0))[0]:
                self.counters[ckey] = latest

    def result(self) -> list[PhaseThroughput]:
        """A row per phase that recorded any work. Training step 0 is left out, except for
        a process whose only training step with work it is (a run that never called
        `step()` is that one step): its rate is that step's, set-up included."""
        accs = dict(self.accs)
        only_first = [key for key in self.first_steps if key not in accs]
        for key in only_first:
            accs[key] = self.first_steps[key]
        sampled = False
        if self.steps is None:  # the histograms cannot be filtered by step number
            sampled = _from_aggregates(accs, self.kept_steps, self.step_hists, self.counters)
        by_phase: dict[str, list[_Acc]] = {}
        for (phase, _resource), acc in accs.items():
            by_phase.setdefault(phase, []).append(acc)
        out = []
        for phase, group in sorted(by_phase.items(), key=lambda kv: (kv[0] != PHASE_TRAIN, kv[0])):

            def rate(name: str, group: list[_Acc] = group) -> float | None:
                values = [
                    getattr(a, name) / a.seconds for a in group if getattr(a, name) is not None
                ]
                return sum(values) if values and all(a.seconds > 0 for a in group) else None

            mfus = [a.flops / a.seconds / a.peak for a in group if a.flops and a.peak and a.seconds]
            peaks = [a.peak for a in group if a.peak]
            out.append(
                PhaseThroughput(
                    phase=phase,
                    processes=len(group),
                    steps=sum(a.steps for a in group),
                    seconds=sum(a.seconds for a in group),
                    samples_per_s=rate("samples"),
                    tokens_per_s=rate("tokens"),
                    flops_per_s=rate("flops"),
                    mfu=sum(mfus) / len(mfus) if mfus else None,
                    peak_flops=max(peaks) if peaks else None,
                    from_aggregates=sampled and phase == PHASE_TRAIN,
                    step0_only=any(k[0] == phase for k in only_first),
                )
            )
        return out


def _from_aggregates(
    accs: dict[tuple[str, Resource], _Acc],
    kept_steps: dict[Resource, int],
    step_hists: dict[SeriesKey, HistRec],
    counters: dict[tuple[Resource, str], tuple[int, float]],
) -> bool:
    """Replace each sampled process's training figures by its counters over its step
    histogram; True if any was replaced."""
    replaced = False
    for hist in step_hists.values():
        resource = hist.resource
        acc = accs.get((PHASE_TRAIN, resource))
        if acc is None or hist.count <= kept_steps.get(resource, 0) or hist.sum <= 0:
            continue  # all steps were kept (exact spans stay), or no work was recorded
        flops_rate = acc.flops / acc.seconds if acc.flops is not None and acc.seconds else None
        acc.steps, acc.seconds = hist.count, hist.sum
        acc.samples, acc.tokens = (counters.get((resource, w), (0, None))[1] for w in _COUNTED)
        acc.flops = flops_rate * hist.sum if flops_rate is not None else None
        replaced = True
    return replaced
