"""The recorder is one object, the only writer and reader of its private state, and frames
have one layout per kind, built in `_frames` (the hot paths, Python and C, build the same
lists inline); the compiled recorder binds only names of the recorder's own module."""

from __future__ import annotations

import ast
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof._timings import _frames
from otelprof._timings import _recorder as rec

STATE = (
    "current",
    "queue",
    "capacity",
    "in_items",
    "out_items",
    "chunk_size",
    "dropped",
    "exhausted",
    "cuda_timer",
    "torch_profiler_flags",
    "torch_range_enter",
    "torch_range_exit",
    "wake_builder",
    "started",
    "clock",
    "threads",
)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[rec.StepContext]:
    """A fresh recorder state with a step recording on this thread (restored afterwards)."""
    for name in STATE:
        monkeypatch.setattr(rec.recorder, name, getattr(rec.recorder, name))
    monkeypatch.setattr(rec.recorder, "queue", type(rec.recorder.queue)())
    monkeypatch.setattr(rec.recorder, "threads", rec._Local())
    monkeypatch.setattr(rec.recorder, "started", False)
    rec.recorder.start(100)
    ctx = rec.StepContext(5, None, 0)
    rec.recorder.record(ctx)
    yield ctx
    rec.recorder.record(None)


def test_the_recorder_state_lives_in_named_fields_not_module_globals() -> None:
    assert not hasattr(rec.recorder, "__dict__")  # __slots__: the C code reads by offset
    for name in STATE:
        assert name in rec.Recorder.__slots__
        assert not hasattr(rec, name), f"_recorder.{name} is still a module global"


