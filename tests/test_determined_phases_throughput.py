"""Determined's timings group: validation keeps its own keys, throughput and MFU appear."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

import otelprof
from otelprof.determined.mapping import phase_timing_name
from tests.determined_contract import DeterminedContractServer, set_trial_env, trial_metrics


@pytest.fixture
def master() -> Iterator[DeterminedContractServer]:
    server = DeterminedContractServer().start()
    server.token = server.add_user("alice")  # type: ignore[attr-defined]
    server.add_trial(42, run_id=1, editors=("alice",))
    yield server
    server.stop()


def test_timing_keys_of_other_phases_stay_apart() -> None:
    assert phase_timing_name("forward", "train") == "forward"
    assert phase_timing_name("forward", None) == "forward"
    assert phase_timing_name("forward", "validation") == "forward_validation"
    # a phase's root span: "validation_s" would be titled "s" by the Web UI
    assert phase_timing_name("validation", "validation") == "phase_validation"
    name = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
    assert phase_timing_name(name, "validation") == "torch_dataloader_next_validation"


def test_determined_gets_throughput_mfu_and_validation_apart_from_training(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_trial_env(monkeypatch, master)
    otelprof.set_peak_flops(1e12)
    try:
        with otelprof.instrument(determined=True, detached=False, interval=0.2) as prof:
            for _ in range(4):
                with otelprof.timing("forward"):
                    time.sleep(0.005)
                otelprof.step_work(samples=8, tokens=64, flops=1e9)
                otelprof.step()
            with otelprof.phase("validation"):
                for _ in range(2):
                    with otelprof.timing("forward"):
                        time.sleep(0.005)
                    otelprof.step()
            time.sleep(0.5)
    finally:
        otelprof.set_peak_flops(None)
    rows = trial_metrics(master.url, master.token, 42, "timings")  # type: ignore[attr-defined]
    avg: dict[str, Any] = {}
    counts: dict[str, int] = {}
    for row in rows:
        avg.update(row["metrics"]["avg_metrics"])
        for key, value in row["metrics"]["batch_metrics"][0].items():
            counts[key] = counts.get(key, 0) + value
    assert counts.get("forward_count") == 4  # training only
    assert counts.get("forward_validation_count") == 2
    assert counts.get("phase_validation_count") == 2
    assert avg["samples_per_second"] > 0
    assert avg["tokens_per_second"] == pytest.approx(8 * avg["samples_per_second"], rel=1e-6)
    assert 0 < avg["mfu"] < 1
    assert prof.stats()["dropped_total"] == 0
