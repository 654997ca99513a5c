"""`otelprof demo` (what `make demo` runs): real training in detached mode, then the report."""

from __future__ import annotations

import json
from pathlib import Path

from tests.demo_runs import run_demo
from tests.otlp_files import read_points, read_spans
from tests.spec import DETERMINED_TIMINGS


def test_demo_trains_in_detached_mode_and_prints_the_report(tmp_path: Path) -> None:
    result, run_dir = run_demo(tmp_path, "--steps", "40", "--interval", "0.2")
    assert str(run_dir) in result.stdout.replace("\n", "")
    spans = read_spans(run_dir / "traces.jsonl")
    steps = [s for s in spans if s.name == "step"]
    assert len(steps) == 40
    names = {s.name for s in spans}
    assert set(DETERMINED_TIMINGS) <= names
    assert {"forward", "backward", "optimizer_step"} <= names  # record_function + hook spans
    points = read_points(run_dir / "metrics.jsonl")
    assert {"system.cpu.utilization", "system.network.throughput"} <= {p.name for p in points}
    info = json.loads((run_dir / "run.json").read_text())
    assert info["stats"]["dropped_total"] == 0
    # the report at the end names every timing of the step breakdown
    for name in DETERMINED_TIMINGS:
        assert name in result.stdout
