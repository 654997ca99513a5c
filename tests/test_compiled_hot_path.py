"""The compiled recorder (`otelprof/_timings/_speedups.c`) records exactly what the Python
reference in `_recorder.py` records: every function it compiles (`Timing.__enter__` and
`__exit__`, the record_function bridge's, `Recorder.begin_step` and `Recorder.end_step`),
and nothing else is compiled.

Each scenario drives the recorder through one implementation, then the other, under a fake
clock, and compares a transcript of everything left behind: the frames of the step, the
queue, the thread's stack, drop and exhaustion counts, the rows and layouts of steps sampled
out on their thread, the token budgets and the calls made to torch and CUDA stand-ins.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from otelprof._timings import _frames as fr
from otelprof._timings import _recorder as rec
from tests.timings_harness import start_run

IMPLEMENTATIONS = ("python", "compiled")


COMPILED = {
    (rec.Timing, "__enter__"): "timing_enter",
    (rec.Timing, "__exit__"): "timing_exit",
    (rec.Recorder, "begin_step"): "begin_step",
    (rec.Recorder, "end_step"): "end_step",
}
"""Every method the compiled recorder replaces, and its C function."""


def test_the_compiled_hot_path_is_built_and_is_the_recorder_only() -> None:
    if os.environ.get("OTELPROF_PURE_PYTHON", "").strip() not in ("", "0"):
        pytest.fail("OTELPROF_PURE_PYTHON is set: the compiled hot path cannot be checked")
    assert rec.speedups is not None, (
        "the C extension otelprof._timings._speedups was not built: installing otelprof "
        "(pip install -e .) needs a C compiler and Python's headers"
    )
    assert rec.compiled
    for (cls, name), function in COMPILED.items():
        assert getattr(cls, name) is getattr(rec.speedups, function), name
    enter, exit_ = rec.bridged_methods(print, print)  # record_function.__enter__, __exit__
    assert enter.__func__.func is rec.speedups.bridge_enter
    assert exit_.__func__.func is rec.speedups.bridge_exit
    functions = {name for name in dir(rec.speedups) if callable(getattr(rec.speedups, name))}
    assert functions == {*COMPILED.values(), "bridge_enter", "bridge_exit", "bind", "method"}


@pytest.fixture
def use() -> Iterator[Callable[[str], None]]:
    """Switch the hot path; the default (compiled when built) comes back afterwards."""
    if rec.speedups is None:
        pytest.fail("the C extension otelprof._timings._speedups was not built")
    default = rec.compiled

    def switch(implementation: str) -> None:
        on = implementation == "compiled"
        assert rec.use_compiled(on) is on

    yield switch
    rec.use_compiled(default)


class _Clock:
    def __init__(self) -> None:
        self.now = 10**12

    def __call__(self) -> int:
        self.now += 1_000
        return self.now


class _Recording:
    """Fresh recorder state for one run of a scenario (restored by monkeypatch)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, capacity: int = 1000) -> None:
        self.patch = monkeypatch  # what a scenario changes beyond this is undone with it
        self.clock = _Clock()
        self.calls: list[tuple[Any, ...]] = []
        self.queue: Any = type(rec.recorder.queue)()
        for name, value in {
            "queue": self.queue,
            "capacity": capacity,
            "chunk_size": rec.CHUNK,
            "dropped": 0,
            "exhausted": 0,
            "in_items": 0,
            "out_items": 0,
            "torch_profiler_flags": None,
            "cuda_timer": None,
            "clock": self.clock,
            "threads": rec._Local(),
        }.items():
            monkeypatch.setattr(rec.recorder, name, value)
        for name in ("limits", "layouts", "layout_ids"):
            monkeypatch.setattr(rec.on_thread, name, type(getattr(rec.on_thread, name))())
        monkeypatch.setattr(rec, "_timings_by_name", {})
        self.state = rec.thread_state()
        self.ctx = rec.StepContext(3, 1, self.clock.now)
        monkeypatch.setattr(rec.recorder, "current", self.ctx)

    def torch_on(self) -> None:
        patch = self.patch
        patch.setattr(rec.recorder, "torch_profiler_flags", ({"recording": True}, "recording"))
        patch.setattr(rec.recorder, "torch_range_enter", self._range_enter)
        patch.setattr(rec.recorder, "torch_range_exit", lambda handle: self.calls.append(handle))

    def _range_enter(self, name: str, _args: Any) -> tuple[str, str]:
        self.calls.append(("range", name))
        return ("range", name)

    def cuda_on(self) -> None:
        calls = self.calls

        class _Timer:
            def enter(self) -> list[str]:
                calls.append(("cuda.enter",))
                return ["events", str(len(calls))]

            def exit(self, events: list[str]) -> None:
                calls.append(("cuda.exit", *events))

            def release(self, events: list[str]) -> None:
                calls.append(("cuda.release", *events))

        self.patch.setattr(rec.recorder, "cuda_timer", _Timer())

    def transcript(self) -> dict[str, Any]:
        """Everything the recorder left, with objects replaced by stable labels."""
        labels: dict[int, str] = {}

        def label(obj: Any) -> Any:
            if obj is None or isinstance(obj, (str, int, float, bool)):
                return obj
            if obj is self.ctx:
                return "ctx"
            if isinstance(obj, rec.StepContext):
                return labels.setdefault(id(obj), f"step context {obj.step} #{len(labels)}")
            if obj is self.state:
                return "main thread"
            if isinstance(obj, rec.ThreadState):
                return f"thread {obj.name}"
            if isinstance(obj, rec.Timing):
                return repr(obj)
            if isinstance(obj, tuple):
                return tuple(label(part) for part in obj)
            if isinstance(obj, list) and len(obj) in (12, 13):  # bridged: 12
                return labels.setdefault(id(obj), f"frame {obj[0]} #{len(labels)}")
            return repr(obj)

        def frame(f: list[Any]) -> tuple[Any, ...]:
            error = f[fr.F_ERROR]
            shown = [label(f)]
            shown += [label(v) for i, v in enumerate(f) if i not in (fr.F_ERROR, fr.F_ATTRS)]
            shown.append(error[:2] if error else None)  # the stack's text names the caller
            shown.append(repr(f[fr.F_ATTRS]))
            return tuple(shown)

        def item(entry: list[Any]) -> Any:
            if entry[fr.F_KIND] == fr.KIND_CHUNK:
                return ("chunk", label(entry[fr.F_CTX]), [frame(f) for f in entry[fr.CHUNK_RANGES]])
            if entry[fr.F_KIND] == fr.KIND_ROWS:
                return ("rows", entry[fr.ROWS])
            return frame(entry)

        return {
            "step frames": [frame(f) for f in self.ctx.frames],
            "queue": [item(entry) for entry in self.queue],
            "stack": [frame(f) for f in self.state.stack[1:]],
            "dropped": rec.recorder.dropped,
            "exhausted": rec.recorder.exhausted,
            "in_items": rec.recorder.in_items,
            "ctx": (self.ctx.error, self.ctx.kept, label(self.ctx.owner)),
            "calls": self.calls,
            "rows": self.state.rows,
            "hold": self.state.hold,
            "layouts": dict(rec.on_thread.layouts),
            "quiet": {
                phase: [getattr(limits, name) for name in rec.QuietLimits.__slots__]
                for phase, limits in rec.on_thread.limits.items()
            },
        }


