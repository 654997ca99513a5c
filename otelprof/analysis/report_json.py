"""`otelprof report --json`: the report's figures as one JSON document.

Built from the same structured summary and rows as the text report (tables.py,
problems.py, sections.py), so the two never disagree. Durations are seconds, shares are
fractions of summed step time, absent values are null.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from otelprof.analysis.problems import notes, problems
from otelprof.analysis.sections import Section
from otelprof.analysis.summary import RunSummary
from otelprof.analysis.tables import hardware_series, rank_rows, timing_rows
from otelprof.analysis.verdict import Verdict

SCHEMA_VERSION = 1


def json_safe(value: Any) -> Any:
    """NaN and infinities become null (JSON has neither); containers recursively (also
    `otelprof compare --json`'s)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def build_json(summary: RunSummary, verdict: Verdict, sections: list[Section]) -> dict[str, Any]:
    """The whole report as a JSON-ready dict (`otelprof report --json`)."""
    files = summary.files
    step = summary.step
    covered = (
        (summary.last_ns - summary.first_ns) / 1e9
        if summary.first_ns is not None and summary.last_ns is not None
        else None
    )
    doc: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "run": {
            "run_ids": files.run_ids,
            "dirs": [str(d) for d in files.dirs],
            "files": len(files.jsonl),
            "bytes": summary.read.bytes,
            "spans": summary.read.spans,
            "metric_points": summary.read.points,
            "processes": summary.processes,
            "first_unix_nano": summary.first_ns,
            "last_unix_nano": summary.last_ns,
            "covered_s": covered,
            "bad_lines": summary.read.bad_lines,
            "skipped_items": summary.read.skipped_items,
            "ends": [i.get("end") for i in files.run_info],
        },
        "problems": [dataclasses.asdict(p) for p in problems(summary)],
        "notes": notes(summary),
        "steps": {
            "range": list(summary.steps_range) if summary.steps_range else None,
            "count": step.count,
            "mean_s": step.mean if step.count else None,
            "p50_s": step.percentile(50) if step.count else None,
            "p95_s": step.percentile(95) if step.count else None,
            "total_s": step.total,
            "step0_s": summary.step0_s,
        },
        "timings": [dataclasses.asdict(r) for r in timing_rows(summary)],
        "failed_spans": dict(summary.failed_spans),
        "processes": [dataclasses.asdict(r) for r in rank_rows(summary)],
        "hardware": [
            {
                "host": s.host,
                "scope": s.scope,
                "device": s.device,
                "metric": s.name,
                "unit": s.unit,
                "min": s.min,
                "mean": s.mean,
                "max": s.max,
                "samples": s.count,
            }
            for s in hardware_series(summary)
        ],
        "counters": dict(summary.counters),
        "verdict": dataclasses.asdict(verdict),
        # the analysis behind the verdict's straggler sentences, with what each figure measures
        "stragglers": summary.stragglers.to_dict() if summary.stragglers is not None else None,
        "sections": {s.key: {"title": s.title, "rows": s.rows, "notes": s.notes} for s in sections},
    }
    cleaned: dict[str, Any] = json_safe(doc)
    return cleaned
