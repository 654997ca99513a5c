"""Helpers for the framework integration tests: read a run's spans as step breakdowns."""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from otelprof.cli import main as cli_main
from tests.otlp_files import Span, read_spans

INSTRUMENT = {"host_metrics": False, "gpus": "none", "process_metrics": False}


def spans_of(run_dir: Path) -> list[Span]:
    spans: list[Span] = []
    for path in sorted(run_dir.glob("traces*.jsonl")):
        spans.extend(read_spans(path))
    return spans


def roots(spans: list[Span], name: str) -> list[Span]:
    return sorted((s for s in spans if s.name == name and not s.parent_span_id),
                  key=lambda s: s.start_ns)  # fmt: skip


def children(spans: list[Span], parent: Span) -> dict[str, list[Span]]:
    """Direct children of `parent` by name."""
    out: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        if s.parent_span_id == parent.span_id and s.trace_id == parent.trace_id:
            out[s.name].append(s)
    return out


def in_order(*spans: Span) -> bool:
    """Each span ends before the next starts (the phases of a step do not overlap)."""
    return all(a.end_ns <= b.start_ns for a, b in itertools.pairwise(spans))


def report_json(run_dir: Path, capsys: Any) -> dict[str, Any]:
    capsys.readouterr()
    assert cli_main(["report", str(run_dir), "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def expected_train_rate(steps: list[Span], per_step: float) -> float:
    """Σwork / Σstep time over training steps 1.. (step 0 is warm-up), from the spans."""
    later = [s for s in steps if s.attributes["otelprof.step"] != 0]
    return per_step * len(later) / math.fsum((s.end_ns - s.start_ns) / 1e9 for s in later)