def _nested(r: _Recording) -> None:
    with rec.timing("outer"):
        with rec.timing("inner", batch=4):
            pass
        with rec.timing("inner"):
            pass
    with rec.Timing("sibling"):
        pass


def _errors(r: _Recording) -> None:
    with rec.timing("outer"), pytest.raises(ValueError, match="bad batch"), rec.timing("fails"):
        raise ValueError("bad batch")
    with pytest.raises(StopIteration), rec.timing("exhausted"):
        raise StopIteration
    with pytest.raises(GeneratorExit), rec.timing("closed"):
        raise GeneratorExit


def _out_of_order(r: _Recording) -> None:
    first, second = rec.timing("first"), rec.timing("second")
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # not on top: found further down
    second.__exit__(None, None, None)
    second.__exit__(None, None, None)  # closed twice: nothing left to close
    lonely = rec.timing("never entered")
    lonely.__exit__(None, None, None)


def _another_thread(r: _Recording) -> None:
    def work() -> None:
        with rec.timing("other thread"):
            pass

    with rec.timing("main"):
        side = threading.Thread(target=work, name="side")
        side.start()
        side.join()


def _chunks(r: _Recording) -> None:
    rec.recorder.chunk_size = 3
    for _ in range(7):
        with rec.timing("many"):
            pass


