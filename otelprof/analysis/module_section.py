"""The report's per-module view: forward and backward time of a model's parts.

From the `module.forward:` / `module.backward:` ranges `module_timings=<depth>` records
(`_module_timings.py`), training first. A module's time includes its submodules'; these
ranges are kept out of the step breakdown, whose parts already hold them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from otelprof._schema import MODULE_BACKWARD_PREFIX, MODULE_FORWARD_PREFIX
from otelprof.analysis.sections import Section, section
from otelprof.analysis.summary import RunSummary

TOP = 15
"""Modules the section lists."""


@dataclass
class ModuleTime:
    """One module's forward and backward in one phase (seconds)."""

    module: str  # "<Model>.<path>", with " (<phase>)" outside training
    forward_s: float = 0.0
    forward_calls: int = 0
    backward_s: float = 0.0
    backward_calls: int = 0

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def module_times(summary: RunSummary) -> list[ModuleTime]:
    """Every timed module, the most time first."""
    out: dict[str, ModuleTime] = {}
    for name, agg in summary.timings.items():
        if name.startswith(MODULE_FORWARD_PREFIX):
            key, forward = name[len(MODULE_FORWARD_PREFIX) :], True
        elif name.startswith(MODULE_BACKWARD_PREFIX):
            key, forward = name[len(MODULE_BACKWARD_PREFIX) :], False
        else:
            continue
        row = out.setdefault(key, ModuleTime(key))
        if forward:
            row.forward_s += agg.stats.total
            row.forward_calls += agg.stats.count
        else:
            row.backward_s += agg.stats.total
            row.backward_calls += agg.stats.count
    return sorted(out.values(), key=lambda r: -r.total_s)


def _ms(seconds: float, calls: int) -> float | None:
    return round(1e3 * seconds / calls, 3) if calls else None


@section
def modules(summary: RunSummary) -> Section | None:
    """The modules that take the most time (see the module docstring)."""
    times = module_times(summary)
    if not times:
        return None
    step_total = summary.step.total
    rows = []
    for t in times[:TOP]:
        in_training = not t.module.endswith(")")
        share = t.total_s / step_total if step_total and in_training else math.nan
        rows.append(
            {
                "module": t.module,
                "forward ms": _ms(t.forward_s, t.forward_calls),
                "backward ms": _ms(t.backward_s, t.backward_calls),
                "calls": t.forward_calls,
                "total s": round(t.total_s, 4),
                "% of step time": None if math.isnan(share) else round(100 * share, 1),
            }
        )
    notes = [
        "forward/backward ms: mean per call; a module's time includes its submodules'; a "
        "module whose inputs need no gradient (a model's first layer) has its backward end "
        "with the backward pass"
    ]
    if len(times) > TOP:
        notes.append(f"{len(times) - TOP} more module(s) in the JSON report's timings")
    return Section("modules", f"Top modules (of {len(times)})", rows, notes)
