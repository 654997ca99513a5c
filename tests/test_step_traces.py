"""Step N of every rank in one trace: trace ids derived from (run id, attempt, phase,
number), head sampling that picks the same steps on every rank without communication, and
a straggler's step kept on every rank, shown with a real 2-rank gloo job."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import otelprof
from otelprof._timings._trace_ids import RunTraces, level_for
from tests.otlp_files import Span, read_spans
from tests.test_distributed import JOB, _env, _only_run_dir


def test_trace_ids_are_equal_for_a_step_and_distinct_across_steps_attempts_phases_and_runs() -> (
    None
):
    rank0, rank1 = RunTraces("job-7", 0), RunTraces("job-7", 0)
    steps = range(20_000)
    ids = [rank0.trace_id("train", n) for n in steps]
    assert ids == [rank1.trace_id("train", n) for n in steps]  # every rank derives the same
    assert len(set(ids)) == len(ids) and 0 not in ids
    assert all(0 < i < 1 << 128 for i in ids)
    others = [
        RunTraces("job-7", 1).trace_id("train", 5),  # the next attempt
        rank0.trace_id("validation", 5),  # another phase, same number
        RunTraces("job-8", 0).trace_id("train", 5),  # another run
        RunTraces("job-7", None).trace_id("train", 5),  # no attempt: attempt 0
    ]
    assert others[3] == ids[5]
    assert len({ids[5], *others[:3]}) == 4


def test_head_selection_keeps_one_step_per_block_nested_across_levels() -> None:
    traces = RunTraces("job-7", 0)
    numbers = 1 << 12
    selected = {
        level: {n for n in range(numbers) if traces.head_selected("train", n, level)}
        for level in range(8)
    }
    for level, chosen in selected.items():
        assert len(chosen) == numbers >> level  # exactly one in each block of 2**level
        assert {n >> level for n in chosen} == set(range(numbers >> level))
        assert chosen == traces.head_numbers("train", 0, numbers, level)
        if level:  # a rank at a higher level keeps a subset of a lower level's steps
            assert chosen <= selected[level - 1]
    # no aliasing with a loop's period (gradient accumulation every 4 steps)
    by_residue = Counter(n % 4 for n in selected[5])
    assert min(by_residue.values()) >= len(selected[5]) // 8, by_residue
    assert traces.head_numbers("train", 100, 300, 3) == {
        n for n in range(100, 300) if traces.head_selected("train", n, 3)
    }
    assert (level_for(1.0), level_for(0.5), level_for(0.3), level_for(0.125)) == (0, 1, 2, 3)
    assert level_for(0.0) is None and not traces.head_selected("train", 3, None)
    # each phase's first step is kept at every level (a one-batch phase still shows)
    for phase in ("train", "validation", "test"):
        assert all(traces.head_selected(phase, 0, level) for level in range(48))


def _steps_by_trace(path: Path) -> dict[str, list[tuple[str, int | None]]]:
    roots: dict[str, list[tuple[str, int | None]]] = {}
    for span in read_spans(path):
        if not span.parent_span_id:
            roots.setdefault(span.trace_id, []).append(
                (span.attributes["otelprof.phase"], span.attributes.get("otelprof.step"))
            )
    return roots


def _one_rank(tmp_path: Path, name: str) -> list[tuple[str, str]]:
    """A rank's loop (5 steps, a validation phase of 3 batches, 5 more steps), every trace
    kept: its roots in order as (phase, trace id)."""
    with otelprof.instrument(
        output_dir=str(tmp_path / name), run_id="same-job", trace_budget=float("inf"),
        host_metrics=False, process_metrics=False,
    ):  # fmt: skip
        for step in range(10):
            with otelprof.timing("train_batch"):
                pass
            otelprof.step()
            if step == 4:
                with otelprof.phase("validation"):
                    for batch in range(3):
                        with otelprof.timing("eval_batch"):
                            pass
                        if batch < 2:
                            otelprof.step()
    (path,) = (tmp_path / name / "same-job").glob("traces*.jsonl")  # .attempt1 after a restart
    spans = read_spans(path)
    roots = sorted((s for s in spans if not s.parent_span_id), key=lambda s: s.start_ns)
    return [(s.attributes["otelprof.phase"], s.trace_id) for s in roots]


def test_phase_batches_share_trace_ids_across_ranks_and_attempts_get_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _one_rank(tmp_path, "rank0")
    second = _one_rank(tmp_path, "rank1")
    assert [p for p, _ in first] == ["train"] * 5 + ["validation"] * 3 + ["train"] * 5
    assert first == second  # the same loop on another rank: the same traces, in order
    assert len({t for _, t in first}) == len(first)  # every step and batch its own trace
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = _one_rank(tmp_path, "attempt1")
    assert not {t for _, t in restarted} & {t for _, t in first}


def _spans_of(run_dir: Path, rank: int) -> list[Span]:
    return read_spans(run_dir / f"traces.rank{rank}.jsonl")


def test_every_rank_of_a_real_job_keeps_the_same_head_sampled_steps_in_shared_traces(
    tmp_path: Path,
) -> None:
    """mp.spawn, gloo on CPU, detached: 160 steps with head sampling at one step in 8 and a
    validation phase every 50 steps. Both ranks write the same head-selected steps, each
    step's spans of both ranks in one trace; rank 1 is 0.4 s late at step 120 and both
    ranks keep that step (rank 0 waited for it in the gradient all-reduce)."""
    steps, slow_at = 160, 120
    result = subprocess.run(
        [sys.executable, str(JOB), "--spawn", "2", "--steps", str(steps),
         "--step-sleep-ms", "1", "--validate-every", "50",
         "--slow-rank", "1", "--slow-at", str(slow_at), "--slow-ms", "400"],
        env=_env(tmp_path, OTELPROF_TRACE_HEAD_FRACTION="0.125"),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = _only_run_dir(tmp_path)
    traces = RunTraces(run_dir.name, 0)
    selected = {n for n in range(steps) if traces.head_selected("train", n, 3)}
    assert len(selected) == steps // 8
    kept: list[dict[int, Span]] = []
    for rank in (0, 1):
        spans = _spans_of(run_dir, rank)
        by_step = {s.attributes["otelprof.step"]: s for s in spans if s.name == "step"}
        kept.append(by_step)
        # every selected step is kept, whatever else this rank kept for its own reasons
        assert selected <= set(by_step), (rank, sorted(selected - set(by_step)))
        head = {n for n, s in by_step.items() if s.attributes["otelprof.sampled"] == "head"}
        assert head <= selected
        for n, step in by_step.items():  # its id is the one every rank derives
            assert int(step.trace_id, 16) == traces.trace_id("train", n)
        step_ids = {s.span_id: s.trace_id for s in by_step.values()}
        for span in spans:  # a kept step's ranges are in its trace
            if span.parent_span_id in step_ids:
                assert span.trace_id == step_ids[span.parent_span_id]
    # the same steps in the same traces on both ranks, with each rank's own span ids
    for n in selected | (set(kept[0]) & set(kept[1])):
        assert kept[0][n].trace_id == kept[1][n].trace_id
        assert kept[0][n].span_id != kept[1][n].span_id
    # the straggler's step: kept on both, and rank 0's is long too (it waited)
    late = [kept[rank].get(slow_at) for rank in (0, 1)]
    assert all(late), [sorted(k) for k in kept]
    assert {s.attributes["otelprof.sampled"] for s in late} <= {"anomaly", "capture", "head"}
    assert all(s.duration_s >= 0.3 for s in late)  # type: ignore[union-attr]
    # validation batches: traces of their own, shared by the ranks that kept them
    batches = [
        {
            s.trace_id
            for s in _spans_of(run_dir, rank)
            if s.name == "validation" and not s.parent_span_id
        }
        for rank in (0, 1)
    ]
    assert not (batches[0] | batches[1]) & {s.trace_id for s in kept[0].values()}
    shared = _steps_by_trace(run_dir / "traces.rank0.jsonl")
    for trace_id in batches[0] & batches[1]:
        assert {phase for phase, _ in shared[trace_id]} == {"validation"}
