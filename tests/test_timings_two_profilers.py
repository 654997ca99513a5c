"""kineto=True beside a program's own torch.profiler: no crash, the program's profiler works.

Torch segfaults with two profilers at once, so each scenario runs in a real child process:
a crash fails the test (exit status) instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import otelprof

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, torch, otelprof
mode, out = sys.argv[1], sys.argv[2]
model = torch.nn.Linear(16, 16)
def work():
    with otelprof.timing("train_batch"):
        model(torch.randn(8, 16)).sum().backward()
prof = otelprof.instrument(kineto=True, host_metrics=False, process_metrics=False,
                           schedule=otelprof.schedule(wait=1, warmup=1, active=2))
if mode == "user profiler first":
    with torch.profiler.profile() as user:
        for _ in range(8):
            work(); otelprof.step()
elif mode == "user profiler during a window":
    for _ in range(3):  # steps 0-2: wait, warmup, first active step
        work(); otelprof.step()
    with torch.profiler.profile() as user:
        for _ in range(5):
            work(); otelprof.step()
user.export_chrome_trace(out + ".user.json")
events = len(user.key_averages())
prof.shutdown()
json.dump({"stats": prof.stats(), "user_events": events}, open(out, "w"))
"""


@pytest.mark.parametrize("mode", ["user profiler first", "user profiler during a window"])
def test_kineto_beside_another_torch_profiler_never_crashes(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "result.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OTELPROF_OUTPUT_DIR=str(tmp_path / "runs"))
    result = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    stats = doc["stats"]
    assert doc["user_events"] > 0  # the program's own profiler recorded its operators
    assert json.loads((tmp_path / "result.json.user.json").read_text())["traceEvents"]
    assert stats["timings.kineto_steps_skipped"] >= 1
    assert stats["timings.steps"] == 8  # timing spans unaffected
    assert (
        result.stderr.count("another torch profiler is active")
        + result.stderr.count("started a torch profiler during a kineto window")
        == 1
    )  # logged once
    if mode == "user profiler first":
        assert stats["timings.kineto_traces"] == 0  # no window ran beside it


def test_kineto_guard_is_removed_at_shutdown(tmp_path: Path) -> None:
    original = torch.autograd.profiler.profile._prepare_trace
    with otelprof.instrument(
        output_dir=tmp_path, kineto=True, host_metrics=False, process_metrics=False
    ):
        assert torch.autograd.profiler.profile._prepare_trace is not original
        otelprof.step()
    assert torch.autograd.profiler.profile._prepare_trace is original
