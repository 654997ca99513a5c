"""A Determined master that speaks only the contract otelprof relies on, strictly.

Written from shared/reference/determined-api.md (Determined 0.38.1), not from otelprof's
code: route, auth headers, required fields and their JSON types, group-name rules, the
run-id check, `stepsCompleted` required for non-profiling groups, merging of a repeated
(trial, group, stepsCompleted) with overlapping keys refused. What it stored is read back
through the shapes the Web UI uses: the profiler's `available_series` and `metrics`
endpoints and `trial_metrics` for generic groups (newline-delimited `{"result": ...}`).

Stricter than the real master where that catches client bugs: unknown JSON fields are
refused, and a body `trialId` different from the path is refused. A real HTTP server on a
free loopback port; `down()` closes it (connections included) to simulate an outage.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import re
import secrets
import socket
import ssl
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

PROFILING_GROUPS = {"gpu", "cpu", "memory", "disk", "network"}
PASSWORD_SALT = "GubPEmmotfiK9TMD6Zdw"
METRIC_TYPE_SYSTEM = "PROFILER_METRIC_TYPE_SYSTEM"
INT32 = (-(2**31), 2**31 - 1)

# gRPC status code -> HTTP status, as grpc-gateway maps them.
_HTTP = {3: 400, 5: 404, 7: 403, 9: 400, 13: 500, 14: 503, 16: 401}

_PREFIX_GROUP = (("cpu_", "cpu"), ("gpu_", "gpu"), ("disk_", "disk"), ("net_", "network"),
                 ("memory_", "memory"))  # fmt: skip


class _ClientGone(Exception):
    """The request body ended before its Content-Length."""


class ApiError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Trial:
    trial_id: int
    run_id: int
    experiment_id: int
    editors: set[str]


@dataclass
class ProfilingRow:
    id: int
    trial_id: int
    run_id: int
    group: str
    metrics: dict[str, Any]
    end_time: dt.datetime


@dataclass
class GenericRow:
    id: int
    trial_id: int
    run_id: int
    group: str
    total_batches: int
    avg_metrics: dict[str, Any]
    batch_metrics: list[dict[str, Any]] | None
    end_time: dt.datetime


@dataclass
class Post:
    """One accepted ReportTrialMetrics call, in arrival order."""

    trial_id: int
    group: str
    body: dict[str, Any]
    auth_header: str


@dataclass
class Store:
    lock: threading.Lock = field(default_factory=threading.Lock)
    users: dict[str, str] = field(default_factory=dict)  # name -> password
    user_tokens: dict[str, str] = field(default_factory=dict)  # token -> user
    allocation_tokens: dict[str, str] = field(default_factory=dict)  # token -> user
    trials: dict[int, Trial] = field(default_factory=dict)
    profiling: list[ProfilingRow] = field(default_factory=list)
    generic: dict[tuple[int, str, int], GenericRow] = field(default_factory=dict)
    posts: list[Post] = field(default_factory=list)
    refusals: list[tuple[int, str]] = field(default_factory=list)
    logins: int = 0
    next_id: int = 1
    fail_remaining: int = 0
    fail_status: int = 503


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _rfc3339(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _parse_timestamp(value: Any) -> dt.datetime:
    if not isinstance(value, str) or "T" not in value:
        raise ApiError(3, f"reportTime: invalid google.protobuf.Timestamp value {value!r}")
    text = value[:-1] + "+00:00" if value.endswith(("Z", "z")) else value
    try:
        stamp = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ApiError(
            3, f"reportTime: invalid google.protobuf.Timestamp value {value!r}"
        ) from None
    if stamp.tzinfo is None:
        raise ApiError(3, f"reportTime: {value!r} has no time zone (RFC 3339 needs one)")
    return stamp


def _int32(obj: dict[str, Any], camel: str, snake: str, where: str, required: bool) -> int | None:
    if camel in obj and snake in obj:
        raise ApiError(3, f"{where}: field {camel} set twice (as {camel} and {snake})")
    raw = obj.get(camel, obj.get(snake))
    if raw is None:
        if required:
            raise ApiError(3, f"{where}.{camel} is required")
        return None
    if isinstance(raw, bool):
        raise ApiError(3, f"{where}.{camel}: invalid value {raw!r} for type int32")
    if isinstance(raw, str) and re.fullmatch(r"-?\d+", raw):  # protojson accepts both
        raw = int(raw)
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    if not isinstance(raw, int) or not INT32[0] <= raw <= INT32[1]:
        raise ApiError(3, f"{where}.{camel}: invalid value {raw!r} for type int32")
    return raw


def _only_fields(obj: Any, allowed: set[str], where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ApiError(3, f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ApiError(3, f"{where}: unknown field {unknown[0]!r}")
    return obj


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms stalls
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read state, not access logs."""

    # -- plumbing --------------------------------------------------------------------------
    def _send(self, status: int, payload: Any, ndjson: list[Any] | None = None) -> None:
        if ndjson is not None:
            data = b"".join(json.dumps(line).encode() + b"\n" for line in ndjson)
        else:
            data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, exc: ApiError) -> None:
        status = _HTTP.get(exc.code, 500)
        with self.server.store.lock:
            self.server.store.refusals.append((status, exc.message))
        self._send(status, {"code": exc.code, "message": exc.message, "details": []})

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if len(raw) < length:
            # The client went away mid-request (e.g. killed): like an HTTP server hitting an
            # unexpected EOF, drop the request unprocessed instead of answering it.
            self.close_connection = True
            raise _ClientGone
        try:
            return json.loads(raw or b"null")
        except ValueError as exc:
            raise ApiError(3, f"invalid JSON body: {exc}") from None

    def _user(self) -> str:
        store = self.server.store
        for header, tokens in (
            ("Authorization", store.user_tokens),
            ("Grpc-Metadata-x-user-token", store.user_tokens),
            ("Grpc-Metadata-x-allocation-token", store.allocation_tokens),
        ):
            value = self.headers.get(header)
            if value is None:
                continue
            if not value.startswith("Bearer "):
                raise ApiError(16, f"{header} must be 'Bearer <token>'")
            user = tokens.get(value[len("Bearer ") :])
            if user is None:
                raise ApiError(16, "invalid credentials")
            return user
        raise ApiError(16, "unauthenticated: no credentials given")

    def _dispatch(self, method: str) -> None:
        store = self.server.store
        with store.lock:
            failing = store.fail_remaining > 0
            if failing:
                store.fail_remaining -= 1
        if failing:
            if method == "POST":
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(store.fail_status, {"code": 14, "message": "injected failure"})
            return
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        try:
            if method == "POST" and url.path == "/api/v1/auth/login":
                return self._send(200, self._login(self._body()))
            m = re.fullmatch(r"/api/v1/trials/([^/]+)/metrics", url.path)
            if method == "POST" and m:
                body = self._body()
                user = self._user()
                self._report(m.group(1), body, user, self._auth_header())
                return self._send(200, {})
            m = re.fullmatch(r"/api/v1/trials/(\d+)/profiler/available_series", url.path)
            if method == "GET" and m:
                self._user()
                labels = self.server.available_series(int(m.group(1)))
                return self._send(200, None, ndjson=[{"result": {"labels": labels}}])
            m = re.fullmatch(r"/api/v1/trials/(\d+)/profiler/metrics", url.path)
            if method == "GET" and m:
                self._user()
                batches = self.server.profiler_metrics(int(m.group(1)), query)
                return self._send(200, None, ndjson=[{"result": {"batch": b}} for b in batches])
            if method == "GET" and url.path == "/api/v1/trials/metrics/trial_metrics":
                self._user()
                reports = self.server.trial_metrics(query)
                return self._send(200, None, ndjson=[{"result": {"metrics": reports}}])
            raise ApiError(5, "Not Found")
        except ApiError as exc:
            self._error(exc)
        except _ClientGone:
            return

    def _auth_header(self) -> str:
        for header in ("Authorization", "Grpc-Metadata-x-user-token",
                       "Grpc-Metadata-x-allocation-token"):  # fmt: skip
            if header in self.headers:
                return header
        return ""

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_GET(self) -> None:
        self._dispatch("GET")

    # -- /api/v1/auth/login ---------------------------------------------------------------------
    def _login(self, body: Any) -> dict[str, Any]:
        body = _only_fields(body, {"username", "password", "isHashed", "is_hashed"}, "login")
        store = self.server.store
        username, password = body.get("username"), body.get("password", "")
        if not isinstance(username, str) or not isinstance(password, str):
            raise ApiError(3, "username and password must be strings")
        expected = store.users.get(username)
        hashed = body.get("isHashed", body.get("is_hashed", False))
        if expected is not None and hashed and expected:
            expected = hashlib.sha512((PASSWORD_SALT + expected).encode()).hexdigest()
        if expected is None or password != expected:
            raise ApiError(16, "invalid credentials")
        token = secrets.token_hex(16)
        with store.lock:
            store.user_tokens[token] = username
            store.logins += 1
        return {"token": token, "user": {"username": username, "active": True}}

    # -- POST /api/v1/trials/{id}/metrics ------------------------------------------------------
    def _report(self, path_id: str, body: Any, user: str, header: str) -> None:
        if not re.fullmatch(r"-?\d+", path_id):
            raise ApiError(3, f"type mismatch, parameter: metrics.trial_id, error: {path_id!r}")
        trial_id = int(path_id)
        body = _only_fields(body, {"metrics", "group"}, "ReportTrialMetricsRequest")
        group = body.get("group")
        if not isinstance(group, str) or not group:
            raise ApiError(3, "group is required (a non-empty string)")
        if "." in group:
            raise ApiError(3, "metric group cannot contain '.'")
        metrics = _only_fields(
            body.get("metrics"),
            {"trialId", "trial_id", "trialRunId", "trial_run_id", "stepsCompleted",
             "steps_completed", "reportTime", "report_time", "metrics"},
            "metrics",
        )  # fmt: skip
        if body.get("metrics") is None:
            raise ApiError(3, "metrics is required")
        body_trial = _int32(metrics, "trialId", "trial_id", "metrics", True)
        if body_trial != trial_id:
            raise ApiError(3, f"metrics.trialId {body_trial} does not match the path ({trial_id})")
        run_id = _int32(metrics, "trialRunId", "trial_run_id", "metrics", True)
        steps = _int32(metrics, "stepsCompleted", "steps_completed", "metrics", False)
        raw_time = metrics.get("reportTime", metrics.get("report_time"))
        report_time = None if raw_time is None else _parse_timestamp(raw_time)
        if metrics.get("metrics") is None:
            raise ApiError(3, "metrics.metrics is required")
        inner = _only_fields(
            metrics["metrics"],
            {"avgMetrics", "avg_metrics", "batchMetrics", "batch_metrics"},
            "metrics.metrics",
        )
        avg = inner.get("avgMetrics", inner.get("avg_metrics"))
        if not isinstance(avg, dict):
            raise ApiError(3, "metrics.metrics.avgMetrics is required (a JSON object)")
        batch = inner.get("batchMetrics", inner.get("batch_metrics"))
        if batch is not None and (
            not isinstance(batch, list) or not all(isinstance(b, dict) for b in batch)
        ):
            raise ApiError(3, "metrics.metrics.batchMetrics must be a list of JSON objects")
        for key in ("epoch", "epochs"):
            if key in avg and (isinstance(avg[key], bool) or not isinstance(avg[key], int | float)):
                raise ApiError(3, f"{key} must be numeric, got {avg[key]!r}")
        store = self.server.store
        with store.lock:
            trial = store.trials.get(trial_id)
            if trial is None:
                raise ApiError(5, f"trial {trial_id} not found")
            if user not in trial.editors:
                raise ApiError(
                    7,
                    f"user {user} does not have permission to edit experiment "
                    f"{trial.experiment_id}",
                )
            if run_id != trial.run_id:
                raise ApiError(
                    3, f"invalid run id, {run_id} (reported) != {trial.run_id} (expected)"
                )
            if group in ("avg_metrics", "validation_metrics"):
                # The database's custom_type_check constraint: an internal error on a master.
                raise ApiError(
                    13,
                    'new row for relation "metrics" violates check constraint "custom_type_check"',
                )
            end_time = report_time or _now()
            if group in PROFILING_GROUPS:
                store.profiling.append(
                    ProfilingRow(store.next_id, trial_id, run_id, group, avg, end_time)
                )
            else:
                if steps is None:
                    raise ApiError(
                        3,
                        f"stepsCompleted is required for group {group!r} "
                        "(generic_metrics.total_batches is NOT NULL)",
                    )
                self.server.merge_generic(trial_id, run_id, group, steps, avg, batch, end_time)
            store.next_id += 1
            store.posts.append(Post(trial_id, group, body, header))


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], store: Store) -> None:
        self.store = store
        self.connections: set[socket.socket] = set()
        self.conn_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.conn_lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.conn_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        with self.conn_lock:
            for conn in list(self.connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    # -- storage rules (called with store.lock held) ------------------------------------------
    def merge_generic(
        self,
        trial_id: int,
        run_id: int,
        group: str,
        steps: int,
        avg: dict[str, Any],
        batch: list[dict[str, Any]] | None,
        end_time: dt.datetime,
    ) -> None:
        key = (trial_id, group, steps)
        row = self.store.generic.get(key)
        if row is None:
            self.store.generic[key] = GenericRow(
                self.store.next_id, trial_id, run_id, group, steps, dict(avg), batch, end_time
            )
            return
        clash = [k for k in avg if k in row.avg_metrics and row.avg_metrics[k] != avg[k]]
        if clash:
            raise ApiError(
                3,
                f"overwriting existing metric keys is not supported, conflicting keys: {clash}",
            )
        if batch and row.batch_metrics:
            raise ApiError(3, "overwriting existing batch metrics is not supported")
        row.avg_metrics.update(avg)
        row.batch_metrics = row.batch_metrics or batch
        row.end_time = end_time

    # -- reads ----------------------------------------------------------------------------------
    def available_series(self, trial_id: int) -> list[dict[str, Any]]:
        """GetTrialProfilerAvailableSeries: latest row per (group, agent), every key of it."""
        with self.store.lock:
            rows = [r for r in self.store.profiling if r.trial_id == trial_id]
        latest: dict[tuple[str, str], ProfilingRow] = {}
        for row in rows:
            for agent in row.metrics:
                best = latest.get((row.group, agent))
                if best is None or (row.end_time, row.id) > (best.end_time, best.id):
                    latest[(row.group, agent)] = row
        labels = []
        for (_group, _agent), row in sorted(latest.items()):
            for agent_id, agent_metrics in row.metrics.items():  # every agent of that row
                if not isinstance(agent_metrics, dict):
                    continue
                for key, value in agent_metrics.items():
                    base = {"trialId": trial_id, "agentId": agent_id,
                            "metricType": METRIC_TYPE_SYSTEM}  # fmt: skip
                    if isinstance(value, dict):
                        if row.group == "disk":
                            continue  # "the Web UI needs to be aware"
                        for name in value:
                            label = {**base, "name": name}
                            if row.group == "gpu":
                                label["gpuUuid"] = key
                            labels.append(label)
                    else:
                        labels.append({**base, "name": key})
        return labels

    def profiler_metrics(self, trial_id: int, query: dict[str, list[str]]) -> list[dict[str, Any]]:
        """GetTrialProfilerMetrics: one batch per stored row, group from the name's prefix."""
        name = query.get("labels.name", [""])[0]
        agent = query.get("labels.agentId", [""])[0]
        uuid = query.get("labels.gpuUuid", [""])[0]
        metric_type = query.get("labels.metricType", [METRIC_TYPE_SYSTEM])[0]
        if metric_type != METRIC_TYPE_SYSTEM:
            return []
        group = next((g for prefix, g in _PREFIX_GROUP if name.startswith(prefix)), "")
        with self.store.lock:
            rows = sorted(
                (r for r in self.store.profiling if r.trial_id == trial_id and r.group == group),
                key=lambda r: r.id,
            )
        if group == "gpu" and agent and not uuid:  # "All": one series per GPU UUID
            uuids = sorted({u for r in rows if isinstance(r.metrics.get(agent), dict)
                            for u in r.metrics[agent]})  # fmt: skip
            return [b for u in uuids for b in self._series(trial_id, rows, name, agent, u)]
        return self._series(trial_id, rows, name, agent, uuid)

    @staticmethod
    def _series(
        trial_id: int, rows: list[ProfilingRow], name: str, agent: str, uuid: str
    ) -> list[dict[str, Any]]:
        out = []
        labels = {"trialId": trial_id, "name": name, "agentId": agent,
                  "metricType": METRIC_TYPE_SYSTEM}  # fmt: skip
        if uuid:
            labels["gpuUuid"] = uuid
        for row in rows:
            node: Any = row.metrics
            for part in (agent, uuid):
                if part:
                    node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict) or name not in node:
                continue
            value = struct.unpack("f", struct.pack("f", float(node[name])))[0]  # float32 column
            out.append(
                {"values": [value], "timestamps": [_rfc3339(row.end_time)], "labels": labels}
            )
        return out

    def trial_metrics(self, query: dict[str, list[str]]) -> list[dict[str, Any]]:
        """GetMetrics: generic rows only (profiling rows have NULL total_batches)."""
        trial_ids = {int(t) for t in query.get("trialIds", [])}
        group = query.get("group", [""])[0]
        if not trial_ids or not group:
            raise ApiError(3, "trialIds and group are required")
        with self.store.lock:
            rows = sorted(
                (r for r in self.store.generic.values()
                 if r.trial_id in trial_ids and r.group == group),
                key=lambda r: (r.trial_id, r.total_batches),
            )  # fmt: skip
        return [
            {
                "trialId": r.trial_id,
                "endTime": _rfc3339(r.end_time),
                "metrics": {"avg_metrics": r.avg_metrics, "batch_metrics": r.batch_metrics},
                "totalBatches": r.total_batches,
                "archived": False,
                "id": r.id,
                "trialRunId": r.run_id,
                "group": r.group,
            }
            for r in rows
        ]


