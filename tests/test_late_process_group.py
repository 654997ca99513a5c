"""A process group that appears after `instrument()`: what each rank wrote before it moves
into the job's files, every line of every file kind, relabelled; what cannot move is counted.

mp.spawn's children (the PyTorch tutorial with `instrument()` first, or any script that
instruments before `init_process_group`) know no rank until the group tells it: they start
under a provisional identity and move their early files into the rank's once it is known.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.otlp_files import read_points, read_spans
from tests.services import free_port
from tests.test_distributed import JOB, _env, _only_run_dir, _report, _spawn, _torchrun

EARLY, LATE = 10, 30  # steps before the process group exists, and after (ddp_job's --steps)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_a_late_process_group_keeps_every_step_of_each_rank_apart_and_drops_nothing(
    tmp_path: Path, compress: bool
) -> None:
    # gzip'd, with one run id for the job: the second child finds the first's names taken at
    # instrument() (both guess rank 0) and writes files of its own until its rank is known
    env = {"OTELPROF_COMPRESS": "true", "OTELPROF_RUN_ID": "late-group"} if compress else {}
    result = _spawn(tmp_path, "--instrument-first", "--early-steps", str(EARLY), **env)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = _only_run_dir(tmp_path)
    gz = ".gz" if compress else ""
    assert sorted(p.name for p in run_dir.iterdir()) == [
        f"metrics.rank0.jsonl{gz}", f"metrics.rank1.jsonl{gz}", "run.rank0.json",
        "run.rank1.json", f"traces.rank0.jsonl{gz}", f"traces.rank1.jsonl{gz}",
    ]  # fmt: skip
    for rank in (0, 1):
        spans = read_spans(run_dir / f"traces.rank{rank}.jsonl{gz}")
        assert [s.name for s in spans].count("step") == EARLY + LATE, rank
        assert {s.resource["otelprof.rank"] for s in spans} == {rank}
        assert {s.resource["otelprof.world_size"] for s in spans} == {2}
        assert {s.resource["otelprof.run_id"] for s in spans} == {run_dir.name}
        points = read_points(run_dir / f"metrics.rank{rank}.jsonl{gz}")
        assert {p.resource["otelprof.rank"] for p in points} == {rank}
        info = json.loads((run_dir / f"run.rank{rank}.json").read_text())
        assert info["end"]["status"] == "clean", info["end"]
        assert info["stats"]["dropped_total"] == 0, info["stats"]
        # the run began at instrument(), before the group: run.json keeps that start
        assert info["started_unix_nano"] <= min(s.start_ns for s in spans)
    report = json.loads(_report("--json", str(run_dir)))
    assert report["steps"]["count"] == 2 * (EARLY + LATE)
    assert sorted(p["steps"] for p in report["processes"]) == [EARLY + LATE] * 2
    assert report["problems"] == []


def test_torchrun_elastic_restart_with_compressed_files_keeps_each_attempt_apart(
    tmp_path: Path,
) -> None:
    # torchrun gives the ranks: instrument() first names the rank's files at once, each
    # restart attempt its own, gzip'd; attempt 0's rank 1 raises at step 5
    result = _torchrun(
        tmp_path,
        "--instrument-first", "--raise-rank", "1", "--fail-at", "5", "--fail-attempt", "0",
        extra=("--max-restarts=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=elastic-gz"),
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        OTELPROF_COMPRESS="true",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = _only_run_dir(tmp_path)
    names = sorted(p.name for p in run_dir.iterdir())
    assert names == sorted(
        f"{kind}.rank{rank}{attempt}{ext}"
        for rank in (0, 1)
        for attempt in ("", ".attempt1")
        for kind, ext in (("metrics", ".jsonl.gz"), ("traces", ".jsonl.gz"), ("run", ".json"))
    )
    for rank in (0, 1):
        second = read_spans(run_dir / f"traces.rank{rank}.attempt1.jsonl.gz")
        assert [s.name for s in second].count("step") == LATE
        assert {(s.resource["otelprof.rank"], s.resource["otelprof.attempt"]) for s in second} == {
            (rank, 1)
        }
        info = json.loads((run_dir / f"run.rank{rank}.attempt1.json").read_text())
        assert info["end"]["status"] == "clean" and info["stats"]["dropped_total"] == 0
    raised = json.loads((run_dir / "run.rank1.json").read_text())["end"]
    assert raised["exception"]["message"] == "rank 1 failed at step 5"


UNWRITABLE_TARGET = """
import os, sys, time
import torch.distributed as dist
import torch.multiprocessing as mp
import otelprof

