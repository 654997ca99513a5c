"""Stragglers in synchronous training: who makes the others wait, and where its time goes.

Synchronous data parallelism makes every rank's step as long as the slowest rank's, so step
times cannot name a straggler; collectives can: the rank that arrives late waits least in
them. From the collective spans (`otelprof.collective`), each rank's step splits into
**waiting** (time in collectives, by the direct part of the step that holds them) and **own
work** (each direct part minus its collectives, plus `(untimed)`). The straggler is the rank
that waits least when the others wait clearly longer (`MIN_WAIT_GAP_S` and
`MIN_WAIT_GAP_SHARE` of the step); its extra time is its own work beyond the others' median.

Bounded: spans are grouped by (rank, step) in a window of recent steps per rank; a step still
incomplete when it leaves the window is folded with what it has.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from otelprof._schema import (
    ATTR_ATTEMPT,
    ATTR_COLLECTIVE,
    COLLECTIVE_SPAN_PREFIX,
    DDP_COLLECTIVE,
    DDP_SPAN,
    STEP_SPAN,
    TORCH_STEP_RANGE,
    is_torch_step_range,
)
from otelprof.analysis.reader import Resource, SpanRec

UNTIMED = "(untimed)"
MIN_WAIT_GAP_S = 1e-3
MIN_WAIT_GAP_SHARE = 0.05
_WINDOW_STEPS = 64  # open (rank, step) groups kept per rank
_COLLECTIVE_PREFIXES = (COLLECTIVE_SPAN_PREFIX, DDP_SPAN)  # _distributed.collectives' spans


_Child = tuple[str, str, str, int, int, bool]  # span id, parent id, name, start, end, collective


@dataclass
class _StepGroup:
    step_id: str = ""
    step_s: float = 0.0
    step_end: int = 0
    children: list[_Child] = field(default_factory=list)
    collectives: list[tuple[str, str, str, int, int]] = field(default_factory=list)


@dataclass
class RankWork:
    """Sums over one rank's steps (seconds)."""

    resource: Resource
    steps: int = 0
    step_s: float = 0.0
    wait_s: float = 0.0
    own: dict[str, float] = field(default_factory=dict)  # direct part -> own work
    wait_in: dict[str, float] = field(default_factory=dict)  # direct part -> waiting
    wait_op: dict[str, float] = field(default_factory=dict)  # collective -> waiting

    @property
    def label(self) -> str:
        return self.resource.label

    def per_step(self, total: float) -> float:
        return total / self.steps if self.steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "process": self.label,
            "rank": self.resource.rank,
            "host": self.resource.host,
            "attempt": self.resource.get(ATTR_ATTEMPT),
            "steps": self.steps,
            "step_ms": 1e3 * self.per_step(self.step_s),
            "wait_ms": 1e3 * self.per_step(self.wait_s),
            "own_ms": self._ms_per_step(self.own),
            "wait_in_ms": self._ms_per_step(self.wait_in),
            "wait_by_collective_ms": self._ms_per_step(self.wait_op),
        }

    def _ms_per_step(self, sums: dict[str, float]) -> dict[str, float]:
        return {k: 1e3 * self.per_step(v) for k, v in sorted(sums.items())}


