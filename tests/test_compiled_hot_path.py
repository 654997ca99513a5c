"""The compiled hot path (`otelprof/_timings/_speedups.c`) records exactly what the Python
reference in `_recorder.py` / `_quiet_steps.py` records.

Each scenario drives the recorder through one implementation, then the other, under a fake
clock, and compares a transcript of everything left behind: the frames of the step, the
queue, the thread's stack, drop and exhaustion counts, the rows and layouts of steps sampled
out on their thread, the token budgets and the calls made to torch and CUDA stand-ins.
"""

from __future__ import annotations

import inspect
import os
import re
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import otelprof
from otelprof._timings import _api, _engine, _quiet_steps
from otelprof._timings import _frames as fr
from otelprof._timings import _recorder as rec
from tests.timings_harness import start_run

IMPLEMENTATIONS = ("python", "compiled")


def test_the_compiled_hot_path_is_built() -> None:
    if os.environ.get("OTELPROF_PURE_PYTHON", "").strip() not in ("", "0"):
        pytest.fail("OTELPROF_PURE_PYTHON is set: the compiled hot path cannot be checked")
    assert rec.speedups is not None, (
        "the C extension otelprof._timings._speedups was not built: installing otelprof "
        "(pip install -e .) needs a C compiler and Python's headers"
    )
    assert rec.compiled and _quiet_steps.sample_out is rec.speedups.sample_out
    enter, exit_ = rec.bridged_methods(print, print)  # record_function.__enter__, __exit__
    assert enter.__func__.func is rec.speedups.bridge_enter
    assert exit_.__func__.func is rec.speedups.bridge_exit
    assert _engine.TimingsEngine.step is rec.speedups.engine_step  # (unbound: the function)
    assert not inspect.isgenerator(_api.timed_items(iter(())))  # an iterator object
    assert _api._move_to_device is rec.speedups.move_to_device
    assert _api._move_to_host is rec.speedups.move_to_host
    # otelprof.step() and Profiler.step() call the engine's step with no frame of their own
    assert otelprof.step is rec.speedups.step
    assert otelprof.Profiler.step is rec.speedups.profiler_step  # (unbound: the function)


@pytest.fixture
def use() -> Iterator[Callable[[str], None]]:
    """Switch the hot path; the default (compiled when built) comes back afterwards."""
    if rec.speedups is None:
        pytest.fail("the C extension otelprof._timings._speedups was not built")
    default = rec.compiled

    def switch(implementation: str) -> None:
        on = implementation == "compiled"
        assert rec.use_compiled(on) is on
        assert _quiet_steps.use_compiled(on) is on
        assert _engine.use_compiled(on) is on

    yield switch
    rec.use_compiled(default)
    _quiet_steps.use_compiled(default)
    _engine.use_compiled(default)


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
            "torch_profiler_state": None,
            "cuda_timer": None,
        }.items():
            monkeypatch.setattr(rec.recorder, name, value)
        monkeypatch.setattr(rec, "perf_counter_ns", self.clock)
        monkeypatch.setattr(rec, "_local", rec._Local())
        monkeypatch.setattr(rec, "_timings_by_name", {})
        self.state = rec.thread_state()
        self.ctx = rec.StepContext(3, 1, self.clock.now)
        monkeypatch.setattr(rec.recorder, "current", self.ctx)

    def torch_on(self) -> None:
        patch = self.patch
        patch.setattr(
            rec.recorder, "torch_profiler_state", SimpleNamespace(_is_profiler_enabled=True)
        )
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
            "layouts": dict(_quiet_steps.layouts),
            "quiet": {phase: list(limits) for phase, limits in _quiet_steps.quiet.items()},
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
    with rf("one"), rf("two"), rf("three"), rf("four"):
        pass


def _bridged_nothing_records(r: _Recording) -> None:
    rf = _record_function(r)
    rec.recorder.current = None
    with rf("idle"):
        pass


