"""The Determined bridge against the contract server: mapping, windows, refusals, retries."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from otelprof.determined.client import Credentials, DeterminedClient
from otelprof.determined.mapping import Route
from otelprof.determined.pipeline import Pipeline
from otelprof.determined.server import BridgeServer
from otelprof.determined.spool import DiskSpool
from tests.determined_contract import (
    DeterminedContractServer,
    available_series,
    profiler_metrics,
    trial_metrics,
)
from tests.determined_feed import (
    TIMING_NAMES,
    OtlpClient,
    SeedValues,
    bridge_tokens,
    seed_metrics_request,
    timing_spans_request,
    trial_resource,
)

GPU_A = "GPU-11111111-aaaa-bbbb-cccc-000000000000"
GPU_B = "GPU-22222222-aaaa-bbbb-cccc-000000000000"


@pytest.fixture
def master() -> Iterator[DeterminedContractServer]:
    server = DeterminedContractServer().start()
    server.token = server.add_user("alice", "s3cret")  # type: ignore[attr-defined]
    server.add_trial(42, run_id=1, experiment_id=7, editors=("alice",))
    yield server
    server.stop()


class Bridge:
    """A bridge in this process on a free port; the window closes only when told."""

    def __init__(self, master: DeterminedContractServer, tmp: Path, **kw: Any) -> None:
        creds = kw.pop("credentials", None) or Credentials(user_token=master.token)  # type: ignore[attr-defined]
        client = DeterminedClient(master.url, creds, **kw.pop("client_kw", {}))
        self.pipeline = Pipeline(
            client,
            DiskSpool(tmp / "spool"),
            window_s=kw.pop("window_s", 3600.0),
            retry_initial_s=0.05,
            retry_max_s=0.3,
            **kw,
        )
        self.server = BridgeServer(self.pipeline, "127.0.0.1:0", tokens=bridge_tokens())
        self.server.start()
        self.otlp = OtlpClient(self.server.port)

    def report_now(self, timeout_s: float = 10.0) -> int:
        produced = self.pipeline.flush()
        assert self.pipeline.wait_delivered(timeout_s), self.pipeline.stats()
        return produced

    def stop(self) -> None:
        self.otlp.close()
        self.server.stop(grace_s=0.5, drain_timeout_s=2.0)


@pytest.fixture
def bridge(master: DeterminedContractServer, tmp_path: Path) -> Iterator[Bridge]:
    b = Bridge(master, tmp_path)
    yield b
    b.stop()


def _series(master: DeterminedContractServer, trial: int = 42) -> set[tuple[str, str, str]]:
    labels = available_series(master.url, master.token, trial)  # type: ignore[attr-defined]
    return {(lab["name"], lab["agentId"], lab.get("gpuUuid", "")) for lab in labels}


def _values(master: DeterminedContractServer, name: str, agent: str, gpu: str = "") -> list[float]:
    batches = profiler_metrics(master.url, master.token, 42, name, agent, gpu)  # type: ignore[attr-defined]
    return [v for b in batches for v in b["values"]]


def test_every_seed_metric_lands_under_its_group_agent_and_gpu(
    master: DeterminedContractServer, bridge: Bridge
) -> None:
    bridge.otlp.send_metrics(seed_metrics_request(trial_resource(42, agent="agent-1")))
    assert bridge.report_now() == 5  # gpu, cpu, memory, disk, network

    assert _series(master) == {
        ("gpu_util", "agent-1", GPU_A),
        ("gpu_free_memory", "agent-1", GPU_A),
        ("gpu_util", "agent-1", GPU_B),
        ("gpu_free_memory", "agent-1", GPU_B),
        ("cpu_util_simple", "agent-1", ""),
        ("memory_free", "agent-1", ""),
        ("disk_iops", "agent-1", ""),
        ("disk_throughput_read", "agent-1", ""),
        ("disk_throughput_write", "agent-1", ""),
        ("net_throughput_sent", "agent-1", ""),
        ("net_throughput_recv", "agent-1", ""),
    }
    assert _values(master, "gpu_util", "agent-1", GPU_A) == [87.5]  # 0–1 → %
    assert _values(master, "gpu_util", "agent-1", GPU_B) == [25.0]
    assert _values(master, "gpu_free_memory", "agent-1", GPU_A) == [12884901888.0]  # bytes
    assert _values(master, "cpu_util_simple", "agent-1") == [pytest.approx(42.1, rel=1e-6)]
    assert _values(master, "memory_free", "agent-1") == [pytest.approx(101234567168.0, rel=1e-6)]
    assert _values(master, "disk_iops", "agent-1") == [120.0]  # read + write
    assert _values(master, "disk_throughput_read", "agent-1") == [1048576.0]
    assert _values(master, "disk_throughput_write", "agent-1") == [524288.0]
    assert _values(master, "net_throughput_sent", "agent-1") == [2048.0]
    assert _values(master, "net_throughput_recv", "agent-1") == [4096.0]
    # "All" GPUs for an agent: one series per UUID, as the Web UI's filter asks.
    all_gpus = profiler_metrics(master.url, master.token, 42, "gpu_util", "agent-1")  # type: ignore[attr-defined]
    assert {b["labels"]["gpuUuid"] for b in all_gpus} == {GPU_A, GPU_B}
    # Profiling groups are not generic metrics: nothing in trial_metrics.
    assert trial_metrics(master.url, master.token, 42, "gpu") == []  # type: ignore[attr-defined]
    bodies = [p.body for p in master.posts()]
    assert all(p.auth_header == "Authorization" for p in master.posts())
    assert all("stepsCompleted" not in b["metrics"] for b in bodies)


def test_report_is_the_window_mean_stamped_with_the_data_time(
    master: DeterminedContractServer, bridge: Bridge
) -> None:
    t0 = 1_760_000_000_000_000_000
    for i, cpu in enumerate((0.2, 0.4, 0.9)):
        values = SeedValues(cpu=cpu)
        bridge.otlp.send_metrics(seed_metrics_request(trial_resource(42), values, t0 + i * 10**9))
    bridge.report_now()
    cpu_posts = [p.body for p in master.posts() if p.group == "cpu"]
    assert len(cpu_posts) == 1
    assert cpu_posts[0]["metrics"]["metrics"]["avgMetrics"] == {
        "agent-1": {"cpu_util_simple": pytest.approx(50.0)}
    }
    assert cpu_posts[0]["metrics"]["reportTime"] == "2025-10-09T08:53:22.000Z"


def test_one_report_per_agent_so_each_agent_keeps_its_latest_row(
    master: DeterminedContractServer, bridge: Bridge
) -> None:
    for agent in ("agent-1", "agent-2"):
        bridge.otlp.send_metrics(seed_metrics_request(trial_resource(42, agent=agent)))
    assert bridge.report_now() == 10
    assert all(len(p.body["metrics"]["metrics"]["avgMetrics"]) == 1 for p in master.posts())
    assert {a for _n, a, _g in _series(master)} == {"agent-1", "agent-2"}


def test_agent_falls_back_to_host_name(master: DeterminedContractServer, bridge: Bridge) -> None:
    bridge.otlp.send_metrics(seed_metrics_request(trial_resource(42, agent=None)))
    bridge.report_now()
    assert {a for _n, a, _g in _series(master)} == {"host-a"}


def test_group_waits_for_its_full_key_set_then_carries_missing_keys_forward(
    master: DeterminedContractServer, bridge: Bridge
) -> None:
    request = seed_metrics_request(trial_resource(42))
    metrics = request.resource_metrics[0].scope_metrics[0].metrics
    only_util = [m for m in metrics if m.name == "hw.gpu.utilization"]
    del metrics[:]
    metrics.extend(only_util)
    bridge.otlp.send_metrics(request)  # gpu_util alone: gpu_free_memory never seen
    bridge.report_now()
    assert master.posts() == []  # no half report that would shrink the series list

    bridge.otlp.send_metrics(seed_metrics_request(trial_resource(42)))
    bridge.report_now()
    bridge.otlp.send_metrics(request)  # util only again: free memory carried from last window
    bridge.report_now()
    gpu = [p.body["metrics"]["metrics"]["avgMetrics"] for p in master.posts() if p.group == "gpu"]
    assert len(gpu) == 2
    assert gpu[1]["agent-1"][GPU_A] == {"gpu_util": 87.5, "gpu_free_memory": 12884901888.0}


WEB_UI_KEYS = {
    "dataloader_next": "dataloader_next",
    "to_device": "to_device",
    "train_batch": "batch_train",  # the Metrics tab strips a leading train_
    "step_lr_schedulers": "step_lr_schedulers",
    "from_device": "from_device",
    "reduce_metrics": "reduce_metrics",
}


def test_timings_go_to_a_generic_group_as_mean_seconds_at_steps_with_web_ui_keys(
    master: DeterminedContractServer, bridge: Bridge
) -> None:
    durations = {name: 0.01 * (i + 1) for i, name in enumerate(TIMING_NAMES)}
    bridge.otlp.send_traces(timing_spans_request(trial_resource(42), range(10), durations))
    bridge.report_now()
    bridge.otlp.send_traces(timing_spans_request(trial_resource(42), range(10, 15), durations))
    bridge.report_now()

    reports = trial_metrics(master.url, master.token, 42, "timings")  # type: ignore[attr-defined]
    assert [r["totalBatches"] for r in reports] == [10, 15]
    first = reports[0]["metrics"]["avg_metrics"]
    for i, name in enumerate(TIMING_NAMES):
        assert first[f"{WEB_UI_KEYS[name]}_s"] == pytest.approx(0.01 * (i + 1), rel=1e-6)
    assert first["step_train_s"] == pytest.approx(sum(durations.values()), rel=1e-6)
    # one chart per timing: no _count keys, nothing the UI renames
    keys = {k for r in reports for k in r["metrics"]["avg_metrics"]}
    assert keys == {f"{k}_s" for k in WEB_UI_KEYS.values()} | {"step_train_s"}
    assert all(isinstance(v, float) for r in reports for v in r["metrics"]["avg_metrics"].values())


def test_timings_without_a_new_step_wait_instead_of_colliding(
    master: DeterminedContractServer, bridge: Bridge
) -> None:
    bridge.otlp.send_traces(timing_spans_request(trial_resource(42), range(5)))
    bridge.report_now()
    # A late span of step 4 alone would repeat stepsCompleted=5: held, merged into the next.
    bridge.otlp.send_traces(timing_spans_request(trial_resource(42), [4]))
    bridge.report_now()
    bridge.otlp.send_traces(timing_spans_request(trial_resource(42), [5]))
    bridge.report_now()
    reports = trial_metrics(master.url, master.token, 42, "timings")  # type: ignore[attr-defined]
    assert [r["totalBatches"] for r in reports] == [5, 6]
    assert set(reports[1]["metrics"]["avg_metrics"]) >= {"batch_train_s", "step_train_s"}
    assert master.refusals() == []


def test_data_without_trial_id_is_refused_with_invalid_argument(bridge: Bridge) -> None:
    with pytest.raises(grpc.RpcError) as err:
        bridge.otlp.send_metrics(seed_metrics_request(trial_resource(None)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "determined.trial.id" in err.value.details()
    assert "--trial-id" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        bridge.otlp.send_traces(timing_spans_request(trial_resource(None), range(2)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_mixed_request_keeps_the_trial_data_and_reports_partial_success(
    master: DeterminedContractServer, bridge: Bridge
) -> None:
    good = seed_metrics_request(trial_resource(42))
    bad = seed_metrics_request(trial_resource(42, run_id=None))
    good.resource_metrics.extend(bad.resource_metrics)
    response = bridge.otlp.send_metrics(good)
    assert response.partial_success.rejected_data_points == 12  # every point of it
    assert "determined.trial.run_id" in response.partial_success.error_message
    assert bridge.report_now() == 5
    spans = timing_spans_request(trial_resource(42), range(2))
    bad_spans = timing_spans_request(trial_resource(42, run_id=None), range(2))
    spans.resource_spans.extend(bad_spans.resource_spans)
    answer = bridge.otlp.send_traces(spans)
    assert answer.partial_success.rejected_spans == sum(
        len(s.spans) for r in bad_spans.resource_spans for s in r.scope_spans
    )
    assert "determined.trial.run_id" in answer.partial_success.error_message


def test_data_without_ids_goes_to_the_configured_trial(
    master: DeterminedContractServer, tmp_path: Path
) -> None:
    b = Bridge(master, tmp_path, route=Route(trial_id=42, run_id=1, agent="node-9"))
    try:
        b.otlp.send_metrics(
            seed_metrics_request(trial_resource(None, agent=None, **{"host.name": ""}))
        )
        assert b.report_now() == 5
        assert {a for _n, a, _g in _series(master)} == {"node-9"}
    finally:
        b.stop()


def test_malformed_otlp_gets_invalid_argument_and_the_bridge_keeps_serving(
    master: DeterminedContractServer, bridge: Bridge
) -> None:
    raw = bridge.otlp.channel.unary_unary(
        "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
        request_serializer=None,
        response_deserializer=None,
    )
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\xff\xff\xff\xff not protobuf", timeout=5, metadata=bridge.otlp.metadata)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed OTLP ExportMetricsServiceRequest" in err.value.details()
    # A non-integer trial id is malformed too, and named.
    with pytest.raises(grpc.RpcError) as err:
        bridge.otlp.send_metrics(seed_metrics_request(trial_resource("forty-two")))  # type: ignore[arg-type]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "determined.trial.id='forty-two' is not an integer" in err.value.details()

    bridge.otlp.send_metrics(seed_metrics_request(trial_resource(42)))
    assert bridge.report_now() == 5


MALFORMED_TRIAL_IDS = ["\u00b2", "--4242", "abc", "9" * 5000, "4.5", "-7", "0", 1.5, True]


def test_every_malformed_trial_id_is_a_counted_refusal_without_a_traceback(
    bridge: Bridge, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="otelprof.determined")
    for trial in MALFORMED_TRIAL_IDS:
        with pytest.raises(grpc.RpcError) as err:
            bridge.otlp.send_traces(timing_spans_request(trial_resource(trial), range(2)))  # type: ignore[arg-type]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, trial
        details = err.value.details()
        assert "determined.trial.id=" in details and len(details) < 400, details
    stats = bridge.server.stats()
    spans = 2 * (1 + len(TIMING_NAMES))  # two steps: a step span and its timings each
    assert stats["rejected_points_bad_id"] == spans * len(MALFORMED_TRIAL_IDS), stats
    assert not [r for r in caplog.records if r.exc_info], "a refusal logged a traceback"
    assert "could not map" not in caplog.text
    bridge.otlp.send_metrics(seed_metrics_request(trial_resource(42)))  # still serving
    assert bridge.report_now() == 5


def test_refused_reports_are_logged_once_with_the_masters_message_and_not_retried(
    master: DeterminedContractServer, bridge: Bridge, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="otelprof.determined")
    for _ in range(3):  # run id 2 while the master's current run is 1
        bridge.otlp.send_metrics(seed_metrics_request(trial_resource(42, run_id=2)))
        bridge.report_now()
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    messages = {r.getMessage() for r in refused}
    # one line for this kind of refusal, not one per report or per group
    assert len(refused) == 1, messages
    assert all("invalid run id, 2 (reported) != 1 (expected)" in m for m in messages)
    stats = bridge.pipeline.stats()
    assert stats["refused_by_master"] == 15
    assert stats["pending"] == 0
    assert len(master.refusals()) == 15  # each tried exactly once


def test_transient_5xx_is_retried_until_delivered_in_order(
    master: DeterminedContractServer, bridge: Bridge
) -> None:
    master.fail_next(4, status=503)
    bridge.otlp.send_traces(timing_spans_request(trial_resource(42), range(3)))
    bridge.otlp.send_metrics(seed_metrics_request(trial_resource(42)))
    bridge.report_now()
    assert bridge.pipeline.stats()["retries"] == 4
    # each group (a delivery lane) in order; groups do not wait for each other
    assert sorted(p.group for p in master.posts()) == sorted(
        ["gpu", "cpu", "memory", "disk", "network", "timings"]
    )


def test_unknown_trial_is_refused_not_retried_while_any_user_may_report_to_any_trial(
    master: DeterminedContractServer, bridge: Bridge
) -> None:
    master.add_trial(43, run_id=1, experiment_id=8, editors=("bob",))
    bridge.otlp.send_metrics(seed_metrics_request(trial_resource(43)))
    bridge.otlp.send_metrics(seed_metrics_request(trial_resource(44)))
    bridge.report_now()
    # open-source Determined: any logged-in user may report to any trial (reference §0)
    assert {p.trial_id for p in master.posts()} == {43}
    assert {status for status, _ in master.refusals()} == {404}
    assert len(master.refusals()) == 5  # each tried once
    assert bridge.pipeline.stats()["pending"] == 0
    assert bridge.pipeline.stats()["refused_kept"] == 5


def test_window_timer_reports_without_being_asked(
    master: DeterminedContractServer, tmp_path: Path
) -> None:
    b = Bridge(master, tmp_path, window_s=0.2)
    try:
        b.otlp.send_metrics(seed_metrics_request(trial_resource(42)))
        deadline = time.monotonic() + 10
        while len(master.posts()) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(master.posts()) == 5
    finally:
        b.stop()
