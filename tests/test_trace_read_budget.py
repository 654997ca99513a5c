"""`otelprof trace --read-budget`: a run over the budget becomes a trace of time windows that
are the same on every rank (whole steps), noted as a sample; within it, the full trace."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from otelprof.cli import main as cli_main
from tests.otlp_files import read_spans
from tests.run_generators import RunSpec, write_sdk_run

RANKS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 ranks of 800 steps (about 15 s of run time, 4.2 MB): step numbers and times shared
    by the ranks, each rank's durations jittered (so ranks drift apart a little)."""
    out = tmp_path_factory.mktemp("runs") / "run"
    return write_sdk_run(out, RunSpec(ranks=RANKS, steps=400, epochs=2))


def _trace(
    run: Path, out: Path, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[dict[str, Any], str]:
    assert cli_main(["trace", str(run), "-o", str(out), *args]) == 0
    err = capsys.readouterr().err
    return json.loads(out.read_text()), err


def _steps_by_rank(doc: dict[str, Any]) -> dict[int, set[int]]:
    steps: dict[int, set[int]] = defaultdict(set)
    for event in doc["traceEvents"]:
        step = event.get("args", {}).get("otelprof.step")
        if event["ph"] == "X" and step is not None:
            steps[event["pid"]].add(step)
    return steps


def test_a_run_over_the_budget_is_read_in_the_same_time_windows_on_every_rank(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    size = sum(p.stat().st_size for p in run.glob("*.jsonl"))
    doc, err = _trace(run, tmp_path / "t.json", capsys, "--read-budget", str(size // 2))
    sample = doc["otherData"]["sample"]
    assert "sample of the run" in err and "--read-all" in err
    assert sample["note"] in err and "--read-all" in sample["note"]
    windows = sample["windows"]
    assert len(windows) >= 2 and windows[0]["from_s"] == 0  # the run's start, then spread
    assert all(a["to_s"] < b["from_s"] for a, b in itertools.pairwise(windows))

    every = {
        s.attributes["otelprof.step"]
        for f in run.glob("traces*.jsonl")
        for s in read_spans(f)
        if "otelprof.step" in s.attributes
    }
    steps = _steps_by_rank(doc)
    assert sorted(steps) == list(range(RANKS))
    kept = steps[0]
    assert 0 < len(kept) < len(every)
    for rank in range(RANKS):  # step N of every rank, or of none
        assert steps[rank] == kept, rank
    ranges = [tuple(w["steps"]["train"]) for w in windows]
    assert kept == {n for lo, hi in ranges for n in range(lo, hi + 1)} & every
    assert 0 in kept and max(kept) >= max(every) / 2  # the run's start, and spread over it

    # every span is whole: each kept step has its children on every rank
    children = defaultdict(set)
    for event in doc["traceEvents"]:
        if event["ph"] == "X" and event["name"] == "train_batch":
            children[event["pid"]].add(event["args"]["otelprof.step"])
    assert all(children[rank] == kept for rank in range(RANKS))
    # gauges only inside the windows
    origin_us = [(w["from_s"] * 1e6 - 500, w["to_s"] * 1e6 + 500) for w in windows]  # ms
    counters = [e["ts"] for e in doc["traceEvents"] if e["ph"] == "C"]
    assert counters and all(any(a <= t < b for a, b in origin_us) for t in counters)


def test_within_the_budget_and_with_read_all_the_trace_is_the_whole_run(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _default, err = _trace(run, tmp_path / "default.json", capsys)
    assert "sample" not in err
    everything, _ = _trace(run, tmp_path / "all.json", capsys, "--read-all")
    assert (tmp_path / "default.json").read_bytes() == (tmp_path / "all.json").read_bytes()
    assert "sample" not in everything["otherData"]
    spans = sum(len(read_spans(f)) for f in run.glob("traces*.jsonl"))
    slices = [e for e in everything["traceEvents"] if e["ph"] == "X" and e["cat"] == "otelprof"]
    assert len(slices) == spans
    small, _ = _trace(run, tmp_path / "small.json", capsys, "--read-budget", "1M")
    assert "sample" in small["otherData"]
    with pytest.raises(SystemExit):  # one or the other, not both
        cli_main(["trace", str(run), "--read-all", "--read-budget", "1M"])
