"""The README's examples for phases, throughput and the framework integrations run as shown."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _block(marker: str) -> str:
    found = [b for b in BLOCKS if marker in b]
    assert len(found) == 1, f"expected one README python block with {marker!r}, got {len(found)}"
    return found[0]


@pytest.mark.parametrize(
    "marker",
    [
        'otelprof.phase("validation")',
        "otelprof.step_work(samples=32",
        "OtelprofCallback(peak_flops=1e12)",
        "instrument_accelerator(accelerator, peak_flops=1e12)",
        "OtelprofTrainerCallback(peak_flops=1e12)",
    ],
)
def test_readme_example_runs_and_writes_a_run(marker: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(_block(marker))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "otelprof-runs").glob("*/traces.jsonl"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_the_lightning_module_ranges_the_readme_names_are_what_lightning_records(
    tmp_path: Path,
) -> None:
    """The README's Lightning example under `profiler="pytorch"`: the module range it names
    is a span Lightning records, nested in `forward` as it says."""
    import json

    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`(\[pl\]\[module\][^`]+)`", readme))
    assert named, "the README names a module range"
    script = tmp_path / "example.py"
    block = _block("OtelprofCallback(peak_flops=1e12)")
    script.write_text(block.replace("callbacks=[", 'profiler="pytorch", callbacks=['))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (traces,) = (tmp_path / "otelprof-runs").glob("*/traces.jsonl")
    spans = [
        span
        for line in traces.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]
    names = {s["spanId"]: s["name"] for s in spans}
    recorded = {s["name"]: names.get(s.get("parentSpanId", "")) for s in spans}
    for name in named:
        assert recorded.get(name) == "forward", (name, sorted(n for n in recorded if "[pl]" in n))