@dataclass
class StragglerReport:
    """Per-rank split of step time, and the straggler if there is one."""

    ranks: list[RankWork]
    straggler: RankWork | None = None
    extra_s: float = 0.0  # own work beyond the others' median own work, per step
    extra_in: str = ""  # the direct part that holds most of it
    extra_in_s: float = 0.0
    others_wait_in: str = ""  # where the others wait for it
    others_wait_op: str = ""
    others_wait_s: float = 0.0
    extras: dict[str, float] = field(default_factory=dict)  # part -> own work beyond median

    def name(self, rank: RankWork) -> str:
        """ "rank 3", or "rank 3 on node2" when the job's ranks ran on several hosts."""
        hosts = {r.resource.host for r in self.ranks}
        short = _short(rank)
        return f"{short} on {rank.resource.host}" if len(hosts) > 1 else short

    @property
    def headline(self) -> str | None:
        s = self.straggler
        if s is None:
            return None
        where = "outside any timing" if self.extra_in == UNTIMED else f"in {self.extra_in}"
        return (
            f"{self.name(s)} is the straggler: it arrives late, with +{1e3 * self.extra_in_s:.1f} "
            f"ms per step of own work {where} beyond the other ranks' median; "
            f"{self.waiting_sentence}"
        )

    @property
    def waiting_sentence(self) -> str:
        """What the others' waiting measures, in words (headline and evidence)."""
        wait, op = self.others_wait_in, self.others_wait_op
        # the span the collective's waiting is on (`otelprof.collective` → span name)
        span = DDP_SPAN if op == DDP_COLLECTIVE else f"{COLLECTIVE_SPAN_PREFIX}{op}"
        if op and span != wait:  # the collective, named as in the timings table
            wait = f"{wait}, in {span}"
        name = self.name(self.straggler) if self.straggler is not None else "it"
        return (
            f"the other ranks wait for it: they spend {1e3 * self.others_wait_s:.1f} ms per step "
            f"longer in collectives than {name} (median), in {wait}"
        )

    def evidence(self) -> list[str]:
        """The same analysis's figures, each saying what it measures (verdict evidence)."""
        s = self.straggler
        if s is None:
            return []
        name = self.name(s)
        return [
            f"{name} arrives late: its own work (step time outside collectives) exceeds the "
            f"other ranks' median by {1e3 * self.extra_s:.1f} ms per step ({self.parts_text} ms)",
            self.waiting_sentence,
        ]

    @property
    def parts_text(self) -> str:
        """Where `extra_s` goes, part by part (the largest first, lower parts included), the
        figures adding up to it: "untimed +322.4, train_batch -31.0"; with more than two
        ranks a median of sums is no sum of medians, and "other parts" holds the rest."""
        shown = sorted(self.extras.items(), key=lambda kv: -abs(kv[1]))[:3]
        shown = [(n, v) for n, v in shown if round(1e3 * v, 1)]
        rest = self.extra_s - sum(v for _, v in shown)
        if round(1e3 * rest, 1):
            shown.append(("other parts", rest))
        return ", ".join(
            f"{'untimed' if n == UNTIMED else n} {1e3 * v:+.1f}"
            for n, v in sorted(shown, key=lambda kv: -kv[1])
        )

    def to_dict(self) -> dict[str, Any]:
        s = self.straggler
        return {
            "ranks": [r.to_dict() for r in self.ranks],
            "straggler": None
            if s is None
            else {
                "process": s.label,
                "rank": s.resource.rank,
                "host": s.resource.host,
                "extra_ms_per_step": 1e3 * self.extra_s,
                "extra_in": self.extra_in,
                "extra_in_ms_per_step": 1e3 * self.extra_in_s,
                "others_wait_in": self.others_wait_in,
                "others_wait_collective": self.others_wait_op,
                "others_wait_ms_per_step": 1e3 * self.others_wait_s,
                "headline": self.headline,
                "evidence": self.evidence(),
                "measures": {
                    "extra_ms_per_step": "arrives late: the straggler's own work (step time "
                    "outside collectives) beyond the other ranks' median, per step",
                    "extra_in_ms_per_step": "the part of extra_ms_per_step in extra_in",
                    "others_wait_ms_per_step": "waits for others: how much longer the other "
                    "ranks (median) spend in collectives per step than the straggler",
                },
            },
        }


def _short(rank: RankWork) -> str:
    r = rank.resource.rank
    attempt = rank.resource.get(ATTR_ATTEMPT)
    name = f"rank {r}" if r is not None else rank.label
    return f"{name} (attempt {attempt})" if attempt else name


