"""`otelprof replay`: a detached run reaches a collector with its timestamps and resources."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from otelprof.analysis.reader import WarningLog, open_run
from otelprof.analysis.replay import ReplayError, ReplayOptions, replay
from otelprof.cli import main as cli_main
from tests.otlp_files import read_points, read_spans
from tests.otlp_sink import OtlpSink
from tests.run_generators import RunSpec, write_sdk_run
from tests.services import free_port, running, start_collector, start_prometheus, wait_for


@pytest.fixture
def sink() -> Iterator[OtlpSink]:
    s = OtlpSink().start()
    yield s
    s.stop()


def _quiet() -> WarningLog:
    return WarningLog(sink=lambda _m: None)


def _all_spans(run: Path) -> list:
    return [s for f in sorted(run.glob("traces*.jsonl")) for s in read_spans(f)]


def _all_points(run: Path) -> list:
    return [p for f in sorted(run.glob("metrics*.jsonl")) for p in read_points(f)]


def _value(v: object) -> object:
    kind = v.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(v, kind) if kind else None


def test_replay_sends_every_span_and_point_with_original_ids_times_and_resources(
    tmp_path: Path, sink: OtlpSink
) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(ranks=2, steps=30))
    result = replay(open_run([run]), ReplayOptions(endpoint=sink.endpoint), _quiet())
    assert result.ok and result.failed_requests == 0
    expected = {s.span_id: s for s in _all_spans(run)}
    got = sink.spans()
    assert result.spans == len(got) == len(expected)
    for span in got:
        exp = expected[span.span_id.hex()]
        assert span.trace_id.hex() == exp.trace_id
        assert span.parent_span_id.hex() == exp.parent_span_id
        assert (span.start_time_unix_nano, span.end_time_unix_nano) == (exp.start_ns, exp.end_ns)
        assert span.name == exp.name
        assert {a.key: _value(a.value) for a in span.attributes} == exp.attributes
    # resources arrive unchanged, one per rank
    resources = {
        tuple(sorted((a.key, _value(a.value)) for a in rs.resource.attributes))
        for req in sink.trace_requests
        for rs in req.resource_spans
    }
    expected_resources = {tuple(sorted(s.resource.items())) for s in expected.values()}
    assert resources == expected_resources and len(resources) == 2
    # metric points: same values at the same timestamps
    sent = sorted(
        (m.name, dp.time_unix_nano, dp.as_double if dp.HasField("as_double") else dp.as_int)
        for req in sink.metric_requests
        for rm in req.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for dp in m.gauge.data_points
    )
    points = sorted((p.name, p.time_ns, p.value) for p in _all_points(run))
    assert sent == points and result.points == len(points)


def test_replay_merges_lines_into_requests_of_about_batch_bytes(
    tmp_path: Path, sink: OtlpSink
) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=200))
    lines = len((run / "traces.jsonl").read_text().splitlines())
    assert lines >= 4
    big = replay(open_run([run]), ReplayOptions(endpoint=sink.endpoint, signals="traces"), _quiet())
    assert big.requests == 1  # ~300 KB of spans fit in one 1 MiB request
    sink.trace_requests.clear()
    small = replay(
        open_run([run]),
        ReplayOptions(endpoint=sink.endpoint, signals="traces", batch_bytes=1),
        _quiet(),
    )
    assert small.requests == lines == len(sink.trace_requests)
    assert small.spans == big.spans


def test_replay_retries_while_the_collector_is_unavailable(tmp_path: Path, sink: OtlpSink) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=10))
    sink.refuse = True
    threading.Timer(0.6, lambda: setattr(sink, "refuse", False)).start()
    result = replay(
        open_run([run]),
        ReplayOptions(endpoint=sink.endpoint, backoff_s=0.1, retries=10),
        _quiet(),
    )
    assert result.ok and result.retries >= 1
    assert len(sink.spans()) == len(_all_spans(run))


def test_replay_to_nothing_listening_fails_fast_with_a_clear_error(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=3))
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ReplayError, match=f"no OTLP gRPC server answered at {endpoint}"):
        replay(open_run([run]), ReplayOptions(endpoint=endpoint, timeout_s=1.0), _quiet())
    assert time.monotonic() - started < 5


def test_shift_to_now_moves_every_timestamp_by_one_offset(tmp_path: Path, sink: OtlpSink) -> None:
    two_hours_ago = time.time_ns() - 7200 * 10**9
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=10, t0_ns=two_hours_ago))
    result = replay(
        open_run([run]), ReplayOptions(endpoint=sink.endpoint, shift_to_now=True), _quiet()
    )
    assert 7190e9 < result.shift_ns < 7300e9
    expected = {s.span_id: s for s in _all_spans(run)}
    for span in sink.spans():
        exp = expected[span.span_id.hex()]
        assert span.start_time_unix_nano == exp.start_ns + result.shift_ns
        assert span.end_time_unix_nano == exp.end_ns + result.shift_ns
    newest = max(
        dp.time_unix_nano
        for req in sink.metric_requests
        for rm in req.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for dp in m.gauge.data_points
    )
    assert abs(newest - time.time_ns()) < 30e9


def test_replay_skips_corrupt_lines_with_warnings_and_sends_the_rest(
    tmp_path: Path, sink: OtlpSink, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=10))
    intact = len(_all_spans(run))
    with (run / "traces.jsonl").open("a") as f:
        f.write('{"resourceSpans": [oops]}\n{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId"')
    assert cli_main(["replay", str(run), "--endpoint", sink.endpoint]) == 0
    captured = capsys.readouterr()
    assert "traces.jsonl:2: corrupt line skipped" in captured.err
    assert "traces.jsonl:3: truncated last line skipped" in captured.err
    assert f"{intact:,} spans" in captured.out and "2 bad lines skipped" in captured.out
    assert len(sink.spans()) == intact


@pytest.mark.e2e
def test_replay_into_the_real_collector_lands_in_prometheus_and_the_trace_exporter(
    tmp_path: Path,
) -> None:
    """An old run (2 h ago): spans keep their times in the trace exporter (what Tempo gets),
    timing histograms and the latest gauge values appear in Prometheus."""
    two_hours_ago = time.time_ns() - 7200 * 10**9
    run = write_sdk_run(tmp_path / "run", RunSpec(ranks=2, steps=40, gpus=1, t0_ns=two_hours_ago))
    collector = start_collector(
        tmp_path / "otelcol",
        traces_exporters=["span_metrics", "file/traces"],
        metrics_exporters=["prometheus"],
    )
    with running(collector):
        prom = start_prometheus(tmp_path / "prom", collector=collector)
        with running(prom):
            assert cli_main(["replay", str(run), "--endpoint", collector.otlp_endpoint]) == 0
            # the trace exporter (the collector's file/traces, standing in for Tempo)
            out = collector.debug_dir / "traces.jsonl"
            expected = {s.span_id: s for s in _all_spans(run)}

            def all_exported() -> bool:
                return out.exists() and len(read_spans(out)) >= len(expected)

            wait_for(all_exported, timeout_s=30, what="replayed spans in file/traces")
            exported = {s.span_id: s for s in read_spans(out)}
            assert set(exported) == set(expected)
            for span_id, exp in expected.items():
                got = exported[span_id]
                assert (got.start_ns, got.end_ns) == (exp.start_ns, exp.end_ns)
                assert got.resource["otelprof.rank"] == exp.resource["otelprof.rank"]
            # Prometheus: span_metrics counts every replayed dataloader_next, per rank
            per_rank = {
                r: sum(
                    1
                    for s in expected.values()
                    if s.name == "dataloader_next" and s.resource["otelprof.rank"] == r
                )
                for r in (0, 1)
            }
            query = 'traces_span_metrics_calls_total{span_name="dataloader_next"}'

            want = {str(r): float(n) for r, n in per_rank.items()}
            seen: list[dict[str, float]] = []

            def counted() -> bool:
                samples = prom.query(query)
                seen.append({s["metric"]["otelprof_rank"]: float(s["value"][1]) for s in samples})
                return seen[-1] == want

            wait_for(
                counted, timeout_s=60, what=f"{query} == {want}", on_timeout=lambda: str(seen[-1:])
            )
            # the latest GPU utilization of the run is the value Prometheus shows
            points = [p for p in _all_points(run) if p.name == "hw.gpu.utilization"]
            last = max(points, key=lambda p: p.time_ns)
            samples = prom.wait_for_series('hw_gpu_utilization_ratio{host_name="node0"}')
            assert float(samples[0]["value"][1]) == pytest.approx(last.value)


@pytest.mark.e2e
def test_remote_write_keeps_every_sample_of_a_shifted_run_and_refuses_an_old_one(
    tmp_path: Path,
) -> None:
    """The documented Prometheus limit: once its head is at "now", samples 2 h old are
    refused; with --shift-to-now every sample of the run lands, with its own spacing."""
    two_hours_ago = time.time_ns() - 7200 * 10**9
    spec = {"steps": 60, "t0_ns": two_hours_ago, "metric_interval_s": 0.25}
    new = write_sdk_run(tmp_path / "new", RunSpec(service="shifted", **spec))  # type: ignore[arg-type]
    old = write_sdk_run(tmp_path / "old", RunSpec(service="old", **spec))  # type: ignore[arg-type]
    prom = start_prometheus(tmp_path / "prom", scrape_targets={})
    with running(prom):
        collector = start_collector(
            tmp_path / "otelcol",
            traces_exporters=["span_metrics"],
            metrics_exporters=["prometheus_remote_write"],
            extra_env={"OTELCOL_REMOTE_WRITE_URL": prom.remote_write_url},
        )
        with running(collector):
            endpoint = collector.otlp_endpoint
            assert cli_main(["replay", str(new), "--endpoint", endpoint, "--shift-to-now"]) == 0
            points = [p for p in _all_points(new) if p.name == "system.cpu.utilization"]
            query = 'count_over_time(system_cpu_utilization_ratio{job="shifted"}[1h])'

            def landed() -> float | None:
                values = prom.values(query)
                return values[0] if values and values[0] >= len(points) else None

            assert wait_for(landed, timeout_s=60, what=query) == len(points)
            assert cli_main(["replay", str(old), "--endpoint", endpoint]) == 0
            time.sleep(3)  # the collector's batch + remote-write round trip
            assert prom.query('count_over_time(system_cpu_utilization_ratio{job="old"}[3h])') == []
            assert "out of bounds" in collector.log_text()


def test_the_report_and_replay_count_a_runs_metric_points_alike(
    tmp_path: Path, sink: OtlpSink, capsys: pytest.CaptureFixture[str]
) -> None:
    """Gauges, counters and the timing histograms: every data point the run exported (its
    own count), as the test's own reading of the files counts them; the closing record is
    the run's end, no telemetry."""
    import json

    import otelprof

    with otelprof.instrument(output_dir=tmp_path, run_id="run", interval=0.2):
        for _ in range(20):
            with otelprof.timing("train_batch"):
                time.sleep(0.01)
            otelprof.step()
    run = tmp_path / "run"
    in_files = 0
    kinds = set()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        for rm in json.loads(line)["resourceMetrics"]:
            for sm in rm["scopeMetrics"]:
                for metric in sm["metrics"]:
                    if metric["name"] == "otelprof.run.end":
                        continue
                    for kind in ("gauge", "sum", "histogram"):
                        if kind in metric:
                            kinds.add(kind)
                            in_files += len(metric[kind]["dataPoints"])
    assert kinds == {"gauge", "sum", "histogram"}
    sent = replay(open_run([run]), ReplayOptions(endpoint=sink.endpoint), _quiet())
    assert cli_main(["report", "--json", str(run)]) == 0
    reported = json.loads(capsys.readouterr().out)["run"]["metric_points"]
    exported = json.loads((run / "run.json").read_text())["stats"]["files.metric_points_exported"]
    assert reported == sent.points == in_files == exported
