"""Phases: validation and checkpointing are kept apart from training steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import otelprof
from otelprof import _steps
from otelprof._timings._recorder import timing
from tests.timings_harness import by_name, start_run


def _train(steps: int) -> None:
    for _ in range(steps):
        with timing("dataloader_next"):
            pass
        with timing("train_batch"), torch.profiler.record_function("forward"):
            pass
        otelprof.step()


def _validate(batches: int) -> None:
    with otelprof.phase("validation"):
        for _ in range(batches):
            with timing("dataloader_next"):
                pass
            with torch.profiler.record_function("forward"):
                pass
            otelprof.step()


def test_validation_inside_an_epoch_loop_is_not_folded_into_training_steps(
    tmp_path: Path,
) -> None:
    run = start_run(tmp_path)
    for epoch in range(2):
        otelprof.set_epoch(epoch)
        _train(3)
        _validate(2)
    spans = run.finish()
    steps = by_name(spans, "step")
    # 6 training steps, numbered 0..5; no empty step from the validation boundary
    assert sorted(s.attributes["otelprof.step"] for s in steps) == list(range(6))
    assert {s.attributes["otelprof.phase"] for s in steps} == {"train"}
    validation = by_name(spans, "validation")
    assert len(validation) == 4  # one root span per validation batch
    assert all(not v.parent_span_id for v in validation)
    assert {v.attributes["otelprof.phase"] for v in validation} == {"validation"}
    # validation happens after training step 2 (epoch 0) and 5 (epoch 1): same step number
    assert sorted({v.attributes["otelprof.step"] for v in validation}) == [3, 6]
    step_traces = {s.trace_id for s in steps}
    for v in validation:
        children = [s for s in spans if s.trace_id == v.trace_id and s is not v]
        assert sorted(c.name for c in children) == ["dataloader_next", "forward"]
        assert all(c.attributes["otelprof.phase"] == "validation" for c in children)
        assert v.trace_id not in step_traces
    # every range of a training trace is phase train
    for s in spans:
        if s.trace_id in step_traces:
            assert s.attributes["otelprof.phase"] == "train"


def test_training_resumes_the_interrupted_step_after_a_phase(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    _train(1)
    with timing("train_batch"):  # step 1 has begun when checkpointing starts
        pass
    with otelprof.phase("checkpoint"), timing("save"):
        pass
    _train(1)  # the rest of step 1
    spans = run.finish()
    steps = sorted(by_name(spans, "step"), key=lambda s: s.start_ns)
    assert [s.attributes["otelprof.step"] for s in steps] == [0, 1, 1]
    checkpoint = by_name(spans, "checkpoint")
    assert len(checkpoint) == 1
    save = by_name(spans, "save")[0]
    assert save.parent_span_id == checkpoint[0].span_id
    assert save.attributes["otelprof.phase"] == "checkpoint"
    # the training pieces before and after do not cover the checkpoint
    assert steps[1].end_ns <= checkpoint[0].start_ns
    assert steps[2].start_ns >= checkpoint[0].end_ns
    assert run.engine.stats()["steps"] == 2


def test_phase_restores_the_previous_phase_and_nests(tmp_path: Path) -> None:
    run = start_run(tmp_path)
    assert otelprof.phase.current() == "train"
    with otelprof.phase("validation"):
        assert otelprof.phase.current() == "validation"
        with otelprof.phase("checkpoint"):
            assert otelprof.phase.current() == "checkpoint"
        assert otelprof.phase.current() == "validation"
    assert otelprof.phase.current() == "train"
    previous = _steps.set_phase("validation")
    assert previous == "train"
    assert _steps.set_phase("train") == "validation"
    run.finish()


def test_phase_as_decorator_and_without_a_profiler() -> None:
    @otelprof.phase("validation")
    def evaluate() -> str:
        return otelprof.phase.current()

    assert evaluate() == "train"  # no profiler runs: a no-op that still runs the function
    with otelprof.phase("validation"):
        pass


@pytest.mark.parametrize("bad", ["", "step", "Validation", "a b", 3, None])
def test_a_bad_phase_name_is_refused_with_a_clear_error(bad: object) -> None:
    with pytest.raises(ValueError, match="phase must be"):
        otelprof.phase(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="phase must be"):
        _steps.set_phase(bad)  # type: ignore[arg-type]


def test_report_gives_training_steps_without_validation_and_validation_its_own_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import time

    from otelprof.analysis.reader import WarningLog, open_run
    from otelprof.analysis.summary import summarize
    from otelprof.analysis.tables import timing_rows
    from otelprof.cli import main as cli_main

    with otelprof.instrument(
        output_dir=str(tmp_path), run_id="phases", host_metrics=False, gpus="none",
        process_metrics=False,
    ):  # fmt: skip
        for _ in range(2):
            for _ in range(4):
                with timing("train_batch"):
                    time.sleep(0.001)
                otelprof.step()
            with otelprof.phase("validation"):
                for _ in range(3):
                    with timing("forward"):
                        time.sleep(0.02)  # validation batches are 20x slower
                    otelprof.step()
    run_dir = tmp_path / "phases"
    warn = WarningLog(sink=lambda _m: None)
    summary = summarize(open_run([run_dir], warn), warn)
    assert summary.step.count == 8  # training steps only
    # no validation batch (20 ms or more) in the step statistics: the median, since a loaded
    # machine can stretch a 1 ms training step past 20 ms (its p95 read 20.5 ms under two test
    # workers at a load of 7-9 on two cores)
    assert summary.step.percentile(50) < 0.015
    rows = {row.name: row for row in timing_rows(summary)}
    assert rows["validation"].count == 6
    assert rows["validation"].level == "top level"
    assert rows["validation"].mean_s >= 0.02
    assert rows["forward (validation)"].count == 6
    assert rows["forward (validation)"].level == "in validation"
    assert rows["train_batch"].share is not None and rows["train_batch"].count == 8
    assert cli_main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "forward (validation)" in out and "validation bound" not in out


def test_a_phase_block_without_ranges_still_records_its_time(tmp_path: Path) -> None:
    import time

    run = start_run(tmp_path)
    _train(1)
    with otelprof.phase("checkpoint"):
        time.sleep(0.02)  # e.g. torch.save: no range inside
    with otelprof.phase("validation"):
        with timing("forward"):
            pass
        otelprof.step()  # the trailing, empty validation batch is no batch
    spans = run.finish()
    (checkpoint,) = by_name(spans, "checkpoint")
    assert checkpoint.end_ns - checkpoint.start_ns >= 20_000_000
    assert checkpoint.attributes["otelprof.phase"] == "checkpoint"
    assert len(by_name(spans, "validation")) == 1


def test_ids_do_not_repeat_when_training_code_reseeds_random(tmp_path: Path) -> None:
    import random

    run = start_run(tmp_path)
    for _ in range(3):
        random.seed(0)  # as seed_everything() or Lightning's isolate_rng() do
        _train(1)
    spans = run.finish()
    assert len({s.trace_id for s in by_name(spans, "step")}) == 3
    assert len({s.span_id for s in spans}) == len(spans)
