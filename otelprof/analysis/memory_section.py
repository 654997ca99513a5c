"""The report's memory by phase: this process's RSS and, with `memory_peaks`, the CUDA
allocator's peak, for each phase (docs/guide/timings.md, "Memory by phase").

From the phase-labelled gauges the run exported (`system/memory_peaks.py`). Several
processes: the largest process's figure, and the mean over every process's samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from otelprof._schema import ATTR_PHASE, CUDA_PEAK_ALLOCATED, CUDA_PEAK_RESERVED, MEMORY_BY_PHASE
from otelprof._schema import PHASE_TRAIN as TRAIN
from otelprof.analysis.sections import Section, section
from otelprof.analysis.summary import RunSummary

MiB = float(1 << 20)
_CUDA_CURRENT = "otelprof.torch.cuda.memory.allocated"
MEMORY_GAUGES = (MEMORY_BY_PHASE, CUDA_PEAK_ALLOCATED, CUDA_PEAK_RESERVED)


@dataclass
class PhaseMemory:
    """Memory figures of one phase, bytes (None: not recorded)."""

    phase: str
    rss_max: float | None = None
    rss_mean: float | None = None
    cuda_peak_allocated: float | None = None
    cuda_peak_reserved: float | None = None
    processes: set[str] = field(default_factory=set)
    _rss_total: float = 0.0
    _rss_count: int = 0


def _most(a: float | None, b: float) -> float:
    return b if a is None else max(a, b)


def memory_by_phase(summary: RunSummary) -> list[PhaseMemory]:
    """Per phase, training first, then the others by name."""
    phases: dict[str, PhaseMemory] = {}
    for s in summary.series.values():
        if s.name not in MEMORY_GAUGES or not s.count or not math.isfinite(s.max):
            continue
        phase = str(dict(s.attrs).get(ATTR_PHASE, TRAIN))
        row = phases.setdefault(phase, PhaseMemory(phase))
        row.processes.add(s.scope)
        if s.name == MEMORY_BY_PHASE:
            row.rss_max = _most(row.rss_max, s.max)
            row._rss_total += s.total
            row._rss_count += s.count
            row.rss_mean = row._rss_total / row._rss_count
        elif s.name == CUDA_PEAK_ALLOCATED:
            row.cuda_peak_allocated = _most(row.cuda_peak_allocated, s.max)
        else:
            row.cuda_peak_reserved = _most(row.cuda_peak_reserved, s.max)
    return sorted(phases.values(), key=lambda r: (r.phase != TRAIN, r.phase))


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value / MiB, 1)


@section
def memory(summary: RunSummary) -> Section | None:
    """RSS and CUDA peaks per phase (see the module docstring)."""
    rows = memory_by_phase(summary)
    if not rows:
        return None
    cuda = any(r.cuda_peak_allocated is not None for r in rows)
    table = []
    for r in rows:
        row: dict[str, str | float | int | None] = {
            "phase": r.phase,
            "RSS max MiB": _mib(r.rss_max),
            "RSS mean MiB": _mib(r.rss_mean),
        }
        if cuda:
            row["CUDA peak allocated MiB"] = _mib(r.cuda_peak_allocated)
            row["CUDA peak reserved MiB"] = _mib(r.cuda_peak_reserved)
        row["processes"] = len(r.processes)
        table.append(row)
    notes = [
        "RSS: each process's resident memory, sampled every interval and labelled with the "
        "phase running at the sample (max: the largest process's highest sample)"
    ]
    if cuda:
        notes.append(
            "CUDA peaks: the caching allocator's highest bytes at any moment of the phase "
            "(its peak counters read and reset every interval and at each change of phase: "
            "memory_peaks)"
        )
    elif any(s.name == _CUDA_CURRENT for s in summary.series.values()):
        notes.append(
            "this run used CUDA: memory_peaks=True (OTELPROF_MEMORY_PEAKS=1) adds the "
            "allocator's peak per phase"
        )
    return Section("memory", "Memory by phase", table, notes)
