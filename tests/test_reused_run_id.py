"""A reused `run_id` never touches another run's files: `instrument()` refuses it.

Before, a second run with the same id appended to the first run's files and overwrote its
run.json, and `otelprof report` then merged both runs; two started at once both wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import otelprof
from otelprof import _profiler
from otelprof.config import ConfigError

OPTIONS = {"interval": 0.2, "gpus": "none", "host_metrics": False}


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()}


def test_a_finished_runs_id_is_refused_and_its_files_stay_as_they_were(tmp_path: Path) -> None:
    with otelprof.instrument(output_dir=tmp_path, run_id="same", **OPTIONS), otelprof.timing("w"):
        pass
    before = _snapshot(tmp_path / "same")
    assert "run.json" in before
    with pytest.raises(ConfigError, match=r"run_id 'same': .* already holds a run"):
        otelprof.instrument(output_dir=tmp_path, run_id="same", **OPTIONS)
    assert _profiler.active_profiler() is None
    assert _snapshot(tmp_path / "same") == before


def test_a_killed_runs_id_is_refused_too(tmp_path: Path) -> None:
    script = (
        "import os, signal, otelprof\n"
        f"otelprof.instrument(output_dir={str(tmp_path)!r}, run_id='killed', **{OPTIONS!r})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=False, timeout=120)
    assert (tmp_path / "killed" / "run.json").exists()
    before = _snapshot(tmp_path / "killed")
    assert ".run.claim" in before  # its claim, left behind: free since the process died
    with pytest.raises(ConfigError, match="already holds a run"):
        otelprof.instrument(output_dir=tmp_path, run_id="killed", **OPTIONS)
    assert _snapshot(tmp_path / "killed") == before


def test_a_new_attempt_of_an_elastic_job_shares_the_run_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with otelprof.instrument(output_dir=tmp_path, run_id="elastic", **OPTIONS):
        pass
    first = _snapshot(tmp_path / "elastic")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted the job
    with otelprof.instrument(output_dir=tmp_path, run_id="elastic", **OPTIONS) as prof:
        assert prof.files["metrics"].name == "metrics.attempt1.jsonl"
    after = _snapshot(tmp_path / "elastic")
    assert {name: after[name] for name in first} == first
    assert "run.attempt1.json" in after


AT_ONCE = """
import sys, otelprof
print("ready", flush=True)
sys.stdin.readline()  # both start at the test's word
try:
    prof = otelprof.instrument(output_dir=sys.argv[1], run_id="twice", **OPTIONS)
except otelprof.ConfigError as error:
    print("refused:", error, flush=True)
    raise SystemExit(0)
print("running", flush=True)
with otelprof.timing("work"):
    pass
otelprof.step()
sys.stdin.readline()  # until the other one has tried
prof.shutdown()
"""


def test_two_processes_started_at_once_with_one_run_id_one_runs_and_the_other_is_refused(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTELPROF_")}
    script = f"OPTIONS = {OPTIONS!r}\n" + AT_ONCE
    starts = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    try:
        for start in starts:
            assert start.stdout is not None and start.stdout.readline() == "ready\n"
        for start in starts:  # as close together as two processes can be started
            assert start.stdin is not None
            start.stdin.write("go\n")
            start.stdin.flush()
        said = [start.stdout.readline() for start in starts if start.stdout is not None]
        (refused,) = [s for s in said if s.startswith("refused:")]
        (winner,) = [start for start, s in zip(starts, said, strict=True) if s == "running\n"]
        assert f"is being written by another live process (pid {winner.pid}" in refused
        assert "choose another run_id" in refused
        for start in starts:
            start.communicate("stop\n", timeout=120)
            assert start.returncode == 0
    finally:
        for start in starts:
            start.kill()
    run_dir = tmp_path / "twice"
    names = sorted(p.name for p in run_dir.iterdir())
    assert names == ["metrics.jsonl", "run.json", "traces.jsonl"]  # and no claim left
    info = json.loads((run_dir / "run.json").read_text())
    assert info["resource"]["process.pid"] == winner.pid and "finished_unix_nano" in info


HOLD_THEN_DIE = """
import os, signal, sys
from otelprof._run.claim import lock
held = lock(__import__("pathlib").Path(sys.argv[1]))
held.write_owner({"pid": os.getpid()})
print("held", flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_claim_is_refused_while_its_holder_lives_and_taken_over_once_it_died(
    tmp_path: Path,
) -> None:
    from otelprof._run.claim import Taken, lock

    path = tmp_path / ".run.claim"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THEN_DIE, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])),
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    with pytest.raises(Taken) as taken:
        lock(path)
    assert taken.value.owner == {"pid": holder.pid}
    holder.communicate("die\n", timeout=60)
    assert holder.returncode == -9
    claim = lock(path)  # the dead holder's lock went with it; its file is taken over
    assert claim.locked and not claim.created
    claim.release()
    assert not path.exists()
