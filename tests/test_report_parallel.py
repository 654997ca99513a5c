"""`otelprof report --jobs N` reads the files in N worker processes and says exactly what
one process says: the same text, JSON and warnings, within or over the read budget.

The multi-rank run is one real run's files written again as four ranks on two hosts (the
resource rewritten, so every rank is its own process), plus a corrupt line and a truncated
last line, so the warnings' order is checked too.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof.analysis.quantiles import DurationStats
from otelprof.analysis.reader import ReadPlan, WarningLog, open_run
from otelprof.analysis.report_json import build_json
from otelprof.analysis.sections import build_sections
from otelprof.analysis.summary import _FilePass, read_files, summarize
from otelprof.analysis.verdict import judge

RANKS = 4


def _as_rank(line: bytes, rank: int) -> bytes:
    body = json.loads(line)
    for entry in next(iter(body.values())):
        for item in entry.get("resource", {}).get("attributes", []):
            if item["key"] == "otelprof.rank":
                item["value"] = {"intValue": str(rank)}
            elif item["key"] == "process.pid":
                item["value"] = {"intValue": str(1000 + rank)}
            elif item["key"] == "host.name":
                item["value"] = {"stringValue": f"node{rank // 2}"}
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


@pytest.fixture(scope="module")
def ranks_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    prof = otelprof.instrument(
        output_dir=str(out), run_id="one", trace_budget=20, interval=0.2, host_metrics=True,
    )  # fmt: skip
    try:
        for i in range(1500):
            with otelprof.timing("dataloader_next"):
                pass
            with otelprof.timing("train_batch"), otelprof.timing("forward"):
                time.sleep(0.0002 if i % 5 else 0.0005)
            otelprof.step_work(samples=8)
            otelprof.step()
    finally:
        prof.shutdown()
    assert prof.run_dir is not None
    run = tmp_path_factory.mktemp("ranks") / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "ranks"}))
    for source in sorted(prof.run_dir.glob("*.jsonl")):
        lines = source.read_bytes().splitlines(keepends=True)
        kind = source.name.split(".")[0]
        for rank in range(RANKS):
            body = b"".join(_as_rank(line, rank) for line in lines if line.strip())
            if rank == 1:
                body = body.replace(b"\n", b"\nnot json\n", 1)  # a corrupt second line
            if rank == 2:
                body += b'{"resourceSpans": [{"resou'  # a crash mid-line
            (run / f"{kind}.rank{rank}.jsonl").write_bytes(body)
    return run


def _cli(run: Path, *args: str) -> tuple[str, str]:
    done = subprocess.run(
        [sys.executable, "-m", "otelprof", "report", str(run), "--width", "160", *args],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return done.stdout, done.stderr


@pytest.mark.parametrize("fmt", [[], ["--json"]], ids=["text", "json"])
def test_report_from_workers_is_the_report_of_one_process(ranks_run: Path, fmt: list[str]) -> None:
    out_one, err_one = _cli(ranks_run, "--jobs", "1", *fmt)
    out_many, err_many = _cli(ranks_run, "--jobs", "3", *fmt)
    assert out_many == out_one
    assert err_many == err_one
    assert "corrupt line" in err_one and "truncated last line" in err_one
    if fmt:
        doc = json.loads(out_one)
        assert doc["run"]["processes"] == RANKS


@pytest.mark.parametrize("budget", [None, 1 << 20], ids=["whole", "in-parts"])
def test_summaries_from_workers_equal_one_pass_in_every_figure(
    ranks_run: Path, budget: int | None
) -> None:
    docs = []
    said = []
    for jobs in (1, 2):
        messages: list[str] = []
        warn = WarningLog(sink=messages.append)
        summary = summarize(open_run([ranks_run]), warn, read_budget=budget, jobs=jobs)
        assert len(summary.ranks) == RANKS
        assert summary.plan.partial is (budget is not None)
        docs.append(json.dumps(build_json(summary, judge(summary), build_sections(summary, warn))))
        said.append(messages)
    assert docs[1] == docs[0]
    assert said[1] == said[0]
    # and the merge is right: the same as feeding every file's records into one state
    files = open_run([ranks_run])
    plan = ReadPlan.for_files(files.jsonl, budget)
    one = _FilePass(50_000, 200_000, None)
    messages = []
    warn = WarningLog(sink=messages.append)
    for path in files.jsonl:
        one.read_file(path, plan.for_file(path), warn)
    merged = read_files(
        files.jsonl, plan, WarningLog(sink=lambda _m: None), 2, (50_000, 200_000, None)
    )
    _assert_same_figures(_state(merged), _state(one))
    summary = one.result(files, plan)
    doc = json.loads(json.dumps(build_json(summary, judge(summary), build_sections(summary, warn))))
    _assert_same_figures(doc, json.loads(docs[0]))
    assert messages == said[0]


def _stats(stats: DurationStats) -> list[object]:
    return [stats.count, stats.total, stats.min, stats.max, stats.percentile(50)]


def _state(part: _FilePass) -> dict[str, object]:
    """Every figure a pass gathered, span-based ones included (before the histograms
    replace some of them in the report)."""
    return {
        "step": _stats(part.step),
        "timings": {
            name: [
                _stats(agg.stats),
                agg.direct_total_s,
                agg.direct_count,
                agg.nested_count,
                agg.root_count,
                agg.unresolved_count,
                agg.nested_in,
                {parent: _stats(s) for parent, s in agg.by_parent.items()},
            ]
            for name, agg in part.timings.items()
        },
        "ranks": {
            rank.resource.label: [
                rank.spans,
                _stats(rank.steps),
            ]
            for rank in part.ranks.values()
        },
        "series": {
            repr(key): [agg.count, agg.total, agg.min, agg.max] for key, agg in part.series.items()
        },
        "latest": {repr(key): list(value) for key, value in part.latest.items()},
        "failed": part.failed,
        "step0": part.step0,
        "read": vars(part.read),
        "unresolved": part.unresolved,
        "over_limit": part.over_limit,
        "span": [part.first_ns, part.last_ns],
        "hists": len(part.hists),
        "stragglers": [w.to_dict() for w in part.stragglers.result().ranks],
        "throughput": [vars(t) for t in part.work.result()],
        "kept_steps": {r.label: n for r, n in part.work.kept_steps.items()},
    }


def _assert_same_figures(got: object, want: object, where: str = "") -> None:
    """Equal, but for floats summed in another order (a few units in the last place)."""
    if isinstance(want, float) and isinstance(got, float):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), where
    elif isinstance(want, dict) and isinstance(got, dict):
        assert list(got) == list(want), where
        for key in want:
            _assert_same_figures(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list) and isinstance(got, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same_figures(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def test_merged_duration_stats_are_one_pass_over_both_parts_total_included() -> None:
    rng = random.Random(7)
    values = [rng.lognormvariate(-6, 1.5) for _ in range(3000)]
    for cap, cut in ((10_000, 1234), (2000, 1500), (1000, 200), (1000, 2900)):
        whole = DurationStats(cap)
        for v in values:
            whole.add(v)
        first, second = DurationStats(cap), DurationStats(cap)
        for v in values[:cut]:
            first.add(v)
        for v in values[cut:]:
            second.add(v)
        first.merge(second)
        assert (first.count, first.min, first.max) == (whole.count, whole.min, whole.max)
        assert first.exact == whole.exact
        if second.exact:  # re-added one by one: the very float total of one pass
            assert first.total == whole.total
        else:
            assert first.total == pytest.approx(whole.total, rel=1e-12)
        assert [first.percentile(q) for q in (0, 50, 90, 99, 100)] == [
            whole.percentile(q) for q in (0, 50, 90, 99, 100)
        ]


def test_spawned_workers_give_the_report_of_one_process(
    ranks_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where fork is unsafe (threads) or missing, workers are spawned: the same report."""
    import multiprocessing

    from otelprof.analysis import parallel_summary

    monkeypatch.setattr(parallel_summary, "_context", lambda: multiprocessing.get_context("spawn"))
    docs = []
    for jobs in (1, 2):
        warn = WarningLog(sink=lambda _m: None)
        summary = summarize(open_run([ranks_run]), warn, jobs=jobs)
        docs.append(json.dumps(build_json(summary, judge(summary), build_sections(summary, warn))))
    assert docs[1] == docs[0]