def _timed_items(r: _Recording) -> None:
    """`timed_items` (compiled: an iterator object; Python: a generator): a span per item
    with the hooks around it, none for the exhausted next(), an error span for an iterator
    that raises; finished after either, as a generator is."""

    def items(n: int, fail: bool = False) -> Iterator[int]:
        yield from range(n)
        if fail:
            raise ValueError("disk gone")

    def before() -> None:
        r.calls.append(("before", len(r.ctx.frames)))

    def after(item: int) -> None:
        r.calls.append(("after", item, len(r.ctx.frames)))

    timed = _api.timed_items(items(3), "dataloader_next", before, after)
    assert list(timed) == [0, 1, 2]
    assert list(timed) == []  # exhausted: no next() of the iterator, no span
    failing = _api.timed_items(items(1, fail=True), "load")
    assert next(failing) == 0
    with pytest.raises(ValueError, match="disk gone"):
        next(failing)
    assert list(failing) == []
    plain = _api.timed_items(items(2))  # no hooks, the default name
    assert list(plain) == [0, 1]

    def refuse() -> None:
        raise RuntimeError("before refused")

    refused = _api.timed_items(items(2), "refused", refuse)
    with pytest.raises(RuntimeError, match="before refused"):
        next(refused)
    assert list(refused) == []

    def reject(_item: int) -> None:
        raise RuntimeError("after rejected")

    rejected = _api.timed_items(items(2), "rejected", None, reject)
    with pytest.raises(RuntimeError, match="after rejected"):
        next(rejected)
    assert list(rejected) == []


class _Tensor:
    """Stands for torch.Tensor in `_device_copies`: says what was done to it."""

    def __init__(self, name: str, calls: list[tuple[Any, ...]]) -> None:
        self.name, self.calls = name, calls

    def to(self, device: str, non_blocking: bool = False) -> str:
        if self.name == "broken":
            raise RuntimeError("device lost")
        self.calls.append(("to", self.name, device, non_blocking))
        return f"{self.name}@{device}"

    def detach(self) -> _Tensor:
        self.calls.append(("detach", self.name))
        return self

    def cpu(self) -> str:
        self.calls.append(("cpu", self.name))
        return f"{self.name}@host"


def _device_copies(r: _Recording) -> None:
    """`to_device`/`from_device` (compiled: their copies and span in C): flat batches, single
    tensors, nested data through `_map_nested`, non_blocking, and a copy that raises."""
    r.patch.setattr(_api, "_tensor_class", _Tensor)
    x, y = _Tensor("x", r.calls), _Tensor("y", r.calls)
    results = [
        _api.to_device((x, y), "dev"),
        _api.to_device([x, {"label": y}, 3], "dev", non_blocking=True),
        _api.to_device(x, "dev", non_blocking=True),
        _api.to_device({"x": x}, "dev"),
        _api.to_device((), "dev"),
        _api.from_device(x),
        _api.from_device([x, (y,)]),
    ]
    with pytest.raises(RuntimeError, match="device lost"):
        _api.to_device((x, _Tensor("broken", r.calls)), "dev")
    r.calls.append(tuple(repr(result) for result in results))


