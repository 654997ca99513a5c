"""`otelprof demo` (what `make demo` runs): real training in detached mode, then the report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.otlp_files import read_points, read_spans
from tests.spec import DETERMINED_TIMINGS


def test_demo_trains_in_detached_mode_and_prints_the_report(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "otelprof",
            "demo",
            "--steps",
            "40",
            "--interval",
            "0.2",
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
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