def run(rank):
    prof = otelprof.instrument(interval=0.2, host_metrics=False)
    for _ in range(5):
        with otelprof.timing("early"):
            time.sleep(0.002)
        otelprof.step()
    if rank == 1:  # where rank 1's early spans are to go cannot take them
        os.makedirs(os.path.join(os.environ["OTELPROF_OUTPUT_DIR"], "job", "traces.rank1.jsonl"))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for _ in range(20):
        with otelprof.timing("late"):
            time.sleep(0.002)
        otelprof.step()
    dist.barrier()
    if rank == 1:
        stats = prof.stats()
        print("STATS", stats["relocation.lines_dropped"], stats["dropped_total"],
              stats["timings.steps"], flush=True)
    prof.shutdown()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, nprocs=2)
"""


def test_lines_that_cannot_move_are_counted_and_logged_and_profiling_goes_on(
    tmp_path: Path,
) -> None:
    script = tmp_path / "job.py"
    script.write_text(UNWRITABLE_TARGET)
    result = subprocess.run(
        [sys.executable, str(script)],
        env=_env(tmp_path, OTELPROF_RUN_ID="job"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("STATS")]
    lost, dropped, steps = map(int, line.split()[1:])
    assert lost > 0 and dropped >= lost  # counted, in dropped_total too
    assert steps == 20  # the profiler went on under the group's ranks
    assert "moving this process's early lines" in result.stderr
    assert "Is a directory" in result.stderr
    run_dir = tmp_path / "runs" / "job"
    info = json.loads((run_dir / "run.rank1.json").read_text())
    assert info["stats"]["relocation.lines_dropped"] == lost
    assert read_points(run_dir / "metrics.rank1.jsonl")  # the early metrics did move
    report = _report(str(run_dir))
    assert "relocation.lines_dropped" in report


def test_the_report_flags_two_jobs_that_share_a_run_id_and_run_at_once(tmp_path: Path) -> None:
    # two mp.spawn jobs started at once with one run id: each rank of the second finds its
    # names held by the first's and writes files of its own (the first run's files are never
    # mixed with the second's); the report says two processes claimed each rank
    meet = tmp_path / "meet"  # every process waits there for the others before it ends
    meet.mkdir()
    jobs = [
        subprocess.Popen(
            [sys.executable, str(JOB), "--spawn", "2", "--steps", "30", "--instrument-first",
             "--meet-dir", str(meet), "--meet-count", "4"],
            env=_env(tmp_path, OTELPROF_RUN_ID="shared"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]  # fmt: skip
    for job in jobs:
        _out, err = job.communicate(timeout=300)
        assert job.returncode == 0, err[-3000:]
    run_dir = _only_run_dir(tmp_path)
    infos = [json.loads(p.read_text()) for p in sorted(run_dir.glob("run*.json"))]
    assert len(infos) == 4  # one per process: nobody rewrote another's run.json
    ranks = sorted(i["resource"]["otelprof.rank"] for i in infos)
    assert ranks == [0, 0, 1, 1]
    for info in infos:  # each file has one writer: its lines are its own process's
        pids = {s.resource["process.pid"] for s in read_spans(run_dir / info["files"]["traces"])}
        assert pids == {info["resource"]["process.pid"]}
    report = _report(str(run_dir))
    problems = report.split("problems")[1].split("Timings")[0]
    assert "rank 0 was claimed by 2 processes" in problems, problems
    assert "rank 1 was claimed by 2 processes" in problems, problems
