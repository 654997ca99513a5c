"""Steps, epochs, schedules, bounded queue and lifecycle of the TimingsEngine."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import torch

import otelprof
from otelprof._timings._recorder import timing
from otelprof._timings._schedule import ScheduleAction, cyclic_schedule, schedule
from otelprof.analysis.reader import WarningLog, open_run
from otelprof.analysis.summary import summarize
from otelprof.analysis.verdict import judge
from tests.timings_harness import by_name, one, start_run


def _work(steps: int) -> None:
    for i in range(steps):
        with timing("train_batch", index=i), torch.profiler.record_function("forward"):
            pass
        otelprof.step()


def test_each_step_is_one_trace_rooted_at_a_step_span(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    _work(3)
    spans = run.finish()
    steps = sorted(by_name(spans, "step"), key=lambda s: s.attributes["otelprof.step"])
    assert [s.attributes["otelprof.step"] for s in steps] == [0, 1, 2]
    assert len({s.trace_id for s in steps}) == 3
    for step in steps:
        n = step.attributes["otelprof.step"]
        children = [s for s in spans if s.trace_id == step.trace_id and s is not step]
        assert sorted(c.name for c in children) == ["forward", "train_batch"]
        batch = next(c for c in children if c.name == "train_batch")
        assert batch.parent_span_id == step.span_id
        assert batch.attributes["index"] == n
        assert all(c.attributes["otelprof.step"] == n for c in children)
    # consecutive steps tile time: one ends where the next begins (within the boundary cost)
    for a, b in itertools.pairwise(steps):
        assert 0 <= b.start_ns - a.end_ns < 5_000_000
    # the trailing step (after the last step() call) had no ranges: not exported
    assert run.engine.stats()["steps"] == 3


def test_ranges_after_the_last_step_are_after_training_work_not_a_step(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    _work(10)
    with timing("final_sync"):
        time.sleep(0.05)  # longer than all the steps together: it would decide a verdict
    spans = run.finish()
    # a step is exactly what step() delimits: 10 calls, 10 steps
    assert sorted(s.attributes["otelprof.step"] for s in by_name(spans, "step")) == list(range(10))
    after = one(spans, "after_training")
    assert after.attributes["otelprof.phase"] == "after_training"
    final = one(spans, "final_sync")
    assert final.parent_span_id == after.span_id
    assert final.attributes["otelprof.phase"] == "after_training"
    assert run.engine.stats()["steps"] == 10
    # and the report of that file: 10 steps, their mean from the steps alone, no verdict
    # from the work after them
    warn = WarningLog(sink=lambda _m: None)
    summary = summarize(open_run([tmp_path], warn), warn)
    step_spans = by_name(spans, "step")
    assert summary.step.count == 10
    mean = sum(s.end_ns - s.start_ns for s in step_spans) / 10 / 1e9
    assert summary.step.mean == pytest.approx(mean, rel=1e-6)
    assert "final_sync" not in judge(summary).headline


def test_a_run_without_step_calls_is_one_step(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    with timing("evaluate"):
        pass
    spans = run.finish()
    assert [s.attributes["otelprof.step"] for s in by_name(spans, "step")] == [0]


def test_epoch_is_carried_by_step_and_timing_spans(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    for epoch in range(2):
        otelprof.set_epoch(epoch)
        _work(2)
    spans = run.finish()
    assert {(s.attributes["otelprof.step"], s.attributes["otelprof.epoch"]) for s in spans} == {
        (0, 0),
        (1, 0),
        (2, 1),
        (3, 1),
    }
    assert all("otelprof.epoch" in s.attributes for s in spans)


def test_schedule_windows_produce_spans_exactly_on_active_steps(tmp_path: Path) -> None:
    sched = schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=2)
    run = start_run(tmp_path, schedule=sched)
    _work(14)
    spans = run.finish()
    active = {n for n in range(14) if sched(n).records}
    assert active == {3, 4, 7, 8}
    for name in ("step", "train_batch", "forward"):
        assert {s.attributes["otelprof.step"] for s in by_name(spans, name)} == active


def test_cyclic_schedule_restarts_at_each_epoch(tmp_path: Path) -> None:
    run = start_run(
        tmp_path, schedule=cyclic_schedule(skip_first=1, wait=0, warmup=0, active=1, repeat=1)
    )
    for epoch in range(2):
        otelprof.set_epoch(epoch)
        _work(5)
    spans = run.finish()
    recorded = sorted(
        (s.attributes["otelprof.epoch"], s.attributes["otelprof.step"])
        for s in by_name(spans, "step")
    )
    # batches 1 and 2 of each epoch (one window + one repetition), global steps 1,2 and 6,7
    assert recorded == [(0, 1), (0, 2), (1, 6), (1, 7)]


def test_a_raising_schedule_records_nothing_and_is_counted(tmp_path: Path) -> None:
    def broken(step: int) -> ScheduleAction:
        raise RuntimeError("bad schedule")

    run = start_run(tmp_path, schedule=broken)
    _work(2)
    spans = run.finish()
    assert spans == []
    assert run.engine.stats()["schedule_errors"] == 3


def test_a_full_queue_drops_and_counts_instead_of_blocking(tmp_path: Path) -> None:
    run = start_run(tmp_path, max_queued_spans=10)
    started = time.perf_counter()
    for _ in range(5000):
        with timing("burst"):
            pass
    assert time.perf_counter() - started < 5.0
    spans = run.finish()
    stats = run.engine.stats()
    assert stats["spans_dropped"] > 0
    assert len(by_name(spans, "burst")) + stats["spans_dropped"] == 5000
    assert stats["spans_recorded"] == len(spans)


def test_helpers_are_no_ops_that_still_run_the_code_without_an_engine() -> None:
    calls = []

    @timing("decorated")
    def work() -> int:
        calls.append(1)
        return 5

    with timing("block", k="v"):
        calls.append(2)
    assert work() == 5
    otelprof.step()
    otelprof.set_epoch(3)
    assert calls == [2, 1]


def test_unexportable_attribute_values_become_strings(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    with timing("attrs", shape=(2, 3), device=torch.device("cpu"), missing=None, flag=True):
        pass
    span = by_name(run.finish(), "attrs")[0]
    assert span.attributes["device"] == "cpu"
    assert span.attributes["flag"] is True
    assert "missing" not in span.attributes
    assert "shape" in span.attributes


def test_timing_rejects_an_empty_name() -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        timing("")


def test_start_twice_is_an_error_and_shutdown_is_idempotent(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    with pytest.raises(RuntimeError, match="started once"):
        run.engine.start()
    run.finish()
    run.engine.shutdown()


def test_stats_report_recorded_spans(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    _work(2)
    run.engine.flush()
    stats = run.engine.stats()
    assert stats["spans_recorded"] == 6  # 2 x (step, train_batch, forward)
    assert stats["spans_dropped"] == 0
    assert stats["bridge_installed"] == 1
    run.finish()


def test_first_step_starts_at_its_first_range_not_at_start(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    time.sleep(0.2)  # set-up between instrument() and the first batch: not step time
    t0 = time.perf_counter_ns()
    with timing("first"):
        pass
    t1 = time.perf_counter_ns()
    otelprof.step()
    step_call_ns = time.perf_counter_ns() - t1
    first_step_ns = time.perf_counter_ns() - t0  # at most this, however busy the machine
    with timing("second"):
        pass
    otelprof.step()
    time.sleep(0.1)
    spans = run.finish()
    steps = sorted(by_name(spans, "step"), key=lambda s: s.attributes["otelprof.step"])
    first = by_name(spans, "first")[0]
    assert steps[0].start_ns == first.start_ns
    assert steps[0].duration_s * 1e9 <= first_step_ns + 1000  # the 0.2 s set-up left out
    assert steps[1].start_ns - steps[0].end_ns <= step_call_ns, "later steps start at step()"


def test_after_training_work_ends_at_its_last_range(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    otelprof.step()
    with timing("evaluate"):
        pass
    time.sleep(0.2)  # tear-down before shutdown: not after-training work
    spans = run.finish()
    assert one(spans, "after_training").end_ns == one(spans, "evaluate").end_ns


def test_a_forked_child_records_nothing(tmp_path: Path) -> None:
    import os

    run = start_run(tmp_path)
    with timing("parent"):
        pass
    pid = os.fork()
    if pid == 0:  # child: e.g. a DataLoader worker; nothing may queue up there
        from otelprof._timings import _recorder as rec

        with timing("child"), torch.profiler.record_function("child_rf"):
            pass
        os._exit(0 if rec.recorder.current is None and len(rec.recorder.queue) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    names = {s.name for s in run.finish()}
    assert names == {"step", "parent"}
