"""Delivery against a master that behaves like the real 0.38.1 one: refusals are 500s.

Classification by the master's message, one queue per trial (no head-of-line blocking),
refused reports kept in the spool, bounded retries of unknown 500s, and exactly-once
delivery across lost responses.
"""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from otelprof.determined.aggregate import Report, build_body
from otelprof.determined.client import Credentials, DeterminedClient, Outcome
from otelprof.determined.pipeline import Pipeline
from otelprof.determined.spool import DiskSpool, MemorySpool
from tests.determined_contract import DeterminedContractServer
from tests.determined_feed import (
    OtlpClient,
    seed_metrics_request,
    trial_resource,
    write_token_file,
)

T0 = 1_760_000_000_000_000_000
AGENT = "agent-1"


@pytest.fixture
def master() -> Iterator[DeterminedContractServer]:
    server = DeterminedContractServer().start()
    server.token = server.add_user("alice")  # type: ignore[attr-defined]
    for trial in (42, 43, 44):
        server.add_trial(trial, run_id=1)
    yield server
    server.stop()


def _client(master: DeterminedContractServer, **kw: Any) -> DeterminedClient:
    return DeterminedClient(master.url, Credentials(user_token=master.token), **kw)  # type: ignore[attr-defined]


def _cpu(trial: int, i: int, run: int = 1) -> Report:
    body = build_body(trial, run, "cpu", {AGENT: {"cpu_util_simple": float(i)}}, T0 + i * 10**9)
    return Report(trial, run, "cpu", body)


def _timings(trial: int, steps: int, value: float, run: int = 1) -> Report:
    body = build_body(trial, run, "timings", {"x_s": value}, T0 + steps * 10**9, steps)
    return Report(trial, run, "timings", body)


def _post(master: DeterminedContractServer, body: Any, trial: int = 42) -> httpx.Response:
    return httpx.post(
        f"{master.url}/api/v1/trials/{trial}/metrics",
        json=body,
        headers={"Authorization": f"Bearer {master.token}"},  # type: ignore[attr-defined]
    )


def _pipeline(master: DeterminedContractServer, spool: Any = None, **kw: Any) -> Pipeline:
    pipeline = Pipeline(
        _client(master), spool or MemorySpool(), window_s=3600, retry_initial_s=0.05,
        retry_max_s=0.2, **kw,
    )  # fmt: skip
    pipeline.start()
    return pipeline


def _commit(pipeline: Pipeline, window: int, reports: list[Report]) -> None:
    pipeline.spool.commit_window(window, reports, {})
    pipeline.deliverer.wake()


# -- what the master answers, and what it means ------------------------------------------------
@pytest.mark.parametrize(
    ("body", "permanent"),
    [
        # stale run id
        (build_body(42, 2, "cpu", {AGENT: {"cpu_util_simple": 1.0}}, T0), "invalid run id"),
        # missing stepsCompleted in a generic group
        (build_body(42, 1, "timings", {"x_s": 1.0}, T0), 'null value in column "total_batches"'),
        # a group Determined reserves
        (build_body(42, 1, "avg_metrics", {"x": 1.0}, T0, 1), "custom_type_check"),
        # non-numeric epoch
        (build_body(42, 1, "timings", {"epoch": "x"}, T0, 1), "non numeric 'epoch'"),
        # no metrics at all
        ({"group": "cpu", "metrics": {"trialId": 42, "trialRunId": 1}}, "nil pointer"),
    ],
)
def test_permanent_refusals_are_500s_with_the_masters_message_and_never_retried(
    master: DeterminedContractServer, body: dict[str, Any], permanent: str
) -> None:
    response = _post(master, body)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == 13 and error["reason"] == "Internal"
    assert permanent in error["error"]
    group = body["group"]
    result = _client(master).report(Report(42, 1, group, body))
    assert result.outcome is Outcome.REJECTED, result
    assert permanent in result.message