def _parts(group: _StepGroup) -> list[_Child]:
    """The step's direct parts, a range that wraps the step (torch's `ProfilerStep#N`, or
    one with children open past the step's end) opened up into its children, as the
    report's breakdown does (summary._StepResolver)."""
    direct = [c for c in group.children if c[1] == group.step_id]
    end = group.step_end
    if not any(c[4] > end or c[2].startswith(TORCH_STEP_RANGE) for c in direct):
        return direct  # nothing wraps the step: the common case, one pass
    by_parent: dict[str, list[_Child]] = {}
    for child in group.children:
        by_parent.setdefault(child[1], []).append(child)
    parts = []
    todo = list(direct)
    while todo:
        child = todo.pop(0)
        inside = by_parent.get(child[0])
        if is_torch_step_range(child[2]) or (inside and child[4] > end):
            todo.extend(inside or ())
        else:
            parts.append(child)
    return parts


class StragglerPass:
    """Fed every span of a run (`span()`), then `result()`."""

    def __init__(self) -> None:
        self._ranks: dict[Resource, RankWork] = {}
        self._open: dict[Resource, OrderedDict[Any, _StepGroup]] = {}

    def span(self, rec: SpanRec) -> None:
        groups = self._open.get(rec.resource)
        if groups is None:
            groups = self._open[rec.resource] = OrderedDict()
        key = rec.trace_id
        group = groups.get(key)
        if group is None:
            group = groups[key] = _StepGroup()
            if len(groups) > _WINDOW_STEPS:
                _, oldest = groups.popitem(last=False)
                self._fold(rec.resource, oldest)
        if rec.name == STEP_SPAN and not rec.parent_span_id:
            group.step_id = rec.span_id
            group.step_s = (rec.end_ns - rec.start_ns) / 1e9
            group.step_end = rec.end_ns
            return
        # only otelprof's collective spans carry the attribute, and they have these names:
        # skip the attribute scan for every other span (the report's hot loop)
        op = rec.attr(ATTR_COLLECTIVE) if rec.name.startswith(_COLLECTIVE_PREFIXES) else None
        item = (rec.span_id, rec.parent_span_id, rec.name, rec.start_ns, rec.end_ns)
        if op is not None:
            group.collectives.append((*item[:2], str(op), *item[3:]))
        group.children.append((*item, op is not None))

    def _fold(self, resource: Resource, group: _StepGroup) -> None:
        if not group.step_id:
            return  # a step whose root never arrived (truncated run): left out
        work = self._ranks.get(resource)
        if work is None:  # not setdefault: it would build a RankWork per step
            work = self._ranks[resource] = RankWork(resource)
        direct = _parts(group)
        work.steps += 1
        work.step_s += group.step_s
        timed = 0.0
        inside: dict[str, float] = {}  # direct child span id -> collective time inside it
        for span_id, _parent, op, start, end in group.collectives:
            dur = (end - start) / 1e9
            work.wait_s += dur
            work.wait_op[op] = work.wait_op.get(op, 0.0) + dur
            holder = next((c for c in direct if c[0] == span_id), None) or next(
                (c for c in direct if c[3] <= start and end <= c[4]), None
            )
            where = holder[2] if holder else UNTIMED
            work.wait_in[where] = work.wait_in.get(where, 0.0) + dur
            key = holder[0] if holder is not None else ""  # "": outside every direct part
            inside[key] = inside.get(key, 0.0) + dur
        for span_id, _parent, name, start, end, _is_collective in direct:
            dur = (end - start) / 1e9
            timed += dur
            own = max(0.0, dur - inside.get(span_id, 0.0))
            work.own[name] = work.own.get(name, 0.0) + own
        untimed = max(0.0, group.step_s - timed - inside.get("", 0.0))
        work.own[UNTIMED] = work.own.get(UNTIMED, 0.0) + untimed

    def close(self) -> None:
        """Fold every step still open (the end of the spans fed; each rank's steps fold in
        the order they came, as the window does)."""
        for resource, groups in self._open.items():
            while groups:
                _, group = groups.popitem(last=False)
                self._fold(resource, group)
        self._open.clear()

    def merge(self, other: StragglerPass) -> None:
        """Fold in a closed pass over other files (sums per rank; a rank's steps all come
        from its own trace file, so its sums are those of one pass)."""
        other.close()
        for resource, theirs in other._ranks.items():
            work = self._ranks.get(resource)
            if work is None:
                self._ranks[resource] = theirs
                continue
            work.steps += theirs.steps
            work.step_s += theirs.step_s
            work.wait_s += theirs.wait_s
            for mine, more in (
                (work.own, theirs.own),
                (work.wait_in, theirs.wait_in),
                (work.wait_op, theirs.wait_op),
            ):
                for key, value in more.items():
                    mine[key] = mine.get(key, 0.0) + value

    def result(self) -> StragglerReport:
        self.close()
        ranks = sorted(
            (w for w in self._ranks.values() if w.steps),
            key=lambda w: (w.resource.rank if w.resource.rank is not None else -1, w.label),
        )
        return _judge(ranks)


