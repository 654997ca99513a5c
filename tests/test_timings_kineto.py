"""Kineto windows: torch.profiler runs on active steps; its operator events become spans."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import otelprof
from otelprof._timings._recorder import timing
from otelprof._timings._schedule import schedule
from tests.timings_harness import by_name, start_run


def test_kineto_window_operator_events_become_child_spans_of_active_steps(
    tmp_path: Path,
) -> None:
    sched = schedule(wait=1, warmup=1, active=2, repeat=1)
    run = start_run(tmp_path, schedule=sched, kineto=True)
    x = torch.randn(64, 64)
    for _ in range(6):
        with timing("train_batch"):
            (x @ x).relu()
        otelprof.step()
    spans = run.finish()
    stats = run.engine.stats()
    assert stats["kineto_traces"] == 1

    files = list((run.settings.run_dir / "kineto").glob("*.pt.trace.json"))
    assert len(files) == 1, files
    assert json.loads(files[0].read_text())["traceEvents"], "the Chrome trace is kept"

    steps = {s.attributes["otelprof.step"]: s for s in by_name(spans, "step")}
    assert set(steps) == {2, 3}
    kineto = [s for s in spans if s.attributes.get("otelprof.source") == "kineto"]
    assert stats["kineto_spans"] == len(kineto) > 0
    assert {s.attributes["otelprof.step"] for s in kineto} == {2, 3}
    by_id = {s.span_id: s for s in spans}
    for span in kineto:
        step = steps[span.attributes["otelprof.step"]]
        assert span.trace_id == step.trace_id
        assert step.start_ns <= span.start_ns <= step.end_ns
        node = span  # the parent chain ends at the step span
        while node.parent_span_id:
            node = by_id[node.parent_span_id]
        assert node is step
    names = {s.name for s in kineto}
    assert "aten::relu" in names and ("aten::mm" in names or "aten::matmul" in names)
    matmul = next(s for s in kineto if s.name == "aten::matmul")
    mm = next(s for s in kineto if s.name == "aten::mm" and s.trace_id == matmul.trace_id)
    assert mm.parent_span_id == matmul.span_id, "CPU operators nest by time containment"
    # record_function ranges already are spans through the bridge: not repeated from Kineto
    assert not [s for s in kineto if s.name == "train_batch"]


def test_kineto_without_a_schedule_runs_one_short_window(tmp_path: Path) -> None:
    run = start_run(tmp_path, kineto=True)
    x = torch.randn(16, 16)
    for _ in range(7):
        x @ x
        otelprof.step()
    spans = run.finish()
    kineto_steps = {
        s.attributes["otelprof.step"]
        for s in spans
        if s.attributes.get("otelprof.source") == "kineto"
    }
    assert kineto_steps == {2, 3, 4}  # wait=1, warmup=1, active=3, once
    assert len(by_name(spans, "step")) == 7  # timing spans stay always on
