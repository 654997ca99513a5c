"""Steps sampled out on their own thread (`_recorder.OnThreadSampler`) give the same
aggregates, the same decisions and the same accounting as steps decided by the span builder.

A fake clock makes every duration known in advance, so the histograms can be checked exactly
against the schedule, with the on-thread path on and off.
"""

from __future__ import annotations

import bisect
import gc
import threading
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof._timings import _engine, _sampling
from otelprof._timings import _recorder as rec
from tests.otlp_files import read_lines, read_spans, timing_histograms


class _FakeClock:
    """perf_counter_ns for the recorder and the engine: moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 10**12

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _FakeClock:
    fake = _FakeClock()
    monkeypatch.setattr(rec.recorder, "clock", fake)
    monkeypatch.setattr(_engine, "perf_counter_ns", fake)
    monkeypatch.setattr(_sampling, "HEAD_BURST", 0.0)  # nothing fits a budget: every
    monkeypatch.setattr(_sampling, "TAIL_BURST", 0.0)  # step is sampled out but anomalies
    return fake


def _instrument(tmp_path: Path, run_id: str) -> Any:
    return otelprof.instrument(
        output_dir=str(tmp_path), run_id=run_id, trace_budget=0,
        host_metrics=False, process_metrics=False,
    )  # fmt: skip


def _train(prof: Any, clock: _FakeClock, steps: int, slow_step: int | None = None) -> dict:
    """A schedule of known durations; returns the expected durations per (name, phase)."""
    expected: dict[tuple[str, str], list[int]] = {}

    def block(name: str, ns: int, phase: str = "train") -> None:
        with otelprof.timing(name):
            clock.now += ns
        expected.setdefault((name, phase), []).append(ns)

    for i in range(steps):
        if i == 100:
            prof._timings.flush()  # the builder has seen 100 steps: it publishes its limits
        # a step starts at the previous step() (the first step, and the first after a
        # phase, at their first range): only step 251 starts before its loop iteration
        start = clock.now - (4_000 if i == 251 else 0)
        block("dataloader_next", 10_000 + (i % 7) * 1_000)
        forward = 100_000 + (i % 13) * 5_000 + (50_000_000 if i == slow_step else 0)
        with otelprof.timing("train_batch"):
            block("forward", forward)
            clock.now += 2_000
        expected.setdefault(("train_batch", "train"), []).append(forward + 2_000)
        if i == 320:  # a range of another thread, buffered by the builder mid-step
            side = threading.Thread(target=block, args=("side", 3_000))
            side.start()
            side.join()
            prof._timings._builder.drain(final=False)
        if i == 250:  # a range still open across the step boundary: it stays in step 250
            carry = otelprof.timing("carry")
            carry.__enter__()
            clock.now += 1_000
        expected.setdefault(("step", "train"), []).append(clock.now - start)
        otelprof.step()
        if i == 250:
            clock.now += 4_000
            carry.__exit__(None, None, None)
            expected[("carry", "train")] = [5_000]
        if i % 100 == 99:
            with otelprof.phase("validation"):
                block("eval_batch", 30_000, "validation")
    return expected


def _assert_histograms_are(hists: dict, expected: dict) -> None:
    for key, durations in expected.items():
        dp = hists[key]
        seconds = [d / 1e9 for d in durations]
        assert int(dp["count"]) == len(seconds), key
        assert dp["sum"] == pytest.approx(sum(seconds), rel=1e-9), key
        assert dp["min"] == pytest.approx(min(seconds)), key
        assert dp["max"] == pytest.approx(max(seconds)), key
        buckets = [0] * (len(_sampling.BOUNDS) + 1)
        for s in seconds:
            buckets[bisect.bisect_left(_sampling.BOUNDS, s)] += 1
        assert [int(c) for c in dp["bucketCounts"]] == buckets, key


@pytest.mark.parametrize(
    ("on_thread", "compiled", "long_ns"),
    [
        (True, True, None),
        (True, False, None),
        (False, True, None),
        (True, True, 150_000),
        (True, False, 150_000),
    ],
    ids=[
        "on-thread",
        "on-thread-python-recorder",
        "builder-only",
        "long-steps-to-the-builder",
        "long-steps-to-the-builder-python-recorder",
    ],
)
def test_steps_sampled_out_on_their_thread_give_the_exact_histograms_of_the_schedule(
    tmp_path: Path,
    clock: _FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    on_thread: bool,
    compiled: bool,
    long_ns: int | None,
) -> None:
    if not on_thread:  # every step is long: each goes to the builder
        monkeypatch.setattr(rec.on_thread, "long_step_ns", 0)
    if long_ns is not None:  # the schedule's steps take 0.11-0.18 ms: some long, some not
        monkeypatch.setattr(rec.on_thread, "long_step_ns", long_ns)
    rec.use_compiled(compiled)  # the Python recorder is the reference
    prof = _instrument(tmp_path, "q")
    try:
        expected = _train(prof, clock, 400)
        prof._timings.flush()
        # the other thread's range of step 320 is not left waiting for a decision
        assert prof._timings._builder.sampler._buffered == 0
    finally:
        prof.shutdown()
        rec.use_compiled(True)
    stats = prof.stats()
    if long_ns is not None:  # the long ones reached the builder whole, the rest did not
        assert 20 < stats["timings.steps_sampled_out_on_thread"] < 200
    elif on_thread:
        assert stats["timings.steps_sampled_out_on_thread"] > 200
    else:
        assert stats["timings.steps_sampled_out_on_thread"] == 0
    hists = timing_histograms(prof.files["metrics"])
    _assert_histograms_are(hists, expected)
    # every recorded span is written or counted as sampled out; none is lost
    recorded = sum(int(dp["count"]) for dp in hists.values())
    traces = prof.files["traces"]
    written = len(read_spans(traces)) if traces.exists() else 0  # a file once a span is kept
    assert written + stats["timings.spans_sampled_out"] == recorded
    assert stats["dropped_total"] == 0


@pytest.mark.parametrize("long_ns", [None, 150_000], ids=["on-thread", "long-steps-to-the-builder"])
def test_a_slow_step_after_steps_sampled_out_on_their_thread_is_kept_with_the_next_five(
    tmp_path: Path, clock: _FakeClock, monkeypatch: pytest.MonkeyPatch, long_ns: int | None
) -> None:
    if long_ns is not None:  # the slow step and some others reach the builder whole
        monkeypatch.setattr(rec.on_thread, "long_step_ns", long_ns)
    prof = _instrument(tmp_path, "a")
    try:
        _train(prof, clock, 300, slow_step=200)
    finally:
        prof.shutdown()
    stats = prof.stats()
    assert stats["timings.steps_sampled_out_on_thread"] > (10 if long_ns else 50)
    assert stats["timings.anomalies"] == 1
    assert stats["timings.anomalies_refused"] == 0
    steps = {
        s.attributes["otelprof.step"]: s
        for s in read_spans(prof.files["traces"])
        if s.name == "step"
    }
    assert steps[200].attributes["otelprof.sampled"] == "anomaly"
    captured = sorted(n for n, s in steps.items() if s.attributes["otelprof.sampled"] == "capture")
    assert captured == [201, 202, 203, 204, 205]
    (links,) = [
        span["links"]
        for request in read_lines(prof.files["traces"])
        for rs in request["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
        if span["spanId"] == steps[200].span_id
    ]
    assert {link["spanId"] for link in links} == {steps[n].span_id for n in captured}


def test_flush_on_the_training_thread_brings_the_histograms_up_to_the_last_step(
    tmp_path: Path, clock: _FakeClock
) -> None:
    prof = _instrument(tmp_path, "f")
    try:
        _train(prof, clock, 170)
        prof._timings.flush()
        hist = prof._timings.aggregates.histograms[("step", "train")]
        assert prof.stats()["timings.steps_sampled_out_on_thread"] > 0
        assert hist.count == 170
    finally:
        prof.shutdown()


def test_rows_of_steps_sampled_out_on_their_thread_are_left_alone_by_the_garbage_collector(
    tmp_path: Path, clock: _FakeClock
) -> None:
    """Rows wait for the builder's next drain (0.2 s): were they tracked containers,
    thousands a second would survive into the oldest generation and set off full
    collections, each a GIL stall as long as the process's heap is big."""
    prof = _instrument(tmp_path, "g")
    try:
        _train(prof, clock, 150)
        rows = rec.thread_state().rows  # this thread's batch, not handed over yet
        assert rows
        assert all(type(row) is bytes for row in rows)  # one int64 row, no container
        assert not any(gc.is_tracked(row) for row in rows)
    finally:
        prof.shutdown()


