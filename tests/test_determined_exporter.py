"""The in-process Determined exporters (no collector): SDK → same mapping → master."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import pytest
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import otelprof
from otelprof.determined.client import ConfigError, Credentials
from otelprof.export.determined import DeterminedMetricExporter, build_pipeline
from tests.determined_contract import (
    DeterminedContractServer,
    available_series,
    set_trial_env,
    trial_metrics,
)
from tests.determined_feed import trial_resource

GPU = "GPU-11111111-aaaa-bbbb-cccc-000000000000"


@pytest.fixture
def master() -> Iterator[DeterminedContractServer]:
    server = DeterminedContractServer().start()
    server.token = server.add_user("alice")  # type: ignore[attr-defined]
    server.add_trial(42, run_id=1, editors=("alice",))
    yield server
    server.stop()


def _gauges(meter_provider: MeterProvider) -> None:
    meter = meter_provider.get_meter("test")

    def one(value: float, attrs: dict[str, object] | None = None):  # type: ignore[no-untyped-def]
        def cb(_o: CallbackOptions) -> Iterable[Observation]:
            yield Observation(value, attrs or {})

        return cb

    def gpu(value: float):  # type: ignore[no-untyped-def]
        def cb(_o: CallbackOptions) -> Iterable[Observation]:
            yield Observation(value, {"hw.id": GPU, "gpu.index": 0})

        return cb

    def directions(attr: str, a: str, b: str, va: float, vb: float):  # type: ignore[no-untyped-def]
        def cb(_o: CallbackOptions) -> Iterable[Observation]:
            yield Observation(va, {attr: a})
            yield Observation(vb, {attr: b})

        return cb

    meter.create_observable_gauge("hw.gpu.utilization", [gpu(0.5)], unit="1")
    meter.create_observable_gauge("hw.gpu.memory.free", [gpu(1e9)], unit="By")
    meter.create_observable_gauge("system.cpu.utilization", [one(0.25)], unit="1")
    meter.create_observable_gauge("system.memory.linux.available", [one(2e9)], unit="By")
    meter.create_observable_gauge(
        "system.network.throughput",
        [directions("network.io.direction", "transmit", "receive", 10.0, 20.0)],
        unit="By/s",
    )
    meter.create_observable_gauge(
        "system.disk.iops",
        [directions("disk.io.direction", "read", "write", 3.0, 4.0)],
        unit="{operation}/s",
    )
    meter.create_observable_gauge(
        "system.disk.throughput",
        [directions("disk.io.direction", "read", "write", 5.0, 6.0)],
        unit="By/s",
    )


def _run(master: DeterminedContractServer, resource: dict[str, object]) -> None:
    exporter = DeterminedMetricExporter(
        master=master.url,
        credentials=Credentials(user_token=master.token),  # type: ignore[attr-defined]
        report_interval_s=3600,
        env={},
    )
    res = Resource.create(resource)  # type: ignore[arg-type]
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    meters = MeterProvider(resource=res, metric_readers=[reader])
    _gauges(meters)
    tracer_provider = TracerProvider(resource=res)
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter.span_exporter()))
    tracer = tracer_provider.get_tracer("t")
    for step in range(4):
        attrs = {"otelprof.step": step}
        with (
            tracer.start_as_current_span("step", attributes=attrs),
            tracer.start_as_current_span("train_batch", attributes=attrs),
        ):
            time.sleep(0.002)
    reader.collect()
    assert exporter.force_flush(10_000)
    tracer_provider.shutdown()
    meters.shutdown()


def test_in_process_exporter_posts_the_same_reports_as_the_bridge(
    master: DeterminedContractServer,
) -> None:
    _run(master, trial_resource(42))
    labels = available_series(master.url, master.token, 42)  # type: ignore[attr-defined]
    assert {(x["name"], x.get("gpuUuid", "")) for x in labels} == {
        ("gpu_util", GPU), ("gpu_free_memory", GPU), ("cpu_util_simple", ""),
        ("memory_free", ""), ("disk_iops", ""), ("disk_throughput_read", ""),
        ("disk_throughput_write", ""), ("net_throughput_sent", ""), ("net_throughput_recv", ""),
    }  # fmt: skip
    disk = next(p.body for p in master.posts() if p.group == "disk")
    assert disk["metrics"]["metrics"]["avgMetrics"]["agent-1"]["disk_iops"] == 7.0
    timings = trial_metrics(master.url, master.token, 42, "timings")  # type: ignore[attr-defined]
    assert len(timings) == 1 and timings[0]["totalBatches"] == 4
    assert timings[0]["metrics"]["batch_metrics"][0]["batch_train_count"] == 4
    assert timings[0]["metrics"]["batch_metrics"][0]["step_count"] == 4
    assert set(timings[0]["metrics"]["avg_metrics"]) == {"batch_train_s", "step_s"}


def test_only_local_rank_0_reports_hardware_and_only_rank_0_timings(
    master: DeterminedContractServer,
) -> None:
    _run(master, trial_resource(42, **{"otelprof.rank": 1, "otelprof.local_rank": 1}))
    assert master.posts() == []
    _run(master, trial_resource(42, **{"otelprof.rank": 1, "otelprof.local_rank": 0}))
    assert {p.group for p in master.posts()} == {"gpu", "cpu", "memory", "disk", "network"}


def test_exporter_reads_the_determined_task_environment(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DET_MASTER", master.url)
    monkeypatch.setenv("DET_SESSION_TOKEN", master.add_allocation_token("alice"))
    exporter = DeterminedMetricExporter.from_environment(report_interval_s=3600)
    try:
        assert exporter.pipeline.client.master == master.url
    finally:
        exporter.shutdown()


def test_missing_master_or_credentials_is_a_clear_config_error() -> None:
    with pytest.raises(otelprof.ConfigError, match="no master"):
        build_pipeline(env={})
    with pytest.raises(ConfigError, match="no credentials"):
        build_pipeline(env={"DET_MASTER": "http://127.0.0.1:1"})


def test_instrument_with_determined_posts_real_hardware_and_timings_from_the_process(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    set_trial_env(monkeypatch, master)
    with otelprof.instrument(determined=True, detached=False, interval=0.2) as prof:
        for _ in range(3):
            with otelprof.timing("train_batch"):
                time.sleep(0.01)
            otelprof.step()
        time.sleep(0.5)
    names = {x["name"] for x in available_series(master.url, master.token, 42)}  # type: ignore[attr-defined]
    assert {"cpu_util_simple", "memory_free", "disk_iops", "net_throughput_sent"} <= names
    timings = trial_metrics(master.url, master.token, 42, "timings")  # type: ignore[attr-defined]
    counts = [t["metrics"]["batch_metrics"][0] for t in timings]
    assert sum(c.get("batch_train_count", 0) for c in counts) == 3
    assert prof.stats()["dropped_total"] == 0


def test_reports_the_master_refuses_show_as_lost_in_stats_not_as_exported(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    master.restart_trial(42)  # the master is at run 2; this process still says run 1
    set_trial_env(monkeypatch, master)
    with otelprof.instrument(determined=True, detached=False, interval=0.2) as prof:
        time.sleep(0.5)
    stats = prof.stats()
    assert master.posts() == []
    assert stats["determined.reports_delivered"] == 0
    assert stats["determined.reports_failed_refused_by_master"] >= 4  # cpu, memory, disk, net
    assert stats["dropped_total"] >= stats["determined.reports_failed_refused_by_master"]


def test_reports_still_undelivered_at_shutdown_are_counted_as_dropped(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_trial_env(monkeypatch, master)
    # every report a retryable 500 until the process ends
    with (
        master.database_down(),
        otelprof.instrument(determined=True, detached=False, interval=0.2) as prof,
    ):
        time.sleep(0.5)
    stats = prof.stats()
    assert master.posts() == []
    assert stats["determined.reports_delivered"] == 0
    # cpu, memory, disk, net: each counted, as dropped, or as unconfirmed when shutdown came
    # while its post was on the wire (the master may have stored it)
    dropped = stats["determined.reports_dropped_at_shutdown"]
    assert dropped + stats["determined.reports_unconfirmed_at_shutdown"] >= 4
    assert stats["determined.reports_failed_refused_by_master"] == 0
    assert stats["dropped_total"] >= stats["determined.reports_dropped_at_shutdown"]
