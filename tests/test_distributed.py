"""Distributed jobs launched for real (gloo on CPU): ranks from any launcher, one run
directory per job, stragglers named although synchronous training equalizes step times,
crashed ranks and elastic attempts recorded."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import otelprof
from tests.otlp_files import read_points, read_spans
from tests.services import REPO, free_port

JOB = REPO / "tests" / "ddp_job.py"


def _env(tmp_path: Path, launcher_sets_master: bool = False, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTELPROF_", "OTEL_"))}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        env.pop(name, None)
    env.update(
        OTELPROF_OUTPUT_DIR=str(tmp_path / "runs"),
        PYTHONPATH=str(REPO),
        GLOO_SOCKET_IFNAME="lo",  # loopback only: no other interface to resolve or time out on
        **extra,
    )
    if not launcher_sets_master:  # mp.spawn: the program's environment says where rank 0 is
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    else:  # torchrun sets them; a stale MASTER_PORT in its environment hangs restarts
        env.pop("MASTER_ADDR", None)
    return env


def _spawn(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(JOB), "--spawn", "2", "--steps", "30", *args],
        env=_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=240,
    )


def _torchrun(tmp_path: Path, *args: str, extra: tuple[str, ...] = (), **env: str) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         *(extra or ("--master_addr=127.0.0.1", f"--master_port={free_port()}")),
         str(JOB), "--steps", "30", *args],
        env=_env(tmp_path, launcher_sets_master=True, **env),
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip


def _only_run_dir(tmp_path: Path) -> Path:
    dirs = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert len(dirs) == 1, f"expected one run directory for the job, got {dirs}"
    return dirs[0]


def _named_dirs(stderr: str) -> list[Path]:
    """The run directories the console named ("writing run files to ..."), in order."""
    return [Path(d) for d in re.findall(r"otelprof: writing run files to (\S+) ", stderr)]


def _report(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "otelprof", "report", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _last_collective_seconds(path: Path) -> float:
    """The live counter otelprof.collective.duration at its last export, all operations."""
    latest: dict[str, tuple[int, float]] = {}
    for p in read_points(path):
        if p.name == "otelprof.collective.duration":
            op = str(p.attributes["otelprof.collective"])
            if op not in latest or p.time_ns >= latest[op][0]:
                latest[op] = (p.time_ns, p.value)
    return sum(v for _, v in latest.values())


def _check_ranks(
    run_dir: Path, world: int = 2, relocated: bool = False, steps: int | None = 30
) -> None:
    """Right ranks everywhere; host metrics from local rank 0 only (`relocated`: a rank that
    started before the process group existed also sampled them until it learned its rank;
    those points are kept, relabelled)."""
    for rank in range(world):
        spans = read_spans(run_dir / f"traces.rank{rank}.jsonl")
        assert {s.resource["otelprof.rank"] for s in spans} == {rank}
        assert {s.resource["otelprof.local_rank"] for s in spans} == {rank}
        assert {s.resource["otelprof.world_size"] for s in spans} == {world}
        if steps is not None:  # one step per step() call; the final barrier is no step
            assert [s.name for s in spans].count("step") == steps, rank
        points = read_points(run_dir / f"metrics.rank{rank}.jsonl")
        assert {p.resource["otelprof.rank"] for p in points} == {rank}
        cpu = [p for p in points if p.name == "system.cpu.utilization"]
        if relocated and rank:
            training = min(s.start_ns for s in spans)
            cpu = [p for p in cpu if p.time_ns > training]
        assert bool(cpu) == (rank == 0), "host metrics come from local rank 0 only"
        info = json.loads((run_dir / f"run.rank{rank}.json").read_text())
        assert info["resource"]["otelprof.rank"] == rank


def test_spawn_job_takes_ranks_from_the_process_group_and_names_the_slow_rank(
    tmp_path: Path,
) -> None:
    # mp.spawn, the PyTorch tutorial pattern: no launcher environment, init_process_group
    # before instrument(); rank 1 does 20 ms of extra work per step outside any timing.
    result = _spawn(tmp_path, "--slow-rank", "1", "--slow-ms", "20")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = _only_run_dir(tmp_path)
    _check_ranks(run_dir)
    # synchronous DDP makes step times equal, so the verdict cannot come from them...
    report = _report(str(run_dir))
    assert "rank 1 is the straggler" in report, report
    assert "outside any timing" in report
    # ...the fast rank waits in DDP's gradient all-reduce inside train_batch
    assert "wait for it" in report and "train_batch" in report.split("wait for it")[1]
    # the live counter tells the same: the straggler spends the least time in collectives
    waits = [_last_collective_seconds(run_dir / f"metrics.rank{r}.jsonl") for r in (0, 1)]
    assert waits[0] > waits[1] + 0.2, waits  # 30 steps x ~20 ms of waiting on rank 0


def test_the_trace_of_a_ddp_job_shows_every_ranks_steps_on_tracks_that_nest(
    tmp_path: Path,
) -> None:
    from otelprof.analysis.chrome_trace import ALL_RANKS, write_trace
    from otelprof.analysis.reader import WarningLog, open_run
    from tests.test_analysis_trace import load_chrome_trace, partial_overlaps

    # rank 1 late every step, a validation phase of three batches every 10 steps
    result = _spawn(tmp_path, "--slow-rank", "1", "--slow-ms", "5", "--validate-every", "10")
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "trace.json"
    write_trace(open_run([_only_run_dir(tmp_path)]), out, WarningLog(sink=lambda _m: None))
    events = load_chrome_trace(out)
    (view,) = [e["pid"] for e in events if e.get("args", {}).get("name") == ALL_RANKS]
    tracks = {
        e["tid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == view
    }
    assert sorted(tracks.values()) == ["rank 0", "rank 1"]
    for tid in tracks:
        names = [
            e["name"] for e in events if e["ph"] == "X" and (e["pid"], e["tid"]) == (view, tid)
        ]
        assert names.count("step 29") == 1 and sum(n.startswith("step ") for n in names) == 30
        assert sum(n.startswith("validation") for n in names) == 9  # 3 phases x 3 batches
    assert not partial_overlaps(events)


def test_instrument_before_init_process_group_restarts_under_the_groups_ranks(
    tmp_path: Path,
) -> None:
    # Lightning's launcher and scripts that instrument first: ranks appear only later, at
    # init_process_group; what was written before moves into the job's run directory.
    result = _spawn(tmp_path, "--instrument-first", "--slow-rank", "0", "--slow-ms", "20")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = _only_run_dir(tmp_path)
    assert sorted(p.name for p in run_dir.glob("*.jsonl")) == [
        "metrics.rank0.jsonl",
        "metrics.rank1.jsonl",
        "traces.rank0.jsonl",
        "traces.rank1.jsonl",
    ]
    _check_ranks(run_dir, relocated=True)
    # the files relocation made or rewrote are owner-only, like every run file
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in run_dir.glob("*.json*")}
    assert set(modes.values()) == {0o600}, modes
    assert "rank 0 is the straggler" in _report(str(run_dir))
    # the console names only the directory that holds the data, once per rank
    assert _named_dirs(result.stderr) == [run_dir, run_dir], result.stderr[-3000:]


def test_torchrun_job_names_the_slow_rank(tmp_path: Path) -> None:
    result = _torchrun(tmp_path, "--slow-rank", "1", "--slow-ms", "20")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = _only_run_dir(tmp_path)
    _check_ranks(run_dir)
    assert _named_dirs(result.stderr) == [run_dir, run_dir], result.stderr[-3000:]
    assert "rank 1 is the straggler" in _report(str(run_dir))


def _run_infos(run_dir: Path) -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(run_dir.glob("run*.json"))}


def test_elastic_restart_keeps_each_attempt_apart_and_records_the_rank_that_raised(
    tmp_path: Path,
) -> None:
    # attempt 0: rank 1 raises at step 5, the other rank fails in its next collective;
    # torchrun restarts both (attempt 1), which finish cleanly.
    # c10d rendezvous, as elastic jobs run; its TCP store is not shared with the workers, which
    # otherwise read the previous attempt's addresses (pytorch/pytorch#135712)
    result = _torchrun(
        tmp_path,
        "--raise-rank", "1", "--fail-at", "5", "--fail-attempt", "0",
        extra=("--max-restarts=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=elastic-job"),
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = _only_run_dir(tmp_path)
    assert run_dir.name == "elastic-job"  # TORCHELASTIC_RUN_ID: every attempt, one directory
    infos = _run_infos(run_dir)
    assert sorted(infos) == [
        "run.rank0.attempt1.json",
        "run.rank0.json",
        "run.rank1.attempt1.json",
        "run.rank1.json",
    ]
    raised = infos["run.rank1.json"]["end"]
    assert raised["status"] == "exception"
    assert raised["exception"] == {"type": "RuntimeError", "message": "rank 1 failed at step 5"}
    # its peer vanished: gloo raises in rank 0's next collective, unless torchrun's SIGTERM to
    # the surviving workers gets there first (a race); either way the failed end is recorded
    peer_end = infos["run.rank0.json"]["end"]
    assert peer_end["status"] in ("exception", "signal"), peer_end
    if peer_end["status"] == "signal":
        assert peer_end["signal"] == "SIGTERM", peer_end
    for name in ("run.rank0.attempt1.json", "run.rank1.attempt1.json"):
        assert infos[name]["attempt"] == 1 and infos[name]["end"]["status"] == "clean"
    step_traces: dict[tuple[int, int], dict[int, str]] = {}
    for rank in (0, 1):  # attempt 0's spans were not overwritten by attempt 1
        first = read_spans(run_dir / f"traces.rank{rank}.jsonl")
        second = read_spans(run_dir / f"traces.rank{rank}.attempt1.jsonl")
        assert {s.resource["otelprof.attempt"] for s in first} == {0}
        assert {s.resource["otelprof.attempt"] for s in second} == {1}
        assert [s.name for s in second].count("step") >= 30
        for attempt, spans in enumerate((first, second)):
            step_traces[rank, attempt] = {
                s.attributes["otelprof.step"]: s.trace_id for s in spans if s.name == "step"
            }
    # a step of both ranks is one trace, and a restart's step N is another trace than the
    # first attempt's (torchrun keeps the run id; the attempt tells them apart)
    assert step_traces[0, 1] == step_traces[1, 1]
    shared = step_traces[0, 0].keys() & step_traces[1, 0].keys()  # rank 1 raised at step 5
    assert len(shared) >= 5
    assert all(step_traces[0, 0][n] == step_traces[1, 0][n] for n in shared)
    assert not set(step_traces[0, 0].values()) & set(step_traces[0, 1].values())
    report = _report(str(run_dir))
    problems = report.split("problems")[1].split("Timings")[0]
    assert "rank 1" in problems and "rank 1 failed at step 5" in problems
    assert report.index("problems") < report.index("Timings")  # problems come first


def test_a_sigkilled_rank_shows_as_not_finalized_first_in_the_report(tmp_path: Path) -> None:
    # instrument() before init_process_group, under torchrun: each rank names the job's
    # directory once its ranks are known, the one killed later too
    result = _torchrun(tmp_path, "--kill-rank", "1", "--fail-at", "5", "--instrument-first")
    assert result.returncode != 0
    run_dir = _only_run_dir(tmp_path)
    assert run_dir.name.startswith("torchrun-")  # not torchrun's default run id "none"
    assert _named_dirs(result.stderr) == [run_dir, run_dir], result.stderr[-3000:]
    infos = _run_infos(run_dir)
    assert "finished_unix_nano" not in infos["run.rank1.json"]  # SIGKILL cannot be caught
    assert infos["run.rank0.json"]["end"]["status"] in ("exception", "signal")
    report = _report(str(run_dir))
    problems = report.split("problems")[1].split("Timings")[0]
    assert "rank 1" in problems and "not finalized" in problems


@pytest.mark.e2e
def test_dashboard_straggler_panels_name_the_slow_rank_of_a_real_job(
    tmp_path: Path, collector: Any, prometheus: Any
) -> None:
    import time
    import uuid

    from dashboards.build import COLLECTIVE_WAIT_PANEL, STRAGGLER_PANEL
    from tests.dashboard_queries import panel_expr, run_range

    service = f"straggler-{uuid.uuid4().hex[:8]}"
    started = time.time()
    result = _spawn(
        tmp_path,
        "--steps", "250", "--slow-rank", "1", "--slow-ms", "20",
        OTELPROF_ENDPOINT=collector.otlp_endpoint,
        OTELPROF_DETACHED="false",
        OTELPROF_SERVICE_NAME=service,
        OTELPROF_INTERVAL="0.5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    finished = time.time()
    prometheus.wait_for_series(
        f'otelprof_collective_duration_seconds_total{{service_name="{service}"}}'
    )
    # the straggler path's copy too (the collector's small endpoint), which the panels read
    prometheus.wait_for_series(
        f'straggler_otelprof_collective_duration_seconds_total{{service_name="{service}"}}'
    )
    time.sleep(2)  # the last export's scrape

    def by_rank(title: str) -> dict[str, float]:
        series = run_range(prometheus, panel_expr(title, service), started, finished + 2)
        out = {}
        for labels, _times, values in series:
            rank = dict(kv.split("=", 1) for kv in labels.split(","))["otelprof_rank"]
            out[rank] = sum(values) / len(values)
        return out

    waiting = by_rank(COLLECTIVE_WAIT_PANEL)
    assert set(waiting) == {"0", "1"}, waiting
    # rank 0 waits for the straggler: its share of wall time waiting is several times the
    # straggler's own. A loaded machine makes every step longer, so both shares shrink:
    # 0.42-0.54 against 0.06-0.08 here with one other job, 0.23 against 0.04 under two test
    # workers and a load of 9 on two cores
    assert waiting["0"] > max(3 * waiting["1"], waiting["1"] + 0.1), waiting
    lateness = by_rank(STRAGGLER_PANEL)
    assert lateness["1"] > 0.2 and lateness["1"] > lateness["0"] + 0.2, lateness
    # the OtelprofStraggler rule's expression (as shipped, with the panels' 4 s rate window
    # for a job of seconds) names the same rank, and only it (its `for:` aside)
    from tests.alert_rules import alerts_module, rules

    rule = rules(alerts_module().rules_file({"rate_window": "4s"}))["OtelprofStraggler"]
    named = run_range(prometheus, rule["expr"], started, finished + 2)
    assert {dict(kv.split("=", 1) for kv in labels.split(","))["otelprof_rank"]
            for labels, _, _ in named} == {"1"}, named  # fmt: skip


def test_lightning_like_launcher_gets_right_ranks_although_only_local_rank_is_set(
    tmp_path: Path,
) -> None:
    # Lightning's DDP launcher: the script (already instrumented) is local rank 0 and starts
    # its copies with LOCAL_RANK=1 and WORLD_SIZE set, no RANK; ranks come with the group.
    # The run id is the user's here (tests/test_distributed_lightning.py: a generated one);
    # no MASTER_* in the environment: the launcher sets them after instrument(), as Lightning
    result = subprocess.run(
        [sys.executable, str(JOB), "--lightning-like", "2", "--steps", "30",
         "--slow-rank", "1", "--slow-ms", "20"],
        env=_env(tmp_path, launcher_sets_master=True, OTELPROF_RUN_ID="job-1"),
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = _only_run_dir(tmp_path)
    assert run_dir.name == "job-1"
    _check_ranks(run_dir, relocated=True)
    # local rank 0 named its directory at instrument() (no launcher variables yet): it stays
    # the job's, and nobody names another, nor the same one twice
    assert _named_dirs(result.stderr) == [run_dir, run_dir], result.stderr[-3000:]
    # local rank 1 knew the world size but not its rank: it wrote under its pid, never under
    # rank 0's file names (moving its lines out of those once replaced rank 0's live file)
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "metrics.rank0.jsonl", "metrics.rank1.jsonl", "run.rank0.json", "run.rank1.json",
        "traces.rank0.jsonl", "traces.rank1.jsonl",
    ]  # fmt: skip
    for rank in (0, 1):
        stats = json.loads((run_dir / f"run.rank{rank}.json").read_text())["stats"]
        assert stats["dropped_total"] == 0, stats
    assert "rank 1 is the straggler" in _report(str(run_dir))


USER_HOOK_SCRIPT = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
import otelprof
from otelprof._distributed import collectives

dist.init_process_group("gloo", rank=0, world_size=1)
prof = otelprof.instrument()
model = DDP(torch.nn.Linear(4, 1))
calls = []
def user_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    calls.append(1)
    return default_hooks.allreduce_hook(state, bucket)
for step in range(3):
    model(torch.randn(2, 4)).sum().backward()
    if step == 0:  # after otelprof registered its hook at the first forward
        model.register_comm_hook(None, user_hook)
    otelprof.step()
print("user hook calls", len(calls), "timed", collectives.snapshot()["ddp_allreduce"][1])
prof.shutdown()
dist.destroy_process_group()
"""


