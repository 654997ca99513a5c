"""A Prometheus /metrics endpoint with a bounded number of threads and connections (the
bridge's self-metrics, `selfmetrics.py`).

prometheus_client's `start_http_server` runs a thread per connection, uncapped, so idle
connections pile threads into the process. Here one selector thread reads every
request's head without blocking and only a complete request reaches one of `WORKERS`
handler threads: a silent or trickling connection (a slowloris) costs a descriptor and at
most `MAX_REQUEST_HEAD` bytes, never a worker. At most `MAX_CONNECTIONS` are held (past it,
the one trickling longest is closed, else the one idle longest); `IDLE_TIMEOUT_S` with
nothing sent, `REQUEST_TIMEOUT_S` from the first byte to a whole head, and per write.
"""

from __future__ import annotations

import contextlib
import io
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler

_log = logging.getLogger("otelprof.export")

WORKERS = 2
MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_HEAD = 16 * 1024  # a scrape's request line and headers are a few hundred bytes
_POLL_S = 0.25
_END_OF_HEAD = (b"\r\n\r\n", b"\n\n")


@dataclass
class _Pending:
    """A connection whose request has not arrived whole yet."""

    accepted: float
    head: bytearray = field(default_factory=bytearray)
    first_byte: float | None = None


class _Received:
    """The connection as the request handler sees it: the request head already read (a GET
    has no body), everything else the socket itself."""

    def __init__(self, conn: socket.socket, head: bytes) -> None:
        self._conn = conn
        self._head = head

    def makefile(self, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode:
            return io.BytesIO(self._head)
        return self._conn.makefile(mode, *args, **kwargs)  # type: ignore[call-overload]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class BoundedMetricsServer:
    """Serves the registry's metrics (any path, as prometheus_client does) on host:port."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
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
        self._pending: OrderedDict[socket.socket, _Pending] = OrderedDict()  # oldest first
        self._busy = 0  # connections handed to a worker and not closed yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._workers = ThreadPoolExecutor(WORKERS, thread_name_prefix="otelprof-prometheus")
        self._thread = threading.Thread(
            target=self._serve, name="otelprof-prometheus-accept", daemon=True
        )
        self._thread.start()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._pending) + self._busy

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                for key, _events in self._selector.select(timeout=_POLL_S):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj in self._pending:  # (not closed by this round's accept)
                        self._read(key.fileobj)  # type: ignore[arg-type]
                self._expire()
        except Exception:  # never let the endpoint's failure reach anything else
            _log.exception("otelprof: the Prometheus endpoint stopped")
        finally:
            for conn in list(self._pending):
                self._close_pending(conn)
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
            if self.open_connections >= MAX_CONNECTIONS:
                # the requests that arrived whole are served, not closed for room
                for key, _events in self._selector.select(timeout=0):
                    if key.fileobj in self._pending:
                        self._read(key.fileobj)  # type: ignore[arg-type]
                victim = self._victim()
                if victim is None:  # every held connection is being answered: no room
                    conn.close()
                    continue
                self._close_pending(victim)
            with self._lock:
                self._pending[conn] = _Pending(time.monotonic())
            self._selector.register(conn, selectors.EVENT_READ)
            self._read(conn)  # a scraper's request is usually there already

    def _victim(self) -> socket.socket | None:
        """The connection to close for room: the one trickling a request the longest (a
        scraper sends its request whole at once), else the one idle the longest."""
        for conn, state in self._pending.items():
            if state.head:
                return conn
        return next(iter(self._pending), None)

    def _read(self, conn: socket.socket) -> None:
        """Take what arrived of the request's head; hand the connection on once it is whole."""
        state = self._pending[conn]
        try:
            data = conn.recv(MAX_REQUEST_HEAD + 1 - len(state.head))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client hung up (or reset)
            self._close_pending(conn)
            return
        if state.first_byte is None:
            state.first_byte = time.monotonic()
        state.head += data
        if any(end in state.head for end in _END_OF_HEAD):
            self._dispatch(conn, bytes(state.head))
        elif len(state.head) > MAX_REQUEST_HEAD:
            self._close_pending(conn)

    def _close_pending(self, conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        with self._lock:
            self._pending.pop(conn, None)
        conn.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for conn, state in list(self._pending.items()):
            if state.first_byte is None:
                late = now - state.accepted > IDLE_TIMEOUT_S
            else:
                late = now - state.first_byte > REQUEST_TIMEOUT_S
            if late:
                self._close_pending(conn)

    def _dispatch(self, conn: socket.socket, head: bytes) -> None:
        self._selector.unregister(conn)
        with self._lock:
            self._pending.pop(conn, None)
            self._busy += 1
        try:
            self._workers.submit(self._answer, conn, head)
        except RuntimeError:  # shutting down
            self._done(conn)

    def _answer(self, conn: socket.socket, head: bytes) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(REQUEST_TIMEOUT_S)  # each write: a reader that stalls
            self._handler(_Received(conn, head), conn.getpeername(), self)
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