def test_no_module_outside_the_recorder_writes_its_fields() -> None:
    """Every write to `recorder.<field>` (or `rec.<state>`) is in `_recorder.py`."""
    root = Path(otelprof.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "_recorder.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[Any] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                if not isinstance(target, ast.Attribute):
                    continue
                owner = ast.unparse(target.value)
                if owner.endswith("recorder") or (
                    owner in ("rec", "_rec") and target.attr in STATE
                ):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == []


PRIVATE_STATE = re.compile(r"\b(?:rec|_rec|_recorder)\._[a-z]\w*|\b_local\b|\b_getrandbits\b")
"""A read of the recorder module's private names (`rec._local`, `_getrandbits`, ...)."""


def test_no_module_outside_the_recorder_reads_its_private_state() -> None:
    """Others go through the recorder's public functions and methods (`thread_state`,
    `thread_state_if_any`, `new_span_id`, `compiling`, ...); the engine, the builder, Kineto
    and the on-thread sampler read `_local`/`_getrandbits` before."""
    root = Path(otelprof.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "_recorder.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if PRIVATE_STATE.search(code):
                offenders.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert offenders == []


def test_the_compiled_recorder_binds_only_names_of_the_recorder_module() -> None:
    """Its binding table (every attribute it reads or calls by name) names classes of
    `_recorder.py` and their attributes, and otherwise only public names of what the
    recorder holds (its deque, its CUDA timer, torch's record_function): renaming anything
    it reads is a change to `_recorder.py`, which `bind()` and this test catch."""
    if rec.speedups is None:
        pytest.skip("the C extension is not built (OTELPROF_PURE_PYTHON or no compiler)")
    table = dict(rec.speedups.BINDINGS)
    others = table.pop("")
    assert others and all(not name.startswith("_") for name in others), others
    for class_name, attributes in table.items():
        cls = getattr(rec, class_name)
        assert isinstance(cls, type) and cls.__module__ == rec.__name__, class_name
        for attribute in attributes:
            assert attribute in getattr(cls, "__slots__", ()) or attribute in vars(cls), (
                f"_speedups binds {class_name}.{attribute}, which _recorder.py does not define"
            )
    # and the C source looks nothing up anywhere else: no module dict, no import but the
    # clock's, no attribute by a literal name but the one class attribute it reads
    source = (Path(rec.__file__).parent / "_speedups.c").read_text()
    assert "PyModule_GetDict" not in source and "PyEval_GetGlobals" not in source
    assert re.findall(r"PyImport_\w+\(([^)]*)\)", source) == ['"time"']
    assert re.findall(r"GetAttrString\([^,]+, (\"\w+\")\)", source) == [
        '"__slots__"',
        '"perf_counter_ns"',
    ]


def test_the_compiled_hot_path_uses_the_python_frame_layout() -> None:
    if rec.speedups is None:
        pytest.skip("the C extension is not built (OTELPROF_PURE_PYTHON or no compiler)")
    assert rec.speedups.FRAME_LAYOUT == _frames.LAYOUT


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
def test_hot_path_frames_are_the_layouts_of_their_kind(
    recording: rec.StepContext, compiled: bool
) -> None:
    if compiled and rec.speedups is None:
        pytest.skip("the C extension is not built (OTELPROF_PURE_PYTHON or no compiler)")
    default = rec.compiled
    try:
        rec.use_compiled(compiled)
        state = rec.thread_state()
        outer = rec.Timing("outer", {"k": 1})
        with outer:
            (opened,) = state.stack[1:]
            expected = _frames.timing_frame("outer", None, recording, state, {"k": 1}, outer)
            assert opened[: _frames.F_START] == expected[: _frames.F_START]
            assert opened[_frames.F_ERROR :] == expected[_frames.F_ERROR :]

            class Range:
                name = "rf"

            enter, exit_ = rec.bridged_methods(lambda self: self, lambda self, *exc: None)
            bridged = Range()
            enter(bridged)
            top = state.stack[-1]
            expected = _frames.record_function_frame("rf", opened, recording, state, bridged)
            assert len(top) == len(expected) == _frames.RF_LEN
            assert top[: _frames.F_START] == expected[: _frames.F_START]
            assert top[_frames.F_ERROR :] == expected[_frames.F_ERROR :]
            exit_(bridged, None, None, None)
        assert [f[_frames.F_KIND] for f in recording.frames] == ["record_function", "timing"]
    finally:
        rec.use_compiled(default)


def test_steps_chunks_and_rows_are_queued_in_their_own_layouts(
    recording: rec.StepContext,
) -> None:
    recorder = rec.recorder
    with rec.timing("a"):
        pass
    recorder.hand_off(recording)
    chunk = recorder.queue.popleft()
    assert chunk[_frames.F_KIND] is _frames.KIND_CHUNK and chunk[_frames.F_CTX] is recording
    assert [f[_frames.F_NAME] for f in chunk[_frames.CHUNK_RANGES]] == ["a"]

    row = _frames.pack_row([1, 2], 3, 0)  # two ranges' durations, the step's, the layout
    recorder.enqueue_rows([row])
    rows = recorder.queue.popleft()
    assert rows[_frames.F_KIND] is _frames.KIND_ROWS and rows[_frames.ROWS] == [row]
    assert list(_frames.row_values(rows[_frames.ROWS])) == [1, 2, 3, 0]

    with rec.timing("b"):
        pass
    recorder.emit_step(recording, 99)
    step = recorder.queue.popleft()
    assert step[_frames.F_KIND] is _frames.KIND_STEP and step[_frames.F_NAME] == "step"
    assert step[_frames.F_END] == 99 and step[_frames.STEP_ENDED_ELSEWHERE] is False
    assert [f[_frames.F_NAME] for f in recording.frames] == ["b"]  # carried by its context
    # spans inside items count against the capacity until the builder took them: the
    # chunk's range, the row's two ranges and its step, the step's range
    assert recorder.queued_frames() == 1 + 3 + 1
    recorder.took(5)
    assert recorder.queued_frames() == 0


def test_the_item_that_leaves_the_queue_half_full_wakes_the_builder(
    recording: rec.StepContext,
) -> None:
    """An idle builder sleeps up to a second; a burst must not wait for it to wake."""
    wakes: list[int] = []
    rec.recorder.stop()  # (the fixture's start, without a builder)
    rec.recorder.start(100, wake_builder=lambda: wakes.append(rec.recorder.queued_frames()))
    row = _frames.pack_row(range(9), 9, 0)  # 10 spans carried (9 ranges and their step)
    for _ in range(4):  # 4 items of 10 spans: up to 44 of 100 queued
        rec.recorder.enqueue_rows([row])
    assert wakes == []
    rec.recorder.enqueue_rows([row])
    assert wakes == [55]
    rec.recorder.stop()
    assert rec.recorder.wake_builder is None  # a stopped recorder holds no builder


def test_a_step_ended_from_another_thread_says_so(recording: rec.StepContext) -> None:
    recording.owner = rec.thread_state()
    ender = threading.Thread(target=rec.recorder.emit_step, args=(recording, 1))
    ender.start()
    ender.join()
    assert rec.recorder.queue.popleft()[_frames.STEP_ENDED_ELSEWHERE] is True


def test_measured_ranges_hang_under_the_open_range_and_are_dropped_when_full(
    recording: rec.StepContext,
) -> None:
    recorder = rec.recorder
    with rec.timing("outer"):
        ctx, parent, state = recorder.position()
        assert ctx is recording and parent is not None and parent[_frames.F_NAME] == "outer"
        recorder.enqueue_measured("allreduce", {"op": "x"}, 10, 20, ctx, parent, state)
    (frame,) = recorder.queue
    assert frame == _frames.measured_frame("allreduce", parent, ctx, state, {"op": "x"}, 10, 20)
    recorder.capacity = 1  # full
    recorder.enqueue_measured("allreduce", None, 10, 20, ctx, None, state)
    assert len(recorder.queue) == 1 and recorder.dropped == 1


def test_forget_above_drops_this_threads_open_ranges_without_emitting_them(
    recording: rec.StepContext,
) -> None:
    recorder = rec.recorder
    base = recorder.depth()
    assert recorder.top_name() is None
    outer, inner = rec.timing("outer"), rec.timing("inner")
    outer.__enter__()
    inner.__enter__()
    assert recorder.depth() == base + 2 and recorder.top_name() == "inner"
    recorder.forget_above(base + 1)
    assert recorder.top_name() == "outer"
    inner.__exit__(None, None, None)  # nothing left to close
    outer.__exit__(None, None, None)
    assert [f[_frames.F_NAME] for f in recording.frames] == ["outer"]


def test_leaves_are_recorded_without_entering_the_stack(recording: rec.StepContext) -> None:
    recorder = rec.recorder
    depth = recorder.depth()
    leaf = recorder.begin_leaf("optimizer_step")
    assert leaf is not None and recorder.depth() == depth
    recorder.end_leaf(leaf)
    assert recording.frames == [leaf] and leaf[_frames.F_END] >= leaf[_frames.F_START]
    recorder.record(None)
    assert recorder.begin_leaf("idle") is None


def test_isolated_recording_restores_every_field_and_queues_nothing(
    recording: rec.StepContext,
) -> None:
    recorder = rec.recorder
    recorder.count_drop(2)
    before = {name: getattr(recorder, name) for name in STATE}
    queued = list(recorder.queue)
    recorder.chunk_size = 2
    with recorder.isolated(10) as discard:
        assert recorder.current is not recording
        for _ in range(5):
            with rec.timing("calibration"):
                pass
        discard()
        with rec.timing("calibration"):
            pass
    recorder.chunk_size = before["chunk_size"]
    assert {name: getattr(recorder, name) for name in STATE} == before
    assert list(recorder.queue) == queued and recording.frames == []


def test_stop_leaves_nothing_recording_and_no_room(recording: rec.StepContext) -> None:
    recorder = rec.recorder
    recorder.set_cuda_timer(object())
    recorder.set_torch_hooks(({}, "flag"), print, print)
    recorder.stop()
    assert recorder.current is None and recorder.capacity == 0 and not recorder.started
    assert recorder.cuda_timer is None and recorder.torch_profiler_flags is None
    with rec.timing("after stop"):
        pass
    assert recording.frames == [] and not recorder.queue


def test_the_span_builder_uses_only_public_methods_of_the_sampler_and_name_cache() -> None:
    builder = Path(otelprof.__file__).parent / "_timings" / "_builder.py"
    reaches = re.findall(r"\b(?:sampler|names)\._\w+", builder.read_text())
    assert reaches == []