class DeterminedContractServer:
    """Start/stop wrapper plus a test-facing view of what was stored."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, tls: tuple[str, str] | None = None
    ) -> None:
        self.host = host
        self.port = port
        self.tls = tls  # (certfile, keyfile): serve https
        self.store = Store()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> DeterminedContractServer:
        self._httpd = _HTTPServer((self.host, self.port), self.store)
        self.port = self._httpd.server_address[1]
        if self.tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*self.tls)
            self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.drop_connections()
        self._httpd.server_close()
        self._httpd = None

    @contextlib.contextmanager
    def down(self) -> Iterator[None]:
        """Master unreachable (connection refused) inside the block, back on the same port."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    def __enter__(self) -> DeterminedContractServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.host}:{self.port}"

    # -- fixtures ------------------------------------------------------------------------------
    def add_user(self, username: str, password: str = "") -> str:
        """A user and a fresh session token for it."""
        token = secrets.token_hex(16)
        with self.store.lock:
            self.store.users[username] = password
            self.store.user_tokens[token] = username
        return token

    def add_allocation_token(self, username: str) -> str:
        token = secrets.token_hex(16)
        with self.store.lock:
            self.store.allocation_tokens[token] = username
        return token

    def add_trial(
        self, trial_id: int, run_id: int = 1, experiment_id: int = 1, editors: tuple[str, ...] = ()
    ) -> None:
        with self.store.lock:
            self.store.trials[trial_id] = Trial(trial_id, run_id, experiment_id, set(editors))

    def fail_next(self, count: int, status: int = 503) -> None:
        """Answer the next `count` requests with `status` (5xx: the bridge must retry)."""
        with self.store.lock:
            self.store.fail_remaining = count
            self.store.fail_status = status

    # -- what was stored -----------------------------------------------------------------------
    def posts(self) -> list[Post]:
        with self.store.lock:
            return list(self.store.posts)

    def refusals(self) -> list[tuple[int, str]]:
        with self.store.lock:
            return list(self.store.refusals)


