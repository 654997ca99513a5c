"""The README's usage example runs as written on a CPU-only machine, and says where its run went."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def usage_example() -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Usage\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's Usage section has no python block"
    return match.group(1)


def test_readme_usage_example_runs_on_cpu_and_prints_its_run_directory(tmp_path: Path) -> None:
    code = usage_example()
    assert "zero_grad()" in code
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    for name in ("OTELPROF_OUTPUT_DIR", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTELPROF_ENDPOINT"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = list((tmp_path / "otelprof-runs").iterdir())
    # logging is not configured by the example: the run directory still shows, by default
    assert f"writing run files to otelprof-runs/{run.name}" in result.stderr
    info = json.loads((run / "run.json").read_text())
    assert info["end"]["status"] == "clean"
    assert info["stats"]["timings.steps"] == 2 * 8  # 2 epochs x 512/64 batches
    report = subprocess.run(
        [sys.executable, "-m", "otelprof", "report", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    doc = json.loads(report.stdout)
    assert doc["steps"]["count"] == 16
    assert doc["problems"] == []
    assert {r["name"] for r in doc["timings"]} >= {"dataloader_next", "to_device", "train_batch"}
