"""Determined's timings group comes from otelprof's duration histograms: exact under sampling.

Traces are sampled (trace_budget), so spans cover some steps only; the `timings` report
must still give every step's mean and call count, and never count a range twice when a
trial's spans and histograms both arrive.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof.determined.aggregate import WindowAggregator
from otelprof.determined.client import Credentials, DeterminedClient
from otelprof.determined.mapping import HistogramPoint, TimingSample
from otelprof.determined.pipeline import Pipeline
from otelprof.determined.server import BridgeServer
from otelprof.determined.spool import DiskSpool
from tests.determined_contract import DeterminedContractServer, set_trial_env, trial_metrics
from tests.determined_feed import OTLP_HEADERS_ENV, bridge_tokens

TRAIN_STEPS = 3000
VALIDATION_BATCHES = 40


@pytest.fixture
def master() -> Iterator[DeterminedContractServer]:
    server = DeterminedContractServer().start()
    server.token = server.add_user("alice")  # type: ignore[attr-defined]
    server.add_trial(42, run_id=1, editors=("alice",))
    yield server
    server.stop()


def _timed(record: dict[str, list[list[int]]], key: str, name: str, sleep_s: float) -> None:
    """One otelprof range, also timed here inside it and outside it on the same clock: its
    duration lies between the two, whatever the machine's load puts around its enter/exit."""
    outer = time.perf_counter_ns()
    with otelprof.timing(name):
        inner = time.perf_counter_ns()
        if sleep_s:
            time.sleep(sleep_s)
        inner = time.perf_counter_ns() - inner
    outer = time.perf_counter_ns() - outer
    record.setdefault(key, [[], []])
    record[key][0].append(inner)
    record[key][1].append(outer)


