"""In-process delivery (`instrument(determined=True)`) with answers that never come back:
no report waits behind another group's lost answer, shutdown keeps its time, nothing is
miscounted, and what the master refused stays in the run directory."""

from __future__ import annotations

import json
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import otelprof
from otelprof.cli import main as otelprof_main
from otelprof.determined.aggregate import Report, build_body
from otelprof.determined.client import Credentials, DeterminedClient
from otelprof.determined.pipeline import Pipeline
from otelprof.determined.spool import MemorySpool
from tests.determined_contract import DeterminedContractServer, set_trial_env, trial_metrics

T0 = 1_760_000_000_000_000_000


@pytest.fixture
def master() -> Iterator[DeterminedContractServer]:
    server = DeterminedContractServer().start()
    server.token = server.add_user("alice")  # type: ignore[attr-defined]
    server.add_trial(42, run_id=1, experiment_id=7)
    yield server
    server.stop()


def test_a_lost_answer_holds_up_only_its_own_group(master: DeterminedContractServer) -> None:
    client = DeterminedClient(master.url, Credentials(user_token=master.token), timeout_s=20)  # type: ignore[attr-defined]
    pipeline = Pipeline(client, MemorySpool(), window_s=3600, retry_initial_s=0.05)
    pipeline.start()
    try:
        master.lose_next_responses(1, hang_s=15, groups=("cpu",))
        cpu = build_body(42, 1, "cpu", {"a": {"cpu_util_simple": 1.0}}, T0)
        timings = build_body(42, 1, "timings", {"forward_s": 0.1}, T0, 5, [{"forward_count": 5}])
        pipeline.spool.commit_window(0, [Report(42, 1, "cpu", cpu),
                                         Report(42, 1, "timings", timings)], {})  # fmt: skip
        pipeline.deliverer.wake()
        deadline = time.monotonic() + 10
        while not trial_metrics(master.url, master.token, 42, "timings"):  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "timings waited behind the cpu report"
            time.sleep(0.05)
    finally:
        pipeline.abandon()
        pipeline.shutdown(0.5)


def test_shutdown_keeps_the_export_timeout_when_answers_are_lost_and_counts_them_right(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    set_trial_env(monkeypatch, master)
    master.lose_next_responses(1000, hang_s=30)  # a proxy that stores and never answers
    with otelprof.instrument(
        determined=True, detached=False, interval=0.2, export_timeout=2.0,
        output_dir=str(tmp_path),
    ) as prof:  # fmt: skip
        for _ in range(20):
            with otelprof.timing("forward"):
                time.sleep(0.01)
            otelprof.step()
        time.sleep(0.6)
        started = time.monotonic()
    took = time.monotonic() - started
    assert took < 2.0 + 2.5, f"shutdown took {took:.1f} s with export_timeout 2 s"
    stats = prof.stats()
    stored = len(master.posts())
    assert stored >= 1
    # Posted without an answer: the master may hold them, so they are not "dropped".
    unconfirmed = stats["determined.reports_unconfirmed_at_shutdown"]
    assert unconfirmed >= 1
    # and the ones found stored when asked after a lost answer count as delivered
    assert stats["determined.reports_delivered"] + unconfirmed <= stored


def test_what_the_master_refused_is_kept_in_the_run_directory(
    master: DeterminedContractServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    set_trial_env(monkeypatch, master, run_id="2")  # the master's run id is 1: refused
    with otelprof.instrument(
        determined=True, detached=True, interval=0.2, output_dir=str(tmp_path)
    ) as prof:
        for _ in range(5):
            otelprof.step()
        time.sleep(0.6)
    assert prof.stats()["determined.reports_failed_refused_by_master"] >= 1
    run_dir = tmp_path / prof.settings.run_id
    kept = run_dir / "determined-refused.jsonl"
    entries = [json.loads(line) for line in kept.read_text().splitlines()]
    assert entries and all("invalid run id" in e["message"] for e in entries)
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    capsys.readouterr()
    assert otelprof_main(["report", str(run_dir)]) == 0
    report = capsys.readouterr().out
    assert "refused by the Determined master" in report and "invalid run id" in report


def test_withheld_timing_windows_are_counted_as_dropped(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    master.restart_trial(42)  # run 2, and no DET_STEPS_COMPLETED: no safe step count
    set_trial_env(monkeypatch, master, run_id=str(master.trial(42)["runId"]))
    monkeypatch.delenv("DET_STEPS_COMPLETED", raising=False)
    with otelprof.instrument(determined=True, detached=False, interval=0.2) as prof:
        for _ in range(5):
            with otelprof.timing("forward"):
                pass
            otelprof.step()
        time.sleep(0.6)
    stats = prof.stats()
    assert stats["determined.timing_windows_dropped_unknown_steps"] >= 1
    assert stats["dropped_total"] >= stats["determined.timing_windows_dropped_unknown_steps"]
    assert trial_metrics(master.url, master.token, 42, "timings") == []  # type: ignore[attr-defined]
