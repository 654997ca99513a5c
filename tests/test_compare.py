"""`otelprof compare A B`: two runs whose difference the test made, reported as that change.

The real-run test slows a data loader by a known amount in run B and measures, with its
own clock, how long each step waited for its batch in both runs; the comparison must report
the change of `dataloader_next` per step within a millisecond of that, name it as what
changed most, and say the verdict moved. A multi-rank pair (two ranks per run, written
through the SDK's exporters) checks the per-rank rows.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof.cli import main as cli_main
from tests.run_generators import RunSpec, write_sdk_run
from tests.test_memory_by_phase import wait_for_samples

TRAIN_S = 0.010
LOADER_S = 0.002
SLOWER_BY_S = 0.014  # run B's data loader: the change the comparison must find


@pytest.fixture(autouse=True)
def _no_profiler_left_running() -> Iterator[None]:
    yield
    otelprof.uninstrument()


class SlowData:
    """A map-style dataset whose items take `delay_s` to load."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> int:
        time.sleep(self.delay_s)
        return index


def record(
    output_dir: Path, loader_s: float, steps: int = 24
) -> tuple[Path, list[float], list[float]]:
    """A real run; returns its directory and, per step, the wait for the batch and the
    training as the test's own clock measured them (a loaded machine oversleeps)."""
    from torch.utils.data import DataLoader

    loader = DataLoader(SlowData(loader_s), batch_size=1)
    waits, trains = [], []
    with otelprof.instrument(output_dir=output_dir, interval=0.2, host_metrics=False) as prof:
        batches = iter(otelprof.timed_dataloader(loader))
        for _ in range(steps):
            start = time.perf_counter()
            next(batches)
            waits.append(time.perf_counter() - start)
            start = time.perf_counter()
            with otelprof.timing("train_batch"):
                time.sleep(TRAIN_S)
            trains.append(time.perf_counter() - start)
            otelprof.step()
    assert prof.run_dir is not None
    return prof.run_dir, waits, trains


def compare_json(capsys: pytest.CaptureFixture[str], a: Path, b: Path, *args: str) -> Any:
    capsys.readouterr()
    assert cli_main(["compare", "--json", str(a), str(b), *args]) == 0
    return json.loads(capsys.readouterr().out)


def row(doc: dict[str, Any], group: str, name: str) -> dict[str, Any]:
    (found,) = [r for r in doc["rows"] if r["group"] == group and r["name"] == name]
    return found


def test_a_slowed_data_loader_is_reported_as_that_change_per_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_a, waits_a, trains_a = record(tmp_path / "a", LOADER_S)
    run_b, waits_b, trains_b = record(tmp_path / "b", LOADER_S + SLOWER_BY_S)
    doc = compare_json(capsys, run_a, run_b)

    loader = row(doc, "per step", "dataloader_next")
    # the range sits inside the test's measurement: at most a little less, never more
    for reported, waits in ((loader["a"], waits_a), (loader["b"], waits_b)):
        measured = statistics.fmean(waits)
        assert measured - 0.001 <= reported <= measured
    measured_change = statistics.fmean(waits_b) - statistics.fmean(waits_a)
    assert loader["change"] == pytest.approx(measured_change, abs=0.001)
    assert loader["direction"] == "slower" and loader["better"] == "lower"
    assert loader["relative"] == pytest.approx(measured_change / loader["a"], rel=0.05)
    train = row(doc, "per step", "train_batch")
    train_change = statistics.fmean(trains_b) - statistics.fmean(trains_a)
    assert train["change"] == pytest.approx(train_change, abs=0.001)  # the test did not change it

    step = row(doc, "steps", "step time (mean)")
    assert step["change"] == pytest.approx(measured_change + train_change, abs=0.002)
    assert doc["a"]["verdict"]["kind"] == "compute bound"
    assert doc["b"]["verdict"]["kind"] == "data-loader bound"
    assert doc["headline"].startswith("dataloader_next +")
    assert " % per step (" in doc["headline"]
    assert "now data-loader bound (was compute bound)" in doc["headline"]
    assert doc["changes"][0].startswith("step time +")
    # hardware rows are measurements: not the run's end marker for Prometheus' alerts
    hardware = [r["name"] for r in doc["rows"] if r["group"] == "hardware"]
    assert "process.memory.usage (mean)" in hardware
    assert not any(name.startswith("otelprof.run.ended") for name in hardware)

    capsys.readouterr()
    assert cli_main(["compare", "--width", "160", str(run_a), str(run_b)]) == 0
    text = capsys.readouterr().out
    assert "what changed: dataloader_next +" in text
    assert "Time per training step" in text and "slower" in text