def test_key_conflict_on_the_same_step_is_a_permanent_500(master: DeterminedContractServer) -> None:
    client = _client(master)
    assert client.report(_timings(42, 5, 0.1)).outcome is Outcome.OK
    assert client.report(_timings(42, 5, 0.1)).outcome is Outcome.OK  # equal values merge
    result = client.report(_timings(42, 5, 0.2))
    assert result.outcome is Outcome.REJECTED and result.status == 500
    assert "conflicting key: x_s" in result.message


def test_database_outage_is_a_500_that_is_retried(master: DeterminedContractServer) -> None:
    client = _client(master)
    with master.database_down():
        result = client.report(_cpu(42, 0))
    assert result.status == 500 and "terminating connection" in result.message
    assert result.outcome is Outcome.RETRY and result.master_wide
    assert client.report(_cpu(42, 0)).outcome is Outcome.OK


def test_unrecognised_500_is_unknown_and_proxy_errors_may_have_been_stored(
    master: DeterminedContractServer,
) -> None:
    client = _client(master)
    master.break_trial(42, "something nobody has seen before")
    result = client.report(_cpu(42, 0))
    assert result.outcome is Outcome.UNKNOWN and result.status == 500
    master.fail_next(1, status=502)
    result = client.report(_cpu(43, 0))
    assert result.outcome is Outcome.RETRY and result.maybe_stored


def test_unknown_fields_are_ignored_and_the_path_trial_id_wins(
    master: DeterminedContractServer,
) -> None:
    body = build_body(43, 1, "cpu", {AGENT: {"cpu_util_simple": 3.0}}, T0)
    body["metrics"]["somethingNew"] = 1
    body["alsoNew"] = {"x": 1}
    body["metrics"]["trialRunId"] = "1"  # the run id may be a string
    assert _post(master, body, trial=42).status_code == 200
    assert [r.trial_id for r in master.profiling_rows(42, "cpu")] == [42]
    assert master.profiling_rows(43, "cpu") == []


# -- no head-of-line blocking ------------------------------------------------------------------
def test_a_refused_trial_and_a_failing_trial_never_delay_the_others(
    master: DeterminedContractServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="otelprof.determined")
    master.restart_trial(43)  # trial 43's reports carry a stale run id: refused for good
    master.break_trial(44, "an internal error nobody has seen")  # unknown 500, every time
    pipeline = _pipeline(master, max_unknown_attempts=3)
    try:
        # The failing trials come first in every window: a single queue would block on them.
        for window in range(3):
            reports = [_cpu(43, window), _cpu(44, window), _cpu(42, window)]
            _commit(pipeline, window, reports)
        deadline = time.monotonic() + 5
        while len(master.profiling_rows(42, "cpu")) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        healthy = master.profiling_rows(42, "cpu")
        assert [r.metrics[AGENT]["cpu_util_simple"] for r in healthy] == [0.0, 1.0, 2.0]
        assert pipeline.wait_delivered(10), pipeline.stats()
    finally:
        pipeline.shutdown(1)
    stats = pipeline.stats()
    assert stats["delivered"] == 3
    assert stats["refused_by_master"] == 6  # 3 stale-run-id + 3 given up
    assert stats["gave_up_unknown_error"] == 3
    assert stats["pending"] == 0
    refused = pipeline.refused_reports()
    assert sorted(r["report"]["trial_id"] for r in refused) == [43, 43, 43, 44, 44, 44]
    assert all(r["status"] == 500 for r in refused)
    stale = [r for r in refused if r["report"]["trial_id"] == 43]
    assert all("invalid run id, 1 (reported) != 2 (expected)" in r["message"] for r in stale)
    # trial 43: each report tried exactly once; trial 44: 3 attempts per report
    tried_43 = [m for _, m in master.refusals() if "invalid run id" in m]
    assert len(tried_43) == 3
    tried_44 = [m for _, m in master.refusals() if "nobody has seen" in m]
    assert len(tried_44) == 9
    logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len([m for m in logged if "invalid run id" in m]) == 1  # logged once


