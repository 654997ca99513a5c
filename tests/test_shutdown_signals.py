"""Signals during shutdown() lose nothing and leave the run's end told truthfully; a SIGTERM
the program survives is not its end; large attributes keep memory bounded.

Real child processes, signalled for real at random points of their shutdown.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otelprof.analysis.problems import _end_finding
from otelprof.analysis.reader import open_run
from tests.otlp_files import read_spans

REPO = Path(__file__).resolve().parents[1]
STEPS = 1500

# Fast steps with three timings each and every span kept: at shutdown the span builder still
# has a backlog to drain (thousands of spans), so shutdown lasts long enough for a signal
# sent at a random moment to land in it.
CHILD = f"""
import os, sys, time
import otelprof
out = sys.argv[1]
prof = otelprof.instrument(output_dir=out, interval=0.2, trace_budget=float("inf"))
for _ in range({STEPS}):
    with otelprof.timing("train_batch"):
        with otelprof.timing("forward"):
            pass
        with otelprof.timing("backward"):
            pass
    prof.step()
open(os.path.join(out, "shutting-down"), "w").close()
prof.shutdown()
time.sleep(30)  # the signal acts here at the latest
"""


def _start(tmp_path: Path, script: str) -> subprocess.Popen[str]:
    path = tmp_path / "child.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    return subprocess.Popen(
        [sys.executable, str(path), str(tmp_path / "runs")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, child: subprocess.Popen[str], seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if child.poll() is not None:
            pytest.fail(f"child exited early ({child.returncode}): {child.stderr.read()}")  # type: ignore[union-attr]
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail(f"child never reached {path.name}")
        time.sleep(0.01)


def _run_dir(tmp_path: Path) -> Path:
    (run,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    return run


@pytest.mark.parametrize("trial", range(6))
def test_a_signal_at_a_random_point_of_shutdown_loses_no_span_and_the_end_is_told(
    tmp_path: Path, trial: int
) -> None:
    rng = random.Random(trial)
    signum = (signal.SIGINT, signal.SIGTERM)[trial % 2]
    delay = rng.uniform(0.0, 0.2)  # shutdown takes ~0.3-2 s here: anywhere in it
    child = _start(tmp_path, CHILD)
    (tmp_path / "runs").mkdir(exist_ok=True)
    _wait_for(tmp_path / "runs" / "shutting-down", child)
    time.sleep(delay)
    child.send_signal(signum)
    try:
        _, stderr = child.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        pytest.fail(f"{signum.name} after {delay:.3f} s: the child did not end")
    assert child.returncode != 0, stderr  # the signal still acted, once shutdown was done
    run = _run_dir(tmp_path)
    names = [span.name for span in read_spans(run / "traces.jsonl")]
    assert names.count("step") == STEPS, (signum.name, delay, stderr)
    assert names.count("train_batch") == STEPS
    (info,) = open_run([run]).run_info
    assert "finished_unix_nano" in info, (signum.name, delay, info)
    finding = _end_finding(info)
    assert finding is None or finding.kind != "unfinalized", (signum.name, delay, finding)


HANDLED = """
import json, os, signal, sys, time
import otelprof
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
handled = []
signal.signal(signal.SIGTERM, lambda signum, frame: handled.append(signum))  # checkpoint, go on
prof = otelprof.instrument(output_dir=out, interval=0.2)
open(os.path.join(out, "training"), "w").close()
while not handled:
    with otelprof.timing("train_batch"):
        time.sleep(0.002)
    prof.step()
for _ in range(20):  # training goes on after the program's handler
    with otelprof.timing("train_batch"):
        time.sleep(0.002)
    prof.step()
prof.shutdown()
"""


def test_a_sigterm_the_program_handles_and_survives_is_not_the_runs_end(tmp_path: Path) -> None:
    child = _start(tmp_path, HANDLED)
    _wait_for(tmp_path / "runs" / "training", child)
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 0, stderr
    info = json.loads((_run_dir(tmp_path) / "run.json").read_text())
    assert info["end"]["status"] == "clean", info["end"]
    assert info["end"]["signal"] is None, info["end"]


LARGE_ATTRIBUTES = """
import json, sys, time
import otelprof

def rss_mb():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

prof = otelprof.instrument(output_dir=sys.argv[1], interval=0.5)
base = peak = rss_mb()
for i in range(8000):  # 64 KB of distinct text per step: 500 MB in all
    blob = (str(i) * 70000)[:65536]
    with otelprof.timing("load_batch", batch=blob):
        pass
    prof.step()
    if i % 200 == 0:
        peak = max(peak, rss_mb())
prof.shutdown()
peak = max(peak, rss_mb())
print(json.dumps({"growth_mb": peak - base, **prof.stats()}))
"""


def test_a_64kb_attribute_per_step_is_truncated_counted_and_memory_stays_bounded(
    tmp_path: Path,
) -> None:
    from otelprof._limits import DEFAULT_VALUE_LENGTH_LIMIT

    child = _start(tmp_path, LARGE_ATTRIBUTES)
    stdout, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["timings.attributes_truncated"] == 8000, result
    # 8,000 x 64 KB were made; what waits to be written is bounded in bytes (4 KB values)
    assert result["growth_mb"] < 200, result
    spans = [s for s in read_spans(_run_dir(tmp_path) / "traces.jsonl") if s.name == "load_batch"]
    assert spans and all(len(s.attributes["batch"]) == DEFAULT_VALUE_LENGTH_LIMIT for s in spans)