@pytest.mark.parametrize("on_thread", [True, False], ids=["on-thread", "builder-only"])
def test_cuda_events_of_sampled_out_steps_are_reused(
    tmp_path: Path, clock: _FakeClock, monkeypatch: pytest.MonkeyPatch, on_thread: bool
) -> None:
    from otelprof._timings._cuda import CudaTimer
    from tests.test_timings_cuda import _StandInEvent, _StandInTorch

    created = []

    class _CountedEvent(_StandInEvent):
        def __init__(self, enable_timing: bool = True) -> None:
            super().__init__(enable_timing)
            created.append(self)

    class _Cuda(_StandInTorch.cuda):  # type: ignore[name-defined,misc]
        Event = _CountedEvent

    class _Torch:
        cuda = _Cuda

    if not on_thread:  # every step is long: each goes to the builder
        monkeypatch.setattr(rec.on_thread, "long_step_ns", 0)
    prof = _instrument(tmp_path, "c")
    _StandInEvent.completed = True  # the device is done with every range
    try:
        timer = CudaTimer(_Torch, events=True, sync=False)
        prof._timings._builder._cuda = timer
        rec.recorder.cuda_timer = timer
        _train(prof, clock, 200)  # on-thread decisions start at step 100
        prof._timings.flush()  # the builder has decided every step it was handed
        before = len(created)
        _train(prof, clock, 100)
        prof._timings.flush()
        if on_thread:
            assert prof.stats()["timings.steps_sampled_out_on_thread"] > 150
        # 4 ranges x 2 events per step: without reuse 800 new events in 100 steps
        assert len(created) - before <= 16
    finally:
        rec.recorder.cuda_timer = None
        prof.shutdown()
        _StandInEvent.completed = False


def test_a_second_session_sampling_out_the_same_ranges_gives_exact_histograms(
    tmp_path: Path, clock: _FakeClock
) -> None:
    """Row layouts are numbered per session (`OnThreadSampler.reset()`), while the training
    thread remembers the last layout it found: a new session's first rows of the same
    ranges must name the new session's layouts, never the last session's numbers."""
    first = _instrument(tmp_path, "s1")
    try:
        _train(first, clock, 150)
    finally:
        first.shutdown()
    second = _instrument(tmp_path, "s2")
    try:
        # a range the first session never had, so the layouts are numbered differently
        with otelprof.timing("warmup"):
            clock.now += 1_000
        otelprof.step()
        expected = _train(second, clock, 300)
        expected[("warmup", "train")] = [1_000]
        expected[("step", "train")].append(1_000)  # the first step starts at its first range
    finally:
        second.shutdown()
    assert second.stats()["timings.steps_sampled_out_on_thread"] > 100
    _assert_histograms_are(timing_histograms(second.files["metrics"]), expected)
