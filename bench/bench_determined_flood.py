"""Determined bridge: a healthy trial's delivery while another trial floods the bridge.

Side by side, alternating (A-B-A-B), each run a fresh `otelprof determined-bridge` process
(on-disk spool, fsync on) in front of one contract master (tests/determined_contract.py,
its own process):
  alone    one healthy trial sends a step's spans and one sample of every gauge each tick
  flooded  the same, while a second trial (its own token) sends from 8 threads at once:
           4 MB requests of gauges (the per-request cap) and a cardinality flood of 100,000
           agent ids
Reported per run: the healthy trial's OTLP requests answered per second and their p95
latency, its reports stored by the master per second, the flood's requests refused (by
reason), and the bridge's peak resident memory. The ratios flooded/alone are the figures.

    .venv/bin/python bench/bench_determined_flood.py [--seconds 8] [--pairs 2]
        [--bridge-repo ../main-copy]   # the bridge of another checkout, for a before/after
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import psutil
from _machine import cpu_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2  # noqa: E402
from opentelemetry.proto.metrics.v1 import metrics_pb2  # noqa: E402
from opentelemetry.proto.resource.v1.resource_pb2 import Resource  # noqa: E402

from tests.determined_contract import DeterminedContractServer  # noqa: E402
from tests.determined_feed import (  # noqa: E402
    OtlpClient,
    kv,
    seed_metrics_request,
    timing_spans_request,
    trial_resource,
    write_token_file,
)

HEALTHY_TOKEN = "bench-healthy-token-0123456789abcdef"
FLOOD_TOKEN = "bench-flood-token-0123456789abcdefgh"
TICK_S = 0.05


def _master(conn: Connection, runs: int) -> None:
    server = DeterminedContractServer().start()
    token = server.add_user("bench")
    for trial in range(1, 4 * runs + 3):
        server.add_trial(trial, run_id=1)
    conn.send((server.url, token))
    while True:
        command = conn.recv()
        if isinstance(command, tuple) and command[0] == "count":
            conn.send(sum(1 for p in server.store.posts if p.trial_id == command[1]))
        elif command == "refusals":
            conn.send(server.store.refusals[-3:])
        else:
            break
    server.stop()


def _has_ingest_tokens(repo: Path) -> bool:
    """Whether the bridge under test takes ingest tokens (an older checkout does not)."""
    out = subprocess.run(
        [sys.executable, "-m", "otelprof", "determined-bridge", "--help"],
        capture_output=True, text=True, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
    )  # fmt: skip
    return "--ingest-tokens" in out.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _big_request(trial: int, n_bytes: int) -> Any:
    request = seed_metrics_request(trial_resource(trial))
    request.resource_metrics[0].resource.attributes.append(kv("padding", "x" * n_bytes))
    return request


def _agents_request(trial: int, first: int, count: int) -> Any:
    request = metrics_service_pb2.ExportMetricsServiceRequest()
    t = time.time_ns()
    for agent in range(first, first + count):
        gauge = metrics_pb2.Metric(
            name="system.cpu.utilization",
            unit="1",
            gauge=metrics_pb2.Gauge(
                data_points=[metrics_pb2.NumberDataPoint(time_unix_nano=t, as_double=0.5)]
            ),
        )
        attrs = trial_resource(trial, agent=f"flood-{agent}")
        request.resource_metrics.append(
            metrics_pb2.ResourceMetrics(
                resource=Resource(attributes=[kv(k, v) for k, v in attrs.items()]),
                scope_metrics=[metrics_pb2.ScopeMetrics(metrics=[gauge])],
            )
        )
    return request


def _flood(port: int, trial: int, flood_mb: float, stop: Any, out: Any) -> None:
    """7 threads of `flood_mb` requests and one of 100,000 agent ids, until `stop`."""
    answers: dict[str, int] = {}
    lock = threading.Lock()

    def big() -> None:
        client = OtlpClient(port, token=FLOOD_TOKEN)
        request = _big_request(trial, int(flood_mb * 1024 * 1024) - 4096)
        while not stop.is_set():
            try:
                client.send_metrics(request, timeout=30)
                key = "OK"
            except grpc.RpcError as exc:
                key = exc.code().name
            with lock:
                answers[key] = answers.get(key, 0) + 1
        client.close()

    def agents() -> None:
        client = OtlpClient(port, token=FLOOD_TOKEN)
        first = 0
        while not stop.is_set() and first < 100_000:
            try:
                client.send_metrics(_agents_request(trial, first, 5000), timeout=30)
                first += 5000
            except grpc.RpcError:
                time.sleep(0.05)
        client.close()

    threads = [threading.Thread(target=big) for _ in range(7)]
    threads.append(threading.Thread(target=agents))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(answers)


def _run(
    args: argparse.Namespace, url: str, token: str, parent: Connection, trial: int, flood: bool
) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="otelprof-bench-flood-"))
    (work / "token").write_text(token)
    tokens = write_token_file(
        work / "ingest", [f"{HEALTHY_TOKEN} trial={trial}", f"{FLOOD_TOKEN} trial={trial + 1}"]
    )
    port = _free_port()
    ingest = ["--ingest-tokens", str(tokens)] if _has_ingest_tokens(args.bridge_repo) else []
    bridge = subprocess.Popen(
        [sys.executable, "-m", "otelprof", "determined-bridge", "--listen", f"127.0.0.1:{port}",
         "--master", url, "--token-file", str(work / "token"), *ingest,
         "--spool-dir", str(work / "spool"), "--report-interval", "1", "--log-level", "WARNING",
         "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=args.bridge_repo,
        env={**os.environ, "PYTHONPATH": str(args.bridge_repo)},
    )  # fmt: skip
    assert bridge.stdout is not None
    line = bridge.stdout.readline().decode()
    metrics_port = int(re.search(r"metrics on port (\d+)", line).group(1))  # type: ignore[union-attr]
    proc = psutil.Process(bridge.pid)
    stop = threading.Event()
    peak = [proc.memory_info().rss]

    def watch_memory() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], proc.memory_info().rss)

    threads = [threading.Thread(target=watch_memory)]
    for t in threads:
        t.start()
    flood_stop = mp.Event()
    flood_out: mp.Queue[dict[str, int]] = mp.Queue()
    flooder = mp.Process(
        target=_flood, args=(port, trial + 1, args.flood_mb, flood_stop, flood_out)
    )
    if flood:  # its own process: the healthy sender here does not share its interpreter
        flooder.start()
    healthy = OtlpClient(port, token=HEALTHY_TOKEN)
    waits: list[float] = []
    step = 0
    parent.send(("count", trial))
    before = int(parent.recv())
    started = time.monotonic()
    while time.monotonic() - started < args.seconds:
        now = time.time_ns()
        t0 = time.monotonic()
        healthy.send_metrics(seed_metrics_request(trial_resource(trial), t=now), timeout=60)
        healthy.send_traces(
            timing_spans_request(trial_resource(trial), [step], start_ns=now), timeout=60
        )
        waits.append(time.monotonic() - t0)
        step += 1
        time.sleep(TICK_S)
    elapsed = time.monotonic() - started
    time.sleep(2.5)  # the last window closes and is delivered
    parent.send(("count", trial))
    stored = int(parent.recv()) - before
    stop.set()
    for t in threads:
        t.join()
    flood_answers: dict[str, int] = {}
    if flood:
        flood_stop.set()
        flood_answers = flood_out.get(timeout=120)
        flooder.join(60)
    import httpx

    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    refused = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r"^otelprof_determined_bridge_(refused_\w+|dropped_agents)_total (\S+)$", text, re.M
        )
    }
    healthy.close()
    bridge.terminate()
    bridge.wait(30)
    return {
        "healthy_req_per_s": len(waits) / elapsed,
        "healthy_p95_ms": statistics.quantiles(waits, n=20)[-1] * 1000,
        "healthy_reports_per_s": stored / elapsed,
        "peak_rss_mb": peak[0] / 2**20,
        "flood_requests": float(sum(flood_answers.values())),
        **{k: v for k, v in refused.items() if v},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--flood-mb", type=float, default=4.0, help="size of each flood request")
    parser.add_argument(
        "--bridge-repo",
        type=Path,
        default=REPO,
        help="checkout whose bridge runs (e.g. a copy of main, for a before/after)",
    )
    args = parser.parse_args()
    parent, child = mp.Pipe()
    master = mp.Process(target=_master, args=(child, args.pairs), daemon=True)
    master.start()
    url, token = parent.recv()
    print(f"machine: {os.cpu_count()} CPUs ({cpu_model()}), Python {platform.python_version()}")
    print(f"bridge from: {args.bridge_repo.name}, load before: {os.getloadavg()}")
    results: dict[str, list[dict[str, float]]] = {"alone": [], "flooded": []}
    trial = 1
    for _ in range(args.pairs):
        for kind in ("alone", "flooded"):
            row = _run(args, url, token, parent, trial, kind == "flooded")
            results[kind].append(row)
            print(kind, {k: round(v, 1) for k, v in row.items()}, flush=True)
            trial += 2
    print(f"load after: {os.getloadavg()}")
    for key in ("healthy_req_per_s", "healthy_p95_ms", "healthy_reports_per_s", "peak_rss_mb"):
        alone = statistics.median(r[key] for r in results["alone"])
        flooded = statistics.median(r[key] for r in results["flooded"])
        print(
            f"{key}: alone {alone:.1f}, flooded {flooded:.1f}, flooded/alone {flooded / alone:.2f}"
        )
    parent.send("stop")
    master.join(10)


if __name__ == "__main__":
    main()
