"""A thin Determined REST client: ReportTrialMetrics, login, and an experiment's notes.

The `determined` package is heavy (reference §7); the wire contract is small, so this
speaks it directly with httpx. Tokens are held here and nowhere else: they are never put
in log lines or error messages (`redact()` scrubs any text that could carry one).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from otelprof.config import ConfigError as _BaseConfigError
from otelprof.determined.aggregate import Report
from otelprof.determined.classify import (
    Outcome,
    PostResult,
    classify_answer,
    classify_transport_error,
)
from otelprof.determined.mapping import PROFILING_GROUPS

__all__ = ["ConfigError", "Credentials", "DeterminedClient", "LoginError", "Outcome",
           "PostResult", "master_message", "normalize_master"]  # fmt: skip

log = logging.getLogger("otelprof.determined")

USER_TOKEN_HEADER = "Authorization"
ALLOCATION_TOKEN_HEADER = "Grpc-Metadata-x-allocation-token"
# harness/determined/common/api/authentication.py salts the password this way.
_PASSWORD_SALT = "GubPEmmotfiK9TMD6Zdw"
_WARNED_OPEN: set[str] = set()  # secret files with loose modes, warned about once


class ConfigError(_BaseConfigError):
    """Settings that cannot work (no master, no credentials, unreadable token file)."""


def normalize_master(master: str, use_tls: bool = False) -> str:
    """`host:8080` → `http://host:8080` as Determined's CLI does; no trailing slash."""
    master = master.strip().rstrip("/")
    if not master:
        raise ConfigError("no Determined master given (--master or DET_MASTER)")
    if "://" not in master:
        master = ("https://" if use_tls else "http://") + master
    if not master.startswith(("http://", "https://")):
        raise ConfigError(f"master URL must be http:// or https://, got {master!r}")
    return master


def _read_secret_file(path: str, what: str) -> str:
    with contextlib.suppress(OSError):
        mode = os.stat(Path(path).expanduser()).st_mode
        if mode & 0o077 and path not in _WARNED_OPEN:
            _WARNED_OPEN.add(path)
            log.warning("%s file %s is readable by other users (mode %04o); `chmod 600 %s`",
                        what, path, mode & 0o7777, path)  # fmt: skip
    try:
        value = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc.strerror}") from None
    if not value:
        raise ConfigError(f"{what} file {path} is empty")
    return value


@dataclass
class Credentials:
    """How to authenticate; exactly one kind is used (user token wins over allocation)."""

    user_token: str | None = None
    user_token_file: str | None = None
    allocation_token: str | None = None
    allocation_token_file: str | None = None
    username: str | None = None
    password: str | None = None
    password_file: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Credentials:
        """Explicit values (flags) first, then DET_USER_TOKEN / DET_SESSION_TOKEN / DET_USER."""
        env = os.environ if env is None else env
        given = {k: v for k, v in overrides.items() if v}
        creds = cls(**given)
        if creds.has_any():
            return creds
        return cls(
            user_token=env.get("DET_USER_TOKEN") or None,
            allocation_token=env.get("DET_SESSION_TOKEN") or None,
            username=env.get("DET_USER") or None,
            password=env.get("DET_PASS") or None,
            password_file=given.get("password_file"),
        )

    def has_any(self) -> bool:
        return any(
            (self.user_token, self.user_token_file, self.allocation_token,
             self.allocation_token_file, self.username)
        )  # fmt: skip


