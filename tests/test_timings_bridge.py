"""The record_function bridge: ranges become spans with real times, nesting, errors, threads,
and torch is restored exactly afterwards."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from otelprof._timings._recorder import timing
from tests.timings_harness import by_name, one, start_run


def test_nested_ranges_become_spans_with_parent_child_ids(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    with (
        torch.profiler.record_function("outer"),
        timing("middle", batch=7),
        torch.autograd.profiler.record_function("inner"),
    ):
        pass
    spans = run.finish()
    step, outer, middle, inner = (one(spans, n) for n in ("step", "outer", "middle", "inner"))
    assert step.parent_span_id == ""
    assert outer.parent_span_id == step.span_id
    assert middle.parent_span_id == outer.span_id
    assert inner.parent_span_id == middle.span_id
    assert {s.trace_id for s in spans} == {step.trace_id}
    assert len({s.span_id for s in spans}) == 4
    assert middle.attributes["batch"] == 7
    assert set(inner.attributes) == {"otelprof.step", "otelprof.phase", "thread.id"}, (
        "main thread: no name"
    )
    assert inner.attributes["otelprof.phase"] == "train"
    for span in (outer, middle, inner):
        assert span.attributes["otelprof.step"] == 0
        assert step.start_ns <= span.start_ns <= span.end_ns <= step.end_ns
    assert outer.start_ns <= middle.start_ns <= inner.start_ns <= inner.end_ns <= middle.end_ns
    assert outer.resource["otelprof.rank"] == 3


def test_record_function_used_as_decorator_is_bridged_on_every_call(tmp_path: Path) -> None:
    run = start_run(tmp_path)

    @torch.profiler.record_function("decorated")
    def work(n: int) -> int:
        return n + 1

    assert [work(i) for i in range(3)] == [1, 2, 3]
    spans = run.finish()
    assert len(by_name(spans, "decorated")) == 3


def test_recursive_decorated_range_nests_in_itself(tmp_path: Path) -> None:
    run = start_run(tmp_path)

    @torch.profiler.record_function("recurse")
    def recurse(n: int) -> int:
        return 0 if n == 0 else 1 + recurse(n - 1)

    assert recurse(2) == 2
    spans = sorted(by_name(run.finish(), "recurse"), key=lambda s: s.start_ns)
    assert len(spans) == 3
    assert spans[1].parent_span_id == spans[0].span_id
    assert spans[2].parent_span_id == spans[1].span_id


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("kind", ["record_function", "timing"])
def test_exception_marks_span_as_error_and_propagates_unchanged(tmp_path: Path, kind: str) -> None:
    run = start_run(tmp_path)
    error = Boom("exploded at step 0")
    opener = torch.profiler.record_function if kind == "record_function" else timing
    with pytest.raises(Boom) as caught, opener("failing"):
        raise error
    assert caught.value is error
    span = one(run.finish(), "failing")
    assert span.status_code == 2  # STATUS_CODE_ERROR
    (event,) = span.events
    assert event["name"] == "exception"
    attrs = {a["key"]: next(iter(a["value"].values())) for a in event["attributes"]}
    assert attrs["exception.type"].endswith("Boom")
    assert attrs["exception.message"] == "exploded at step 0"
    assert "raise error" in attrs["exception.stacktrace"]


def test_ranges_on_several_threads_nest_per_thread(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    barrier = threading.Barrier(3)

    def worker(index: int) -> None:
        barrier.wait()
        with torch.profiler.record_function(f"outer{index}"):
            time.sleep(0.01)
            with timing(f"inner{index}"):
                time.sleep(0.01)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    spans = run.finish()
    step = one(spans, "step")
    thread_ids = set()
    for i in range(3):
        outer, inner = one(spans, f"outer{i}"), one(spans, f"inner{i}")
        assert outer.parent_span_id == step.span_id, "a thread's first range is under the step"
        assert inner.parent_span_id == outer.span_id, "nesting follows the range's own thread"
        assert inner.attributes["thread.id"] == outer.attributes["thread.id"]
        assert outer.attributes["thread.name"].startswith("Thread-")
        thread_ids.add(outer.attributes["thread.id"])
    assert len(thread_ids) == 3


@pytest.mark.parametrize("kind", ["record_function", "timing"])
def test_span_duration_matches_a_known_sleep(tmp_path: Path, kind: str) -> None:
    run = start_run(tmp_path)
    opener = torch.profiler.record_function if kind == "record_function" else timing
    # the range lies inside what this test times around it (a busy machine may stretch
    # the sleep by any amount, so the upper bound is what it took, not a constant)
    wall_before, t0 = time.time_ns(), time.perf_counter_ns()
    with opener("sleep50"):
        time.sleep(0.050)
    outer_ns, wall_after = time.perf_counter_ns() - t0, time.time_ns()
    span = one(run.finish(), "sleep50")
    assert 50.0 <= span.duration_s * 1000 <= outer_ns / 1e6
    # wall-clock aligned: the span ended while the test's block ran
    assert wall_before - 1e9 < span.end_ns < wall_after + 1e9


def test_shutdown_restores_record_function_exactly(tmp_path: Path) -> None:
    cls = torch.profiler.record_function
    assert cls is torch.autograd.profiler.record_function
    before = dict(vars(cls))
    run = start_run(tmp_path)
    assert vars(cls)["__enter__"] is not before["__enter__"]
    run.finish()
    assert dict(vars(cls)) == before
    for name, value in before.items():
        assert vars(cls)[name] is value, name
    with torch.profiler.record_function("after"):  # still works, records nothing
        pass


def test_ranges_after_shutdown_are_not_recorded(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    with torch.profiler.record_function("during"):
        pass
    spans = run.finish()
    with torch.profiler.record_function("after"), timing("after_timing"):
        pass
    assert {s.name for s in spans} == {"step", "during"}
    assert run.engine.stats()["spans_recorded"] == 2


def test_a_torch_profiler_session_still_sees_every_range(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    x = torch.randn(32, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("user_range"):
            x @ x
        with timing("otelprof_timing"):  # opens a torch range only while torch records
            x @ x
    names = {event.key for event in prof.key_averages()}
    assert {"user_range", "otelprof_timing", "aten::mm"} <= names
    spans = run.finish()
    assert by_name(spans, "user_range") and by_name(spans, "otelprof_timing")
    assert not [s for s in spans if s.name.startswith("ProfilerStep")]


def test_a_range_opened_before_start_and_closed_during_is_ignored(tmp_path: Path) -> None:
    early = torch.profiler.record_function("early")
    early.__enter__()
    run = start_run(tmp_path)
    with torch.profiler.record_function("inside"):
        pass
    early.__exit__(None, None, None)
    names = [s.name for s in run.finish()]
    assert sorted(names) == ["inside", "step"]


def test_a_second_engine_cannot_bridge_twice(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    try:
        with pytest.raises(RuntimeError, match="another TimingsEngine is running"):
            start_run(tmp_path / "second")
    finally:
        run.finish()


def test_a_closed_range_does_not_keep_torchs_range_object_alive(tmp_path: Path) -> None:
    """The queued span keeps names and times, not the record_function object (and its torch
    handle): otherwise every queued range would stay alive until the builder runs."""
    import gc
    import weakref

    run = start_run(tmp_path)
    with torch.profiler.record_function("released") as rf:
        pass
    ref = weakref.ref(rf)
    del rf
    gc.collect()
    assert ref() is None, "the bridge still holds the record_function after its range closed"
    spans = run.finish()
    assert len(by_name(spans, "released")) == 1