def test_a_master_outage_pauses_every_trial_with_one_backoff_and_loses_nothing(
    master: DeterminedContractServer,
) -> None:
    pipeline = _pipeline(master)
    try:
        with master.database_down():
            _commit(pipeline, 0, [_cpu(t, 0) for t in (42, 43, 44)])
            time.sleep(0.6)
            tried_while_down = len(master.refusals())
        assert pipeline.wait_delivered(10), pipeline.stats()
    finally:
        pipeline.shutdown(1)
    # one shared backoff (0.05 s doubling to 0.2 s): a handful of probes, not 3 per round
    assert 1 <= tried_while_down <= 12
    assert pipeline.stats()["refused_by_master"] == 0
    assert sorted(p.trial_id for p in master.posts()) == [42, 43, 44]


def test_order_is_kept_within_a_trial_across_retries(master: DeterminedContractServer) -> None:
    pipeline = _pipeline(master)
    try:
        master.break_trial(42, "FATAL: the database system is starting up (SQLSTATE 57P03)")
        _commit(pipeline, 0, [_timings(42, s, 0.1 * s) for s in (1, 2)])
        _commit(pipeline, 1, [_timings(42, s, 0.1 * s) for s in (3, 4)])
        time.sleep(0.3)
        master.break_trial(42, None)
        assert pipeline.wait_delivered(10), pipeline.stats()
    finally:
        pipeline.shutdown(1)
    assert [p.body["metrics"]["stepsCompleted"] for p in master.posts()] == [1, 2, 3, 4]


# -- refused reports are kept, across restarts ---------------------------------------------------
def test_refused_reports_stay_in_the_disk_spool_and_a_restart_does_not_resend_them(
    master: DeterminedContractServer, tmp_path: Path
) -> None:
    master.restart_trial(43)
    pipeline = _pipeline(master, DiskSpool(tmp_path, fsync=False))
    try:
        _commit(pipeline, 0, [_cpu(43, 0), _cpu(42, 0)])
        assert pipeline.wait_delivered(5)
    finally:
        pipeline.shutdown(1)
    again = _pipeline(master, DiskSpool(tmp_path, fsync=False))
    try:
        _commit(again, 1, [_cpu(42, 1)])
        assert again.wait_delivered(5)
        kept = again.refused_reports()
    finally:
        again.shutdown(1)
    assert len(kept) == 1 and kept[0]["report"]["trial_id"] == 43
    assert "invalid run id" in kept[0]["message"]
    assert kept[0]["report"]["body"] == _cpu(43, 0).body
    assert len([m for _, m in master.refusals() if "invalid run id" in m]) == 1
    assert (tmp_path / "refused.jsonl").exists()


# -- exactly once across lost responses ----------------------------------------------------------
def test_a_lost_response_is_checked_with_the_master_before_resending(
    master: DeterminedContractServer,
) -> None:
    master.lose_next_responses(2)  # the master stores both, the answers never arrive
    pipeline = _pipeline(master)
    try:
        gpu = build_body(42, 1, "gpu", {AGENT: {"GPU-1": {"gpu_util": 50.0,
                         "gpu_free_memory": 1e9}}}, T0)  # fmt: skip
        _commit(pipeline, 0, [Report(42, 1, "gpu", gpu), _timings(42, 3, 0.25)])
        assert pipeline.wait_delivered(10), pipeline.stats()
    finally:
        pipeline.shutdown(1)
    assert len(master.profiling_rows(42, "gpu")) == 1  # not stored twice
    assert len(master.rows(42, "timings")) == 1
    assert pipeline.stats()["found_stored_after_lost_response"] == 2
    assert len(master.posts()) == 2


def test_a_lost_response_for_a_report_the_master_did_not_store_is_sent_again(
    master: DeterminedContractServer,
) -> None:
    pipeline = _pipeline(master)
    try:
        master.fail_next(1, status=504)  # a proxy timed out before the master got it
        _commit(pipeline, 0, [_cpu(42, 7)])
        assert pipeline.wait_delivered(10), pipeline.stats()
    finally:
        pipeline.shutdown(1)
    assert len(master.profiling_rows(42, "cpu")) == 1
    assert pipeline.stats()["delivered"] == 1


