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
TRIALS = 32
"""Signals sent at random points of shutdown: each trial is a real child process."""
PARALLEL = 4
"""Children run side by side (each mostly waits on its builder thread and files), so 32
trials take about the time of 8 in a row."""
MAX_DELAY_S = 0.4
"""Signals land up to this long after shutdown() begins; shutdown takes ~0.3-2 s here, so
most land in it, the rest just after it (the signal then acts at once)."""
SEED = int(os.environ.get("OTELPROF_SIGNAL_SEED") or random.SystemRandom().randrange(1 << 31))
"""Random per CI run, printed; `OTELPROF_SIGNAL_SEED=N` replays a run's trials."""

# Fast steps with three timings each and every span kept: at shutdown the span builder still
# has a backlog to drain (thousands of spans), so shutdown lasts long enough for a signal
# sent at a random moment to land in it. The signal comes from a thread of the child, timed
# from the moment shutdown() begins (so the point in shutdown does not depend on how fast
# the parent is scheduled); `in-shutdown` says whether shutdown() had not returned yet.
CHILD = f"""
import os, signal, sys, threading, time
import otelprof
out, signum, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
# Python raises KeyboardInterrupt only where SIGINT was not ignored at its start, and a
# shell's background job (`make test &`) starts with it ignored: set it as a terminal would.
signal.signal(signal.SIGINT, signal.default_int_handler)
prof = otelprof.instrument(output_dir=out, interval=0.2, trace_budget=float("inf"))
for _ in range({STEPS}):
    with otelprof.timing("train_batch"):
        with otelprof.timing("forward"):
            pass
        with otelprof.timing("backward"):
            pass
    otelprof.step()
begins, returned = threading.Event(), threading.Event()

def send():
    begins.wait()
    time.sleep(delay)
    if not returned.is_set():
        open(os.path.join(out, "in-shutdown"), "w").close()
    os.kill(os.getpid(), signum)

threading.Thread(target=send, daemon=True).start()
begins.set()
prof.shutdown()
returned.set()
time.sleep(30)  # the signal acts here at the latest
"""


def _start(tmp_path: Path, script: str, *args: str) -> subprocess.Popen[str]:
    path = tmp_path / "child.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    return subprocess.Popen(
        [sys.executable, str(path), str(tmp_path / "runs"), *args],
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


def _trial_problem(path: Path, child: subprocess.Popen[str]) -> str | None:
    """What went wrong in one finished trial (None: nothing lost, the end told)."""
    try:
        _, stderr = child.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        child.kill()
        return "the child did not end"
    if child.returncode == 0:  # the signal must still act once shutdown is done
        return f"exit status 0: {stderr[-2000:]}"
    names = [span.name for span in read_spans(_run_dir(path) / "traces.jsonl")]
    if names.count("step") != STEPS or names.count("train_batch") != STEPS:
        return (
            f"{names.count('step')} step and {names.count('train_batch')} train_batch spans "
            f"of {STEPS}: {stderr[-2000:]}"
        )
    (info,) = open_run([_run_dir(path)]).run_info
    if "finished_unix_nano" not in info:
        return f"run.json not finalized: {info}"
    finding = _end_finding(info)
    if finding is not None and finding.kind == "unfinalized":
        return f"the run's end is told as {finding}"
    return None


def test_signals_at_random_points_of_shutdown_lose_no_span_and_the_end_is_told(
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED)
    trials = [
        (i, (signal.SIGINT, signal.SIGTERM)[i % 2], rng.uniform(0.0, MAX_DELAY_S))
        for i in range(TRIALS)
    ]
    print(f"signal trials: seed {SEED} (OTELPROF_SIGNAL_SEED={SEED} replays them)")
    problems: list[str] = []
    inside = 0
    running: list[tuple[tuple[int, signal.Signals, float], Path, subprocess.Popen[str]]] = []
    pending = list(trials)
    while pending or running:
        while pending and len(running) < PARALLEL:
            trial = pending.pop(0)
            path = tmp_path / f"trial{trial[0]}"
            (path / "runs").mkdir(parents=True)
            running.append(
                (trial, path, _start(path, CHILD, str(int(trial[1])), f"{trial[2]:.4f}"))
            )
        trial, path, child = running.pop(0)
        problem = _trial_problem(path, child)
        inside += (path / "runs" / "in-shutdown").exists()
        if problem is not None:
            problems.append(f"trial {trial[0]}: {trial[1].name} {trial[2]:.3f} s in: {problem}")
    print(f"signal trials: {inside} of {TRIALS} signals landed before shutdown() returned")
    assert not problems, f"seed {SEED}:\n" + "\n".join(problems)


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
    otelprof.step()
for _ in range(20):  # training goes on after the program's handler
    with otelprof.timing("train_batch"):
        time.sleep(0.002)
    otelprof.step()
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
    otelprof.step()
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
