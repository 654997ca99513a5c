"""Determined bridge: reports/s into a local contract master, and memory at a 1,000-trial fan-in.

Side by side in one run:
  baseline  a bare httpx loop POSTing the same report bodies straight to the master
  bridge    `otelprof determined-bridge` (its own process, on-disk spool, fsync on) draining
            a window of 1,000 trials x 6 reports into the same master, all trials healthy
  refused   the same with one more trial whose every report the master refuses for good
            (a stale run id: HTTP 500 "invalid run id", as a real 0.38.1 master answers):
            the healthy trials' delivery rate must not drop (no head-of-line blocking)
and the bridge's resident memory idle vs. while 1,000 trials send at once (metrics + timing
spans every second, batched like a collector does). The master (tests/determined_contract.py)
runs in a separate process so neither side shares its interpreter.

    .venv/bin/python bench/bench_determined_bridge.py [--trials 1000] [--seconds 12]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import psutil
from _machine import cpu_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.determined_contract import DeterminedContractServer  # noqa: E402
from tests.determined_feed import (  # noqa: E402
    OtlpClient,
    seed_metrics_request,
    timing_spans_request,
    trial_resource,
    write_token_file,
)


def _master(conn: Connection, trials: int) -> None:
    server = DeterminedContractServer().start()
    token = server.add_user("bench")
    # Trials 1..N for the baseline, N+1..2N and 2N+1..3N for the two bridge runs (no run
    # re-reports another's steps), 3N+1 for the refused one.
    for trial in range(1, 3 * trials + 2):
        server.add_trial(trial, run_id=1, editors=("bench",))
    conn.send((server.url, token))
    while True:
        command = conn.recv()
        if command == "count":
            conn.send(len(server.store.posts))
        elif command == "refusals":
            conn.send(len(server.store.refusals))
        elif command == "restart":  # the refused trial: its reports now carry a stale run id
            conn.send(server.restart_trial(3 * trials + 1))
        else:
            break
    server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _machine() -> str:
    return f"{os.cpu_count()} CPUs ({cpu_model()}), Python {platform.python_version()}"


def _batched(
    trials: int, per_request: int, step: int, t: int, base: int = 0
) -> list[tuple[object, object]]:
    """(metrics, traces) requests, each holding `per_request` trials like a collector batch
    (trial ids base+1 .. base+trials)."""
    out = []
    for first in range(base + 1, base + trials + 1, per_request):
        metrics = seed_metrics_request(trial_resource(first, agent=f"agent-{first}"), t=t)
        traces = timing_spans_request(trial_resource(first), [step], start_ns=t)
        for trial in range(first + 1, min(first + per_request, base + trials + 1)):
            metrics.resource_metrics.extend(
                seed_metrics_request(
                    trial_resource(trial, agent=f"agent-{trial}"), t=t
                ).resource_metrics
            )
            traces.resource_spans.extend(
                timing_spans_request(trial_resource(trial), [step], start_ns=t).resource_spans
            )
        out.append((metrics, traces))
    return out


def _run_bridge(
    args: argparse.Namespace, url: str, token: str, parent: Connection, refused_trial: bool
) -> dict[str, float]:
    """One bridge process fed by `args.trials` healthy trials (plus a refused one)."""

    def count() -> int:
        parent.send("count")
        return int(parent.recv())

    def refusals() -> int:
        parent.send("refusals")
        return int(parent.recv())

    start_posts, start_refusals = count(), refusals()
    work = Path(tempfile.mkdtemp(prefix="otelprof-bench-det-"))
    (work / "token").write_text(token)
    port = _free_port()
    bridge = subprocess.Popen(
        [sys.executable, "-m", "otelprof", "determined-bridge", "--listen", f"127.0.0.1:{port}",
         "--master", url, "--token-file", str(work / "token"), "--spool-dir", str(work / "spool"),
         "--ingest-tokens", str(write_token_file(work / "ingest-tokens")),
         "--report-interval", str(args.window), "--log-level", "WARNING", "--workers", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    assert bridge.stdout is not None
    bridge.stdout.readline()  # "listening on port ..."
    proc = psutil.Process(bridge.pid)
    time.sleep(1.0)
    idle_rss = proc.memory_info().rss
    peak = [idle_rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    otlp = OtlpClient(port)
    sends, step = 0, 0
    fan_start = time.monotonic()
    while time.monotonic() - fan_start < args.seconds:
        tick = time.monotonic()
        now_ns = time.time_ns()
        if refused_trial:  # first in every window: a single queue would stall behind it
            bad = 3 * args.trials + 1
            otlp.send_metrics(seed_metrics_request(trial_resource(bad, agent="bad"), t=now_ns))
            otlp.send_traces(timing_spans_request(trial_resource(bad), [step], start_ns=now_ns))
            sends += 2
        base = 2 * args.trials if refused_trial else args.trials
        for metrics, traces in _batched(args.trials, 50, step, now_ns, base):
            otlp.send_metrics(metrics, timeout=30)
            otlp.send_traces(traces, timeout=30)
            sends += 2
        step += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    fan_s = time.monotonic() - fan_start
    otlp.close()

    # Drain: the last window closes within `window` s. The rate counts only polls during
    # which deliveries happened (busy time), not the wait for the window to close.
    last = count()
    drained_from, busy_s = last, 0.0
    deadline = time.monotonic() + 180
    quiet_since = prev_poll = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now, t = count(), time.monotonic()
        if now != last:
            busy_s += t - prev_poll
            last, quiet_since = now, t
        elif t - quiet_since > args.window + 3:
            break
        prev_poll = t
    settle_s = quiet_since - fan_start - fan_s
    stop.set()
    sampler.join()
    refused = refusals() - start_refusals
    bridge.send_signal(signal.SIGTERM)
    bridge.wait(30)
    return {
        "sends": sends, "fan_s": fan_s, "settle_s": settle_s, "refused": refused,
        "delivered": last - start_posts,
        "drain_rate": (last - drained_from) / busy_s if busy_s else 0.0,
        "idle_rss": idle_rss, "peak_rss": peak[0],
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=12.0, help="fan-in duration")
    parser.add_argument("--window", type=float, default=4.0, help="bridge report window (s)")
    args = parser.parse_args()

    parent, child = mp.Pipe()
    master_proc = mp.Process(target=_master, args=(child, args.trials), daemon=True)
    master_proc.start()
    url, token = parent.recv()

    # -- baseline: bare POST loop, same bodies the bridge sends -------------------------------
    from otelprof.determined.aggregate import WindowAggregator
    from otelprof.determined.mapping import Route, extract_metrics, extract_spans

    agg = WindowAggregator()
    for metrics, traces in _batched(args.trials, 50, 0, time.time_ns()):
        agg.add_gauges(extract_metrics(metrics, Route()).gauges)  # type: ignore[arg-type]
        agg.add_timings(extract_spans(traces, Route()).timings)  # type: ignore[arg-type]
    reports = agg.drain()
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers) as client:
        start = time.perf_counter()
        for report in reports:
            client.post(f"/api/v1/trials/{report.trial_id}/metrics", json=report.body)
        raw_s = time.perf_counter() - start
    raw_rps = len(reports) / raw_s

    healthy = _run_bridge(args, url, token, parent, refused_trial=False)
    parent.send("restart")
    parent.recv()
    with_refused = _run_bridge(args, url, token, parent, refused_trial=True)
    parent.send("stop")
    master_proc.join(10)

    print(f"machine: {_machine()}")
    print(f"trials: {args.trials}, fan-in {healthy['fan_s']:.1f} s, {healthy['sends']:.0f} OTLP "
          f"requests (50 trials each), window {args.window:g} s")  # fmt: skip
    print(f"baseline  bare httpx POST loop: {raw_rps:8.0f} reports/s ({len(reports)} reports)")
    for name, r in (("bridge", healthy), ("refused", with_refused)):
        print(f"{name:9} drain rate (healthy): {r['drain_rate']:8.0f} reports/s "
              f"(ratio {r['drain_rate'] / raw_rps:.2f} of baseline)")  # fmt: skip
        print(f"{name:9} delivered           : {r['delivered']:.0f} reports, "
              f"{r['refused']:.0f} refused by master, last one {r['settle_s']:.1f} s after the "
              "last send")  # fmt: skip
        print(
            f"{name:9} RSS idle / peak     : {r['idle_rss'] / 2**20:.1f} MiB / "
            f"{r['peak_rss'] / 2**20:.1f} MiB (+"
            f"{(r['peak_rss'] - r['idle_rss']) / 2**10 / args.trials:.1f} KiB per trial)"
        )
    print(f"healthy trials' rate with one refused trial / all healthy: "
          f"{with_refused['drain_rate'] / healthy['drain_rate']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
