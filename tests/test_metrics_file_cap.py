"""The detached metrics file's size cap: whole export lines or none, drops counted and reported."""

from __future__ import annotations

import gzip
import logging
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.json.file import FileMetricExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData

import otelprof
from otelprof.analysis.problems import problems
from otelprof.analysis.reader import WarningLog, open_run
from otelprof.analysis.summary import summarize
from otelprof.cli import main as cli_main
from otelprof.config import ConfigError, Settings
from otelprof.export._metriclines import CappedMetricExporter, MetricLineStream
from otelprof.export.counters import CountingMetricExporter, ExportCounters
from tests.otlp_files import read_lines, read_points
from tests.pipeline_run import training_loop

DROPPED = "files.metric_points_dropped_size_cap"
CAPPED_EXPORTS = "files.metric_exports_size_cap"
VAR = "OTELPROF_MAX_METRICS_BYTES"


def _capped_run(tmp_path: Path, cap: int, **options: object) -> otelprof.Profiler:
    prof = otelprof.instrument(
        output_dir=tmp_path / "runs", run_id="cap", interval=0.1, max_metrics_bytes=cap,
        **options,
    )  # fmt: skip
    try:  # ~3 s: several 1 s lines of 10 exports (interval 0.1) are written during the run
        training_loop(prof, steps=30, pause_s=0.1)
    finally:
        prof.shutdown()
    return prof


def _metrics_data(points: int) -> MetricsData:
    """Real SDK metrics data with `points` gauge points (one per attribute value)."""
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    gauge = meter.create_gauge("g")
    for i in range(points):
        gauge.set(float(i), {"i": i})
    data = reader.get_metrics_data()
    assert data is not None
    return data


def _capped_exporter(
    path: Path,
    counters: ExportCounters,
    cap: int | None,
    compress: bool = False,
    reserve: int | None = 0,
) -> tuple[CountingMetricExporter, CappedMetricExporter]:
    stream = MetricLineStream(path, compress=compress, max_bytes=cap, reserve_bytes=reserve)
    file_exporter = FileMetricExporter(stream=stream)  # type: ignore[call-overload]
    capped = CappedMetricExporter(file_exporter, stream, counters, "files")
    return CountingMetricExporter("files", capped, counters), capped


def _step_count(line: dict[str, Any]) -> int | None:
    """The `step` timing histogram's count in one metrics request, if it has one."""
    for rm in line["resourceMetrics"]:
        for sm in rm["scopeMetrics"]:
            for metric in sm["metrics"]:
                if metric["name"] != "otelprof.timing.duration":
                    continue
                for point in metric["histogram"]["dataPoints"]:
                    attrs = {a["key"]: a["value"] for a in point["attributes"]}
                    if attrs.get("otelprof.timing") == {"stringValue": "step"}:
                        return int(point["count"])
    return None


