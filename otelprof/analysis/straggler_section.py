"""The per-rank "waiting vs own work" section of every report format (see stragglers.py)."""

from __future__ import annotations

from otelprof.analysis.sections import Section, section
from otelprof.analysis.stragglers import SPLIT_TITLE, split_rows
from otelprof.analysis.summary import RunSummary


@section
def stragglers(summary: RunSummary) -> Section | None:
    """Per rank: step time split into own work and waiting in collectives, and where."""
    rows = split_rows(summary.stragglers)
    if not rows:
        return None
    report = summary.stragglers
    headline = report.headline if report is not None else None
    notes = [headline] if headline else ["no straggler: the ranks wait for each other alike"]
    notes.append(
        "waiting = time in collectives (torch.distributed calls, DDP's gradient all-reduce): "
        "communication plus waiting for slower ranks; the straggler waits least"
    )
    return Section("stragglers", SPLIT_TITLE, rows, notes)
