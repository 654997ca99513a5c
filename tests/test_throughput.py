"""Throughput (samples/s, tokens/s) and MFU: on step spans, as metrics, and in the report."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof import _throughput
from otelprof.cli import main as cli_main
from otelprof.config import ConfigError, Settings
from tests.otlp_files import read_points, read_spans

BATCH = 8
SEQ = 16
FLOPS = 3.0e9  # declared FLOPs per step
PEAK = 1.0e12  # declared peak FLOP/s


@pytest.fixture(autouse=True)
def _reset_peak() -> Any:
    yield
    otelprof.set_peak_flops(None)
    _throughput.set_precision("16-bit")


def _instrumented_run(tmp_path: Path, steps: int = 8) -> Path:
    otelprof.set_peak_flops(PEAK)
    with otelprof.instrument(
        output_dir=str(tmp_path), run_id="tp", host_metrics=False, gpus="none",
        process_metrics=False, interval=0.2,
    ):  # fmt: skip
        for i in range(steps):
            with otelprof.timing("train_batch"):
                time.sleep(0.05 if i == 0 else 0.004)  # step 0: a slow warm-up
            otelprof.step_work(samples=BATCH / 2, tokens=BATCH * SEQ / 2, flops=FLOPS / 2)
            otelprof.step_work(samples=BATCH / 2, tokens=BATCH * SEQ / 2, flops=FLOPS / 2)
            otelprof.step()
            if i == 3:
                with otelprof.phase("validation"):
                    for _ in range(2):
                        with otelprof.timing("forward"):
                            time.sleep(0.03)  # would halve the rate if it counted
                        otelprof.step_work(samples=BATCH)
                        otelprof.step()
    return tmp_path / "tp"


def test_step_work_lands_on_step_spans_and_window_metrics_exclude_warmup_and_validation(
    tmp_path: Path,
) -> None:
    run = _instrumented_run(tmp_path)
    spans = read_spans(run / "traces.jsonl")
    steps = sorted((s for s in spans if s.name == "step"), key=lambda s: s.start_ns)
    assert len(steps) == 8
    for s in steps:  # micro-batch calls add up
        assert s.attributes["otelprof.samples"] == BATCH
        assert s.attributes["otelprof.tokens"] == BATCH * SEQ
        assert s.attributes["otelprof.flops"] == FLOPS
        assert s.attributes["otelprof.peak_flops"] == PEAK
    validation = [s for s in spans if s.name == "validation"]
    assert [v.attributes["otelprof.samples"] for v in validation] == [BATCH, BATCH]
    # independent figures: steps 1..7 only (step 0 is warm-up), validation excluded
    seconds = math.fsum((s.end_ns - s.start_ns) / 1e9 for s in steps[1:])
    expected_samples = 7 * BATCH / seconds
    points = read_points(run / "metrics.jsonl")

    def last(name: str) -> float:
        found = sorted((p for p in points if p.name == name), key=lambda p: p.time_ns)
        assert found, f"no {name} point"
        assert found[-1].attributes == {"otelprof.phase": "train"}
        return found[-1].value

    assert last("otelprof.train.throughput.samples") == pytest.approx(expected_samples, rel=0.05)
    assert last("otelprof.train.throughput.tokens") == pytest.approx(
        expected_samples * SEQ, rel=0.05
    )
    assert last("otelprof.train.mfu") == pytest.approx(7 * FLOPS / seconds / PEAK, rel=0.05)
    counted = sorted(
        (p for p in points if p.name == "otelprof.train.samples"), key=lambda p: p.time_ns
    )
    assert counted[-1].value == 8 * BATCH  # counters count every training step, not validation


def test_steps_record_no_sdk_measurement_on_the_training_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The work counters are read by the metric reader's thread: an SDK `Counter.add` per
    step (attribute checks, hashing, a lock, an aggregation) cost the training thread
    several µs."""
    import threading

    from opentelemetry.sdk.metrics._internal import instrument

    training_thread = threading.get_ident()
    calls: list[str] = []
    for cls in (instrument._Counter, instrument._UpDownCounter, instrument._Histogram):
        for name in ("add", "record"):
            original = getattr(cls, name, None)
            if original is None:
                continue

            def spy(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if threading.get_ident() == training_thread:
                    calls.append(self.name)
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(cls, name, spy)
    run = _instrumented_run(tmp_path)
    assert calls == []
    counted = {
        p.name: p.value
        for p in sorted(read_points(run / "metrics.jsonl"), key=lambda p: p.time_ns)
        if p.name in ("otelprof.train.samples", "otelprof.train.tokens")
    }
    assert counted == {
        "otelprof.train.samples": 8 * BATCH,
        "otelprof.train.tokens": 8 * BATCH * SEQ,
    }


def test_report_shows_throughput_and_mfu_per_phase(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _instrumented_run(tmp_path)
    assert cli_main(["report", str(run), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["phase"]: r for r in doc["sections"]["throughput"]["rows"]}
    spans = read_spans(run / "traces.jsonl")
    steps = sorted((s for s in spans if s.name == "step"), key=lambda s: s.start_ns)[1:]
    seconds = math.fsum((s.end_ns - s.start_ns) / 1e9 for s in steps)
    train = rows["train"]
    assert train["steps"] == 7
    assert train["samples/s"] == pytest.approx(7 * BATCH / seconds, rel=1e-3)
    assert train["tokens/s"] == pytest.approx(7 * BATCH * SEQ / seconds, rel=1e-3)
    assert train["MFU %"] == pytest.approx(100 * 7 * FLOPS / seconds / PEAK, rel=1e-2)
    assert train["peak TFLOP/s"] == pytest.approx(PEAK / 1e12)
    val = [s for s in spans if s.name == "validation"]
    val_seconds = math.fsum((s.end_ns - s.start_ns) / 1e9 for s in val)
    assert rows["validation"]["samples/s"] == pytest.approx(2 * BATCH / val_seconds, rel=1e-3)
    assert rows["validation"]["MFU %"] is None
    assert cli_main(["report", str(run)]) == 0
    assert "Throughput and MFU" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "16-bit", 989.4e12),
        ("NVIDIA H100 PCIe", "16-bit", 756e12),
        ("NVIDIA A100-SXM4-40GB", "32-bit", 156e12),
        ("NVIDIA A100 80GB PCIe", "16-bit", 312e12),
        ("NVIDIA L40S", "16-bit", 362.05e12),
        ("Tesla T4", "16-bit", 65e12),
        ("AMD Instinct MI300X", "16-bit", 1307.4e12),
        ("NVIDIA A10G", "16-bit", None),  # not an A10: not guessed
        ("NVIDIA GeForce GTX 1080", "16-bit", None),
    ],
)
def test_peak_table_matches_device_names_without_guessing(
    name: str, precision: str, peak: float | None
) -> None:
    assert _throughput.peak_flops_for(name, precision) == peak