# -- reading back over HTTP, as the Web UI does ------------------------------------------------
def _ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    response.raise_for_status()
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def available_series(url: str, token: str, trial_id: int) -> list[dict[str, Any]]:
    lines = _ndjson(
        httpx.get(
            f"{url}/api/v1/trials/{trial_id}/profiler/available_series",
            params={"follow": "false"},
            headers={"Authorization": f"Bearer {token}"},
        )
    )
    return [label for line in lines for label in line["result"]["labels"]]


def profiler_metrics(
    url: str, token: str, trial_id: int, name: str, agent: str, gpu_uuid: str = ""
) -> list[dict[str, Any]]:
    params = {"labels.name": name, "labels.agentId": agent, "labels.metricType": METRIC_TYPE_SYSTEM,
              "follow": "false"}  # fmt: skip
    if gpu_uuid:
        params["labels.gpuUuid"] = gpu_uuid
    lines = _ndjson(
        httpx.get(
            f"{url}/api/v1/trials/{trial_id}/profiler/metrics",
            params=params,
            headers={"Authorization": f"Bearer {token}"},
        )
    )
    return [line["result"]["batch"] for line in lines]


def trial_metrics(url: str, token: str, trial_id: int, group: str) -> list[dict[str, Any]]:
    lines = _ndjson(
        httpx.get(
            f"{url}/api/v1/trials/metrics/trial_metrics",
            params={"trialIds": str(trial_id), "group": group},
            headers={"Authorization": f"Bearer {token}"},
        )
    )
    return [report for line in lines for report in line["result"]["metrics"]]