def own_work(rank: RankWork) -> float:
    """Step time outside collectives, per step (the per-rank table's "own work ms")."""
    return rank.per_step(rank.step_s - rank.wait_s)


def _judge(ranks: list[RankWork]) -> StragglerReport:
    report = StragglerReport(ranks)
    timed = [r for r in ranks if r.wait_s > 0]
    if len(timed) < 2:
        return report
    waits = {id(r): r.per_step(r.wait_s) for r in timed}
    straggler = min(timed, key=lambda r: waits[id(r)])
    others = [r for r in timed if r is not straggler]
    others_wait = statistics.median(waits[id(r)] for r in others)
    gap = others_wait - waits[id(straggler)]
    step = statistics.median(r.per_step(r.step_s) for r in timed)
    if gap < max(MIN_WAIT_GAP_S, MIN_WAIT_GAP_SHARE * step):
        return report
    extra = _beyond_median(straggler, others, "own")
    where = max(extra, key=lambda n: extra[n])
    # where the others wait longest: the straggler's figure furthest below their median
    wait_in = _beyond_median(straggler, others, "wait_in")
    by_op = _beyond_median(straggler, others, "wait_op")
    report.straggler = straggler
    # the table's own figure: step time outside collectives, against the others' median
    report.extra_s = own_work(straggler) - statistics.median(own_work(r) for r in others)
    report.extra_in = where
    report.extra_in_s = extra[where]
    report.others_wait_in = min(wait_in, key=lambda n: wait_in[n])
    report.others_wait_op = min(by_op, key=lambda n: by_op[n]) if by_op else ""
    report.others_wait_s = gap
    report.extras = extra
    return report


def _beyond_median(straggler: RankWork, others: list[RankWork], field: str) -> dict[str, float]:
    """Per key of the `field` sums (own, wait_in, wait_op): the straggler's per step minus
    the other ranks' median."""

    def per_step(rank: RankWork, key: str) -> float:
        return rank.per_step(getattr(rank, field).get(key, 0.0))

    names = set(getattr(straggler, field)).union(*(getattr(r, field) for r in others))
    return {
        n: per_step(straggler, n) - statistics.median(per_step(r, n) for r in others) for n in names
    }


SPLIT_TITLE = "Waiting vs own work per rank (ms per step; waiting = time in collectives)"


def split_rows(report: StragglerReport | None) -> list[dict[str, Any]]:
    """Rows of the per-rank section (empty: fewer than two ranks, or no collectives timed)."""
    if report is None or len(report.ranks) < 2 or not any(r.wait_s for r in report.ranks):
        return []
    rows = []
    for r in report.ranks:
        step = r.per_step(r.step_s)
        wait = r.per_step(r.wait_s)
        parts = sorted(r.own.items(), key=lambda kv: -kv[1])
        rows.append(
            {
                "process": r.label,
                "straggler": r is report.straggler,
                "steps": r.steps,
                "step ms": round(1e3 * step, 3),
                "own work ms": round(1e3 * own_work(r), 3),
                "waiting ms": round(1e3 * wait, 3),
                "waits in": ", ".join(
                    f"{n} {1e3 * r.per_step(v):.2f}"
                    for n, v in sorted(r.wait_in.items(), key=lambda kv: -kv[1])
                ),
                "own work by part": ", ".join(
                    f"{n} {1e3 * r.per_step(v):.2f}" for n, v in parts[:4] if v > 0
                ),
            }
        )
    return rows
