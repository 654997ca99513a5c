"""A reused `run_id` never touches another run's files: `instrument()` refuses it.

Before, a second run with the same id appended to the first run's files and overwrote its
run.json, and `otelprof report` then merged both runs.
"""

from __future__ import annotations

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