def test_multi_rank_runs_are_compared_rank_by_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = RunSpec(steps=20, ranks=2, jitter=0.0, validation=False)
    run_a = write_sdk_run(tmp_path / "a", base)
    run_b = write_sdk_run(
        tmp_path / "b", RunSpec(steps=20, ranks=2, jitter=0.0, validation=False,
                                slow_dataloader_s=0.010, straggler_rank=1)
    )  # fmt: skip
    doc = compare_json(capsys, run_a, run_b)

    assert doc["a"]["processes"] == doc["b"]["processes"] == 2
    assert row(doc, "per step", "dataloader_next")["change"] == pytest.approx(0.010, abs=1e-6)
    rank0 = row(doc, "processes", "rank 0 step time (mean)")
    rank1 = row(doc, "processes", "rank 1 step time (mean)")
    assert rank0["change"] == pytest.approx(0.010, abs=1e-6)
    # rank 1 also got the straggler's doubled train_batch
    assert rank1["change"] == pytest.approx(0.010 + base.train_batch_s, abs=1e-6)
    assert rank1["direction"] == "slower"


def test_a_run_compared_with_itself_has_nothing_that_moved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_sdk_run(tmp_path / "a", RunSpec(steps=10, jitter=0.0))
    doc = compare_json(capsys, run, run)
    assert all(r["direction"] in ("same", "") for r in doc["rows"]), doc["rows"]
    assert doc["changes"][0].startswith("step time unchanged")
    assert "still" in doc["headline"]


def test_a_missing_run_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_sdk_run(tmp_path / "a", RunSpec(steps=4))
    assert cli_main(["compare", str(run), str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err


def test_a_slower_module_and_memory_by_phase_are_in_the_comparison(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    class Sleepy(torch.nn.Module):
        """Sleeps `seconds` a call, and times its calls by the test's clock (a loaded
        machine oversleeps)."""

        def __init__(self, seconds: float) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.seconds = seconds
            self.calls: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            time.sleep(self.seconds)
            out = self.lin(x)
            self.calls.append(time.perf_counter() - start)
            return out

    runs, measured = [], []
    for name, seconds in (("a", 0.004), ("b", 0.016)):
        sleepy_module = Sleepy(seconds)
        measured.append(sleepy_module.calls)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), sleepy_module)
        with otelprof.instrument(
            output_dir=tmp_path / name, module_timings=1, interval=0.2, host_metrics=False
        ) as prof:
            for _ in range(6):
                with otelprof.timing("train_batch"):
                    model(torch.randn(2, 4)).sum().backward()
                otelprof.step()
            wait_for_samples(prof)  # RSS labelled with the phase while the loop runs
        assert prof.run_dir is not None
        runs.append(prof.run_dir)
    doc = compare_json(capsys, *runs)

    sleepy = row(doc, "modules", "Sequential.1")
    measured_change = statistics.fmean(measured[1]) - statistics.fmean(measured[0])
    assert measured_change > 0.010
    assert sleepy["change"] == pytest.approx(measured_change, abs=0.002)
    assert sleepy["direction"] == "slower"
    assert any(c.startswith("module Sequential.1 +") for c in doc["changes"])
    rss = row(doc, "memory", "RSS max (train)")
    assert rss["a"] > 0 and rss["b"] > 0 and rss["unit"] == "By"


def test_a_line_over_max_line_is_skipped_with_a_warning_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_sdk_run(tmp_path / "a", RunSpec(steps=10))
    (traces,) = run.glob("traces*.jsonl")
    limit = max(len(line) for line in traces.read_bytes().splitlines()) - 1
    capsys.readouterr()
    assert cli_main(["compare", str(run), str(run), "--max-line", str(limit)]) == 0
    err = capsys.readouterr().err
    assert f"{traces.name}:1: line of" in err, err
    assert f"longer than the line limit ({limit:,} bytes, --max-line)" in err, err
