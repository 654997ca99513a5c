"""Energy per step and GPU idle by phase, from a run written by the real OTLP file exporters.

The run is scripted so the right answers are known by hand: 60 training steps of 0.1 s
(half data loading, half train_batch) over 6 s at 200 W and 50 % utilization, then a 2 s
validation phase at 100 W and 20 %, then 2 s outside any phase at 50 W and idle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.json.file import FileMetricExporter, FileSpanExporter
from opentelemetry.sdk.metrics.export import AggregationTemporality as Temporality
from opentelemetry.sdk.metrics.export import (
    Gauge,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import set_span_in_context

from otelprof.analysis.gpu_energy import IntervalSet, analyze, section_rows, summary_notes

T0 = 1_800_000_000_000_000_000
S = 1_000_000_000
GPU = {"hw.id": "GPU-0000-uuid", "gpu.index": 0}


def _write_spans(path: Path, steps: int = 60, samples: int | None = 32) -> None:
    provider = TracerProvider(resource=Resource.create({"host.name": "node0"}))
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(path)))
    tracer = provider.get_tracer("otelprof.timings")
    t = T0
    for i in range(steps):
        attrs: dict[str, Any] = {"otelprof.step": i, "otelprof.phase": "train"}
        if samples is not None:
            attrs["otelprof.samples"] = samples
        step = tracer.start_span("step", start_time=t, attributes=attrs)
        ctx = set_span_in_context(step)
        half = S // 20
        tracer.start_span("dataloader_next", context=ctx, start_time=t).end(end_time=t + half)
        tracer.start_span("train_batch", context=ctx, start_time=t + half).end(
            end_time=t + 2 * half
        )
        t += 2 * half
        step.end(end_time=t)
    val = tracer.start_span(
        "validation", start_time=T0 + 6 * S, attributes={"otelprof.phase": "validation"}
    )
    val.end(end_time=T0 + 8 * S)
    provider.shutdown()


def _write_metrics(path: Path, energy_counter: bool = True) -> None:
    """Samples every second at t = 0..10 s; each value covers the second before it."""
    exporter = FileMetricExporter(path)
    resource = Resource.create({"host.name": "node0"})
    energy = 0.0
    for k in range(11):
        t = T0 + k * S
        watts = 200.0 if k <= 6 else (100.0 if k <= 8 else 50.0)
        util = 0.5 if k <= 6 else (0.2 if k <= 8 else 0.0)
        if k:
            energy += watts
        metrics = [
            Metric("hw.gpu.utilization", "", "1", Gauge([NumberDataPoint(GPU, T0, t, util)])),
            Metric("hw.power", "", "W", Gauge([NumberDataPoint(GPU, T0, t, watts)])),
        ]
        if energy_counter:
            point = NumberDataPoint({**GPU, "hw.type": "gpu"}, T0, t, energy)
            metrics.append(Metric("hw.energy", "", "J", Sum([point], Temporality.CUMULATIVE, True)))
        scope = ScopeMetrics(InstrumentationScope("otelprof.system"), metrics, "")
        exporter.export(MetricsData([ResourceMetrics(resource, [scope], "")]))
    exporter.shutdown()


def _run(tmp_path: Path, **kw: Any) -> list[Path]:
    spans_kw = {k: kw.pop(k) for k in ("steps", "samples") if k in kw}
    _write_spans(tmp_path / "traces.jsonl", **spans_kw)
    _write_metrics(tmp_path / "metrics.jsonl", **kw)
    return [tmp_path / "traces.jsonl", tmp_path / "metrics.jsonl"]


def _no_warnings(message: str) -> None:
    raise AssertionError(f"unexpected warning: {message}")


def test_energy_per_step_and_samples_per_joule_come_from_the_energy_counter_over_steps(
    tmp_path: Path,
) -> None:
    result = analyze(_run(tmp_path), _no_warnings)
    assert result is not None
    assert result.train_steps == 60 and result.gpus == 1 and result.energy_source == "hw.energy"
    train = result.row("phase", "train")
    assert train is not None
    assert train.seconds == pytest.approx(6.0)
    assert train.total_energy_j == pytest.approx(1200.0)  # 6 s at 200 W
    assert result.joules_per_step == pytest.approx(20.0)
    assert result.samples_per_joule == pytest.approx(60 * 32 / 1200.0)
    validation = result.row("phase", "validation")
    assert validation is not None and validation.total_energy_j == pytest.approx(200.0)
    assert validation.mean_power_w == pytest.approx(100.0)


def test_gpu_idle_is_attributed_to_the_phases_and_timings_it_overlaps(tmp_path: Path) -> None:
    result = analyze(_run(tmp_path), _no_warnings)
    assert result is not None
    train, validation = result.row("phase", "train"), result.row("phase", "validation")
    loading = result.row("timing", "dataloader_next")
    assert train is not None and validation is not None and loading is not None
    assert train.idle_gpu_seconds == pytest.approx(3.0) and train.idle_share == pytest.approx(0.5)
    assert validation.idle_gpu_seconds == pytest.approx(1.6)
    assert validation.idle_share == pytest.approx(0.8)
    assert loading.seconds == pytest.approx(3.0)
    assert loading.idle_gpu_seconds == pytest.approx(1.5)
    rows = {(r["kind"], r["label"]): r for r in section_rows(result)}
    assert rows[("phase", "validation")]["gpu_idle_share"] == pytest.approx(0.8)
    assert rows[("timing", "train_batch")]["energy_j"] == pytest.approx(600.0)
    notes = summary_notes(result)
    assert any("20 J" in n and "60 steps" in n for n in notes), notes
    assert any("GPU idle while loading data" in n and "50%" in n for n in notes), notes


def test_without_the_energy_counter_power_times_interval_gives_the_same_energy(
    tmp_path: Path,
) -> None:
    result = analyze(_run(tmp_path, energy_counter=False), _no_warnings)
    assert result is not None and result.energy_source == "hw.power"
    assert result.joules_per_step == pytest.approx(20.0)
    assert any("hw.power" in n for n in summary_notes(result))


def test_steps_without_a_samples_attribute_give_no_samples_per_joule(tmp_path: Path) -> None:
    result = analyze(_run(tmp_path, samples=None), _no_warnings)
    assert result is not None and result.samples_per_joule is None
    assert result.joules_per_step == pytest.approx(20.0)


def test_a_run_without_gpu_samples_has_no_gpu_energy_section(tmp_path: Path) -> None:
    _write_spans(tmp_path / "traces.jsonl")
    assert analyze([tmp_path / "traces.jsonl"], _no_warnings) is None


def test_interval_sets_stay_bounded_and_scale_to_their_true_time() -> None:
    ivs = IntervalSet(cap=10)
    for i in range(1000):  # 1000 disjoint 1 ms intervals, 1 ms apart
        ivs.add(i * 2_000_000, i * 2_000_000 + 1_000_000)
    assert len(ivs.intervals()) <= 10 and ivs.lossy
    assert ivs.covered_ns() * ivs.scale() == pytest.approx(1000 * 1_000_000)
    exact = IntervalSet()
    exact.add(0, 10)
    exact.add(5, 20)  # overlapping: the union counts
    assert exact.intervals() == [(0, 20)] and exact.scale() == 1.0


def test_the_report_shows_the_gpu_energy_section_in_text_and_json(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    run = tmp_path / "run"
    run.mkdir()
    _run(run)
    (run / "run.json").write_text(json.dumps({"run_id": "run", "started_unix_nano": T0}))
    cmd = [sys.executable, "-m", "otelprof", "report", str(run)]
    doc = json.loads(
        subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=True).stdout
    )
    section = doc["sections"]["gpu_energy"]
    train = next(r for r in section["rows"] if r["label"] == "train")
    assert train["energy_per_step_j"] == pytest.approx(20.0) and train["steps"] == 60
    assert train["gpu_idle_share"] == pytest.approx(0.5)
    text = subprocess.run(
        [*cmd, "--width", "200"], capture_output=True, text=True, check=True
    ).stdout
    assert "GPU energy and idle time by phase" in text and "energy per training step: 20 J" in text
