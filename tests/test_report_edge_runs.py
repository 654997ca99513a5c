"""The report reads right at a run's edges: a crash mid-step, three steps, no `step()` calls,
an empty run, µs steps, tiny shares; each figure against the test's own clock or the files."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import otelprof
from otelprof.analysis import format as fmt
from tests.run_generators import RunSpec, write_sdk_run
from tests.test_report_ux import record_run, report, report_json


@pytest.fixture(autouse=True)
def _no_profiler_left_running() -> Iterator[None]:
    yield
    otelprof.uninstrument()


def test_the_step_running_at_a_crash_is_reported_as_the_crashed_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with (
        pytest.raises(RuntimeError, match="boom"),
        otelprof.instrument(output_dir=tmp_path, run_id="run", host_metrics=False),
    ):
        for step in range(6):
            with otelprof.timing("dataloader_next"):
                time.sleep(0.002)
            with otelprof.timing("train_batch"):
                began = time.perf_counter()
                if step == 4:
                    time.sleep(0.01)
                    crashed_after = time.perf_counter() - began
                    raise RuntimeError("boom")
            otelprof.step()
    doc = report_json(capsys, str(tmp_path / "run"))
    (crash,) = [p for p in doc["problems"] if p["kind"] == "crashed"]
    assert crash["message"].endswith(
        'training died of RuntimeError: boom in step 4 (its ranges: the "crashed step" rows)'
    )
    rows = {r["name"]: r for r in doc["timings"]}
    assert doc["steps"]["count"] == 4  # the finished steps
    assert rows["crashed step"]["level"] == "top level"
    batch = rows["train_batch (crashed step)"]
    assert batch["count"] == 1 and batch["level"] == "in crashed step"
    assert crashed_after <= batch["mean_s"] < crashed_after + 0.005
    assert not [r for r in rows if "after_training" in r]
    text = report(capsys, str(tmp_path / "run"))
    assert "after_training" not in text and "crashed step" in text


def test_ranges_after_the_last_step_of_a_clean_run_stay_after_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with otelprof.instrument(output_dir=tmp_path, run_id="run", host_metrics=False):
        for _ in range(3):
            with otelprof.timing("train_batch"):
                time.sleep(0.002)
            otelprof.step()
        with otelprof.timing("evaluate"):
            time.sleep(0.002)
    rows = {r["name"] for r in report_json(capsys, str(tmp_path / "run"))["timings"]}
    assert {"after_training", "evaluate (after_training)"} <= rows
    assert not [r for r in rows if "crashed" in r]


def test_a_three_step_run_notes_a_slow_step_0_against_the_later_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = record_run(tmp_path, steps=3, step0_s=0.08)
    doc = report_json(capsys, str(run))
    (note,) = [n for n in doc["notes"] if n.startswith("step 0 took")]
    step0 = doc["steps"]["step0_s"][0]
    total = doc["steps"]["total_s"]
    later = (total - step0) / 2  # two later steps: their median is their mean
    ratio = step0 / later
    assert note.startswith(
        f"step 0 took {fmt.ms_text(step0)}, {ratio:.0f}x the median of the later steps "
        f"({fmt.ms_text(later)})"
    ), note
    assert step0 >= 0.08  # the test's own sleep


def test_step_0_a_few_microseconds_slower_is_no_outlier_and_figures_keep_their_digits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = RunSpec(
        steps=20, epochs=1, dataloader_s=2e-6, to_device_s=1e-6, train_batch_s=6e-6, lr_s=1e-6,
        reduce_s=1e-6, untimed_s=1e-6, validation=False,
    )  # fmt: skip
    µs = write_sdk_run(tmp_path / "us", RunSpec(**{**vars(tiny), "slow_steps": {0: 50e-6}}))
    assert not [n for n in report_json(capsys, str(µs))["notes"] if "step 0" in n]
    ms = write_sdk_run(tmp_path / "ms", RunSpec(**{**vars(tiny), "slow_steps": {0: 0.05}}))
    (note,) = [n for n in report_json(capsys, str(ms))["notes"] if "step 0" in n]
    assert re.match(
        r"step 0 took 50\.\d ms, \d+x the median of the later steps \(0\.0\d+ ms\)", note
    )
    assert fmt.value(0.00026, "1") == "0.026%" and fmt.value(0.23, "1") == "23.0%"


def test_without_step_calls_the_work_declared_shows_in_counters_and_throughput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inside: list[float] = []  # the test's clock just inside each range
    outside: list[float] = []  # and just outside it
    with otelprof.instrument(output_dir=tmp_path, run_id="run", host_metrics=False):
        for _ in range(20):
            outside.append(time.perf_counter())
            with otelprof.timing("train_batch"):
                inside.append(time.perf_counter())
                time.sleep(0.003)
                inside.append(time.perf_counter())
            outside.append(time.perf_counter())
            otelprof.step_work(samples=32)
    doc = report_json(capsys, str(tmp_path / "run"))
    assert doc["counters"]["otelprof.train.samples"] == 640
    (row,) = doc["sections"]["throughput"]["rows"]
    assert row["phase"] == "train" and row["steps"] == 1
    # the one step runs from the first range's start to the last range's end: longer than
    # the test saw inside them, shorter than it saw around them (the report shows 4 digits)
    longest, shortest = outside[-1] - outside[0], inside[-1] - inside[0]
    rounding = 5e-4
    assert 640 / longest * (1 - rounding) <= row["samples/s"], (row, longest)
    assert row["samples/s"] <= 640 / shortest * (1 + rounding), (row, shortest)
    assert any("step() was never called" in n for n in doc["sections"]["throughput"]["notes"])


def test_an_empty_run_counts_the_process_that_wrote_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    otelprof.instrument(output_dir=tmp_path, run_id="run", host_metrics=False).shutdown()
    text = report(capsys, str(tmp_path / "run"))
    assert "1 process(es)" in text and "?" not in text.split("\n")[1]
    assert report_json(capsys, str(tmp_path / "run"))["run"]["processes"] == 1


def test_a_small_mfu_is_shown_with_its_digits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    otelprof.set_peak_flops(1e15)
    try:
        with otelprof.instrument(
            output_dir=tmp_path, run_id="run", host_metrics=False, interval=0.2
        ):
            for _ in range(40):
                with otelprof.timing("train_batch"):
                    time.sleep(0.01)
                otelprof.step_work(samples=8, flops=1e9)
                otelprof.step()
    finally:
        otelprof.set_peak_flops(None)
    points = [
        dp["asDouble"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        for rm in json.loads(line)["resourceMetrics"]
        for sm in rm["scopeMetrics"]
        for m in sm["metrics"]
        if m["name"] == "otelprof.train.mfu"
        for dp in m["gauge"]["dataPoints"]
    ]
    mean = sum(points) / len(points)
    assert 0 < 100 * mean < 0.95  # ~0.01 %: 1e9 FLOP per ~10 ms step over 1e15 FLOP/s
    text = report(capsys, "--width", "200", str(tmp_path / "run"))
    (row,) = [line for line in text.splitlines() if "otelprof.train.mfu" in line]
    assert f"{100 * mean:.2g}%" in row and "0.0%" not in row, row
