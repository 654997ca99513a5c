"""The Prometheus pull endpoint holds a bounded number of threads and connections.

prometheus_client's server ran one thread per connection: 200 idle connections put 206
threads into the training process, and a burst of scrapers got no answer for 20 s.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

import otelprof
from otelprof.export._prom_server import MAX_CONNECTIONS, WORKERS

IDLE = 200


def _pull_only() -> otelprof.Profiler:
    return otelprof.instrument(
        detached=False, prometheus_port=0, host_metrics=False, process_metrics=False,
        gpus="none", interval=0.2,
    )  # fmt: skip


def _scrape(port: int) -> tuple[int, float]:
    started = time.monotonic()
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10.0)
    return response.status_code, time.monotonic() - started


def test_idle_connections_add_no_threads_and_scrapes_are_still_answered() -> None:
    with _pull_only() as prof:
        port = prof.prometheus_port
        assert port
        status, _ = _scrape(port)  # the workers exist from here on
        assert status == 200
        threads_before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(IDLE)]
        try:
            time.sleep(1.0)
            # one accept thread and WORKERS handler threads, whatever the connections
            assert threading.active_count() <= threads_before + WORKERS
            status, took = _scrape(port)
            assert status == 200 and took < 5.0, took
            with ThreadPoolExecutor(20) as burst:  # a burst of scrapers, all answered
                answers = list(burst.map(lambda _i: _scrape(port), range(20)))
            assert all(code == 200 for code, _ in answers)
            assert max(took for _, took in answers) < 8.0, answers
            assert threading.active_count() <= threads_before + WORKERS + 20
        finally:
            for conn in idle:
                conn.close()


def test_connections_past_the_cap_close_the_longest_idle_ones() -> None:
    with _pull_only() as prof:
        port = prof.prometheus_port
        assert port
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS + 8)]
        try:
            time.sleep(1.0)
            closed = 0
            for conn in idle[:8]:  # the first ones were closed by the server
                conn.settimeout(2.0)
                try:
                    closed += conn.recv(1) == b""  # end of stream: the server closed it
                except ConnectionResetError:
                    closed += 1
                except TimeoutError:
                    pass  # still open
            assert closed == 8
            status, _ = _scrape(port)
            assert status == 200
        finally:
            for conn in idle:
                conn.close()
