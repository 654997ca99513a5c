"""The on-disk spool: survives restarts mid-window and mid-batch, stays within its cap."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from otelprof.determined.aggregate import Report, build_body
from otelprof.determined.mapping import GaugeSample, TimingSample
from otelprof.determined.spool import DiskSpool, MemorySpool

T0 = 1_760_000_000_000_000_000


def _reports(window: int, n: int) -> list[Report]:
    return [
        Report(42, 1, "cpu",
               build_body(42, 1, "cpu", {"a": {"cpu_util_simple": float(i)}}, T0 + window * 10**9))
        for i in range(n)
    ]  # fmt: skip


def test_batches_resume_after_a_restart_without_resending_answered_reports(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path)
    spool.recover()
    spool.commit_window(0, _reports(0, 3), {})
    spool.commit_window(1, _reports(1, 2), {(42, 1): 7})
    assert spool.take_new()[0][:2] == (0, 0)
    spool.mark_inflight(0, 0)
    spool.ack(0, 0)
    spool.mark_inflight(0, 1)  # posted; the process dies before the answer
    # no close(): a kill -9 leaves the files as they are
    again = DiskSpool(tmp_path)
    recovered = again.recover()
    assert recovered.pending_reports == 4
    assert recovered.window == 2
    assert recovered.last_steps == {(42, 1): 7}
    assert again.maybe_delivered(0, 1)  # ask the master before resending
    order = []
    for item in again.take_new():
        order.append(item[:2])
        again.ack(item[0], item[1])
    assert order == [(0, 1), (0, 2), (1, 0), (1, 1)]
    assert again.take_new() == [] and again.pending() == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_journal_of_an_open_window_is_replayed_once(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path)
    spool.recover()
    g = GaugeSample(42, 1, "a", "cpu", "", "cpu_util_simple", 10.0, T0)
    t = TimingSample(42, 1, "train_batch", 0.5, 5, 4, T0)
    spool.journal(0, [g], [t])
    spool.commit_window(0, _reports(0, 1), {})  # window 0 closed: its journal is done
    spool.journal(1, [g], [])  # window 1 open when the process dies
    with open(tmp_path / "journal-000000000001.jsonl", "ab") as fh:
        fh.write(b'{"g": [[42, 1, "a", "cpu"')  # a line cut short
    recovered = DiskSpool(tmp_path).recover()
    assert recovered.window == 1
    assert recovered.gauges == [g]
    assert recovered.timings == []


def test_full_spool_drops_the_oldest_reports_counts_and_logs_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="otelprof.determined")
    probe = DiskSpool(tmp_path / "probe")
    probe.commit_window(0, _reports(0, 1), {})
    one_batch = (tmp_path / "probe" / "batch-000000000000.json").stat().st_size
    spool = DiskSpool(tmp_path / "s", max_bytes=3 * one_batch, fsync=False)
    spool.recover()
    for window in range(6):
        spool.commit_window(window, _reports(window, 1), {})
    assert spool.stats.reports_dropped == 3
    assert spool.pending() == 6 - spool.stats.reports_dropped
    head = spool.take_new()[0]
    assert head[0] == spool.stats.reports_dropped  # oldest went first
    assert any("spool full" in r.getMessage() for r in caplog.records)


def test_memory_spool_keeps_order_and_its_cap() -> None:
    spool = MemorySpool(max_bytes=10_000)
    for window in range(3):
        spool.commit_window(window, _reports(window, 2), {})
    seen = []
    for item in spool.take_new():
        seen.append(item[:2])
        spool.ack(item[0], item[1])
    assert seen == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert spool.pending() == 0