def test_a_users_ddp_comm_hook_registered_after_otelprofs_still_runs(tmp_path: Path) -> None:
    # DDP takes one comm hook; otelprof's came first, so the user's is called through it
    # (registering it must not raise into training) and the all-reduce is still timed.
    result = subprocess.run(
        [sys.executable, "-c", USER_HOOK_SCRIPT],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "user hook calls 2 timed 3" in result.stdout


def test_a_process_group_of_one_after_instrument_names_the_run_directory_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Trainer(strategy="ddp", devices=1), or a script's own gloo group of one: the group
    # changes the ranks the profiler started with, not its directory, named once
    import torch.distributed as dist

    with caplog.at_level(logging.WARNING, logger="otelprof"):
        prof = otelprof.instrument(output_dir=str(tmp_path), host_metrics=False)
        try:
            first = prof.run_dir
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
            with otelprof.timing("train_batch"):
                pass
            otelprof.step()
        finally:
            prof.shutdown()
            if dist.is_initialized():
                dist.destroy_process_group()
    assert prof.run_dir == first
    named = [r.getMessage() for r in caplog.records if "writing run files to" in r.getMessage()]
    assert named == [f"otelprof: writing run files to {first} (summarize: otelprof report {first})"]
    assert first is not None and read_spans(first / "traces.jsonl")


def test_a_process_launched_without_its_rank_names_its_files_after_its_pid(
    tmp_path: Path,
) -> None:
    # Lightning's copies of the script get LOCAL_RANK and WORLD_SIZE, no RANK: rank 0 would
    # be a guess, and rank 0's file names are the real rank 0's
    from otelprof._profiler import _Identity
    from otelprof.config import Settings

    pid = os.getpid()
    launched = {"LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    settings = Settings.from_options(output_dir=str(tmp_path), run_id="job", env=launched)
    early = _Identity(settings, launched, settled=False).layout
    assert (early.files["metrics"].name, early.files["traces"].name) == (
        f"metrics.pid{pid}.jsonl",
        f"traces.pid{pid}.jsonl",
    )
    assert early.run_info.name == f"run.pid{pid}.json"
    grouped = {**launched, "RANK": "1"}  # what the process group says
    settings = Settings.from_options(
        output_dir=str(tmp_path), run_id="job", env=grouped, compress=True
    )
    final = _Identity(settings, grouped, settled=True).layout
    assert (final.files["metrics"].name, final.files["traces"].name) == (
        "metrics.rank1.jsonl.gz",
        "traces.rank1.jsonl.gz",
    )
    assert final.run_info.name == "run.rank1.json"
    # a launcher that gives the rank (torchrun): its own names before any group
    assert (
        _Identity(settings, grouped, settled=False).layout.files["metrics"]
        == final.files["metrics"]
    )
