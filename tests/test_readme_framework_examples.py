"""The documentation's examples for phases, throughput and the framework integrations run as
shown (tests/docs_pages.py: README.md and the site's pages)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_pages import ROOT, blocks, page

BLOCKS = [b.code for b in blocks() if b.lang == "python"]
FRAMEWORKS = "docs/guide/frameworks.md"


def _block(marker: str) -> str:
    found = [b for b in BLOCKS if marker in b]
    assert len(found) == 1, f"expected one docs python block with {marker!r}, got {len(found)}"
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
def test_docs_example_runs_and_writes_a_run(marker: str, tmp_path: Path) -> None:
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


def test_the_lightning_module_ranges_the_docs_name_are_what_lightning_records(
    tmp_path: Path,
) -> None:
    """The frameworks guide's Lightning example under `profiler="pytorch"`: the module range
    it names is a span Lightning records, nested in `forward` as it says."""
    import json

    named = set(re.findall(r"`(\[pl\]\[module\][^`]+)`", page(FRAMEWORKS)))
    assert named, "the frameworks guide names a module range"
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