SCENARIOS: dict[str, Callable[[_Recording], None]] = {
    "timed-items": _timed_items,
    "device-copies": _device_copies,
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
        patch.setattr(rec, "perf_counter_ns", time.perf_counter_ns)
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
    """Steps against published limits: head-selected numbers (steps and phase batches) and
    those past the published ones, tail tokens, the slowest recent step, the anomaly
    threshold, holds after it, errors, a full layout table, a full batch of rows."""
    r.cuda_on()
    _quiet_steps.reset()
    r.patch.setattr(_quiet_steps, "ROWS_PER_ITEM", 3)
    r.patch.setattr(_quiet_steps, "MAX_LAYOUTS", 3)
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
        decisions.append((names, _quiet_steps.sample_out(ctx, end, r.state), ctx.kept))
        decisions.append(("frames left", len(ctx.frames), ctx.owner is None))

    decide(("a", "b"), 100)  # nothing published: to the builder
    _quiet_steps.publish({
        "train": [1000.0, 4.0, 1e6, 5e6, frozenset({7, 9})],
        "validation": [1e9, 0.0, 0.0, float("inf"), frozenset({3})],
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
    decide(("a",), 100, took=_quiet_steps.LONG_STEP_NS)  # long: to the builder, held
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
    decisions.append(_quiet_steps.sample_out(ended_elsewhere, r.clock.now, rec.ThreadState()))
    r.calls.append(tuple(decisions))


def test_compiled_step_decisions_equal_the_python_ones(
    use: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    python, compiled = _run(use, monkeypatch, _decide_steps)
    assert python["rows"] and python["layouts"] and python["queue"]  # it sampled some out
    assert ("cuda.release", "cuda a") in python["calls"]
    assert compiled == python


def _emit_steps(r: _Recording) -> None:
    """Steps queued whole: in training and in another phase, with attributes, ended by a
    thread that does not own them, then past half the queue (the builder is woken) and past
    all of it (ranges dropped, the step span still queued)."""
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
        for name in names:
            with rec.timing(name):
                pass
        ctx.owner = owner
        rec.recorder.emit_step(ctx, r.clock())
        r.calls.append(("emitted", len(ctx.frames), ctx.owner, rec.recorder.in_items))
        ctx.frames = []


def test_compiled_step_items_equal_the_python_ones(
    use: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    python, compiled = _run(use, monkeypatch, _emit_steps, 12)
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
            _quiet_steps.reset()
            _quiet_steps.publish({"train": [1e9, 0.0, 1e12, 1e12, frozenset()]})
            decided = []
            for took in (1_000, _quiet_steps.LONG_STEP_NS, 1_000, 1_000):
                ctx = _step(r, ("a", "b"), 100)
                ctx.step = 8
                decided.append(_quiet_steps.sample_out(ctx, ctx.start_ns + took, r.state))
            assert decided == [True, False, False, False], implementation
            assert r.state.hold == _quiet_steps.CAPTURE_STEPS - 2, implementation


def test_compiled_step_contexts_start_like_the_python_ones(
    use: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    made = {}
    for implementation in IMPLEMENTATIONS:
        use(implementation)
        ctx = rec.new_step_context(12, 3, 10**12, True, "validation")
        assert type(ctx) is rec.StepContext
        made[implementation] = {name: getattr(ctx, name) for name in rec.StepContext.__slots__}
    python, compiled = made["python"], made["compiled"]
    assert compiled["frames"] == [] and compiled["frames"] is not python["frames"]
    assert compiled["owner"] is python["owner"] is rec.thread_state()
    assert compiled == python
    assert rec.new_step_context(1, None, 0, False, "train").frames is not compiled["frames"]


def test_compiled_ranges_follow_the_recorder_fields_as_they_change(
    use: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    use("compiled")  # it reads the recorder's fields in place, module globals from a cache
    recording = _Recording(monkeypatch)
    first, second = recording.ctx, rec.StepContext(4, 1, 0)
    timed = rec.timing("timed")
    for ctx in (first, second, first, None, second):
        rec.recorder.current = ctx
        with timed:
            pass
    assert (len(first.frames), len(second.frames)) == (2, 2)
    rec.perf_counter_ns = lambda: 42
    with timed:
        pass
    assert second.frames[-1][fr.F_START] == second.frames[-1][fr.F_END] == 42


def test_compiled_steps_hand_every_case_but_the_common_one_to_the_python_step(
    use: Callable[[str], None], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A training step with no schedule, Kineto or listener is the compiled step's own;
    one with a listener, in another phase, or while `sample_out` is a stand-in runs
    `_engine._py_step`, the reference."""
    use("compiled")
    python_steps: list[str] = []
    python_step = _engine._py_step

    def counted(engine: Any) -> None:
        python_steps.append(engine.phase)
        python_step(engine)

    monkeypatch.setattr(_engine, "_py_step", counted)
    run = start_run(tmp_path)
    engine = run.engine
    try:
        for _ in range(3):
            with rec.timing("work"):
                pass
            engine.step()
        assert (python_steps, engine.step_number) == ([], 3)
        remove = engine.add_step_listener(lambda *_: None)
        engine.step()
        remove()
        engine.set_phase("validation")
        engine.step()
        engine.set_phase("train")
        with monkeypatch.context() as patch:
            patch.setattr(_quiet_steps, "sample_out", lambda *_: False)
            engine.step()
        engine.step()
        assert (python_steps, engine.step_number) == (["train", "validation", "train"], 6)
    finally:
        spans = run.finish()
    assert len([s for s in spans if s.name == "work"]) == 3


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
    """torch.autograd.profiler's `_is_profiler_enabled` is a module global the compiled
    enter reads from the module's dict at its version: each change is seen by the next range."""
    use("compiled")
    recording = _Recording(monkeypatch)
    recording.torch_on()
    profiler = types.ModuleType("profiler_stand_in")
    monkeypatch.setattr(rec.recorder, "torch_profiler_state", profiler)
    for enabled in (False, True, True, False, True):
        profiler._is_profiler_enabled = enabled  # type: ignore[attr-defined]
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
        ("sample_out", "sample_out(ctx, end_ns, state)"),
        ("timed_items", "timed_items(iterator, span, before, after)"),
        ("move_to_device", "move_to_device(span, data, device, non_blocking, tensor, nested)"),
        ("move_to_host", "move_to_host(span, data, tensor, nested)"),
    ],
)
def test_a_compiled_function_called_wrongly_names_its_arguments(name: str, usage: str) -> None:
    """They are called only by otelprof's own modules; a wrong call (a refactor that missed
    one) fails loudly with the expected signature rather than reading past its arguments."""
    function = getattr(rec.speedups, name)
    with pytest.raises(TypeError, match=re.escape(f"otelprof._speedups: {usage}")):
        function(1)