class DeterminedClient:
    """Posts reports to one master. Thread-safe (httpx.Client is)."""

    def __init__(
        self,
        master: str,
        credentials: Credentials,
        ca_bundle: str | None = None,
        timeout_s: float = 10.0,
        use_tls: bool = False,
        verify: bool = True,
    ) -> None:
        self.master = normalize_master(master, use_tls)
        self._creds = credentials
        self._lock = threading.Lock()
        self._header: tuple[str, str] | None = None
        self._secrets: set[str] = set()
        verify_arg: Any = verify
        if ca_bundle:
            if not Path(ca_bundle).expanduser().is_file():
                raise ConfigError(f"CA bundle {ca_bundle} does not exist")
            verify_arg = ssl.create_default_context(cafile=str(Path(ca_bundle).expanduser()))
        self._http = httpx.Client(
            base_url=self.master, timeout=timeout_s, verify=verify_arg, follow_redirects=False
        )
        if credentials.password:
            self._secrets.add(credentials.password)
        if credentials.password_file:
            self._secrets.add(_read_secret_file(credentials.password_file, "password"))

    @classmethod
    def in_task(
        cls,
        master: str,
        credentials: Credentials,
        env: Mapping[str, str],
        ca_bundle: str | None = None,
        timeout_s: float = 10.0,
    ) -> DeterminedClient:
        """A client with the TLS settings of a Determined task's environment: DET_USE_TLS,
        and `ca_bundle` or DET_MASTER_CERT_FILE ('noverify' turns verification off)."""
        ca = ca_bundle or env.get("DET_MASTER_CERT_FILE")
        verify = ca != "noverify"
        use_tls = env.get("DET_USE_TLS", "").lower() in ("1", "true", "yes")
        return cls(master, credentials, ca if verify else None, timeout_s, use_tls, verify)

    # -- secrets ---------------------------------------------------------------------------
    def redact(self, text: str) -> str:
        """`text` with every secret this client knows replaced by `***`."""
        for secret in self._secrets:
            if secret:
                text = text.replace(secret, "***")
        return text

    def _auth_header(self, refresh: bool = False) -> tuple[str, str]:
        with self._lock:
            if self._header is not None and not refresh:
                return self._header
            c = self._creds
            if c.user_token or c.user_token_file:
                token = c.user_token or _read_secret_file(str(c.user_token_file), "token")
                self._header = (USER_TOKEN_HEADER, f"Bearer {token}")
            elif c.allocation_token or c.allocation_token_file:
                token = c.allocation_token or _read_secret_file(
                    str(c.allocation_token_file), "allocation token"
                )
                self._header = (ALLOCATION_TOKEN_HEADER, f"Bearer {token}")
            elif c.username:
                token = self._login()
                self._header = (USER_TOKEN_HEADER, f"Bearer {token}")
            else:
                raise ConfigError(
                    "no Determined credentials: give a user token (--token-file, "
                    "DET_USER_TOKEN), an allocation token (--allocation-token-file, "
                    "DET_SESSION_TOKEN) or a user (--user/DET_USER with DET_PASS)"
                )
            self._secrets.add(token)
            return self._header

    def _login(self) -> str:
        c = self._creds
        password = c.password
        if password is None and c.password_file:
            password = _read_secret_file(c.password_file, "password")
        # Same as the Determined CLI: an empty password is sent as is.
        salted = (
            hashlib.sha512((_PASSWORD_SALT + password).encode()).hexdigest() if password else ""
        )
        response = self._http.post(
            "/api/v1/auth/login",
            json={"username": c.username, "password": salted, "isHashed": True},
        )
        if response.status_code != 200:
            raise LoginError(
                f"login as {c.username!r} refused by {self.master}: HTTP {response.status_code} "
                f"{self.redact(master_message(response))}",
                response.status_code,
            )
        token = response.json().get("token")
        if not isinstance(token, str) or not token:
            raise LoginError(f"login as {c.username!r}: the master's answer has no token", 200)
        log.info("logged in to %s as %s", self.master, c.username)
        return token

    # -- the one call ----------------------------------------------------------------------
    def report(self, report: Report) -> PostResult:
        """POST one report; classify the answer so the caller knows to retry or drop."""
        answer = self._answer("POST", f"/api/v1/trials/{report.trial_id}/metrics", report.body)
        return answer if isinstance(answer, PostResult) else self._classify(answer)

    def _answer(self, method: str, path: str, body: Any) -> httpx.Response | PostResult:
        """One request with this client's credentials, refreshed once after a 401: the
        master's answer, or why none came (classified). An unusable credential raises."""
        try:
            response = self._send(method, path, body)
            c = self._creds
            renewable = c.user_token_file or c.allocation_token_file or c.username
            if response.status_code == 401 and renewable and not c.user_token:
                # Token files may rotate and login sessions expire: fetch a fresh one once.
                self._auth_header(refresh=True)
                response = self._send(method, path, body)
            return response
        except LoginError as exc:
            retry = exc.status is None or exc.status >= 500 or exc.status in (408, 429)
            outcome = Outcome.RETRY if retry else Outcome.REJECTED
            return PostResult(outcome, exc.status, self.redact(str(exc)), master_wide=True)
        except httpx.TransportError as exc:
            return classify_transport_error(exc, self.redact(f"{type(exc).__name__}: {exc}"))

    def _classify(self, response: httpx.Response) -> PostResult:
        status = response.status_code
        if 200 <= status < 300:
            return PostResult(Outcome.OK, status, "")
        return classify_answer(status, self.redact(master_message(response)))

    def _send(self, method: str, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        name, value = self._auth_header()
        return self._http.request(method, path, json=body, headers={name: value}, **kwargs)

    def already_stored(self, report: Report) -> bool | None:
        """Does the master already hold this report? None when it cannot tell.

        Asked only for a report posted by a process that died before the answer arrived,
        through the read endpoints the Web UI uses (reference §5): a profiling report is
        found by its agent, key and reportTime, a generic one by its stepsCompleted and keys.
        """
        try:
            if report.group in PROFILING_GROUPS:
                return self._profiling_stored(report)
            return self._generic_stored(report)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, StopIteration, ConfigError):
            return None

    def _get_ndjson(self, path: str, params: dict[str, str]) -> list[dict[str, Any]]:
        response = self._send("GET", path, params=params)
        response.raise_for_status()
        return [json.loads(line) for line in response.text.splitlines() if line.strip()]

    def _profiling_stored(self, report: Report) -> bool:
        metrics = report.body["metrics"]
        agent, values = next(iter(metrics["metrics"]["avgMetrics"].items()))
        params = {"labels.agentId": agent, "labels.metricType": "PROFILER_METRIC_TYPE_SYSTEM",
                  "follow": "false"}  # fmt: skip
        if report.group == "gpu":
            uuid, values = next(iter(values.items()))
            params["labels.gpuUuid"] = uuid
        params["labels.name"] = next(iter(values))
        wanted = _parse_time(metrics["reportTime"])
        lines = self._get_ndjson(f"/api/v1/trials/{report.trial_id}/profiler/metrics", params)
        for line in lines:
            batch = line.get("result", {}).get("batch", {})
            if any(_parse_time(t) == wanted for t in batch.get("timestamps", [])):
                return True
        return False

    def _generic_stored(self, report: Report) -> bool:
        metrics = report.body["metrics"]
        params = {"trialIds": str(report.trial_id), "group": report.group}
        for line in self._get_ndjson("/api/v1/trials/metrics/trial_metrics", params):
            for row in line.get("result", {}).get("metrics", []):
                stored = (row.get("metrics") or {}).get("avg_metrics") or {}
                if (
                    int(row.get("totalBatches", -1)) == metrics.get("stepsCompleted")
                    and int(row.get("trialRunId", metrics["trialRunId"])) == metrics["trialRunId"]
                    and set(metrics["metrics"]["avgMetrics"]) <= set(stored)
                ):
                    return True
        return False

    def _trial(self, trial_id: int, timeout_s: float | None = None) -> dict[str, Any] | None:
        """GetTrial's `trial` object; None when the master has no such trial. Raises when
        the master cannot answer (down, refused our credentials)."""
        kwargs: dict[str, Any] = {} if timeout_s is None else {"timeout": max(0.01, timeout_s)}
        response = self._send("GET", f"/api/v1/trials/{trial_id}", **kwargs)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise RuntimeError(
                f"HTTP {response.status_code} {self.redact(master_message(response))}"
            )
        trial = response.json().get("trial")
        return trial if isinstance(trial, dict) else {}

    def trial_experiment(self, trial_id: int) -> int | None:
        """A trial's experiment (GetTrial); None for no such trial; raises as `_trial` does."""
        trial = self._trial(trial_id)
        if trial is None:
            return None
        experiment = trial.get("experimentId", trial.get("experiment_id"))
        return None if experiment is None else int(experiment)

    def trial_batches(self, trial_id: int, timeout_s: float | None = None) -> int:
        """The batch count the master holds for a trial (GetTrial's totalBatchesProcessed,
        the highest stepsCompleted any report raised it to); 0 for no such trial. Raises
        when the master cannot answer."""
        trial = self._trial(trial_id, timeout_s)
        if trial is None:
            return 0
        batches = trial.get("totalBatchesProcessed", trial.get("total_batches_processed", 0))
        return int(batches or 0)

    # -- an experiment's notes (otelprof/determined/links.py) ------------------------------
    def experiment_notes(self, experiment_id: int) -> tuple[PostResult, str | None]:
        """GetExperiment's notes: (OK, notes), or the classified failure and None."""
        result, body = self._call("GET", f"/api/v1/experiments/{experiment_id}")
        if result.outcome is not Outcome.OK:
            return result, None
        notes = (body.get("experiment") or {}).get("notes") if isinstance(body, dict) else None
        if notes is not None and not isinstance(notes, str):
            return PostResult(Outcome.UNKNOWN, result.status, "notes are not a string"), None
        return result, notes or ""

    def set_experiment_notes(self, experiment_id: int, notes: str) -> PostResult:
        """PatchExperiment with `notes`: the master replaces the whole notes with these."""
        result, _ = self._call("PATCH", f"/api/v1/experiments/{experiment_id}", {"notes": notes})
        return result

    def _call(self, method: str, path: str, body: Any = None) -> tuple[PostResult, Any]:
        """`_answer`, classified as reports are; the answer's JSON when it succeeded."""
        try:
            answer = self._answer(method, path, body)
        except ConfigError as exc:  # no usable credentials (an unreadable token file)
            return PostResult(Outcome.REJECTED, None, str(exc)), None
        if isinstance(answer, PostResult):
            return answer, None
        result = self._classify(answer)
        if result.outcome is not Outcome.OK:
            return result, None
        try:
            return result, answer.json()
        except ValueError:
            return PostResult(
                Outcome.UNKNOWN, result.status, "the master's answer is not JSON"
            ), None

    def close(self) -> None:
        self._http.close()


def _parse_time(stamp: str) -> datetime.datetime:
    """RFC 3339 → aware datetime at millisecond precision (the master truncates to ms)."""
    value = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return value.replace(microsecond=value.microsecond // 1000 * 1000)


class LoginError(RuntimeError):
    """The master refused the username/password (message names user and status only)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def master_message(response: httpx.Response) -> str:
    """The master's own error text (grpc-gateway `message`, echo `message`, or raw body)."""
    try:
        payload = response.json()
    except ValueError:
        return response.text[:500].strip() or response.reason_phrase
    if isinstance(payload, dict):
        for key in ("message", "error"):
            value = payload.get(key)
            if isinstance(value, dict):
                value = value.get("message") or value.get("error")
            if isinstance(value, str) and value:
                return value
    return str(payload)[:500]
