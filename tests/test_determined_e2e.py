"""End to end: an instrumented training loop → (collector →) bridge → Determined contract.

The loop is real `otelprof.instrument()` with Determined's task environment, so host
metrics and timing spans are otelprof's own. This machine has no GPU, so the GPU gauges come
from a second OpenTelemetry SDK process-alike with the same resource (the design brief's names and
units); everything else is what otelprof measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

import otelprof
from otelprof.determined.client import Credentials, DeterminedClient
from otelprof.determined.mapping import timing_name
from otelprof.determined.pipeline import Pipeline
from otelprof.determined.server import BridgeServer
from otelprof.determined.spool import DiskSpool
from tests.determined_contract import (
    DeterminedContractServer,
    available_series,
    profiler_metrics,
    trial_metrics,
)
from tests.determined_feed import BRIDGE_TOKEN, OTLP_HEADERS_ENV, bridge_tokens
from tests.services import Collector

AGENT = "agent-e2e"
GPUS = {"GPU-aaaaaaaa-0000-0000-0000-000000000001": 0.75,
        "GPU-aaaaaaaa-0000-0000-0000-000000000002": 0.5}  # fmt: skip
TIMINGS = ("dataloader_next", "to_device", "train_batch", "step_lr_schedulers",
           "from_device", "reduce_metrics")  # fmt: skip
STEPS = 30


@pytest.fixture
def master() -> Iterator[DeterminedContractServer]:
    server = DeterminedContractServer().start()
    server.token = server.add_user("alice")  # type: ignore[attr-defined]
    server.add_trial(42, run_id=3, experiment_id=7, editors=("alice",))
    yield server
    server.stop()


@pytest.fixture
def bridge(master: DeterminedContractServer, tmp_path: Path) -> Iterator[BridgeServer]:
    client = DeterminedClient(master.url, Credentials(user_token=master.token))  # type: ignore[attr-defined]
    pipeline = Pipeline(client, DiskSpool(tmp_path / "spool"), window_s=1.0, retry_max_s=0.5)
    server = BridgeServer(pipeline, "127.0.0.1:0", tokens=bridge_tokens())
    server.start()
    yield server
    server.stop(grace_s=0.5, drain_timeout_s=2.0)


@pytest.fixture
def determined_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # run 3 of the trial, restarted from scratch (no checkpoint): DET_STEPS_COMPLETED=0
    for name, value in {"DET_EXPERIMENT_ID": "7", "DET_TRIAL_ID": "42", "DET_TRIAL_RUN_ID": "3",
                        "DET_AGENT_ID": AGENT, "DET_STEPS_COMPLETED": "0",
                        "OTEL_EXPORTER_OTLP_HEADERS": OTLP_HEADERS_ENV}.items():  # fmt: skip
        monkeypatch.setenv(name, value)


def _training_loop(endpoint: str) -> None:
    with otelprof.instrument(endpoint=endpoint, interval=0.25, service_name="train"):
        for _ in range(STEPS):
            for name in TIMINGS:
                with otelprof.timing(name):
                    time.sleep(0.002)
            otelprof.step()
        time.sleep(0.6)  # a few more gauge collections


def _gpu_gauges(endpoint: str) -> None:
    """The GPU half of the seed metrics, as otelprof's NVML gauges would send them."""
    resource = Resource.create({"service.name": "train", "host.name": "vm-e2e",
                                "determined.trial.id": 42, "determined.trial.run_id": 3,
                                "determined.agent.id": AGENT})  # fmt: skip

    def gauge(kind: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def cb(_o: CallbackOptions) -> Iterable[Observation]:
            for i, (uuid, util) in enumerate(GPUS.items()):
                value = util if kind == "util" else 2**30 * (i + 1)
                yield Observation(value, {"hw.id": uuid, "gpu.index": i})

        return cb

    exporter = OTLPMetricExporter(endpoint=endpoint, insecure=True)
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=200)
    provider = MeterProvider(resource=resource, metric_readers=[reader])
    meter = provider.get_meter("gpu")
    meter.create_observable_gauge("hw.gpu.utilization", [gauge("util")], unit="1")
    meter.create_observable_gauge("hw.gpu.memory.free", [gauge("free")], unit="By")
    time.sleep(0.5)
    provider.shutdown()


