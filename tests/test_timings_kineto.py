"""Kineto windows: torch.profiler runs on active steps; its operator events become spans."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import otelprof
from otelprof._timings import _recorder as rec
from otelprof._timings._kineto import KinetoSession, WindowStep
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


class _SpanArgs:
    """A builder that hands back what a span would be made of."""

    def make_span(self, **span: Any) -> dict[str, Any]:
        return span


def _convert(tmp_path: Path, window: list[WindowStep], events: list[dict[str, Any]]) -> Any:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"baseTimeNanoseconds": 0, "traceEvents": events}))
    session = KinetoSession(torch, _SpanArgs(), tmp_path)  # type: ignore[arg-type]
    return session, list(session._convert(path, window))


def _x(cat: str, name: str, ts_us: float, dur_us: float) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts_us, "dur": dur_us, "pid": 1, "tid": 1}


def test_kineto_events_go_to_the_step_torchs_marks_put_them_in_when_its_clock_is_off(
    tmp_path: Path,
) -> None:
    # Our steps (ns): a warm-up step without a mark, then two recorded ones. Kineto's Unix
    # times run 70 µs late, as its clock conversion does on a busy machine; torch's
    # ProfilerStep marks end at the next step() call, after our step's end.
    warmup, second, third = (rec.StepContext(n, None, 0) for n in (1, 2, 3))
    window = [
        WindowStep(warmup, 1_000_000, 1_100_000),
        WindowStep(second, 1_200_000, 1_300_000),
        WindowStep(third, 1_400_000, 1_450_000),
    ]
    session, spans = _convert(
        tmp_path,
        window,
        [
            _x("user_annotation", "ProfilerStep#2", 1270, 195),
            _x("user_annotation", "ProfilerStep#3", 1465, 80),
            _x("cpu_op", "aten::mm", 1350, 40),  # ran from 1280 µs, in step 2
            _x("cpu_op", "aten::relu", 1500, 10),  # ran from 1430 µs, in step 3
        ],
    )
    assert [(s["name"], s["attributes"]["otelprof.step"]) for s in spans] == [
        ("aten::mm", 2),
        ("aten::relu", 3),
    ]
    for span, step in zip(spans, window[1:], strict=True):
        assert step.start_ns <= span["start_ns"] <= step.end_ns, "starts inside its step"
        assert span["parent_id"] == step.ctx.span_id
    assert [s["end_ns"] - s["start_ns"] for s in spans] == [40_000, 10_000], "durations kept"
    assert session.events_dropped == 0

    # Without marks (a torch that writes none), Kineto's Unix times decide: what falls
    # outside every step is dropped, counted.
    session, spans = _convert(
        tmp_path, window, [_x("cpu_op", "aten::mm", 1250, 40), _x("cpu_op", "aten::relu", 1350, 10)]
    )
    assert [(s["name"], s["start_ns"]) for s in spans] == [("aten::mm", 1_250_000)]
    assert session.events_dropped == 1
