"""A Determined master that behaves like the real 0.38.1 one on the calls otelprof makes.

Written from shared/reference/determined-api.md, §0 first (what a running 0.38.1 master
did), not from otelprof's code:

- permanent refusals of a report (stale run id, key conflict, batch-metrics overwrite,
  missing stepsCompleted, reserved group, non-numeric epoch, missing metrics) are HTTP 500
  with the master's own messages, as is a database outage (`database_down()`); only
  malformed requests (400), bad credentials (401) and an unknown trial (404) differ;
- error bodies `{"error": {"code", "reason", "error"}}`, streaming ones
  `{"error": {"grpcCode", "httpCode", "message"}}`;
- reporting any non-profiling group at stepsCompleted N under run id R archives the rows
  of older run ids with total_batches > N (training, validation, generic) and recomputes
  the trial's batch count, summary metrics and latest validation; every generic report
  raises the batch count to GREATEST(batches, N);
- profiling groups have no idempotency (a resend is a second row); a repeated
  (group, stepsCompleted) is merged when the keys do not clash;
- unknown JSON fields are ignored, the path's trial id overrides the body's, the run id
  may be a string; profiling values read back as float32 with microsecond timestamps;
  a string value makes the read a 500 and a null one crashes the master.

An experiment's notes (`GET`/`PATCH /api/v1/experiments/{id}`, §0.1): the PATCH replaces
the whole notes (a second writer's PATCH overwrites the first's), an unknown experiment is
404 `experiment not found: N`, a blank name 400, a non-string value 400, and the database
outage a 500 as for reports.

What it stored is read back through the shapes the Web UI uses: the profiler's
`available_series` and `metrics` endpoints, `trial_metrics` for generic groups
(newline-delimited `{"result": ...}`) and `GET /api/v1/trials/{id}`. A real HTTP server on
a free loopback port; `down()` closes it (connections included) to simulate an outage.
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
import time
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


# The real master's texts for what it refuses while reporting (reference §0); all HTTP 500.
def _tx(group: str, error: str) -> str:
    return f"failed to exec transaction (add trial metrics {group}): {error}"


DB_DOWN_MESSAGE = "FATAL: terminating connection due to administrator command (SQLSTATE 57P01)"
NIL_PANIC_MESSAGE = "runtime error: invalid memory address or nil pointer dereference"


@dataclass
class Trial:
    trial_id: int
    run_id: int
    experiment_id: int
    editors: set[str]  # not checked: open-source Determined lets any user report (§0)
    total_batches: int = 0
    summary_metrics: dict[str, Any] = field(default_factory=dict)
    latest_validation: dict[str, Any] | None = None


@dataclass
class Experiment:
    experiment_id: int
    name: str
    notes: str = ""
    description: str = ""


@dataclass
class Patch:
    """One accepted PatchExperiment call, in arrival order (what the master received)."""

    experiment_id: int
    body: dict[str, Any]
    auth_header: str


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
    """A row of the training, validation or a generic group (`total_batches` = steps)."""

    id: int
    trial_id: int
    run_id: int
    group: str
    total_batches: int
    avg_metrics: dict[str, Any]
    batch_metrics: list[dict[str, Any]] | None
    end_time: dt.datetime
    archived: bool = False


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
    experiments: dict[int, Experiment] = field(default_factory=dict)
    patches: list[Patch] = field(default_factory=list)
    profiling: list[ProfilingRow] = field(default_factory=list)
    generic: list[GenericRow] = field(default_factory=list)
    posts: list[Post] = field(default_factory=list)
    refusals: list[tuple[int, str]] = field(default_factory=list)
    logins: int = 0
    next_id: int = 1
    fail_remaining: int = 0
    fail_status: int = 503
    lose_remaining: int = 0  # store the report, then drop the connection unanswered
    lose_hang_s: float = 0.0  # ... after holding it this long (a proxy that never answers)
    lose_groups: frozenset[str] | None = None  # only reports of these groups (None: any)
    db_down: bool = False
    crashed: bool = False
    broken_trials: dict[int, str] = field(default_factory=dict)  # trial -> a 500's message


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _rfc3339(t: dt.datetime, timespec: str = "milliseconds") -> str:
    return t.astimezone(dt.timezone.utc).isoformat(timespec=timespec).replace("+00:00", "Z")


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


def _path_int32(raw: str, parameter: str) -> int:
    """A path parameter of type int32, refused as grpc-gateway refuses it."""
    if not re.fullmatch(r"-?\d+", raw) or not INT32[0] <= int(raw) <= INT32[1]:
        raise ApiError(
            3, f"type mismatch, parameter: {parameter}, error: strconv.ParseInt: parsing "
            f"{raw!r}: invalid syntax",
        )  # fmt: skip
    return int(raw)


def _object(obj: Any, where: str) -> dict[str, Any]:
    """A JSON object (protojson ignores unknown fields: only the type is checked)."""
    if not isinstance(obj, dict):
        raise ApiError(3, f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


_REASON = {3: "Invalid Argument", 5: "Not Found", 7: "Permission Denied", 13: "Internal",
           14: "Unavailable", 16: "Unauthenticated"}  # fmt: skip


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

    def _error(self, exc: ApiError, streaming: bool = False) -> None:
        status = _HTTP.get(exc.code, 500)
        with self.server.store.lock:
            self.server.store.refusals.append((status, exc.message))
        if streaming:
            body = {"grpcCode": exc.code, "httpCode": status, "message": exc.message}
        else:
            body = {"code": exc.code, "reason": _REASON.get(exc.code, "Unknown"),
                    "error": exc.message}  # fmt: skip
        self._send(status, {"error": body})

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
            if store.crashed:  # a crashed master answers nothing
                self.close_connection = True
                return
            failing = store.fail_remaining > 0
            if failing:
                store.fail_remaining -= 1
        if failing:
            if method in ("POST", "PATCH"):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(store.fail_status, {"error": {"code": 14, "reason": "Unavailable",
                                                     "error": "injected failure"}})  # fmt: skip
            return
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        streaming = method == "GET"
        try:
            if method == "POST" and url.path == "/api/v1/auth/login":
                return self._send(200, self._login(self._body()))
            m = re.fullmatch(r"/api/v1/trials/([^/]+)/metrics", url.path)
            if method == "POST" and m:
                body = self._body()
                user = self._user()
                self._report(m.group(1), body, user, self._auth_header())
                with store.lock:
                    lose = store.lose_remaining > 0 and (
                        store.lose_groups is None or body.get("group") in store.lose_groups
                    )
                    if lose:
                        store.lose_remaining -= 1
                    hang = store.lose_hang_s
                if lose:  # stored, but the answer never reaches the client
                    if hang:
                        time.sleep(hang)
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
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
                if store.crashed:
                    self.close_connection = True
                    return
                return self._send(200, None, ndjson=[{"result": {"batch": b}} for b in batches])
            if method == "GET" and url.path == "/api/v1/trials/metrics/trial_metrics":
                self._user()
                reports = self.server.trial_metrics(query)
                return self._send(200, None, ndjson=[{"result": {"metrics": reports}}])
            m = re.fullmatch(r"/api/v1/experiments/([^/]+)", url.path)
            if method in ("GET", "PATCH") and m:
                streaming = False
                body = self._body() if method == "PATCH" else None
                experiment_id = _path_int32(
                    m.group(1), "experimentId" if method == "GET" else "experiment.id"
                )
                user = self._user()
                if method == "GET":
                    return self._send(
                        200, {"experiment": self.server.experiment_view(experiment_id)}
                    )
                view = self.server.patch_experiment(experiment_id, body, user, self._auth_header())
                return self._send(200, {"experiment": view})
            m = re.fullmatch(r"/api/v1/trials/(\d+)", url.path)
            if method == "GET" and m:
                streaming = False
                self._user()
                return self._send(200, {"trial": self.server.trial_view(int(m.group(1)))})
            raise ApiError(5, "Not Found")
        except ApiError as exc:
            self._error(exc, streaming)
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

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    # -- /api/v1/auth/login ---------------------------------------------------------------------
    def _login(self, body: Any) -> dict[str, Any]:
        body = _object(body, "login")
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
        trial_id = int(path_id)  # the path's trial id overrides the body's
        body = _object(body, "ReportTrialMetricsRequest")
        group = body.get("group")
        if not isinstance(group, str) or not group:
            raise ApiError(3, "group is required (a non-empty string)")
        if "." in group:
            raise ApiError(3, "metric group cannot contain '.'")
        if body.get("metrics") is None:
            raise ApiError(13, NIL_PANIC_MESSAGE)  # a caught nil-pointer panic
        metrics = _object(body["metrics"], "metrics")
        _int32(metrics, "trialId", "trial_id", "metrics", False)
        run_id = _int32(metrics, "trialRunId", "trial_run_id", "metrics", False) or 0
        steps = _int32(metrics, "stepsCompleted", "steps_completed", "metrics", False)
        raw_time = metrics.get("reportTime", metrics.get("report_time"))
        report_time = None if raw_time is None else _parse_timestamp(raw_time)
        if metrics.get("metrics") is None:
            raise ApiError(13, NIL_PANIC_MESSAGE)
        inner = _object(metrics["metrics"], "metrics.metrics")
        avg = inner.get("avgMetrics", inner.get("avg_metrics"))
        if avg is None:
            raise ApiError(13, NIL_PANIC_MESSAGE)
        if not isinstance(avg, dict):
            raise ApiError(3, "metrics.metrics.avgMetrics: expected a JSON object")
        batch = inner.get("batchMetrics", inner.get("batch_metrics"))
        if batch is not None and (
            not isinstance(batch, list) or not all(isinstance(b, dict) for b in batch)
        ):
            raise ApiError(3, "metrics.metrics.batchMetrics must be a list of JSON objects")
        for key in ("epoch", "epochs"):
            if key in avg and (isinstance(avg[key], bool) or not isinstance(avg[key], int | float)):
                raise ApiError(
                    13, f"cannot add metric with non numeric '{key}' value got {avg[key]}"
                )
        store = self.server.store
        with store.lock:
            trial = store.trials.get(trial_id)
            if trial is None:
                raise ApiError(5, f"trial {trial_id} not found")
            if store.db_down:
                raise ApiError(13, _tx(group, DB_DOWN_MESSAGE))
            if trial_id in store.broken_trials:
                raise ApiError(13, _tx(group, store.broken_trials[trial_id]))
            if run_id != trial.run_id:
                raise ApiError(
                    13,
                    _tx(group, f"invalid run id, {run_id} (reported) != {trial.run_id} "
                        "(expected): invalid arguments"),
                )  # fmt: skip
            if group in ("avg_metrics", "validation_metrics"):
                raise ApiError(
                    13,
                    _tx(group, 'ERROR: new row for relation "metrics" violates check '
                        'constraint "custom_type_check" (SQLSTATE 23514)'),
                )  # fmt: skip
            end_time = report_time or _now()
            if group in PROFILING_GROUPS:  # stepsCompleted ignored, no idempotency
                store.profiling.append(
                    ProfilingRow(store.next_id, trial_id, run_id, group, avg, end_time)
                )
            else:
                if steps is None:
                    raise ApiError(
                        13,
                        _tx(group, 'ERROR: null value in column "total_batches" of relation '
                            '"generic_metrics" violates not-null constraint (SQLSTATE 23502)'),
                    )  # fmt: skip
                self.server.merge_generic(trial, group, steps, avg, batch, end_time)
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
        trial: Trial,
        group: str,
        steps: int,
        avg: dict[str, Any],
        batch: list[dict[str, Any]] | None,
        end_time: dt.datetime,
    ) -> None:
        """Insert or merge a row, then roll back older runs and update the trial's summary."""
        store = self.store
        row = next(
            (r for r in store.generic if r.trial_id == trial.trial_id and r.group == group
             and r.total_batches == steps and not r.archived),
            None,
        )  # fmt: skip
        if row is None:
            store.generic.append(
                GenericRow(store.next_id, trial.trial_id, trial.run_id, group, steps, dict(avg),
                           batch, end_time)
            )  # fmt: skip
        else:
            clash = [k for k in avg if k in row.avg_metrics and row.avg_metrics[k] != avg[k]]
            if clash:
                raise ApiError(
                    13,
                    _tx(group, "overwriting existing metric keys is not supported, "
                        f"conflicting key: {clash[0]}"),
                )  # fmt: skip
            if batch and row.batch_metrics:
                raise ApiError(13, _tx(group, "overwriting batch metrics is not supported"))
            row.avg_metrics.update(avg)
            row.batch_metrics = row.batch_metrics or batch
            row.end_time = end_time
        # Rollback: rows of older run ids past this step are archived, of every kind.
        archived = False
        for r in store.generic:
            if (r.trial_id == trial.trial_id and not r.archived and r.run_id < trial.run_id
                    and r.total_batches > steps):  # fmt: skip
                r.archived = True
                archived = True
        live = [r for r in store.generic if r.trial_id == trial.trial_id and not r.archived]
        if archived:
            trial.total_batches = max((r.total_batches for r in live), default=0)
            trial.summary_metrics = {}
            trial.latest_validation = None
            for r in sorted(live, key=lambda r: (r.total_batches, r.id)):
                self._summarize(trial, r)
        trial.total_batches = max(trial.total_batches, steps)  # GREATEST(total_batches, N)
        for r in live:
            if r.group == group and r.total_batches == steps:
                self._summarize(trial, r)

    @staticmethod
    def _summarize(trial: Trial, row: GenericRow) -> None:
        trial.summary_metrics.setdefault(row.group, {}).update(row.avg_metrics)
        if row.group == "validation":
            latest = trial.latest_validation
            if latest is None or row.total_batches >= latest["totalBatches"]:
                trial.latest_validation = {"totalBatches": row.total_batches,
                                           "metrics": dict(row.avg_metrics)}  # fmt: skip

    # -- experiments (GetExperiment, PatchExperiment) ---------------------------------------------
    def experiment_view(self, experiment_id: int) -> dict[str, Any]:
        """GetExperiment's `experiment` (the fields the experiment page shows)."""
        with self.store.lock:
            experiment = self.store.experiments.get(experiment_id)
            if experiment is None:
                raise ApiError(5, f"experiment not found: {experiment_id}")
            if self.store.db_down:
                raise ApiError(
                    13, f"error fetching experiment from database: {experiment_id}: "
                    f"{DB_DOWN_MESSAGE}",
                )  # fmt: skip
            return self._experiment_fields(experiment)

    def _experiment_fields(self, experiment: Experiment) -> dict[str, Any]:
        trials = sorted(
            t.trial_id for t in self.store.trials.values()
            if t.experiment_id == experiment.experiment_id
        )  # fmt: skip
        return {
            "id": experiment.experiment_id,
            "name": experiment.name,
            "description": experiment.description,
            "notes": experiment.notes,
            "trialIds": trials,
            "numTrials": len(trials),
            "state": "STATE_ACTIVE",
            "archived": False,
        }

    def patch_experiment(
        self, experiment_id: int, body: Any, user: str, header: str
    ) -> dict[str, Any]:
        """PatchExperiment: the body is the experiment (`name`, `notes`, `description`,
        `labels`; unknown fields ignored, the path's id wins); each given field replaces the
        stored one whole, notes included (reference §0.1)."""
        body = _object(body, "PatchExperiment")
        changes: dict[str, str] = {}
        for key in ("name", "notes", "description"):
            value = body.get(key)
            if value is None:  # absent or null: a StringValue left unset
                continue
            if not isinstance(value, str):
                raise ApiError(3, f"proto: invalid value for string type: {json.dumps(value)}")
            changes[key] = value
        store = self.store
        with store.lock:
            experiment = store.experiments.get(experiment_id)
            if experiment is None:
                raise ApiError(5, f"experiment not found: {experiment_id}")
            if "name" in changes and not changes["name"].strip():
                raise ApiError(3, "`name` must not be an empty or whitespace string.")
            changed = {k: v for k, v in changes.items() if getattr(experiment, k) != v}
            if changed and store.db_down:
                raise ApiError(
                    13, f"error updating experiment in database: {experiment_id}: "
                    f"{DB_DOWN_MESSAGE}",
                )  # fmt: skip
            for key, value in changed.items():
                setattr(experiment, key, value)
            store.patches.append(Patch(experiment_id, body, header))
            return self._experiment_fields(experiment)

    # -- reads ----------------------------------------------------------------------------------
    def trial_view(self, trial_id: int) -> dict[str, Any]:
        """GetTrial: the fields a restart can hurt (batch count, summary, latest validation)."""
        with self.store.lock:
            trial = self.store.trials.get(trial_id)
            if trial is None:
                raise ApiError(5, f"trial {trial_id} not found")
            return {
                "id": trial.trial_id,
                "experimentId": trial.experiment_id,
                "runId": trial.run_id,
                "totalBatchesProcessed": trial.total_batches,
                "summaryMetrics": json.loads(json.dumps(trial.summary_metrics)),
                "latestValidation": json.loads(json.dumps(trial.latest_validation)),
            }

    def available_series(self, trial_id: int) -> list[dict[str, Any]]:
        """GetTrialProfilerAvailableSeries: latest row (by end_time) per (group, agent)."""
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

    def _series(
        self, trial_id: int, rows: list[ProfilingRow], name: str, agent: str, uuid: str
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
            raw = node[name]
            if raw is None:  # what the real master did with a stored null: it crashed
                with self.store.lock:
                    self.store.crashed = True
                self.drop_connections()
                return []
            if isinstance(raw, bool) or not isinstance(raw, int | float):
                raise ApiError(13, f"cannot parse metric {name}: {raw!r} is not a number")
            value = struct.unpack("f", struct.pack("f", float(raw)))[0]  # float32 column
            out.append({"values": [value], "batches": [],
                        "timestamps": [_rfc3339(row.end_time, "microseconds")],
                        "labels": labels})  # fmt: skip
        return out

    def trial_metrics(self, query: dict[str, list[str]]) -> list[dict[str, Any]]:
        """GetMetrics: generic rows that are not archived (profiling rows have NULL batches)."""
        trial_ids = {int(t) for t in query.get("trialIds", [])}
        group = query.get("group", [""])[0]
        if not trial_ids or not group:
            raise ApiError(3, "trialIds and group are required")
        with self.store.lock:
            rows = sorted(
                (r for r in self.store.generic
                 if r.trial_id in trial_ids and r.group == group and not r.archived),
                key=lambda r: (r.trial_id, r.total_batches),
            )  # fmt: skip
        return [
            {
                "trialId": r.trial_id,
                "endTime": _rfc3339(r.end_time),
                "metrics": {"avg_metrics": r.avg_metrics, "batch_metrics": r.batch_metrics},
                "totalBatches": r.total_batches,
                "archived": r.archived,
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
            self.store.experiments.setdefault(
                experiment_id, Experiment(experiment_id, f"experiment {experiment_id}")
            )

    def add_experiment(self, experiment_id: int, notes: str = "") -> None:
        """An experiment (made by `add_trial` too) with these notes."""
        with self.store.lock:
            self.store.experiments[experiment_id] = Experiment(
                experiment_id, f"experiment {experiment_id}", notes
            )

    def experiment_notes(self, experiment_id: int) -> str:
        with self.store.lock:
            return self.store.experiments[experiment_id].notes

    def set_experiment_notes(self, experiment_id: int, notes: str) -> None:
        """A user edits the notes in the Web UI (no request is recorded)."""
        with self.store.lock:
            self.store.experiments[experiment_id].notes = notes

    def patches(self) -> list[Patch]:
        """Every PatchExperiment the master accepted, in order."""
        with self.store.lock:
            return list(self.store.patches)

    def fail_next(self, count: int, status: int = 503) -> None:
        """Answer the next `count` requests with `status` (5xx: the bridge must retry)."""
        with self.store.lock:
            self.store.fail_remaining = count
            self.store.fail_status = status

    def lose_next_responses(
        self, count: int, hang_s: float = 0.0, groups: tuple[str, ...] | None = None
    ) -> None:
        """Store the next `count` reports (of `groups`, default any) but drop their
        connections before answering (a proxy failing after the master took the report),
        after holding each one `hang_s` seconds (a proxy that never answers)."""
        with self.store.lock:
            self.store.lose_remaining = count
            self.store.lose_hang_s = hang_s
            self.store.lose_groups = None if groups is None else frozenset(groups)

    @contextlib.contextmanager
    def database_down(self) -> Iterator[None]:
        """PostgreSQL gone inside the block: every report is a 500 with the driver's text."""
        with self.store.lock:
            self.store.db_down = True
        try:
            yield
        finally:
            with self.store.lock:
                self.store.db_down = False

    def break_trial(self, trial_id: int, message: str | None) -> None:
        """Every report to this trial fails with a 500 carrying `message` (None: heal it)."""
        with self.store.lock:
            if message is None:
                self.store.broken_trials.pop(trial_id, None)
            else:
                self.store.broken_trials[trial_id] = message

    def restart_trial(self, trial_id: int) -> int:
        """The trial restarts (a new run id, as after a failure or a pause); returns it."""
        with self.store.lock:
            trial = self.store.trials[trial_id]
            trial.run_id += 1
            return trial.run_id

    def trial(self, trial_id: int) -> dict[str, Any]:
        """What GET /api/v1/trials/{id} answers (batch count, summary, latest validation)."""
        assert self._httpd is not None
        return self._httpd.trial_view(trial_id)

    def rows(self, trial_id: int, group: str, archived: bool = False) -> list[GenericRow]:
        """Generic/training/validation rows of a trial (the archived ones when asked)."""
        with self.store.lock:
            rows = self.store.generic
            return [
                r
                for r in rows
                if r.trial_id == trial_id and r.group == group and r.archived == archived
            ]

    def profiling_rows(self, trial_id: int, group: str) -> list[ProfilingRow]:
        with self.store.lock:
            return [r for r in self.store.profiling if r.trial_id == trial_id and r.group == group]

    # -- what was stored -----------------------------------------------------------------------
    def posts(self) -> list[Post]:
        with self.store.lock:
            return list(self.store.posts)

    def refusals(self) -> list[tuple[int, str]]:
        with self.store.lock:
            return list(self.store.refusals)


# -- reading back over HTTP, as the Web UI does ------------------------------------------------
def set_trial_env(
    monkeypatch: Any, master: DeterminedContractServer, run_id: str = "1", **extra: str
) -> None:
    """The environment Determined gives trial 42's task (user token from the test's `master`
    fixture), so `instrument(determined=True)` reports to `master`."""
    env = {
        "DET_MASTER": master.url,
        "DET_USER_TOKEN": master.token,  # type: ignore[attr-defined]
        "DET_TRIAL_ID": "42",
        "DET_TRIAL_RUN_ID": run_id,
        "DET_AGENT_ID": "agent-1",
        **extra,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)


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