def test_timings_report_counts_every_step_when_most_traces_are_sampled_out(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_trial_env(monkeypatch, master)
    mine: dict[str, list[list[int]]] = {}
    with otelprof.instrument(
        determined=True, detached=False, interval=0.2, trace_budget=0,
        host_metrics=False, process_metrics=False,
    ) as prof:  # fmt: skip
        for i in range(TRAIN_STEPS):
            _timed(mine, "dataloader_next", "dataloader_next", 0.0)
            _timed(mine, "forward", "forward", 0.0002 if i % 7 else 0.0006)
            otelprof.step()
            if i == TRAIN_STEPS // 2:
                with otelprof.phase("validation"):
                    for _ in range(VALIDATION_BATCHES):
                        _timed(mine, "forward_validation", "forward", 0.0001)
                        otelprof.step()
        time.sleep(0.6)  # a few metric exports after the last step
    # read once shutdown has decided every step (the builder thread may lag far behind the
    # training loop on a busy machine): the burst budget keeps 5,500 of 3 x TRAIN_STEPS spans
    sampled_out = prof.stats()["timings.spans_sampled_out"]
    assert sampled_out > TRAIN_STEPS  # most steps' traces were not kept...

    rows = trial_metrics(master.url, master.token, 42, "timings")  # type: ignore[attr-defined]
    assert rows
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    steps = []
    for row in rows:
        steps.append(row["totalBatches"])
        batch = row["metrics"]["batch_metrics"][0]
        for key, value in row["metrics"]["avg_metrics"].items():
            if key.endswith("_s"):
                n = batch[f"{key[:-2]}_count"]
                totals[key[:-2]] = totals.get(key[:-2], 0.0) + value * n
                counts[key[:-2]] = counts.get(key[:-2], 0) + n
    # ...yet the reports count every call, each once, and the last report says all steps
    assert counts["dataloader_next"] == TRAIN_STEPS
    assert counts["forward"] == TRAIN_STEPS
    assert counts["forward_validation"] == VALIDATION_BATCHES
    assert counts["step"] == TRAIN_STEPS
    assert counts["phase_validation"] == VALIDATION_BATCHES
    assert steps == sorted(steps) and steps[-1] == TRAIN_STEPS
    # the means over all reports lie between the means of every call timed here inside and
    # outside otelprof's range, independently (the reports' floats: a part in a million)
    for key in ("forward", "forward_validation", "dataloader_next"):
        inner, outer = (sum(times) / len(times) / 1e9 for times in mine[key])
        got = totals[key] / counts[key]
        assert inner * 0.999999 <= got <= outer * 1.000001, key
        if key != "dataloader_next":  # a sleep: what was timed is the sleep
            assert got == pytest.approx(inner, rel=0.15), key
    assert prof.stats()["dropped_total"] == 0


def test_bridge_timings_count_every_step_of_a_sampled_otlp_run(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name, value in {
        "DET_TRIAL_ID": "42",
        "DET_TRIAL_RUN_ID": "1",
        "DET_AGENT_ID": "a1",
        "OTEL_EXPORTER_OTLP_HEADERS": OTLP_HEADERS_ENV,
    }.items():
        monkeypatch.setenv(name, value)
    client = DeterminedClient(master.url, Credentials(user_token=master.token))  # type: ignore[attr-defined]
    pipeline = Pipeline(client, DiskSpool(tmp_path / "spool"), window_s=1.0, retry_max_s=0.5)
    bridge = BridgeServer(pipeline, "127.0.0.1:0", tokens=bridge_tokens())
    bridge.start()
    try:
        with otelprof.instrument(
            endpoint=f"http://127.0.0.1:{bridge.port}", detached=False, interval=0.25,
            trace_budget=0, host_metrics=False, process_metrics=False,
        ) as prof:  # fmt: skip
            for _ in range(TRAIN_STEPS):
                with otelprof.timing("dataloader_next"):
                    pass
                with otelprof.timing("forward"):
                    pass
                otelprof.step()
            time.sleep(0.6)
        # once shutdown has decided every step (see the test above)
        assert prof.stats()["timings.spans_sampled_out"] > TRAIN_STEPS
        deadline = time.monotonic() + 120  # generous: reports arrive in ~1 s windows
        while True:
            rows = trial_metrics(master.url, master.token, 42, "timings")  # type: ignore[attr-defined]
            forward = sum(r["metrics"]["batch_metrics"][0].get("forward_count", 0) for r in rows)
            if forward >= TRAIN_STEPS or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        bridge.stop(grace_s=0.5, drain_timeout_s=2.0)
    assert forward == TRAIN_STEPS  # every call, each once: not the kept spans' count
    assert rows[-1]["totalBatches"] == TRAIN_STEPS


def _hist(
    name: str, calls: int, total: float, *, start: int = 1, step: bool = False,
    cumulative: bool = True, series: str = "p1",
) -> HistogramPoint:  # fmt: skip
    return HistogramPoint(
        7, 1, f"{series}/{name}", name, calls, total, start, 10**18, cumulative, step
    )


def _span(name: str, calls: int, total: float, max_step: int) -> TimingSample:
    return TimingSample(7, 1, name, total, calls, max_step, 10**18)


def _report(agg: WindowAggregator) -> dict[str, Any]:
    (report,) = agg.drain()
    metrics = report.body["metrics"]
    out: dict[str, Any] = {"steps": metrics["stepsCompleted"]}
    out.update(metrics["metrics"]["avgMetrics"])
    out.update(metrics["metrics"]["batchMetrics"][0])
    return out


def test_spans_and_histograms_of_one_trial_are_counted_once_and_cumulative_points_differenced() -> (
    None
):
    agg = WindowAggregator()
    # window 1: kept spans of steps 0-1 and the cumulative histograms of steps 0-9
    agg.add_timings([_span("forward", 2, 0.2, 1), _span("step", 2, 0.4, 1)])
    agg.add_timings(
        agg.histogram_deltas(
            [_hist("forward", 10, 1.5), _hist("step", 10, 3.0, step=True)]
        )
    )  # fmt: skip
    agg.add_timings([_span("forward", 1, 0.1, 9)])  # a later kept span: steps only
    first = _report(agg)
    assert first == {
        "steps": 10, "forward_s": 0.15, "step_s": 0.3, "forward_count": 10, "step_count": 10,
    }  # fmt: skip
    # window 2: the next cumulative points give only what is new
    agg.add_timings(
        agg.histogram_deltas([_hist("forward", 30, 5.5), _hist("step", 30, 9.0, step=True)])
    )
    second = _report(agg)
    assert second["steps"] == 30
    assert second["forward_count"] == 20 and second["forward_s"] == pytest.approx(0.2)
    assert second["step_count"] == 20 and second["step_s"] == pytest.approx(0.3)
    # a restarted producer (new start time) is counted from its new start
    restarted = [_hist("forward", 3, 0.3, start=2), _hist("step", 40, 12.0, step=True)]
    agg.add_timings(agg.histogram_deltas(restarted))
    third = _report(agg)
    assert third["forward_count"] == 3 and third["forward_s"] == pytest.approx(0.1)


def test_delta_histogram_points_are_added_as_they_come() -> None:
    agg = WindowAggregator()
    agg.add_timings([_span("step", 1, 1.0, 4)])  # the step count still comes from spans
    for _ in range(3):
        agg.add_timings(agg.histogram_deltas([_hist("forward", 5, 0.5, cumulative=False)]))
    report = _report(agg)
    assert report["forward_count"] == 15 and report["forward_s"] == pytest.approx(0.1)
    assert "step_count" not in report  # the step's span was a sample, not the figure
    assert report["steps"] == 5


def test_first_histograms_after_span_reports_are_a_baseline_never_a_double_count() -> None:
    agg = WindowAggregator()
    agg.add_timings([_span("forward", 4, 0.4, 3)])  # a producer seen through spans first
    assert _report(agg)["forward_count"] == 4
    # its histograms since process start also hold those 4 calls: only a baseline
    agg.add_timings(
        agg.histogram_deltas([_hist("forward", 4, 0.4), _hist("step", 4, 1.0, step=True)])
    )
    assert agg.drain() == []
    agg.add_timings(
        agg.histogram_deltas([_hist("forward", 9, 0.9), _hist("step", 9, 2.0, step=True)])
    )
    report = _report(agg)
    assert report["forward_count"] == 5 and report["steps"] == 9
    # a timing first seen later in a followed trial is counted in full
    agg.add_timings(
        agg.histogram_deltas([_hist("backward", 6, 0.6), _hist("step", 12, 3.0, step=True)])
    )
    assert _report(agg)["backward_count"] == 6


def test_a_series_starting_after_span_reports_counts_only_the_calls_they_did_not() -> None:
    # what a busy machine produced: the first window closed on spans alone, the first
    # histogram export held only the step's series, the forward series came at the end
    agg = WindowAggregator()
    agg.add_timings([_span("forward", 43, 4.3, 42), _span("step", 42, 8.4, 41)])
    assert _report(agg)["forward_count"] == 43
    agg.add_timings(agg.histogram_deltas([_hist("step", 148, 29.6, step=True)]))
    assert _report(agg)["step_count"] == 148 - 42
    agg.add_timings(
        agg.histogram_deltas([_hist("forward", 3000, 300.0), _hist("step", 3000, 600.0, step=True)])
    )
    last = _report(agg)
    assert last["forward_count"] == 3000 - 43  # 3,000 calls in all, none counted twice
    assert last["forward_s"] == pytest.approx((300.0 - 4.3) / (3000 - 43))
    assert last["step_count"] == 3000 - 148


def test_a_trial_without_histograms_keeps_its_timings_from_spans() -> None:
    agg = WindowAggregator()
    agg.add_timings([_span("forward", 3, 0.3, 2)])
    report = _report(agg)
    assert report == {"steps": 3, "forward_s": pytest.approx(0.1), "forward_count": 3}


def _histogram_request(rank: int, unit: str = "s") -> Any:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    def kv(key: str, value: object) -> KeyValue:
        if isinstance(value, int):
            return KeyValue(key=key, value=AnyValue(int_value=value))
        return KeyValue(key=key, value=AnyValue(string_value=str(value)))

    request = ExportMetricsServiceRequest()
    rm = request.resource_metrics.add()
    for key, value in {"determined.trial.id": 7, "determined.trial.run_id": 1,
                       "host.name": "h", "otelprof.rank": rank}.items():  # fmt: skip
        rm.resource.attributes.append(kv(key, value))
    metric = rm.scope_metrics.add().metrics.add()
    metric.name, metric.unit = "otelprof.timing.duration", unit
    metric.histogram.aggregation_temporality = 2  # cumulative
    point = metric.histogram.data_points.add()
    point.count, point.sum, point.start_time_unix_nano, point.time_unix_nano = 4, 0.4, 1, 2
    point.attributes.extend([kv("otelprof.timing", "forward"), kv("otelprof.phase", "validation")])
    return request


def test_histogram_points_map_to_phase_keys_from_rank_0_only_and_need_seconds() -> None:
    from otelprof.determined.mapping import Route, extract_metrics

    (point,) = extract_metrics(_histogram_request(0), Route()).histograms
    assert (point.name, point.calls, point.sum_s, point.cumulative) == (
        "forward_validation", 4, 0.4, True,
    )  # fmt: skip
    other_rank = extract_metrics(_histogram_request(1), Route())
    assert other_rank.histograms == [] and other_rank.ignored == 1
    wrong_unit = extract_metrics(_histogram_request(0, unit="ms"), Route())
    assert wrong_unit.histograms == [] and wrong_unit.rejected == 1
    assert "unit 'ms'" in wrong_unit.errors[0]
