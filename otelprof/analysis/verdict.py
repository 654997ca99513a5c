"""A plain-language verdict on a run's main bottleneck, with the evidence behind it.

The rule is deliberately simple and explainable: the largest direct part of step time (a
timing span directly under `step`, or the time no span covers) names the bottleneck; hardware
means qualify it (a dominant train_batch with a busy GPU is healthy compute-bound training,
with an idle GPU it points at CPU-side overhead). Stragglers among ranks are added as evidence.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from otelprof.analysis.stragglers import UNTIMED
from otelprof.analysis.summary import RunSummary

_COPY_NAMES = ("to_device", "from_device")
_GPU_BUSY = 0.7
_OTHERS_BUSY = 0.3  # host CPU beyond the process's own, as a share of all CPUs


@dataclass
class Verdict:
    kind: str  # short class, e.g. "data-loader bound"
    headline: str  # the sentence shown first
    evidence: list[str] = field(default_factory=list)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _hardware_clause(gpu: float | None, cpu: float | None, proc: float | None = None) -> str:
    """The hardware figure that tells the story: the GPU's, else the training process's own
    CPU (on a shared machine the host's CPU says little about this job), the host's named so."""
    if gpu is not None:
        return f"GPU utilization averages {_pct(gpu)}"
    if proc is not None:
        host = f"; the host's CPUs are {_pct(cpu)} busy, all processes" if cpu is not None else ""
        return (
            f"the training process uses {_pct(proc)} of the usable CPUs{host} "
            "(no GPU metrics in this run)"
        )
    if cpu is not None:
        return (
            f"the host's CPUs are {_pct(cpu)} busy, all processes (no process or GPU metrics "
            "in this run)"
        )
    return "no hardware metrics in this run"


def _contended(cpu: float | None, proc: float | None) -> bool:
    return proc is not None and cpu is not None and cpu - proc >= _OTHERS_BUSY


def _cpu_evidence(cpu: float | None, proc: float | None) -> list[str]:
    out = []
    if proc is not None:
        out.append(f"the training process's own CPU utilization averages {_pct(proc)}")
    if cpu is not None:
        out.append(f"host CPU utilization (all processes) averages {_pct(cpu)}")
    if proc is not None and cpu is not None and _contended(cpu, proc):
        out.append(
            f"other processes keep the host busy ({_pct(cpu - proc)} of its CPUs beyond this "
            "job's): training may be competing for CPU"
        )
    return out


def direct_shares(summary: RunSummary) -> dict[str, float]:
    """Direct-child shares of step time, plus the untimed remainder when positive."""
    shares = {n: s for n in summary.timings if (s := summary.share(n)) is not None}
    untimed = summary.untimed_share
    if untimed is not None and untimed > 0:
        shares[UNTIMED] = untimed
    return shares


def _stragglers(summary: RunSummary) -> list[str]:
    """Straggler evidence from one analysis: the collectives' (stragglers.py) when ranks
    timed collectives, since synchronous ranks' step times are equal by construction;
    step-time means only for ranks that never wait for each other."""
    report = summary.stragglers
    if report is not None and report.straggler is not None:
        return report.evidence()
    if report is not None and sum(1 for r in report.ranks if r.wait_s > 0) >= 2:
        return []  # the ranks wait for each other alike: no straggler
    means = {r.resource.label: r.steps.mean for r in summary.ranks.values() if r.steps.count}
    if len(means) < 2:
        return []
    out = []
    ordered = sorted(means.values())
    for label, m in sorted(means.items()):
        others = _median_without(ordered, m)
        if others > 0 and m >= 1.25 * others:
            out.append(
                f"straggler: {label} takes {m * 1e3:.1f} ms per step, {m / others:.2f}x the "
                f"median of the other ranks ({others * 1e3:.1f} ms; step time: no collectives "
                "were timed to show who waits)"
            )
    return out


def _median_without(ordered: list[float], value: float) -> float:
    """The median of sorted `ordered` with one `value` left out, without copying it
    (a report over 100,000 ranks compares each with the others: linear, not quadratic)."""
    gone = bisect.bisect_left(ordered, value)
    count = len(ordered) - 1

    def kept(i: int) -> float:
        return ordered[i if i < gone else i + 1]

    half = count // 2
    if count % 2:
        return kept(half)
    return (kept(half - 1) + kept(half)) / 2


def judge(summary: RunSummary) -> Verdict:
    """Name the main bottleneck of a run."""
    gpu = summary.gauge_mean("hw.gpu.utilization")
    cpu = summary.gauge_mean("system.cpu.utilization")
    proc = summary.gauge_mean("process.cpu.utilization")
    hw = _hardware_clause(gpu, cpu, proc)
    shares = direct_shares(summary)
    evidence = [
        f"{name} takes {_pct(share)} of step time"
        for name, share in sorted(shares.items(), key=lambda kv: -kv[1])[:4]
    ]
    if gpu is not None:
        evidence.append(f"GPU utilization averages {_pct(gpu)}")
    evidence.extend(_cpu_evidence(cpu, proc))
    evidence.extend(_stragglers(summary))
    if summary.unresolved_children:
        evidence.append(
            f"{summary.unresolved_children} spans had a parent that was never found "
            "(truncated run?); they are left out of the breakdown"
        )

    stragglers = summary.stragglers
    if stragglers is not None and stragglers.headline:
        # synchronous training: the slow rank sets every rank's pace, so it comes first
        return Verdict("straggler", stragglers.headline, evidence)
    if not summary.step.count:
        if not summary.timings:
            return Verdict("no timings", f"no timing spans in this run; {hw}", evidence)
        top = max(summary.timings.values(), key=lambda a: a.stats.total)
        return Verdict(
            "no steps",
            f"no step spans (call otelprof.step() each iteration for a breakdown); "
            f"the most time is in {top.name} ({top.stats.total:.2f} s in total); {hw}",
            evidence,
        )

    copies = sum(shares.get(n, 0.0) for n in _COPY_NAMES)
    ranked = sorted(
        [(s, n) for n, s in shares.items() if n not in _COPY_NAMES]
        + ([(copies, "copies")] if copies > 0 else []),
        reverse=True,
    )
    if not ranked or ranked[0][0] <= 0:
        return Verdict(
            "no breakdown",
            f"steps have no timing spans inside them, so there is no breakdown; {hw}",
            evidence,
        )
    share, name = ranked[0]

    def bound(kind: str, why: str) -> Verdict:
        return Verdict(kind, f"{kind}: {why}", evidence)

    if name == "dataloader_next":
        return bound(
            "data-loader bound", f"dataloader_next takes {_pct(share)} of step time while {hw}"
        )
    if name == "copies":
        parts = " + ".join(f"{n} {_pct(shares[n])}" for n in _COPY_NAMES if n in shares)
        return bound(
            "host-device copy bound", f"copies take {_pct(share)} of step time ({parts}) while {hw}"
        )
    if name == "train_batch":
        if gpu is None and _contended(cpu, proc):
            return bound(
                "compute bound, CPU contended",
                f"train_batch takes {_pct(share)} of step time while {hw}: other work on this "
                "machine slows training",
            )
        if gpu is None:
            return bound("compute bound", f"train_batch takes {_pct(share)} of step time; {hw}")
        if gpu >= _GPU_BUSY:
            return Verdict(
                "GPU compute bound",
                f"GPU compute bound (healthy): train_batch takes {_pct(share)} of step time "
                f"and {hw}",
                evidence,
            )
        return Verdict(
            "train_batch bound, GPU under-used",
            f"train_batch takes {_pct(share)} of step time but {hw}: look for CPU-side "
            "overhead, synchronisation or batches too small for the GPU",
            evidence,
        )
    if name == UNTIMED:
        return bound(
            "untimed work",
            f"{_pct(share)} of step time is outside every timing span (wrap it in "
            f"otelprof.timing() to see what it is); {hw}",
        )
    return bound(f"{name} bound", f"{name} takes {_pct(share)} of step time while {hw}")
