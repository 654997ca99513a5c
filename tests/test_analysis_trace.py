"""`otelprof trace`: valid Chrome trace JSON, a process per rank, slices, counter tracks."""

from __future__ import annotations

import gzip
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof.analysis.chrome_trace import ALL_RANKS, write_trace
from otelprof.analysis.reader import WarningLog, open_run
from otelprof.cli import main as cli_main
from tests.otlp_files import read_points, read_spans
from tests.run_generators import T0_NS, RunSpec, write_sdk_run


def load_chrome_trace(path: Path) -> list[dict[str, Any]]:
    """Parse and check the trace event format rules a viewer relies on."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:  # type: ignore[operator]
        doc = json.load(f)
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    for ev in doc["traceEvents"]:
        assert ev["ph"] in {"X", "C", "M"}, ev
        assert isinstance(ev["name"], str) and isinstance(ev["pid"], int)
        if ev["ph"] == "X":
            assert isinstance(ev["tid"], int)
            assert isinstance(ev["ts"], (int, float)) and isinstance(ev["dur"], (int, float))
            assert ev["dur"] >= 0
        if ev["ph"] == "C":
            assert isinstance(ev["ts"], (int, float))
            assert all(isinstance(v, (int, float)) for v in ev["args"].values())
    return list(doc["traceEvents"])


def _spans(*run_dirs: Path) -> list[Any]:
    return [s for d in run_dirs for f in sorted(d.glob("traces*.jsonl")) for s in read_spans(f)]


def _rank_processes(events: list[dict[str, Any]]) -> dict[int, str]:
    """pid -> name of every process but the "all ranks" view."""
    return {
        e["pid"]: e["args"]["name"]
        for e in events
        if e["name"] == "process_name" and e["args"]["name"] != ALL_RANKS
    }


def test_trace_has_a_process_per_rank_slices_for_spans_and_counter_tracks(
    tmp_path: Path,
) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(ranks=2, gpus=2, steps=20))
    out = tmp_path / "trace.json"
    assert cli_main(["trace", str(run), "-o", str(out)]) == 0
    events = load_chrome_trace(out)
    names = _rank_processes(events)
    assert sorted(names) == [0, 1]
    assert names[0].startswith("rank 0 @ node0") and names[1].startswith("rank 1 @ node0")
    slices = [e for e in events if e["ph"] == "X" and e["pid"] in names]
    spans = _spans(run)
    assert len(slices) == len(spans)
    by_pid = defaultdict(set)
    for e in slices:
        by_pid[e["pid"]].add(e["name"])
    assert {"step", "dataloader_next", "train_batch", "forward"} <= by_pid[0]
    counters = {(e["pid"], e["name"]) for e in events if e["ph"] == "C"}
    assert (0, "hw.gpu.utilization [gpu 0] (1)") in counters
    assert (0, "hw.gpu.utilization [gpu 1] (1)") in counters
    assert (0, "system.disk.throughput [read] (By/s)") in counters
    assert (1, "process.memory.usage (By)") in counters
    points = [p for f in sorted(run.glob("metrics*.jsonl")) for p in read_points(f)]
    assert sum(e["ph"] == "C" for e in events) == len(points)


def test_slices_keep_nanosecond_times_and_nest_inside_their_step(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=10))
    warn = WarningLog(sink=lambda _m: None)
    result = write_trace(open_run([run]), tmp_path / "t.json", warn)
    events = load_chrome_trace(tmp_path / "t.json")
    origin = result.origin_ns
    assert origin == T0_NS  # run.json's start
    by_id = {e["args"]["span_id"]: e for e in events if e["ph"] == "X"}
    for span in _spans(run):
        ev = by_id[span.span_id]
        assert ev["ts"] == pytest.approx((span.start_ns - origin) / 1000, abs=1e-6)
        assert ev["dur"] == pytest.approx((span.end_ns - span.start_ns) / 1000, abs=1e-6)
        assert ev["args"].get("otelprof.step") == span.attributes.get("otelprof.step")
        parent = by_id.get(span.parent_span_id)
        if parent is not None:  # properly nested on the same track: a viewer draws a stack
            assert (parent["pid"], parent["tid"]) == (ev["pid"], ev["tid"])
            assert (
                parent["ts"] <= ev["ts"]
                and ev["ts"] + ev["dur"] <= parent["ts"] + parent["dur"] + 1e-6
            )


def test_two_nodes_run_directories_merge_on_one_time_axis(tmp_path: Path) -> None:
    node0 = write_sdk_run(
        tmp_path / "node0", RunSpec(ranks=2, world_size=4, host="node0", steps=10)
    )
    node1 = write_sdk_run(
        tmp_path / "node1",
        RunSpec(
            ranks=2, world_size=4, first_rank=2, host="node1", steps=10, t0_ns=T0_NS + 250_000_000
        ),
    )
    out = tmp_path / "merged.json.gz"
    assert cli_main(["trace", str(node0), str(node1), "-o", str(out)]) == 0
    events = load_chrome_trace(out)
    names = _rank_processes(events)
    assert sorted(names) == [0, 1, 2, 3]
    assert "@ node1" in names[3] and "@ node0" in names[0]
    first_step = {
        e["pid"]: e["ts"]
        for e in events
        if e["ph"] == "X" and e["args"].get("otelprof.step") == 0 and e["name"] == "step"
    }
    # one clock: node1 started 250 ms after node0, and the trace shows exactly that
    assert first_step[0] == 0 and first_step[2] == pytest.approx(250_000, abs=1e-3)


def test_trace_without_metrics_has_no_counter_tracks(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=5))
    out = tmp_path / "t.json"
    assert cli_main(["trace", str(run), "-o", str(out), "--no-metrics"]) == 0
    assert not [e for e in load_chrome_trace(out) if e["ph"] == "C"]


def test_a_truncated_trace_file_still_converts_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=5))
    intact = len(_spans(run))
    with (run / "traces.jsonl").open("a") as f:
        f.write('{"resourceSpans":[{"resource":{"attr')
    out = tmp_path / "t.json"
    assert cli_main(["trace", str(run), "-o", str(out)]) == 0
    assert "traces.jsonl:2: truncated last line skipped" in capsys.readouterr().err
    assert len([e for e in load_chrome_trace(out) if e["ph"] == "X"]) == intact


def test_each_track_of_a_process_has_its_own_name(tmp_path: Path) -> None:
    import otelprof

    with otelprof.instrument(output_dir=tmp_path, host_metrics=False) as prof:
        for _ in range(3):
            with otelprof.timing("train_batch"):
                pass
            otelprof.step()
    assert prof.run_dir is not None
    out = tmp_path / "trace.json"
    assert cli_main(["trace", str(prof.run_dir), "-o", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    names = defaultdict(list)
    for e in events:
        if e["ph"] == "M" and e["name"] == "thread_name":
            names[e["pid"]].append(e["args"]["name"])
    for pid, tracks in names.items():
        assert len(tracks) == len(set(tracks)), (pid, tracks)
    assert sorted(names[0]) == ["MainThread", "steps"]


def _rank_run(out: Path, rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank of a 2-rank job, run in this process (the launcher's variables say which):
    6 steps, rank 1 slower at step 3, a validation batch after step 2."""
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", 2)):
        monkeypatch.setenv(name, str(value))
    with otelprof.instrument(
        output_dir=str(out), run_id="job", trace_budget=float("inf"),
        host_metrics=False, process_metrics=False,
    ):  # fmt: skip
        for step in range(6):
            with otelprof.timing("train_batch"):
                time.sleep(0.2 if (rank, step) == (1, 3) else 0.001)
            otelprof.step()
            if step == 2:
                with otelprof.phase("validation"), otelprof.timing("eval_batch"):
                    pass


