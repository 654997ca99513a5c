"""Lightning's own DDP launcher, for real: `Trainer(strategy="ddp", devices=2)` on CPU (gloo)
re-runs the user's script for local rank 1. otelprof starts either at the top of the script
in both processes, before any rank exists (it restarts under the process group's ranks), or
from the one-line callback at the Trainer's setup, after the process group exists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services import REPO
from tests.test_distributed import (
    _check_ranks,
    _env,
    _last_collective_seconds,
    _named_dirs,
    _only_run_dir,
    _report,
)

SCRIPT = REPO / "tests" / "lightning_ddp_job.py"


@pytest.mark.parametrize("start", ["instrument-at-top", "callback-only"])
def test_lightning_ddp_launcher_gives_ranks_their_identity_one_run_dir_named_once_and_straggler(
    tmp_path: Path, start: str
) -> None:
    # no MASTER_ADDR/MASTER_PORT: Lightning picks them itself, as for a user
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(tmp_path / "lightning"),
         "--steps", "30", "--slow-rank", "1", "--slow-ms", "20",
         *(["--callback-only"] if start == "callback-only" else [])],
        env=_env(tmp_path, launcher_sets_master=True),
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    # Lightning itself ran two processes, with these ranks
    seen = [json.loads(p.read_text()) for p in (tmp_path / "lightning").glob("process*.json")]
    assert sorted(s["lightning"] for s in seen) == [[0, 0, 2], [1, 1, 2]], seen
    for process in seen:  # otelprof followed Lightning in each process
        assert process["otelprof"] == process["lightning"], process
    run_dir = _only_run_dir(tmp_path)  # the directory each rank opened first is gone
    assert {Path(s["run_dir"]) for s in seen} == {run_dir}
    # the console names only that directory, once per rank: rank 0 (no launcher variables
    # when instrument() runs at the top) names its first directory, which stays the job's
    assert _named_dirs(result.stderr) == [run_dir, run_dir], result.stderr[-3000:]
    assert sorted(p.name for p in run_dir.iterdir()) == [  # and it holds the data, only
        "metrics.rank0.jsonl", "metrics.rank1.jsonl", "run.rank0.json", "run.rank1.json",
        "traces.rank0.jsonl", "traces.rank1.jsonl",
    ]  # fmt: skip
    # otelprof.rank/local_rank/world_size on every span, point and run file; host metrics
    # from local rank 0 only (rank 1 had LOCAL_RANK=1 from its start)
    _check_ranks(run_dir)
    for rank in (0, 1):
        info = json.loads((run_dir / f"run.rank{rank}.json").read_text())
        assert info["run_id"] == run_dir.name
        assert info["end"]["status"] == "clean"
        assert info["stats"]["dropped_total"] == 0, info["stats"]
    report = _report(str(run_dir))
    assert report.startswith(f"run: {run_dir.name}\n"), report[:200]  # one job, one id
    doc = json.loads(_report(str(run_dir), "--json"))
    assert doc["run"]["run_ids"] == [run_dir.name]
    assert doc["problems"] == []  # no stray run file of the identities the ranks started with
    assert doc["verdict"]["kind"] == "straggler", doc["verdict"]
    straggler = doc["stragglers"]["straggler"]  # the same analysis, each figure explained
    assert straggler["rank"] == 1 and straggler["headline"] == doc["verdict"]["headline"]
    assert set(straggler["measures"]) >= {"extra_ms_per_step", "others_wait_ms_per_step"}
    rows = {r["process"].split(" @")[0]: r for r in doc["sections"]["stragglers"]["rows"]}
    assert [name for name, row in rows.items() if row["straggler"]] == ["rank 1"], rows
    assert rows["rank 0"]["waiting ms"] > rows["rank 1"]["waiting ms"] + 10, rows
    verdict = doc["sections"]["stragglers"]["notes"][0]
    assert verdict.startswith("rank 1 is the straggler: it arrives late, with +"), verdict
    assert "in forward" in verdict.split("the other ranks")[0], verdict  # where it spends it
    # the text report tells the same analysis: its headline under the per-rank table, its
    # evidence (what each figure measures) under the verdict, the straggler's row flagged "yes"
    flat = " ".join(report.replace("│", " ").split())
    for text in (straggler["headline"], *straggler["evidence"]):
        assert " ".join(text.split()) in flat, (text, report)
    assert [e.split(":")[0] for e in straggler["evidence"]] == [
        "rank 1 arrives late", "the other ranks wait for it",
    ]  # fmt: skip
    table = report.split("Waiting vs own work per rank")[1].split("rank 1 is the straggler")[0]
    cells = [line.split("│")[1:3] for line in table.splitlines() if " @ " in line]
    assert [(p.split(" @")[0].strip(), f.strip()) for p, f in cells] == [
        ("rank 0", ""), ("rank 1", "yes"),
    ], table  # fmt: skip
    # live, the straggler is the rank that spends least time in collectives
    waits = [_last_collective_seconds(run_dir / f"metrics.rank{r}.jsonl") for r in (0, 1)]
    assert waits[0] > waits[1] + 0.2, waits  # 30 steps x ~20 ms of waiting on rank 0
