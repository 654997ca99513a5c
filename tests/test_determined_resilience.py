"""No data lost: a master outage and kill -9 of the bridge process, mid-run.

The bridge runs as its own process (`python -m otelprof determined-bridge`) with an
on-disk spool; a sender plays a training job (one step's timing spans plus one sample of
every gauge per tick). Timing counts make loss and duplication exact to check: the
counts the master holds must add up to the steps sent.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from otelprof.determined.mapping import timing_name
from tests.determined_contract import DeterminedContractServer, Post, trial_metrics
from tests.determined_feed import (
    TIMING_NAMES,
    BridgeProcess,
    OtlpClient,
    SeedValues,
    seed_metrics_request,
    timing_spans_request,
    trial_resource,
)

# The outage the issue asks for is 30 s; override to iterate faster locally.
OUTAGE_S = float(os.environ.get("OTELPROF_TEST_OUTAGE_S", "30"))
TICK_S = 0.1
WINDOW_S = 0.5
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


@pytest.fixture
def master() -> Iterator[DeterminedContractServer]:
    server = DeterminedContractServer().start()
    server.add_trial(42, run_id=1, experiment_id=7, editors=("alice",))
    yield server
    server.stop()


@pytest.fixture
def bridge(master: DeterminedContractServer, tmp_path: Path) -> Iterator[BridgeProcess]:
    token_file = tmp_path / "token"
    token_file.write_text(master.add_user("alice"))
    b = BridgeProcess(
        master.url, token_file, tmp_path / "spool", tmp_path / "bridge.log", window_s=WINDOW_S
    )
    b.start()
    yield b
    if b.proc is not None and b.proc.poll() is None:
        b.kill9()


def _send(call: Callable[[], Any], timeout_s: float = 60.0) -> None:
    """Like an OTLP exporter: retry while the bridge is down."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call()
            return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class Job:
    """One tick = one training step's spans + one sample of every gauge."""

    def __init__(self, port: int) -> None:
        self.client = OtlpClient(port)
        self.step = 0
        self.last_t = 0
        self.times: list[int] = []  # every tick's data time (ns)

    def tick(self) -> None:
        self.last_t = time.time_ns()
        self.times.append(self.last_t)
        values = SeedValues(cpu=(self.step % 10) / 10)
        resource = trial_resource(42)
        _send(lambda: self.client.send_metrics(seed_metrics_request(resource, values, self.last_t)))
        spans = timing_spans_request(resource, [self.step], start_ns=self.last_t)
        _send(lambda: self.client.send_traces(spans))
        self.step += 1

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.tick()
            time.sleep(TICK_S)


def _dedupe_resend(posts: list[Post]) -> tuple[list[Post], int]:
    """Drop a report sent twice back to back (kill -9 between the master's answer and the
    bridge's ack: the only window where a report can be resent); count such repeats."""
    out: list[Post] = []
    repeats = 0
    for post in posts:
        if out and out[-1].body == post.body:
            repeats += 1
            continue
        out.append(post)
    return out, repeats


def test_master_outage_and_bridge_kill9_lose_nothing_and_keep_order(
    master: DeterminedContractServer, bridge: BridgeProcess
) -> None:
    job = Job(bridge.port)
    job.run_for(2.0)
    with master.down():
        job.run_for(OUTAGE_S / 2)
        bridge.kill9()  # everything so far waits in the spool (or the window's journal)
        bridge.start()
        job.run_for(OUTAGE_S / 2)
    # The master is back: the backlog drains. Kill again as soon as it is draining.
    before = len(master.posts())
    deadline = time.monotonic() + 120  # a generous bound for a busy machine
    while len(master.posts()) == before and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(master.posts()) > before, "the bridge did not resume delivery"
    bridge.kill9()
    bridge.start()
    job.run_for(1.0)
    steps_sent = job.step

    deadline = time.monotonic() + 300  # a generous bound for a busy machine
    counted = 0
    while time.monotonic() < deadline:
        timing_posts = [p for p in master.posts() if p.group == "timings"]
        counted = sum(p.body["metrics"]["metrics"]["batchMetrics"][0]["batch_train_count"]
                      for p in _dedupe_resend(timing_posts)[0])  # fmt: skip
        if counted >= steps_sent:
            break
        time.sleep(0.2)
    assert bridge.stop() == 0
    log = bridge.log.read_text()
    assert counted == steps_sent, log[-3000:]
    assert "unavailable (ConnectError" in log
    assert log.count("Determined spool recovered") == 2

    posts, repeats = _dedupe_resend(master.posts())
    assert repeats == 0, "a report in flight at a kill was stored twice"
    assert master.refusals() == []

    # Timings: exact. Every span counted once, step counts strictly increasing in arrival order.
    timings = [p.body["metrics"] for p in posts if p.group == "timings"]
    steps = [m["stepsCompleted"] for m in timings]
    assert steps == sorted(set(steps)), steps
    assert steps[-1] == steps_sent
    for name in (*TIMING_NAMES, "train_step"):
        key = f"{timing_name(name)}_count"
        assert sum(m["metrics"]["batchMetrics"][0][key] for m in timings) == steps_sent
    stored = trial_metrics(master.url, next(iter(master.store.user_tokens)), 42, "timings")
    assert [r["totalBatches"] for r in stored] == steps

    # System metrics: in data order per group, no window lost, the last sample delivered.
    by_group: dict[str, list[str]] = defaultdict(list)
    for p in posts:
        if p.group != "timings":
            by_group[p.group].append(p.body["metrics"]["reportTime"])
    assert set(by_group) == {"gpu", "cpu", "memory", "disk", "network"}
    for group, times in by_group.items():
        assert times == sorted(set(times)), f"{group} out of order or repeated"
        # no window lost: each report closes fewer ticks than the job sends in 5 s (10
        # windows) at full speed (a lost window would leave its ticks to the next report).
        # Counted in ticks, not seconds between reports: the job sends nothing while the
        # bridge restarts, and a tick stamped before a restart is accepted after it, both
        # long on a busy machine.
        ms = [t // 1_000_000 for t in job.times]
        for a, b in itertools.pairwise(times):
            after, upto = _ns(a) // 1_000_000, _ns(b) // 1_000_000
            closed = sum(after < t <= upto for t in ms)
            assert 0 < closed < 5.0 / TICK_S, f"{group}: {closed} ticks in the report at {b}"
        assert _ns(times[-1]) // 1_000_000 == job.last_t // 1_000_000
    print(json.dumps({"steps": steps_sent, "reports": len(posts), "resent": repeats}))


def _ns(stamp: str) -> int:
    delta = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")) - EPOCH
    return (delta.days * 86400 + delta.seconds) * 10**9 + delta.microseconds * 1000