class _DiesInAWorker(_FilePass):
    """A pass whose worker is killed reading one file (as the out-of-memory killer would)."""

    parent = os.getpid()

    def read_file(self, path: Path, windows: Any, warn: Any) -> None:
        if os.getpid() != self.parent and path.name == "traces.rank2.jsonl":
            os._exit(9)
        super().read_file(path, windows, warn)


def test_a_worker_that_dies_leaves_the_rest_to_the_report_process_same_figures(
    ranks_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import functools
    import multiprocessing

    from otelprof.analysis import parallel_summary

    monkeypatch.setattr(parallel_summary, "_context", lambda: multiprocessing.get_context("fork"))
    files = open_run([ranks_run])
    plan = ReadPlan.for_files(files.jsonl, None)
    args = (50_000, 200_000, None)
    said: list[str] = []
    survived = parallel_summary.read_in_workers(
        files.jsonl, plan, said.append, 2, functools.partial(_DiesInAWorker, *args)
    )
    one: list[str] = []
    serial = read_files(files.jsonl, plan, one.append, 1, args)
    assert any("worker process ended abruptly" in m for m in said)
    assert [m for m in said if "abruptly" not in m] == one
    _assert_same_figures(_state(survived), _state(serial))


class _StopsInAWorker(_FilePass):
    """A pass whose worker process stops itself reading one file (SIGSTOP: alive, stalled)."""

    parent = os.getpid()

    def read_file(self, path: Path, plan: Any, warn: Any) -> None:
        if os.getpid() != self.parent and path.name == "traces.rank2.jsonl":
            os.kill(os.getpid(), signal.SIGSTOP)
        super().read_file(path, plan, warn)


def test_a_stopped_worker_is_given_up_and_its_files_read_here_with_the_same_figures(
    ranks_run: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import multiprocessing

    from otelprof.analysis import parallel_summary

    monkeypatch.setattr(parallel_summary, "_context", lambda: multiprocessing.get_context("fork"))
    files = open_run([ranks_run])
    plan = ReadPlan.for_files(files.jsonl, None)
    args = (50_000, 200_000, None)
    said: list[str] = []
    started = time.monotonic()
    survived = parallel_summary.read_in_workers(
        files.jsonl,
        plan,
        said.append,
        2,
        functools.partial(_StopsInAWorker, *args),
        stalled_after_s=2.0,
    )
    elapsed = time.monotonic() - started
    one: list[str] = []
    serial = read_files(files.jsonl, plan, one.append, 1, args)
    stalled = [m for m in said if "made no progress for 2 s (stopped?)" in m]
    assert len(stalled) == 1, said
    assert [m for m in said if m not in stalled] == one
    _assert_same_figures(_state(survived), _state(serial))
    assert 2.0 <= elapsed < 60, elapsed
    pid = int(stalled[0].split("(pid ")[1].split(")")[0])
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left stopped
        os.kill(pid, 0)
