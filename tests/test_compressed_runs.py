"""Detached runs written with compress=True: gzip'd OTLP JSON Lines that everything reads."""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path

import pytest

import otelprof
from otelprof.analysis.reader import ReadStats, WarningLog, iter_lines, open_run
from otelprof.analysis.summary import summarize
from otelprof.cli import main as cli_main
from tests.otlp_files import read_lines, read_points, read_spans
from tests.pipeline_run import DETERMINED_TIMINGS, STEP_SPAN, training_loop
from tests.services import COLLECTOR_DIR, Collector, Prometheus

GZIP_REPLAY_OVERLAY = COLLECTOR_DIR / "replay-gzip.yaml"


def _compressed_run(tmp_path: Path, steps: int = 12, **options: object) -> otelprof.Profiler:
    prof = otelprof.instrument(
        output_dir=tmp_path / "runs", run_id="gz", service_name="gz", interval=0.5,
        compress=True, **options,
    )  # fmt: skip
    try:
        training_loop(prof, steps=steps, pause_s=0.01)
    finally:
        prof.shutdown()
    return prof


def test_compressed_files_are_gzip_streams_of_whole_otlp_lines(tmp_path: Path) -> None:
    prof = _compressed_run(tmp_path)
    files = prof.files
    assert files["traces"].name == "traces.jsonl.gz" and files["metrics"].name == "metrics.jsonl.gz"
    spans = read_spans(files["traces"])  # the tests' own reader, via gzip
    assert sum(1 for s in spans if s.name == STEP_SPAN) == 12
    assert {s.name for s in spans} >= set(DETERMINED_TIMINGS)
    assert read_points(files["metrics"])
    raw = gzip.decompress(files["traces"].read_bytes())
    assert len(raw) > 3 * files["traces"].stat().st_size  # it is compressed
    assert all(set(r) == {"resourceSpans"} for r in read_lines(files["traces"]))


def test_report_trace_and_replay_read_a_compressed_run(tmp_path: Path) -> None:
    prof = _compressed_run(tmp_path)
    run_dir = prof.run_dir
    assert run_dir is not None
    warn = WarningLog(sink=lambda _m: None)
    summary = summarize(open_run([run_dir]), warn)
    assert warn.count == 0
    assert summary.step.count == 12
    assert all(summary.timings[name].stats.count == 12 for name in DETERMINED_TIMINGS)
    assert cli_main(["report", str(run_dir)]) == 0
    out = tmp_path / "trace.json"
    assert cli_main(["trace", str(run_dir), "-o", str(out)]) == 0
    assert out.stat().st_size > 0


def test_a_compressed_file_cut_mid_member_keeps_every_whole_line_before_the_cut(
    tmp_path: Path,
) -> None:
    prof = _compressed_run(tmp_path, steps=40, trace_budget=float("inf"))
    path = prof.files["traces"]
    whole = len(read_lines(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])  # a crash while writing the last member
    warnings: list[str] = []
    lines = list(iter_lines([path], warnings.append, ReadStats()))
    assert len(lines) == whole - 1
    assert any("compressed data ends early" in w for w in warnings)


@pytest.mark.e2e
def test_the_collectors_otlpjsonfile_receiver_replays_a_compressed_run(
    tmp_path: Path,
    collector_factory: Callable[..., Collector],
    prometheus_factory: Callable[..., Prometheus],
) -> None:
    steps = 12
    prof = _compressed_run(tmp_path, steps=steps)
    assert prof.run_dir is not None
    collector = collector_factory(
        overlays=[GZIP_REPLAY_OVERLAY], extra_env={"OTELCOL_REPLAY_DIR": str(prof.run_dir)}
    )
    prom = prometheus_factory(collector=collector)
    names = "|".join((*DETERMINED_TIMINGS, STEP_SPAN))
    query = (
        f'count(traces_span_metrics_calls_total{{service_name="gz",span_name=~"{names}"}}'
        f" == {steps})"
    )
    prom.wait_for_series(f"{query} == {len(DETERMINED_TIMINGS) + 1}", timeout_s=90)
    # the metrics file too: otelprof's timing histogram, counting every step
    prom.wait_for_series(
        'otelprof_timing_duration_seconds_count{service_name="gz", otelprof_timing="step"}'
        f" == {steps}",
        timeout_s=60,
    )