def _drops(r: _Recording) -> None:
    r.ctx.owner = None  # the step was handed over: its ranges are queued singly
    for _ in range(5):
        with rec.timing("late"):
            pass


def _nothing_records(r: _Recording) -> None:
    rec.recorder.current = None
    with rec.timing("idle"):
        pass


def _torch_profiler(r: _Recording) -> None:
    r.torch_on()
    with rec.timing("traced"), rec.timing("nested"):
        pass
    with pytest.raises(StopIteration), rec.timing("exhausted"):
        raise StopIteration


def _cuda_events(r: _Recording) -> None:
    r.cuda_on()
    with rec.timing("on the gpu"), rec.timing("nested"):
        pass


def _record_function(r: _Recording) -> Any:
    """torch's record_function as the bridge sees it (its own enter/exit, a `name`),
    bridged by the implementation in use: what `Bridge.install` does to torch's class."""
    calls = r.calls

    class RecordFunction:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> RecordFunction:
            calls.append(("torch enter", self.name))
            return self

        def __exit__(self, exc_type: Any, *_: Any) -> None:
            calls.append(("torch exit", self.name, exc_type and exc_type.__name__))

        def __repr__(self) -> str:
            return f"<record_function {self.name}>"

    enter, exit_ = rec.bridged_methods(RecordFunction.__enter__, RecordFunction.__exit__)
    RecordFunction.__enter__ = enter  # type: ignore[method-assign]
    RecordFunction.__exit__ = exit_  # type: ignore[method-assign]
    return RecordFunction


def _bridged_nested(r: _Recording) -> None:
    rf = _record_function(r)
    with rec.timing("outer"), rf("forward") as opened:
        assert isinstance(opened, rf)  # torch's enter's result
        with rf("aten::mm"):
            pass
    with rf("optimizer"):
        pass


def _bridged_errors(r: _Recording) -> None:
    rf = _record_function(r)
    with rf("outer"), pytest.raises(ValueError, match="bad batch"), rf("fails"):
        raise ValueError("bad batch")
    with pytest.raises(StopIteration), rf("exhausted"):
        raise StopIteration
    with pytest.raises(GeneratorExit), rf("closed"):
        raise GeneratorExit


def _bridged_out_of_order(r: _Recording) -> None:
    rf = _record_function(r)
    first, second = rf("first"), rf("second")
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # not on top: found further down
    second.__exit__(None, None, None)
    second.__exit__(None, None, None)  # closed twice: torch's exit still runs
    rf("never entered").__exit__(None, None, None)


def _bridged_other_thread(r: _Recording) -> None:
    rf = _record_function(r)

    def work() -> None:
        with rf("other thread"):
            pass

    with rf("main"):
        side = threading.Thread(target=work, name="side")
        side.start()
        side.join()
    fresh = threading.Thread(target=rf("no state yet").__exit__, args=(None, None, None))
    fresh.start()  # a thread that never recorded closes a range: only torch's exit runs
    fresh.join()


def _bridged_chunks_and_drops(r: _Recording) -> None:
    rf = _record_function(r)
    rec.recorder.chunk_size = 3
    for _ in range(7):
        with rf("many"):
            pass
    r.ctx.owner = None  # the step was handed over: its ranges are queued singly
    for _ in range(5):
        with rf("late"):
            pass


def _bridged_too_deep(r: _Recording) -> None:
    rf = _record_function(r)
    r.patch.setattr(rec, "MAX_DEPTH", 3)  # the base frame and two ranges; no deeper ones
    rec.use_compiled(rec.compiled)  # (a constant: the compiled code is handed it again)
    with rf("one"), rf("two"), rf("three"), rf("four"):
        pass


def _bridged_nothing_records(r: _Recording) -> None:
    rf = _record_function(r)
    rec.recorder.current = None
    with rf("idle"):
        pass


SCENARIOS: dict[str, Callable[[_Recording], None]] = {
    "bridged-nested": _bridged_nested,
    "bridged-errors": _bridged_errors,
    "bridged-out-of-order": _bridged_out_of_order,
    "bridged-other-thread": _bridged_other_thread,
    "bridged-chunks-and-drops": _bridged_chunks_and_drops,
    "bridged-too-deep": _bridged_too_deep,
    "bridged-nothing-records": _bridged_nothing_records,
    "nested": _nested,
    "errors": _errors,
    "out-of-order": _out_of_order,
    "another-thread": _another_thread,
    "chunks": _chunks,
    "drops": _drops,
    "nothing-records": _nothing_records,
}


