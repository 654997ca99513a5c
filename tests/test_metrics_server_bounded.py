"""The bounded /metrics server (the Determined bridge's self-metrics) holds a bounded number
of threads and connections.

prometheus_client's server ran one thread per connection: 200 idle connections put 206
threads into the process, and a burst of scrapers got no answer for 20 s. Then,
with the threads bounded, 200 connections that trickled their requests held the workers: a
scrape timed out and a storm of 20 scrapers got 0 answers.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx

from otelprof.determined._prom_server import MAX_CONNECTIONS, WORKERS
from otelprof.determined.selfmetrics import serve_metrics

IDLE = 200
SCRAPE_TIMEOUT_S = 10.0  # Prometheus' default scrape_timeout


@contextmanager
def _server() -> Iterator[int]:
    """The bridge's self-metrics endpoint on a free port; yields the port."""
    port, stop = serve_metrics(lambda: {"exported_points": 1, "pending": 0}, 0)
    try:
        yield port
    finally:
        stop()


def _scrape(port: int) -> tuple[int, float]:
    started = time.monotonic()
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S)
    return response.status_code, time.monotonic() - started


def _answered(port: int) -> tuple[bool, float]:
    started = time.monotonic()
    try:
        ok = _scrape(port)[0] == 200
    except httpx.HTTPError:
        ok = False
    return ok, time.monotonic() - started


class SlowClients:
    """`count` connections that each start a request and send one more header byte every
    `every_s` (a slowloris), opening a new one whenever the endpoint closes one."""

    def __init__(self, port: int, count: int = IDLE, every_s: float = 0.5) -> None:
        self.port, self.count, self.every_s = port, count, every_s
        self.opened = 0
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _open(self) -> bool:
        try:
            conn = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        except OSError:
            return False
        conn.setblocking(False)
        self._selector.register(conn, selectors.EVENT_READ)
        self.opened += 1
        return True

    def _close(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        conn.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            while len(self._selector.get_map()) < self.count and self._open():
                pass
            deadline = time.monotonic() + self.every_s
            while (left := deadline - time.monotonic()) > 0:
                for key, _events in self._selector.select(left):
                    conn = key.fileobj
                    assert isinstance(conn, socket.socket)
                    try:
                        data = conn.recv(4096)
                    except OSError:
                        data = b""
                    if not data:  # closed by the endpoint: open another
                        self._close(conn)
            for key in list(self._selector.get_map().values()):
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                try:
                    conn.send(b"X")
                except OSError:
                    self._close(conn)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()


def test_idle_connections_add_no_threads_and_scrapes_are_still_answered() -> None:
    with _server() as port:
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
    with _server() as port:
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


def test_scrapes_are_answered_while_slow_connections_hold_every_slot() -> None:
    with _server() as port:
        slow = SlowClients(port)
        try:
            time.sleep(2.0)  # every slot held, each trickling its request
            ok, took = _answered(port)
            assert ok and took < SCRAPE_TIMEOUT_S, took
            with ThreadPoolExecutor(20) as storm:
                answers = list(storm.map(lambda _i: _answered(port), range(20)))
        finally:
            slow.stop()
    answered = sum(ok for ok, _ in answers)
    print(f"one scrape {took:.2f} s; storm {answered} of 20 answered, slowest "
          f"{max(t for _, t in answers):.2f} s; {slow.opened} slow connections opened")  # fmt: skip
    assert slow.opened > MAX_CONNECTIONS  # the slow ones were closed and came back
    assert answered == 20, answers
