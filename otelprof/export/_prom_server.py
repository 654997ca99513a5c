"""The Prometheus pull endpoint with a bounded number of threads and connections.

prometheus_client's `start_http_server` runs one thread per connection with no cap: 200 idle
connections put 206 threads into the training process, and scrapers arriving behind them got
no answer for 20 s. Here one thread waits on every connection at once (a selector) and hands a
connection to one of `WORKERS` handler threads only once its request has started to arrive,
so idle connections cost a file descriptor, not a thread. At most `MAX_CONNECTIONS` are held:
past that the longest-idle one is closed; an idle connection is closed after
`IDLE_TIMEOUT_S` and a request that does not finish arriving within `REQUEST_TIMEOUT_S` is
dropped, so a slow client holds a worker for at most that long.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler

_log = logging.getLogger("otelprof.export")

WORKERS = 2
MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 5.0
_POLL_S = 0.25


class BoundedMetricsServer:
    """Serves the registry's metrics (any path, as prometheus_client does) on host:port."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        *,
        workers: int = WORKERS,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self._listener = socket.socket(family, kind, proto)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(address)
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.server_address: tuple[Any, ...] = self._listener.getsockname()
        self._handler = MetricsHandler.factory(registry)
        self._max_connections = max_connections
        self._idle_timeout_s = idle_timeout_s
        self._request_timeout_s = request_timeout_s
        self._idle: OrderedDict[socket.socket, float] = OrderedDict()
        self._busy = 0  # connections handed to a worker and not closed yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="otelprof-prometheus")
        self._thread = threading.Thread(
            target=self._serve, name="otelprof-prometheus-accept", daemon=True
        )
        self._thread.start()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._idle) + self._busy

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                for key, _events in self._selector.select(timeout=_POLL_S):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._dispatch(key.fileobj)  # type: ignore[arg-type]
                self._expire_idle()
        except Exception:  # never let the endpoint's failure reach anything else
            _log.exception("otelprof: the Prometheus endpoint stopped")
        finally:
            for conn in list(self._idle):
                self._close_idle(conn)
            self._selector.close()

    def _accept(self) -> None:
        for _ in range(64):  # a burst of connections, without starving the ready ones
            try:
                conn, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:  # EMFILE and the like: try again on the next wakeup
                _log.debug("otelprof: Prometheus endpoint accept failed: %s", error)
                return
            conn.setblocking(False)
            if self.open_connections >= self._max_connections:
                oldest = next(iter(self._idle), None)
                if oldest is None:  # every held connection is being answered: no room
                    conn.close()
                    continue
                self._close_idle(oldest)
            with self._lock:
                self._idle[conn] = time.monotonic()
            self._selector.register(conn, selectors.EVENT_READ)

    def _close_idle(self, conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        with self._lock:
            self._idle.pop(conn, None)
        conn.close()

    def _expire_idle(self) -> None:
        deadline = time.monotonic() - self._idle_timeout_s
        while self._idle:
            conn, since = next(iter(self._idle.items()))
            if since > deadline:
                return
            self._close_idle(conn)

    def _dispatch(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        with self._lock:
            self._idle.pop(conn, None)
            self._busy += 1
        try:
            self._workers.submit(self._answer, conn)
        except RuntimeError:  # shutting down
            self._done(conn)

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(self._request_timeout_s)
            self._handler(conn, conn.getpeername(), self)
        except Exception as error:  # a client that hung up or stalled: its problem only
            _log.debug("otelprof: Prometheus scrape not answered: %r", error)
        finally:
            self._done(conn)

    def _done(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        conn.close()
        with self._lock:
            self._busy -= 1

    def shutdown(self) -> None:
        """Stop accepting, close every connection, and wait for the threads (bounded)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._listener.close()
