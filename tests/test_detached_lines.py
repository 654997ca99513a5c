"""Detached files in fewer, bigger lines: every point and span still reads back, counts exact.

The metrics file holds several exports per OTLP line (`export/_metricbatch.py`) and the trace
file's writer holds spans for fuller lines (`export/_spanlines.py`), so the resource block and
the metric descriptions are written once per line (issue #15's data volume). These tests check
that nothing is lost or changed on the way: the points and spans in the files are exactly the
ones exported, the report's breakdown counts every step, held data reaches the file on
flush/close and within the line time, and the collector's otlpjsonfile receiver feeds every
sample of a multi-export line to Prometheus.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.json.file import FileMetricExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData
from opentelemetry.sdk.resources import Resource

import otelprof
from otelprof.analysis.reader import WarningLog, open_run
from otelprof.analysis.summary import summarize
from otelprof.export._metricbatch import (
    MAX_EXPORTS_PER_LINE,
    MetricLineBatcher,
    exports_per_line,
    merge_exports,
)
from otelprof.export._metriclines import CappedMetricExporter, MetricLineStream
from otelprof.export._spanlines import SpanLineWriter, encode_span
from otelprof.export.counters import CountingMetricExporter, ExportCounters
from tests.otlp_files import read_lines, read_points, read_spans, timing_histograms
from tests.pipeline_run import DETERMINED_TIMINGS, STEP_SPAN, training_loop
from tests.services import COLLECTOR_DIR, Collector, Prometheus

REPLAY_OVERLAY = COLLECTOR_DIR / "replay.yaml"
REPO = Path(__file__).resolve().parents[1]


def _histogram_points(lines: list[dict]) -> int:  # type: ignore[type-arg]
    return sum(
        len(m["histogram"]["dataPoints"])
        for line in lines
        for rm in line["resourceMetrics"]
        for sm in rm["scopeMetrics"]
        for m in sm["metrics"]
        if "histogram" in m
    )


def _run(tmp_path: Path, steps: int, **options: object) -> otelprof.Profiler:
    prof = otelprof.instrument(
        output_dir=tmp_path / "runs", run_id="lines", service_name="lines", **options
    )
    try:
        training_loop(prof, steps=steps, pause_s=0.02)
    finally:
        prof.shutdown()
    return prof


def test_metrics_lines_hold_several_exports_and_every_exported_point_reads_back(
    tmp_path: Path,
) -> None:
    prof = _run(tmp_path, steps=60, interval=0.1)
    path = prof.files["metrics"]
    lines = read_lines(path)
    points = read_points(path)
    stats = prof.stats()
    # every exported point is in the file, once
    assert stats["files.metric_points_exported"] == len(points) + _histogram_points(lines)
    assert stats["dropped_total"] == 0
    cpu = [p.time_ns for p in points if p.name == "system.cpu.utilization"]
    # one point per export, in time order, several exports per line
    assert len(cpu) >= 12 and cpu == sorted(cpu) and len(set(cpu)) == len(cpu)
    assert len(lines) < len(cpu)
    # the report's breakdown counts every step, from the final histograms
    summary = summarize(open_run([prof.run_dir]), WarningLog(sink=lambda _m: None))
    assert summary.step.count == 60
    assert all(summary.timings[name].stats.count == 60 for name in DETERMINED_TIMINGS)
    assert int(timing_histograms(path)[(STEP_SPAN, "train")]["count"]) == 60


def test_trace_lines_hold_many_steps_and_every_span_reads_back(tmp_path: Path) -> None:
    prof = _run(tmp_path, steps=40, trace_budget=float("inf"))
    path = prof.files["traces"]
    spans = read_spans(path)
    stats = prof.stats()
    assert len(spans) == stats["files.spans_exported"] > 40 * (len(DETERMINED_TIMINGS) + 1)
    assert stats["dropped_total"] == 0 and not stats.get("timings.spans_sampled_out")
    assert sum(1 for s in spans if s.name == STEP_SPAN) == 40
    assert len(read_lines(path)) < 40  # several steps per line
    by_trace: dict[str, list[str]] = defaultdict(list)
    for span in spans:
        by_trace[span.trace_id].append(span.name)
    assert len(by_trace) == 40
    incomplete = [n for n in by_trace.values() if not set(n) >= {*DETERMINED_TIMINGS, STEP_SPAN}]
    assert not incomplete


def test_held_spans_are_written_once_the_oldest_has_waited_the_line_time(tmp_path: Path) -> None:
    now = [100.0]
    counters = ExportCounters()
    path = tmp_path / "t.jsonl"
    writer = SpanLineWriter(path, counters, line_seconds=5.0, clock=lambda: now[0])
    resource = Resource({"service.name": "t"})
    span = encode_span("x", 1, 2, 0, 1, 2, {"otelprof.step": 0})
    writer.write(resource, None, [span] * 3)
    now[0] += 4.0
    writer.write(resource, None, [span] * 2)
    writer.flush_due()
    assert not path.exists() or path.stat().st_size == 0  # held, not yet due
    now[0] += 1.0
    writer.flush_due()  # no new span needed: the periodic tick writes it
    assert len(read_lines(path)) == 1 and len(read_spans(path)) == 5
    assert counters.snapshot()["files.spans_exported"] == 5
    writer.write(resource, None, [span])
    writer.close()  # close writes what is held
    assert len(read_spans(path)) == 6 and counters.snapshot()["files.spans_exported"] == 6


def test_a_full_line_is_written_at_once_and_lines_never_exceed_the_line_size(
    tmp_path: Path,
) -> None:
    counters = ExportCounters()
    path = tmp_path / "t.jsonl"
    writer = SpanLineWriter(path, counters, line_spans=4, clock=lambda: 0.0)
    span = encode_span("x", 1, 2, 0, 1, 2, {"otelprof.step": 0})
    writer.write(Resource({}), None, [span] * 9)
    assert [
        len(line["resourceSpans"][0]["scopeSpans"][0]["spans"]) for line in read_lines(path)
    ] == [4, 4, 1]
    writer.close()


def test_force_flush_of_the_tracer_provider_writes_the_held_spans_mid_run(tmp_path: Path) -> None:
    prof = otelprof.instrument(
        output_dir=tmp_path / "runs", run_id="flush", trace_budget=float("inf"),
        host_metrics=False, process_metrics=False,
    )  # fmt: skip
    try:
        for _ in range(3):
            with otelprof.timing("train_batch"):
                pass
            otelprof.step()
        prof._timings.flush()  # the builder has handed its spans to the file's writer
        assert prof.tracer_provider.force_flush()
        names = [s.name for s in read_spans(prof.files["traces"])]
        assert names.count(STEP_SPAN) == 3 and names.count("train_batch") == 3
    finally:
        prof.shutdown()


def _metrics_data(points: int, value: float = 0.0) -> MetricsData:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    gauge = meter.create_gauge("g", unit="1", description="d")
    counter = meter.create_counter("c")
    for i in range(points):
        gauge.set(value + i, {"i": i})
    counter.add(1)
    data = reader.get_metrics_data()
    assert data is not None
    return data


def test_merged_exports_keep_every_point_of_each_series_in_export_order() -> None:
    exports = [_metrics_data(2, value=10.0 * k) for k in range(3)]
    merged = merge_exports(exports)
    [rm] = merged.resource_metrics
    [sm] = rm.scope_metrics
    by_name = {m.name: m for m in sm.metrics}
    assert sorted(by_name) == ["c", "g"]
    gauge = by_name["g"]
    assert (gauge.unit, gauge.description) == ("1", "d")
    values = [p.value for p in gauge.data.data_points]  # type: ignore[union-attr]
    assert values == [0.0, 1.0, 10.0, 11.0, 20.0, 21.0]
    assert len(by_name["c"].data.data_points) == 3  # type: ignore[union-attr]


def _batched(
    path: Path, counters: ExportCounters, per_line: int, cap: int | None
) -> tuple[CountingMetricExporter, MetricLineBatcher]:
    stream = MetricLineStream(path, max_bytes=cap, reserve_bytes=0)
    capped = CappedMetricExporter(FileMetricExporter(stream=stream), stream, counters, "files")  # type: ignore[call-overload]
    batcher = MetricLineBatcher(capped, per_line, counters, "files")
    return CountingMetricExporter("files", batcher, counters), batcher


def test_a_batched_line_is_written_every_n_exports_and_at_flush(tmp_path: Path) -> None:
    counters = ExportCounters()
    path = tmp_path / "m.jsonl"
    exporter, batcher = _batched(path, counters, per_line=3, cap=None)
    for _ in range(7):
        exporter.export(_metrics_data(2))
    assert len(read_lines(path)) == 2  # 3 + 3, one export held
    assert exporter.force_flush()
    assert len(read_lines(path)) == 3
    batcher.close()
    assert len(read_points(path)) == 7 * 3
    assert counters.snapshot()["files.metric_points_exported"] == 7 * 3


def test_a_refused_batched_line_keeps_its_newest_export_then_lines_hold_one_export(
    tmp_path: Path,
) -> None:
    counters = ExportCounters()
    path = tmp_path / "m.jsonl"
    exporter, _ = _batched(path, counters, per_line=3, cap=None)
    exporter.export(_metrics_data(2))
    exporter.force_flush()
    one = path.stat().st_size  # one export's line
    path.unlink()

    counters = ExportCounters()
    exporter, batcher = _batched(path, counters, per_line=3, cap=one + 10)
    results = [exporter.export(_metrics_data(2)) for _ in range(3)]
    # 3 exports are too big for one line: the newest is written alone, the 2 others dropped
    assert [r.name for r in results] == ["SUCCESS", "SUCCESS", "SUCCESS"]
    counts = counters.snapshot()
    assert counts["files.metric_points_dropped_size_cap"] == 6
    assert counts["files.metric_points_exported"] == 3
    assert counts["files.metric_exports_size_cap"] == 2
    assert batcher.capped
    results = [exporter.export(_metrics_data(2)) for _ in range(3)]
    assert [r.name for r in results] == ["FAILURE", "FAILURE", "FAILURE"]  # one per line now
    batcher.close()
    counts = counters.snapshot()
    assert len(read_lines(path)) == 1 and len(read_points(path)) == 3
    assert counts["files.metric_points_exported"] == 3
    assert counts["files.metric_points_dropped_size_cap"] == 6 + 3 * 3


def test_lines_hold_five_seconds_of_exports_at_most_ten() -> None:
    assert exports_per_line(1.0) == 5
    assert exports_per_line(0.1) == MAX_EXPORTS_PER_LINE == 10
    assert exports_per_line(5.0) == exports_per_line(60.0) == 1


@pytest.mark.e2e
def test_the_collectors_otlpjsonfile_receiver_delivers_every_sample_of_multi_export_lines(
    tmp_path: Path,
    collector_factory: Callable[..., Collector],
    prometheus_factory: Callable[..., Prometheus],
) -> None:
    steps = 60
    prof = _run(tmp_path, steps=steps, interval=0.1)
    assert prof.run_dir is not None
    cpu = [p for p in read_points(prof.files["metrics"]) if p.name == "system.cpu.utilization"]
    assert len(read_lines(prof.files["metrics"])) < len(cpu)
    prom = prometheus_factory(scrape_targets={})
    collector = collector_factory(
        overlays=[REPLAY_OVERLAY],
        metrics_exporters=["prometheus_remote_write"],
        extra_env={
            "OTELCOL_REPLAY_DIR": str(prof.run_dir),
            "OTELCOL_REMOTE_WRITE_URL": prom.remote_write_url,
        },
    )
    assert collector is not None
    # every gauge sample of every line, each at its own time
    prom.wait_for_series(
        f'count_over_time(system_cpu_utilization_ratio{{job="lines"}}[1h]) == {len(cpu)}',
        timeout_s=90,
    )
    prom.wait_for_series(
        f'otelprof_timing_duration_seconds_count{{job="lines", otelprof_timing="step"}} == {steps}',
        timeout_s=60,
    )
    names = "|".join((*DETERMINED_TIMINGS, STEP_SPAN))
    kept = sum(1 for s in read_spans(prof.files["traces"]) if s.name == STEP_SPAN)
    query = f'count(traces_span_metrics_calls_total{{job="lines",span_name=~"{names}"}} == {kept})'
    prom.wait_for_series(f"{query} == {len(DETERMINED_TIMINGS) + 1}", timeout_s=60)


def test_the_files_get_the_timing_histograms_every_30_s_and_once_more_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from otelprof._timings._sampling import Aggregates
    from otelprof.export import _aggregates

    now = [1000.0]
    monkeypatch.setattr(_aggregates.time, "monotonic", lambda: now[0])
    aggregates = Aggregates()
    aggregates.add(STEP_SPAN, "train", 0.01)
    metrics = _aggregates.AggregateMetrics(aggregates, Resource({}))

    def carries(exporter: str) -> bool:
        data = metrics.merge(exporter, MetricsData(resource_metrics=[]))
        return bool(data.resource_metrics)

    seen = []
    for _ in range(7):  # one export every 10 s
        seen.append((carries("files"), carries("otlp")))
        now[0] += 10.0
    assert seen == [(True, True), (False, True), (False, True)] * 2 + [(True, True)]
    metrics.final = True  # the builder's final drain: every exporter gets them once more
    assert carries("files") and carries("otlp")
    assert not carries("files")


CHILD = """
import os, sys, time
import otelprof
otelprof.instrument(interval=0.2, trace_budget=float("inf"))
for i in range(10**9):
    with otelprof.timing("train_batch"):
        time.sleep(0.005)
    otelprof.step()
    if i == 20:
        open(sys.argv[1], "w").close()
"""


def test_a_sigterm_writes_the_held_lines_so_the_files_hold_every_counted_step(
    tmp_path: Path,
) -> None:
    ready = tmp_path / "ready"
    env = dict(os.environ, PYTHONPATH=str(REPO), OTELPROF_OUTPUT_DIR=str(tmp_path / "runs"))
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(ready)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert child.poll() is None, "the child died before its loop"
            assert time.monotonic() < deadline, "the child never reached its loop"
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)  # within a line's 2 s: spans and points are held
        assert child.wait(timeout=60) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
    (run,) = (tmp_path / "runs").iterdir()
    stats = json.loads((run / "run.json").read_text())["stats"]
    spans = read_spans(run / "traces.jsonl")
    steps = sum(1 for s in spans if s.name == STEP_SPAN)
    assert steps >= 21 and len(spans) == stats["files.spans_exported"]
    assert int(timing_histograms(run / "metrics.jsonl")[(STEP_SPAN, "train")]["count"]) == steps
    lines = read_lines(run / "metrics.jsonl")
    points = len(read_points(run / "metrics.jsonl")) + _histogram_points(lines)
    assert points == stats["files.metric_points_exported"] and stats["dropped_total"] == 0