def _run(
    use: Callable[[str], None],
    monkeypatch: pytest.MonkeyPatch,
    scenario: Callable[[_Recording], None],
    capacity: int = 1000,
) -> list[dict[str, Any]]:
    transcripts = []
    for implementation in IMPLEMENTATIONS:
        use(implementation)
        with monkeypatch.context() as patch:
            recording = _Recording(patch, capacity)
            scenario(recording)
            transcripts.append(recording.transcript())
    return transcripts


@pytest.mark.parametrize("name", SCENARIOS)
def test_compiled_ranges_record_exactly_what_the_python_ones_do(
    name: str, use: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    python, compiled = _run(use, monkeypatch, SCENARIOS[name], 3)
    assert python["step frames"] or python["queue"] or name.endswith("nothing-records")
    if name.startswith("bridged"):
        assert ("torch enter", python["calls"][0][1]) == python["calls"][0]
    assert compiled == python


@pytest.mark.parametrize(
    ("scenario", "expected_call"),
    [(_torch_profiler, ("range", "nested")), (_cuda_events, ("cuda.enter",))],
    ids=["torch-profiler", "cuda-events"],
)
def test_compiled_ranges_open_torch_ranges_and_cuda_events_like_the_python_ones(
    scenario: Callable[[_Recording], None],
    expected_call: tuple[str, ...],
    use: Callable[[str], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    python, compiled = _run(use, monkeypatch, scenario)
    assert expected_call in python["calls"]
    assert compiled == python


def test_compiled_ranges_read_the_same_clock_as_perf_counter_ns(
    use: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    use("compiled")
    with monkeypatch.context() as patch:
        recording = _Recording(patch)
        patch.setattr(rec.recorder, "clock", time.perf_counter_ns)
        before = time.perf_counter_ns()
        with rec.timing("timed"):
            pass
        after = time.perf_counter_ns()
        (frame,) = recording.ctx.frames
    assert before <= frame[fr.F_START] <= frame[fr.F_END] <= after


def _step(r: _Recording, names: tuple[str, ...], ns: int) -> rec.StepContext:
    """A finished step of `names` on the main thread, each range taking `ns`."""
    ctx = rec.StepContext(7, None, r.clock.now)
    rec.recorder.current = ctx
    for name in names:
        frame = rec.recorder.begin_leaf(name)
        assert frame is not None
        frame[fr.F_END] = frame[fr.F_START] + ns
        frame[fr.F_CUDA] = [f"cuda {name}"]
        rec.recorder.end_leaf(frame)
        frame[fr.F_END] = frame[fr.F_START] + ns  # end_leaf read the clock again
    return ctx


def _decide_steps(r: _Recording) -> None:
    """Steps ended (`end_step`) against published limits: head-selected numbers (steps and
    phase batches) and those past the published ones, tail tokens, the slowest recent step,
    the anomaly threshold, holds after it, errors, a full layout table, a full batch of rows;
    each is sampled out on this thread or queued whole."""
    r.cuda_on()
    r.patch.setattr(rec.on_thread, "rows_per_item", 3)
    r.patch.setattr(rec.on_thread, "max_layouts", 3)
    decisions: list[Any] = []

    def decide(
        names: tuple[str, ...], ns: int, phase: str = "train", took: int = 0, **ctx_attrs: Any
    ) -> None:
        ctx = _step(r, names, ns)
        ctx.phase = phase
        ctx_attrs.setdefault("step", 8)  # not head-selected
        for key, value in ctx_attrs.items():
            setattr(ctx, key, value)
        end = ctx.start_ns + took if took else r.clock.now + ns * len(names)
        ran_on = rec.recorder.end_step(ctx, end)
        decisions.append((names, ctx.kept, ran_on is r.state, rec.recorder.current))
        decisions.append(("frames left", len(ctx.frames), ctx.owner is None))

    decide(("a", "b"), 100)  # nothing published: to the builder
    rec.on_thread.publish({
        "train": rec.QuietLimits(1000.0, 4.0, 1e6, 5e6, frozenset({7, 9})),
        "validation": rec.QuietLimits(1e9, 0.0, 0.0, float("inf"), frozenset({3})),
    })  # fmt: skip
    decide(("a", "b"), 100, step=7)  # head-selected: to the builder
    decide(("a", "b"), 100, step=1000)  # past the published numbers: to the builder
    decide(("a", "b"), 100, step=3, batch=9)  # numbered by its batch: selected
    decide(("x",), 100, phase="validation", step=7, batch=3)  # a selected phase batch
    decide(("a", "b"), 100)  # tail has 4 but the step is not the slowest
    decide(("a", "b"), 100, took=1_000_000)  # as slow as the slowest lately: sampled out
    decide(("a", "b", "c"), 600_000)  # slowest lately: 4 spans take the tail's 4 tokens
    decide(("a", "b", "c"), 600_000)  # no tokens left
    decide(("a",), 100, took=5_000_000)  # at the anomaly threshold: to the builder, held
    for _ in range(6):
        decide(("a", "b"), 100)  # five held, then sampled out again
    decide(("a",), 100, took=rec.on_thread.long_step_ns)  # long: to the builder, held
    for _ in range(7):
        decide(("a", "b"), 100)  # five held, then sampled out again
    decide(("a", "b"), 100, error=True)
    decide(("a", "b"), 100, trim_start=True)
    decide(("a", "b"), 100, kept=True)
    decide((), 100)  # no ranges
    decide(("x",), 100, phase="validation")
    decide(("y",), 100, phase="validation")  # the layout table is full: to the builder
    decide(("x",), 100, phase="checkpoint")  # a phase with nothing published
    ended_elsewhere = _step(r, ("a", "b"), 100)  # ended by a thread that does not own it
    ended_elsewhere.owner = rec.ThreadState()
    decisions.append(rec.recorder.end_step(ended_elsewhere, r.clock.now) is r.state)
    r.calls.append(tuple(decisions))


def test_compiled_step_ends_equal_the_python_ones(
    use: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    python, compiled = _run(use, monkeypatch, _decide_steps)
    assert python["rows"] and python["layouts"] and python["queue"]  # it sampled some out
    assert ("cuda.release", "cuda a") in python["calls"]
    assert compiled == python


def _queue_steps(r: _Recording) -> None:
    """Steps queued whole (nothing published): in training and in another phase, with
    attributes, ended by a thread that does not own them, then past half the queue (the
    builder is woken) and past all of it (ranges dropped, the step span still queued)."""
    r.patch.setattr(rec.recorder, "wake_builder", lambda: r.calls.append(("wake",)))
    ctx = r.ctx
    for phase, attrs, owner, names in (
        ("train", None, r.state, ("a", "b")),
        ("validation", {"samples": 8}, r.state, ("c",)),
        ("train", None, rec.ThreadState(), ("d",)),
        ("train", None, r.state, ("e", "f", "g")),
        ("train", None, r.state, ("h", "i", "j", "k", "l")),
    ):
        ctx.phase, ctx.attrs, ctx.owner = phase, attrs, r.state
        rec.recorder.record(ctx)
        for name in names:
            with rec.timing(name):
                pass
        ctx.owner = owner
        rec.recorder.end_step(ctx, r.clock())
        r.calls.append(("queued", len(ctx.frames), ctx.owner, rec.recorder.in_items))
        ctx.frames = []


def test_compiled_step_items_equal_the_python_ones(
    use: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    python, compiled = _run(use, monkeypatch, _queue_steps, 12)
    steps = [entry for entry in python["queue"] if entry[9] == fr.KIND_STEP]  # (F_ATTRS last)
    assert [(s[1], s[4], s[11]) for s in steps] == [
        ("step", "ctx", False),
        ("validation", "ctx", False),
        ("step", "ctx", True),  # ended by a thread that does not own it
        ("step", "ctx", False),
        ("step", "ctx", False),
    ]
    assert steps[1][-1] == "{'samples': 8}"
    assert ("wake",) in python["calls"] and python["dropped"] == 5  # the last step's ranges
    assert compiled == python


def test_a_long_step_goes_to_the_builder_whole_and_holds_the_next_steps_there(
    use: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    for implementation in IMPLEMENTATIONS:
        use(implementation)
        with monkeypatch.context() as patch:
            r = _Recording(patch)
            rec.on_thread.publish({"train": rec.QuietLimits(1e9, 0.0, 1e12, 1e12, frozenset())})
            decided = []
            for took in (1_000, rec.on_thread.long_step_ns, 1_000, 1_000):
                ctx = _step(r, ("a", "b"), 100)
                ctx.step = 8
                rec.recorder.end_step(ctx, ctx.start_ns + took)
                decided.append(ctx.kept is False)  # sampled out on this thread
            assert decided == [True, False, False, False], implementation
            assert r.state.hold == rec.on_thread.capture_steps - 2, implementation


def test_compiled_step_contexts_start_like_the_python_ones(
    use: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    made = {}
    monkeypatch.setattr(rec.recorder, "current", None)
    for implementation in IMPLEMENTATIONS:
        use(implementation)
        ctx = rec.recorder.begin_step(12, 3, 10**12, True, "validation")
        assert type(ctx) is rec.StepContext and rec.recorder.current is ctx
        made[implementation] = {name: getattr(ctx, name) for name in rec.StepContext.__slots__}
    python, compiled = made["python"], made["compiled"]
    assert compiled["frames"] == [] and compiled["frames"] is not python["frames"]
    assert compiled["owner"] is python["owner"] is rec.thread_state()
    assert compiled == python
    again = rec.recorder.begin_step(1, None, 0, False, "train")
    assert again.frames is not compiled["frames"]


def test_compiled_ranges_follow_the_recorder_fields_as_they_change(
    use: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    use("compiled")  # it reads the recorder's fields in place, at every call
    recording = _Recording(monkeypatch)
    first, second = recording.ctx, rec.StepContext(4, 1, 0)
    timed = rec.timing("timed")
    for ctx in (first, second, first, None, second):
        rec.recorder.current = ctx
        with timed:
            pass
    assert (len(first.frames), len(second.frames)) == (2, 2)
    monkeypatch.setattr(rec.recorder, "clock", lambda: 42)
    with timed:
        pass
    assert second.frames[-1][fr.F_START] == second.frames[-1][fr.F_END] == 42
    monkeypatch.setattr(rec.recorder, "threads", rec._Local())  # every thread starts afresh
    with timed:
        pass
    assert rec.thread_state() is not recording.state
    assert recording.queue[-1][fr.F_THREAD] is rec.thread_state()  # (not the step's thread)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_step_that_fails_is_logged_and_training_goes_on(
    implementation: str,
    use: Callable[[str], None],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    use(implementation)
    run = start_run(tmp_path)
    try:

        def broken(*_: Any) -> None:
            raise OSError("queue gone")

        with monkeypatch.context() as patch:
            # nothing published: the step is queued whole; with no room, by `_queue_item`
            patch.setattr(rec.Recorder, "_queue_item", broken)
            patch.setattr(rec.recorder, "capacity", 0)
            with rec.timing("work"):
                pass
            run.engine.step()  # no exception reaches the training loop
        assert "otelprof: step() failed: OSError('queue gone')" in caplog.text
        run.engine.step()
        with rec.timing("after"):
            pass
        run.engine.step()
    finally:
        spans = run.finish()
    assert [s.name for s in spans if s.name == "after"] == ["after"]


def test_compiled_ranges_see_a_torch_profiler_start_and_stop_at_once(
    use: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's profiler flag is a module global the compiled enter reads from the module's
    dict at its version: each change is seen by the next range."""
    use("compiled")
    recording = _Recording(monkeypatch)
    recording.torch_on()
    namespace: dict[str, Any] = {}
    monkeypatch.setattr(rec.recorder, "torch_profiler_flags", (namespace, "recording"))
    for enabled in (False, True, True, False, True):
        namespace["recording"] = enabled
        with rec.timing(f"while {enabled}"):
            pass
    torch_calls = [call for call in recording.calls if call[0] == "range"]
    assert torch_calls == [("range", "while True")] * 6  # each of the 3: opened and closed


@pytest.mark.parametrize(
    ("name", "usage"),
    [
        ("timing_exit", "timing_exit(self, exc_type, exc, tb)"),
        ("bridge_enter", "bridge_enter(original_enter, self)"),
        ("bridge_exit", "bridge_exit(python_exit, original_exit, self, exc_type, exc, tb)"),
        ("begin_step", "begin_step(recorder, step, epoch, start_ns, trim_start, phase)"),
        ("end_step", "end_step(recorder, ctx, end_ns)"),
    ],
)
def test_a_compiled_function_called_wrongly_names_its_arguments(name: str, usage: str) -> None:
    """They are called only by otelprof's own modules; a wrong call (a refactor that missed
    one) fails loudly with the expected signature rather than reading past its arguments."""
    function = getattr(rec.speedups, name)
    with pytest.raises(TypeError, match=re.escape(f"otelprof._speedups: {usage}")):
        function(1)