def partial_overlaps(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], ...]]:
    """Pairs of slices on one track (pid, tid) that overlap without one holding the other:
    what a viewer cannot draw as a stack."""
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append(e)
    found = []
    eps = 1e-3  # µs: ts and dur are exact decimals of nanoseconds
    for slices in tracks.values():
        slices.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_: list[dict[str, Any]] = []
        for e in slices:
            while open_ and open_[-1]["ts"] + open_[-1]["dur"] <= e["ts"] + eps:
                open_.pop()
            if open_ and e["ts"] + e["dur"] > open_[-1]["ts"] + open_[-1]["dur"] + eps:
                found.append((open_[-1], e))
            open_.append(e)
    return found


def test_steps_of_all_ranks_are_side_by_side_in_an_all_ranks_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for rank in (0, 1):
        _rank_run(tmp_path / "runs", rank, monkeypatch)
    run = tmp_path / "runs" / "job"
    out = tmp_path / "t.json"
    result = write_trace(open_run([run]), out, WarningLog(sink=lambda _m: None))
    events = load_chrome_trace(out)
    (view,) = [e["pid"] for e in events if e.get("args", {}).get("name") == ALL_RANKS]
    assert {"name": "process_sort_index", "pid": view, "tid": 0, "args": {"sort_index": -1}} in [
        {k: e[k] for k in ("name", "pid", "tid", "args")} for e in events if e["ph"] == "M"
    ]
    tracks = {
        e["tid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == view
    }
    assert sorted(tracks.values()) == ["rank 0", "rank 1"]
    slices = [e for e in events if e["ph"] == "X" and e["pid"] == view]
    assert result.steps == 7  # 6 steps and the validation batch, each on both ranks
    assert len(slices) == 14
    by_rank = defaultdict(dict)
    for e in slices:
        by_rank[tracks[e["tid"]]][e["name"]] = e
    names = {f"step {n}" for n in range(6)} | {"validation (at step 3)"}
    assert set(by_rank["rank 0"]) == set(by_rank["rank 1"]) == names
    roots = [e for e in events if e["ph"] == "X" and e["pid"] in (0, 1) and e["name"] == "step"]
    for n in range(6):
        for rank in (0, 1):
            (own,) = [e for e in roots if e["args"]["otelprof.step"] == n and e["pid"] == rank]
            view_slice = by_rank[f"rank {rank}"][f"step {n}"]
            # the rank's own step, in the same trace as every rank's
            assert view_slice["args"]["trace_id"] == own["args"]["trace_id"]
            assert (view_slice["ts"], view_slice["dur"]) == (own["ts"], own["dur"])
            assert view_slice["args"]["ranks"] == 2
    slow = by_rank["rank 0"]["step 3"]["args"]
    assert slow["last_to_end"] == "rank 1" and slow["end_spread_ms"] >= 190
    assert by_rank["rank 1"]["step 3"]["args"]["ends_after_first_ms"] == slow["end_spread_ms"]
    assert by_rank["rank 0"]["step 3"]["args"]["ends_after_first_ms"] == 0
    assert not partial_overlaps(events)


def test_an_all_ranks_track_of_unaligned_ranks_still_nests(tmp_path: Path) -> None:
    """Ranks whose steps start and end at different times (no synchronisation): the slices
    of every track, the "all ranks" ones included, nest or follow each other."""
    spec = RunSpec(ranks=3, steps=60, straggler_rank=1, shared_trace_ids=True)
    run = write_sdk_run(tmp_path / "run", spec)
    out = tmp_path / "t.json"
    result = write_trace(open_run([run]), out, WarningLog(sink=lambda _m: None))
    events = load_chrome_trace(out)
    (view,) = [e["pid"] for e in events if e.get("args", {}).get("name") == ALL_RANKS]
    assert result.steps == 62  # 60 steps and a validation after each of 2 epochs
    assert sum(e["ph"] == "X" and e["pid"] == view for e in events) == 3 * result.steps
    assert not partial_overlaps(events)