def test_a_stale_report_spooled_before_a_restart_is_moved_aside_without_blocking_the_rest(
    master: DeterminedContractServer, tmp_path: Path
) -> None:
    # A bridge died with a stale-run-id report at the head of its spool (the real-master bug
    # replayed it forever after every restart, blocking all later reports).
    master.restart_trial(43)
    spool = DiskSpool(tmp_path, fsync=False)
    spool.recover()
    spool.commit_window(0, [_cpu(43, 0), _cpu(42, 0), _timings(44, 2, 0.5)], {})
    spool.commit_window(1, [_cpu(43, 1), _cpu(42, 1)], {})
    spool.close()
    pipeline = _pipeline(master, DiskSpool(tmp_path, fsync=False))
    try:
        assert pipeline.wait_delivered(5), pipeline.stats()
    finally:
        pipeline.shutdown(1)
    assert sorted((p.trial_id, p.group) for p in master.posts()) == [
        (42, "cpu"), (42, "cpu"), (44, "timings"),
    ]  # fmt: skip
    assert pipeline.stats()["refused_kept"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["refused.jsonl", "state.json"]


def test_the_contract_master_breaks_on_values_otelprof_must_never_send(
    master: DeterminedContractServer,
) -> None:
    # Accepted with 200 on write, as the real master does; the read is where it fails.
    text = build_body(42, 1, "cpu", {AGENT: {"cpu_util_simple": "high"}}, T0)
    assert _post(master, text).status_code == 200
    series = httpx.get(
        f"{master.url}/api/v1/trials/42/profiler/metrics",
        params={"labels.name": "cpu_util_simple", "labels.agentId": AGENT},
        headers={"Authorization": f"Bearer {master.token}"},  # type: ignore[attr-defined]
    )
    assert series.status_code == 500 and "grpcCode" in series.json()["error"]
    null = build_body(42, 1, "memory", {AGENT: {"memory_free": None}}, T0)
    assert _post(master, null).status_code == 200
    with pytest.raises(httpx.TransportError):  # the master went down reading it
        httpx.get(
            f"{master.url}/api/v1/trials/42/profiler/metrics",
            params={"labels.name": "memory_free", "labels.agentId": AGENT},
            headers={"Authorization": f"Bearer {master.token}"},  # type: ignore[attr-defined]
        )


def test_the_bridge_process_serves_its_own_metrics_with_refusals_and_deliveries(
    master: DeterminedContractServer, tmp_path: Path
) -> None:
    master.restart_trial(43)
    (tmp_path / "token").write_text(master.token)  # type: ignore[attr-defined]
    (tmp_path / "token").chmod(0o600)
    bridge = subprocess.Popen(
        [sys.executable, "-m", "otelprof", "determined-bridge", "--listen", "127.0.0.1:0",
         "--master", master.url, "--token-file", str(tmp_path / "token"),
         "--ingest-tokens", str(write_token_file(tmp_path / "ingest")),
         "--spool-dir", str(tmp_path / "spool"), "--report-interval", "0.2",
         "--metrics-port", "0", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert bridge.stdout is not None
        line = bridge.stdout.readline().decode()
        found = re.search(r"listening on port (\d+) .* metrics on port (\d+)", line)
        assert found, line
        otlp = OtlpClient(int(found.group(1)))
        otlp.send_metrics(seed_metrics_request(trial_resource(42)))
        otlp.send_metrics(seed_metrics_request(trial_resource(43)))
        otlp.close()
        url = f"http://127.0.0.1:{found.group(2)}/metrics"
        values: dict[str, float] = {}
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            text = httpx.get(url).text
            values = {
                m.group(1): float(m.group(2))
                for m in re.finditer(r"^otelprof_determined_bridge_(\w+) (\S+)$", text, re.M)
            }
            # each group of each trial is its own delivery lane: wait for all ten answers
            if (
                values.get("delivered_total", 0) >= 5
                and values.get("refused_by_master_total", 0) >= 5
            ):
                break
            time.sleep(0.1)
        assert values["delivered_total"] == 5, (values, master.posts(), master.refusals())
        assert values["refused_by_master_total"] == 5
        assert values["refused_kept_total"] == 5
        assert values["pending"] == 0
        assert "# HELP otelprof_determined_bridge_refused_by_master_total" in text
    finally:
        bridge.send_signal(signal.SIGTERM)
        assert bridge.wait(30) == 0
