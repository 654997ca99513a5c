"""Restarts and producers: otelprof never hides the user's metrics or reports a trial twice.

A real master archives the rows of older run ids past the stepsCompleted of any report under
a new run id and raises the trial's batch count to it (reference §0). These tests restart a
trial that has training and validation rows and check they all survive otelprof's timings;
they also run the in-process exporter and the bridge at once on one trial.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import otelprof
from otelprof.determined.client import Credentials, DeterminedClient
from otelprof.determined.mapping import timing_name
from otelprof.determined.pipeline import Pipeline
from otelprof.determined.server import BridgeServer
from otelprof.determined.spool import MemorySpool
from tests.determined_contract import DeterminedContractServer, set_trial_env, trial_metrics
from tests.determined_feed import (
    OTLP_HEADERS_ENV,
    OtlpClient,
    bridge_tokens,
    timing_spans_request,
    trial_resource,
)

TRAINED = 3000  # batches the trial's first run trained (and checkpointed)


@pytest.fixture
def master() -> Iterator[DeterminedContractServer]:
    server = DeterminedContractServer().start()
    server.token = server.add_user("alice")  # type: ignore[attr-defined]
    server.add_trial(42, run_id=1)
    yield server
    server.stop()


def _user_report(master: DeterminedContractServer, group: str, steps: int, **values: float) -> None:
    """What the user's own training code reports through Determined's Core API."""
    body = {"group": group, "metrics": {"trialId": 42, "trialRunId": master.trial(42)["runId"],
            "stepsCompleted": steps, "metrics": {"avgMetrics": values}}}  # fmt: skip
    response = httpx.post(
        f"{master.url}/api/v1/trials/42/metrics",
        json=body,
        headers={"Authorization": f"Bearer {master.token}"},  # type: ignore[attr-defined]
    )
    assert response.status_code == 200, response.text


def _first_run(master: DeterminedContractServer) -> None:
    for steps in range(500, TRAINED + 1, 500):
        _user_report(master, "training", steps, loss=1.0 / steps)
        if steps % 1000 == 0:
            _user_report(master, "validation", steps, accuracy=steps / 4000)


def _user_rows(master: DeterminedContractServer) -> dict[str, list[int]]:
    return {g: [r.total_batches for r in master.rows(42, g)] for g in ("training", "validation")}


def _numeric_only(posts: list[Any]) -> bool:
    def ok(value: Any) -> bool:
        if isinstance(value, dict):
            return all(ok(v) for v in value.values())
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )

    return all(ok(p.body["metrics"]["metrics"]["avgMetrics"]) for p in posts)


def _env(monkeypatch: pytest.MonkeyPatch, master: DeterminedContractServer, **extra: str) -> None:
    set_trial_env(monkeypatch, master, run_id=str(master.trial(42)["runId"]), **extra)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", OTLP_HEADERS_ENV)


def _train(steps: int, **options: Any) -> otelprof.Profiler:
    with otelprof.instrument(determined=True, detached=False, interval=0.2, **options) as prof:
        for _ in range(steps):
            with otelprof.timing("train_batch"):
                time.sleep(0.002)
            otelprof.step()
        time.sleep(0.3)
    return prof


def test_the_contract_master_archives_a_restarted_trials_rows_when_steps_restart_from_0(
    master: DeterminedContractServer,
) -> None:
    # The hazard itself, so the tests below can fail: a report at step 20 under run 2.
    _first_run(master)
    master.restart_trial(42)
    _user_report(master, "timings", 20, x_s=0.1)
    assert _user_rows(master) == {"training": [], "validation": []}
    trial = master.trial(42)
    assert trial["totalBatchesProcessed"] == 20
    assert trial["latestValidation"] is None
    assert set(trial["summaryMetrics"]) == {"timings"}


def test_a_restarted_trial_keeps_all_its_training_and_validation_rows(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _first_run(master)
    before = master.trial(42)
    master.restart_trial(42)  # resumed from the checkpoint at batch 3000
    _env(monkeypatch, master, DET_STEPS_COMPLETED=str(TRAINED))
    prof = _train(12)
    assert prof.stats()["dropped_total"] == 0
    assert _user_rows(master) == {"training": [500, 1000, 1500, 2000, 2500, 3000],
                                  "validation": [1000, 2000, 3000]}  # fmt: skip
    assert master.rows(42, "training", archived=True) == []
    after = master.trial(42)
    assert after["latestValidation"] == before["latestValidation"]
    assert after["summaryMetrics"]["training"] == before["summaryMetrics"]["training"]
    assert after["summaryMetrics"]["validation"] == before["summaryMetrics"]["validation"]
    timings = trial_metrics(master.url, master.token, 42, "timings")  # type: ignore[attr-defined]
    steps = [r["totalBatches"] for r in timings]
    assert steps and all(TRAINED < s <= TRAINED + 12 for s in steps)
    # the batch count never goes past what was trained
    assert after["totalBatchesProcessed"] == max(steps) <= TRAINED + 12
    assert all(r["trialRunId"] == 2 for r in timings)
    assert _numeric_only(master.posts())


def test_a_restart_without_det_steps_completed_reports_no_timings_and_says_why(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    _first_run(master)
    master.restart_trial(42)
    _env(monkeypatch, master)
    monkeypatch.delenv("DET_STEPS_COMPLETED", raising=False)
    _train(5)
    assert trial_metrics(master.url, master.token, 42, "timings") == []  # type: ignore[attr-defined]
    assert len(master.rows(42, "training")) == 6 and len(master.rows(42, "validation")) == 3
    assert master.trial(42)["totalBatchesProcessed"] == TRAINED
    assert any("DET_STEPS_COMPLETED is unknown" in r.getMessage() for r in caplog.records)
    # hardware metrics still flow: they carry no step
    assert {p.group for p in master.posts()} >= {"cpu", "memory"}


def test_step_per_micro_batch_counts_determined_batches(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _env(monkeypatch, master, DET_STEPS_COMPLETED="100", OTELPROF_DETERMINED_STEPS_PER_BATCH="4")
    _train(12)  # 12 micro-batches = 3 batches
    timings = trial_metrics(master.url, master.token, 42, "timings")  # type: ignore[attr-defined]
    assert timings and max(r["totalBatches"] for r in timings) == 103
    assert master.trial(42)["totalBatchesProcessed"] == 103


def test_the_bridge_leaves_a_trial_to_the_process_that_posts_it_itself(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    client = DeterminedClient(master.url, Credentials(user_token=master.token))  # type: ignore[attr-defined]
    pipeline = Pipeline(client, MemorySpool(), window_s=0.3, skip_direct=True)
    bridge = BridgeServer(pipeline, "127.0.0.1:0", tokens=bridge_tokens())
    bridge.start()
    try:
        # Both paths at once: the process posts itself and also sends OTLP to the bridge.
        _env(monkeypatch, master)
        prof = _train(10, endpoint=f"http://127.0.0.1:{bridge.port}")
        # Another job that does not post itself still goes through the bridge.
        master.add_trial(43, run_id=1)
        otlp = OtlpClient(bridge.port)
        otlp.send_traces(timing_spans_request(trial_resource(43), range(4)))
        otlp.close()
        time.sleep(0.2)
        pipeline.flush()
        assert pipeline.wait_delivered(10)
    finally:
        bridge.stop(grace_s=0.5, drain_timeout_s=2.0)
    assert prof.stats()["dropped_total"] == 0
    assert pipeline.stats()["skipped_direct"] > 0
    assert master.refusals() == []  # no key conflict
    timings = trial_metrics(master.url, master.token, 42, "timings")  # type: ignore[attr-defined]
    steps = [r["totalBatches"] for r in timings]
    assert steps == sorted(set(steps)) and steps[-1] == 10
    counted = sum(r["metrics"]["batch_metrics"][0].get("batch_train_count", 0) for r in timings)
    assert counted == 10  # every span reported once, by one producer
    cpu_rows = master.profiling_rows(42, "cpu")
    stamps = [r.end_time for r in cpu_rows]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)  # no zig-zag
    assert trial_metrics(master.url, master.token, 43, "timings")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("train_batch", "batch_train"),
        ("dataloader_next", "dataloader_next"),
        # torch's range inside otelprof's own dataloader_next: a key of its own
        ("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "torch_dataloader_next"),
        ("Optimizer.step#SGD.step", "optimizer_step"),
        ("Optimizer.zero_grad#AdamW.zero_grad", "optimizer_zero_grad"),
        ("## forward ##", "forward"),
        ("MyBlock.forward", "my_block_forward"),
        ("validation_loop", "loop_validation"),
        ("t_step", "step_t"),
        ("val", "phase_val"),
        ("train_val_loss", "loss_train_val"),
    ],
)
def test_timing_keys_are_short_and_nothing_the_web_ui_renames(name: str, key: str) -> None:
    assert timing_name(name) == key


def test_long_timing_names_stay_distinct_within_40_characters() -> None:
    a = timing_name("a_very_long_user_defined_range_name_for_the_encoder_block_one")
    b = timing_name("a_very_long_user_defined_range_name_for_the_encoder_block_two")
    assert a != b and len(a) <= 40 and len(b) <= 40
    assert a.startswith("a_very_long_user_defined_range")