def test_declared_peak_wins_over_the_environment_which_wins_over_the_table(
    tmp_path: Path,
) -> None:
    configured = Settings.from_options(
        env={"OTELPROF_PEAK_FLOPS": "2.5e14"}, output_dir=tmp_path
    ).peak_flops
    assert _throughput.resolve_peak_flops(configured) == (2.5e14, "OTELPROF_PEAK_FLOPS")
    otelprof.set_peak_flops(1e12)
    assert _throughput.resolve_peak_flops(configured) == (1e12, "declared")
    otelprof.set_peak_flops(None)
    with pytest.raises(ConfigError, match="OTELPROF_PEAK_FLOPS: expected a number"):
        Settings.from_options(env={"OTELPROF_PEAK_FLOPS": "fast"}, output_dir=tmp_path)
    peak, why = _throughput.resolve_peak_flops()
    assert peak is None and "declare the peak" in why  # no GPU here


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"samples": -1}, "samples must be finite and >= 0"),
        ({"tokens": float("nan")}, "tokens must be finite"),
        ({"flops": "1e9"}, "flops must be a number"),
        ({"samples": True}, "samples must be a number"),
    ],
)
def test_bad_step_work_is_refused_with_a_clear_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        otelprof.step_work(**kwargs)
    with pytest.raises(ValueError, match="peak FLOP/s must be > 0"):
        otelprof.set_peak_flops(0)


def test_without_a_declared_peak_mfu_is_absent_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with otelprof.instrument(
        output_dir=str(tmp_path), run_id="nopeak", host_metrics=False, gpus="none",
        process_metrics=False,
    ):  # fmt: skip
        for _ in range(3):
            otelprof.step_work(samples=4, flops=1e6)
            otelprof.step()
    points = read_points(tmp_path / "nopeak" / "metrics.jsonl")
    assert not [p for p in points if p.name == "otelprof.train.mfu"]
    assert [p for p in points if p.name == "otelprof.train.throughput.samples"]
    assert sum("no MFU" in r.getMessage() for r in caplog.records) == 1


def test_report_steps_range_selects_the_steps_throughput_is_computed_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _instrumented_run(tmp_path)
    assert cli_main(["report", str(run), "--json", "--steps", "0:3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["phase"]: r for r in doc["sections"]["throughput"]["rows"]}
    steps = sorted((s for s in read_spans(run / "traces.jsonl") if s.name == "step"),
                   key=lambda s: s.start_ns)[:3]  # fmt: skip
    seconds = math.fsum((s.end_ns - s.start_ns) / 1e9 for s in steps)
    assert rows["train"]["steps"] == 3  # step 0 included when asked for
    assert rows["train"]["samples/s"] == pytest.approx(3 * BATCH / seconds, rel=1e-3)