def test_a_tiny_cap_stops_the_metrics_file_at_the_cap_and_counts_the_dropped_exports(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cap = 12_000
    with caplog.at_level(logging.WARNING, logger="otelprof"):
        prof = _capped_run(tmp_path, cap)
    path = prof.files["metrics"]
    size = path.stat().st_size
    assert 0 < size <= cap
    lines = read_lines(path)  # every line whole
    assert lines and all(set(line) == {"resourceMetrics"} for line in lines)
    stats = prof.stats()
    assert stats[CAPPED_EXPORTS] >= 1 and stats[DROPPED] >= stats[CAPPED_EXPORTS]
    assert stats["files.metric_points_exported"] == len(read_points(path)) + sum(
        1
        for line in lines
        for rm in line["resourceMetrics"]
        for sm in rm["scopeMetrics"]
        for m in sm["metrics"]
        if "histogram" in m
        for _ in m["histogram"]["dataPoints"]
    )
    assert stats["dropped_total"] >= stats[DROPPED]
    messages = [r.getMessage() for r in caplog.records]
    assert any("reached its size cap" in m and str(path) in m for m in messages)
    assert any("telemetry was dropped" in m and DROPPED in m for m in messages)


def test_a_capped_metrics_file_reads_back_and_the_report_shows_the_drops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof = _capped_run(tmp_path, 12_000)
    assert prof.run_dir is not None
    warnings = WarningLog(sink=lambda _m: None)
    summary = summarize(open_run([prof.run_dir]), warnings)
    assert warnings.count == 0, warnings.messages
    assert summary.read.points > 0
    found = [f for f in problems(summary) if f.kind == "dropped"]
    assert found and DROPPED in found[0].message
    assert cli_main(["report", str(prof.run_dir)]) == 0
    assert DROPPED in capsys.readouterr().out


def test_a_compressed_metrics_file_is_capped_at_its_compressed_size(tmp_path: Path) -> None:
    cap = 6_000
    prof = _capped_run(tmp_path, cap, compress=True)
    path = prof.files["metrics"]
    assert path.name == "metrics.jsonl.gz"
    assert 0 < path.stat().st_size <= cap
    lines = read_lines(path)  # one gzip stream of whole lines
    assert len(gzip.decompress(path.read_bytes())) > cap  # the cap counted compressed bytes
    stats = prof.stats()
    assert stats[CAPPED_EXPORTS] >= 1 and stats[DROPPED] > 0, stats
    # (lines of several exports: a few fit; multi-member reading: test_no_cap_writes_every_export)
    assert stats["files.metric_points_exported"] > 0 and len(lines) >= 1
    assert prof.run_dir is not None
    warnings = WarningLog(sink=lambda _m: None)
    summarize(open_run([prof.run_dir]), warnings)
    assert warnings.count == 0, warnings.messages


def test_each_export_is_written_whole_or_dropped_whole_and_counted_by_its_points(
    tmp_path: Path,
) -> None:
    counters = ExportCounters()
    path = tmp_path / "metrics.jsonl"
    exporter, capped = _capped_exporter(path, counters, cap=None)
    exporter.export(_metrics_data(3))
    line = path.stat().st_size
    exporter.shutdown()
    capped.close()
    path.unlink()

    exporter, capped = _capped_exporter(path, counters := ExportCounters(), cap=2 * line + 10)
    results = [exporter.export(_metrics_data(3)) for _ in range(4)]
    capped.close()
    assert [r.name for r in results] == ["SUCCESS", "SUCCESS", "FAILURE", "FAILURE"]
    assert path.stat().st_size == 2 * line
    assert len(read_lines(path)) == 2
    counts = counters.snapshot()
    assert counts["files.metric_points_exported"] == 6
    assert counts[DROPPED] == 6 and counts[CAPPED_EXPORTS] == 2
    assert "files.metric_points_failed" not in counts  # a cap drop is not an export failure


def test_lines_already_in_the_file_are_kept_and_count_toward_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    earlier = b'{"resourceMetrics":[]}\n' * 40
    path.write_bytes(earlier)
    counters = ExportCounters()
    exporter, capped = _capped_exporter(path, counters, cap=len(earlier) + 50, reserve=None)
    exporter.export(_metrics_data(2))
    capped.close()  # the held export does not fit either
    assert path.read_bytes() == earlier
    assert counters.snapshot()[DROPPED] == 2


def test_the_newest_dropped_export_is_written_at_close_into_the_reserve(tmp_path: Path) -> None:
    counters = ExportCounters()
    path = tmp_path / "metrics.jsonl"
    exporter, capped = _capped_exporter(path, counters, cap=None)
    exporter.export(_metrics_data(3))
    line = path.stat().st_size
    capped.close()
    path.unlink()

    # room for 4 lines; the last 2 are kept for the final export
    exporter, capped = _capped_exporter(
        path, counters := ExportCounters(), 4 * line, reserve=2 * line
    )
    for _ in range(4):
        exporter.export(_metrics_data(3))
    exporter.export(_metrics_data(5))  # the "final" export: larger, and newest
    assert counters.snapshot()[DROPPED] == 2 * 3 + 5
    capped.close()
    lines = read_lines(path)
    assert len(lines) == 3 and path.stat().st_size <= 4 * line
    final = lines[-1]["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][0]
    assert len(final["gauge"]["dataPoints"]) == 5
    counts = counters.snapshot()
    assert counts["files.metric_points_exported"] == 2 * 3 + 5
    assert counts[DROPPED] == 2 * 3 and counts[CAPPED_EXPORTS] == 2


def test_a_run_past_its_cap_still_ends_with_its_final_timing_histograms(
    tmp_path: Path,
) -> None:
    cap = 100_000  # a quarter kept for the final export, which a ~20 KB histogram line fits
    run_dir = tmp_path / "runs" / "cap"
    run_dir.mkdir(parents=True)
    earlier = b'{"resourceMetrics":[]}\n' * (70_000 // 23)  # a file nearly at the periodic limit
    (run_dir / "metrics.jsonl").write_bytes(earlier)
    prof = _capped_run(tmp_path, cap)
    path = prof.files["metrics"]
    assert path.read_bytes().startswith(earlier) and path.stat().st_size <= cap
    stats = prof.stats()
    assert stats[DROPPED] > 0  # periodic exports past the limit
    assert _step_count(read_lines(path)[-1]) == 30  # the final export made it in
    warnings = WarningLog(sink=lambda _m: None)
    summary = summarize(open_run([run_dir]), warnings)
    assert warnings.count == 0, warnings.messages
    assert summary.step.count == 30


def test_no_cap_writes_every_export(tmp_path: Path) -> None:
    counters = ExportCounters()
    path = tmp_path / "metrics.jsonl.gz"
    exporter, capped = _capped_exporter(path, counters, cap=None, compress=True)
    for _ in range(5):
        exporter.export(_metrics_data(4))
    capped.close()
    assert len(read_lines(path)) == 5
    assert counters.snapshot()["files.metric_points_exported"] == 20


def test_max_metrics_bytes_defaults_to_one_gib_and_zero_means_no_cap() -> None:
    assert Settings.from_options(env={}).max_metrics_bytes == 1 << 30
    assert Settings.from_options(env={}, max_metrics_bytes=0).max_metrics_bytes is None
    env = {"OTELPROF_MAX_METRICS_BYTES": "5000"}
    assert Settings.from_options(env=env).max_metrics_bytes == 5000
    assert Settings.from_options(env=env, max_metrics_bytes=7).max_metrics_bytes == 7


@pytest.mark.parametrize(
    ("env", "options", "message"),
    [
        ({VAR: "-1"}, {}, f"environment variable {VAR}: must be >= 0 (0 = no cap)"),
        ({VAR: "lots"}, {}, f"environment variable {VAR}: expected an integer"),
        ({}, {"max_metrics_bytes": -5}, "option 'max_metrics_bytes': must be >= 0 (0 = no cap)"),
        ({}, {"max_metrics_bytes": True}, "option 'max_metrics_bytes': expected an integer"),
    ],
)
def test_a_bad_max_metrics_bytes_is_refused_naming_the_setting(
    env: dict[str, str], options: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        Settings.from_options(env=env, **options)
    assert message in str(raised.value)