def _wait(predicate: Callable[[], bool], timeout_s: float = 300.0) -> None:  # generous
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the master to receive reports")
        time.sleep(0.2)


def _counts(report: dict[str, Any]) -> dict[str, int]:
    """Calls per timing: in the report's batch metrics, not charted by the Metrics tab."""
    batch = report["metrics"]["batch_metrics"] or [{}]
    return dict(batch[0])


def _check_master(master: DeterminedContractServer) -> None:
    token = master.token  # type: ignore[attr-defined]

    def timing_count() -> int:
        reports = trial_metrics(master.url, token, 42, "timings")
        return sum(_counts(r).get("batch_train_count", 0) for r in reports)

    _wait(lambda: timing_count() >= STEPS and len(available_series(master.url, token, 42)) >= 11)
    series = {(x["name"], x["agentId"], x.get("gpuUuid", "")) for x in
              available_series(master.url, token, 42)}  # fmt: skip
    expected = {(name, AGENT, uuid) for uuid in GPUS for name in ("gpu_util", "gpu_free_memory")}
    expected |= {(name, AGENT, "") for name in ("cpu_util_simple", "memory_free", "disk_iops",
                 "disk_throughput_read", "disk_throughput_write", "net_throughput_sent",
                 "net_throughput_recv")}  # fmt: skip
    assert series == expected
    for uuid, util in GPUS.items():
        values = [v for b in profiler_metrics(master.url, token, 42, "gpu_util", AGENT, uuid)
                  for v in b["values"]]  # fmt: skip
        assert values and all(v == util * 100 for v in values)
    cpu = [v for b in profiler_metrics(master.url, token, 42, "cpu_util_simple", AGENT)
           for v in b["values"]]  # fmt: skip
    assert cpu and all(0 <= v <= 100 for v in cpu)
    free = [v for b in profiler_metrics(master.url, token, 42, "memory_free", AGENT)
            for v in b["values"]]  # fmt: skip
    assert free and all(v > 2**20 for v in free)  # bytes, not GB

    reports = trial_metrics(master.url, token, 42, "timings")
    steps = [r["totalBatches"] for r in reports]
    assert steps == sorted(set(steps)) and steps[-1] >= STEPS
    assert all(r["trialRunId"] == 3 for r in reports)
    for name in TIMINGS:
        key = timing_name(name)
        total = sum(_counts(r).get(f"{key}_count", 0) for r in reports)
        assert total == STEPS, name
        means = [r["metrics"]["avg_metrics"][f"{key}_s"] for r in reports
                 if f"{key}_s" in r["metrics"]["avg_metrics"]]  # fmt: skip
        assert all(0.001 < m < 0.5 for m in means), (name, means)
    assert master.refusals() == []


@pytest.mark.e2e
def test_training_loop_to_bridge_to_determined(
    master: DeterminedContractServer, bridge: BridgeServer, determined_env: None
) -> None:
    endpoint = f"http://127.0.0.1:{bridge.port}"
    _gpu_gauges(endpoint)
    _training_loop(endpoint)
    _check_master(master)


@pytest.mark.e2e
def test_training_loop_through_the_collector_to_determined(
    master: DeterminedContractServer,
    bridge: BridgeServer,
    determined_env: None,
    collector_factory: Callable[..., Collector],
) -> None:
    collector = collector_factory(
        traces_exporters=["span_metrics", "otlp_grpc/determined"],
        metrics_exporters=["prometheus", "otlp_grpc/determined"],
        extra_env={
            "OTELCOL_DETERMINED_BRIDGE_ENDPOINT": f"127.0.0.1:{bridge.port}",
            "OTELCOL_DETERMINED_BRIDGE_TOKEN": BRIDGE_TOKEN,
        },
    )
    _gpu_gauges(collector.otlp_endpoint)
    _training_loop(collector.otlp_endpoint)
    _check_master(master)
    # The collector's own span-metric histograms reach the bridge too; they are not
    # Determined keys and are ignored, not refused.
    assert bridge.pipeline.rejected_points == 0
