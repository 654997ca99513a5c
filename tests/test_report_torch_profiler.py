"""A user's own `torch.profiler.profile` beside otelprof (the torch.profiler + TensorBoard
recipe): its `ProfilerStep#N` ranges wrap every step, and never take the step's place."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity

import otelprof
from otelprof.analysis.reader import WarningLog, open_run
from otelprof.analysis.summary import RunSummary, summarize
from otelprof.analysis.tables import WRAPS_STEP, timing_rows
from otelprof.analysis.verdict import direct_shares, judge

STEPS = 24
LOAD_S, TRAIN_S = 0.026, 0.014  # 65 % of each step in dataloader_next
PROFILED = 5  # steps 0-4: the schedule's wait, warmup and active steps (kineto's own costs)


def _loop_beside_torch_profiler(out: Path) -> tuple[Path, list[int], list[int]]:
    """The recipe's loop with otelprof beside it; per step, the test's own clock's step time
    (from one `step()` to the next) and time in dataloader_next (ns)."""
    steps: list[int] = []
    loading: list[int] = []
    with otelprof.instrument(
        output_dir=str(out), run_id="run", host_metrics=False, process_metrics=False,
        trace_budget=float("inf"),
    ), torch.profiler.profile(
        activities=[ProfilerActivity.CPU],
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(out / "tensorboard")),
    ) as torch_prof:  # fmt: skip
        model = torch.nn.Linear(8, 8)
        began = None
        for _ in range(STEPS):
            load = time.perf_counter_ns()
            with otelprof.timing("dataloader_next"):
                time.sleep(LOAD_S)
                batch = torch.randn(4, 8)
            loaded = time.perf_counter_ns()
            with otelprof.timing("train_batch"):
                model(batch).sum().backward()
                time.sleep(TRAIN_S)
            otelprof.step()
            ended = time.perf_counter_ns()
            torch_prof.step()  # closes ProfilerStep#N, opens ProfilerStep#N+1
            steps.append(ended - (load if began is None else began))
            loading.append(loaded - load)
            began = ended
    assert list((out / "tensorboard").glob("*.json")), "torch's own trace was written"
    return out / "run", steps, loading


def _summary(run: Path, **kw: Any) -> RunSummary:
    warn = WarningLog(sink=lambda _m: None)
    return summarize(open_run([run], warn), warn, **kw)


def test_torch_profilers_step_ranges_wrap_each_step_and_the_verdict_reads_data_bound(
    tmp_path: Path,
) -> None:
    run, steps, loading = _loop_beside_torch_profiler(tmp_path)
    spans = [json.loads(line) for line in (run / "traces.jsonl").read_text().splitlines()]
    names = {
        s["name"]
        for doc in spans
        for rs in doc["resourceSpans"]
        for ss in rs["scopeSpans"]
        for s in ss["spans"]
    }
    assert "ProfilerStep" in names  # recorded: torch's ranges are bridged like any other

    # after the profiler's window, each step is the loop's: 65 % loading by the test's clock
    after = _summary(run, steps=(PROFILED, None))
    expected = sum(loading[PROFILED:]) / sum(steps[PROFILED:])
    shares = direct_shares(after)
    assert "ProfilerStep" not in shares
    assert abs(shares["dataloader_next"] - expected) < 0.02, (shares, expected)
    verdict = judge(after)
    assert verdict.kind == "data-loader bound", verdict.headline

    # the whole run: ProfilerStep wraps every step; the loop's ranges are the step's parts
    whole = _summary(run)
    rows = {r.name: r for r in timing_rows(whole)}
    assert rows["ProfilerStep"].level == WRAPS_STEP and rows["ProfilerStep"].share is None
    assert rows["ProfilerStep"].count == STEPS
    assert rows["dataloader_next"].level == "in step"
    assert whole.timings["dataloader_next"].direct_count == STEPS
    assert whole.timings["train_batch"].direct_count == STEPS
    assert "ProfilerStep" not in direct_shares(whole)
    assert not judge(whole).kind.startswith("ProfilerStep")
    # the ProfilerStep opened at the last torch step() is no timing after training
    assert not [n for n in whole.timings if "after_training" in n]


def test_a_range_open_across_step_is_no_part_of_the_step(tmp_path: Path) -> None:
    """`with timing("iteration"): ...; otelprof.step()`: the range wraps the step's work."""
    with otelprof.instrument(
        output_dir=str(tmp_path), run_id="run", host_metrics=False, process_metrics=False,
        trace_budget=float("inf"),
    ):  # fmt: skip
        for _ in range(6):
            with otelprof.timing("iteration"):
                with otelprof.timing("dataloader_next"):
                    time.sleep(0.006)
                with otelprof.timing("train_batch"):
                    time.sleep(0.002)
                otelprof.step()
    summary = _summary(tmp_path / "run")
    rows = {r.name: r for r in timing_rows(summary)}
    assert rows["iteration"].level == WRAPS_STEP
    assert set(direct_shares(summary)) >= {"dataloader_next", "train_batch"}
    assert "iteration" not in direct_shares(summary)
    assert judge(summary).kind == "data-loader bound"
