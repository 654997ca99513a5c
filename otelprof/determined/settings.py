"""Bridge settings: command-line flags over environment variables, validated once.

Every flag has an environment variable so the bridge can run as a container with no
arguments; the Determined ones reuse the names a Determined task already has
(DET_MASTER, DET_USER_TOKEN, DET_SESSION_TOKEN, DET_USER, DET_MASTER_CERT_FILE, ...).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otelprof.determined.client import ConfigError, Credentials
from otelprof.determined.ingest_auth import IngestLimits, IngestTokens, Scope, TlsFiles
from otelprof.determined.mapping import PROFILING_GROUPS, Route

DEFAULT_LISTEN = "127.0.0.1:4327"
DEFAULT_WINDOW_S = 10.0

# flag destination -> environment variable
ENV = {
    "listen": "OTELPROF_BRIDGE_LISTEN",
    "master": "DET_MASTER",
    "token_file": "OTELPROF_DET_TOKEN_FILE",
    "allocation_token_file": "OTELPROF_DET_ALLOCATION_TOKEN_FILE",
    "user": "DET_USER",
    "password_file": "OTELPROF_DET_PASSWORD_FILE",
    "ca_bundle": "DET_MASTER_CERT_FILE",
    "report_interval": "OTELPROF_BRIDGE_REPORT_INTERVAL",
    "spool_dir": "OTELPROF_BRIDGE_SPOOL_DIR",
    "spool_max_mb": "OTELPROF_BRIDGE_SPOOL_MAX_MB",
    "trial_id": "OTELPROF_BRIDGE_TRIAL_ID",
    "trial_run_id": "OTELPROF_BRIDGE_TRIAL_RUN_ID",
    "agent_id": "OTELPROF_BRIDGE_AGENT_ID",
    "timings_group": "OTELPROF_BRIDGE_TIMINGS_GROUP",
    "retry_max_delay": "OTELPROF_BRIDGE_RETRY_MAX_DELAY",
    "request_timeout": "OTELPROF_BRIDGE_REQUEST_TIMEOUT",
    "metrics_port": "OTELPROF_BRIDGE_METRICS_PORT",
    "ingest_tokens": "OTELPROF_BRIDGE_INGEST_TOKENS",
    "tls_cert": "OTELPROF_BRIDGE_TLS_CERT",
    "tls_key": "OTELPROF_BRIDGE_TLS_KEY",
    "tls_client_ca": "OTELPROF_BRIDGE_TLS_CLIENT_CA",
    "max_request_mb": "OTELPROF_BRIDGE_MAX_REQUEST_MB",
    "max_inflight_mb": "OTELPROF_BRIDGE_MAX_INFLIGHT_MB",
    "max_steps_per_second": "OTELPROF_BRIDGE_MAX_STEPS_PER_SECOND",
}


def validate_group(name: str) -> str:
    """Determined's rules for a generic group name (reference §1), plus: not a profiling one."""
    if not name:
        raise ConfigError("timings group name is empty")
    if "." in name:
        raise ConfigError(f"timings group {name!r}: Determined group names cannot contain '.'")
    if name in ("avg_metrics", "validation_metrics"):
        raise ConfigError(f"timings group {name!r} is reserved by Determined")
    if name in PROFILING_GROUPS or name in ("training", "validation"):
        raise ConfigError(
            f"timings group {name!r} is one of Determined's built-in groups; pick another"
        )
    return name


@dataclass
class BridgeSettings:
    """Everything `otelprof determined-bridge` needs, already checked."""

    master: str
    credentials: Credentials
    ingest_tokens: IngestTokens
    listen: str = DEFAULT_LISTEN
    ca_bundle: str | None = None  # 'noverify': Determined's own spelling for "do not verify"
    window_s: float = DEFAULT_WINDOW_S
    spool_dir: str | None = None
    spool_max_bytes: int = 256 * 1024 * 1024
    fsync: bool = True
    route: Route = field(default_factory=Route)
    timings_group: str = "timings"
    retry_max_s: float = 30.0
    request_timeout_s: float = 10.0
    workers: int = 8
    metrics_port: int | None = None  # the bridge's own Prometheus metrics (0: any free port)
    tls: TlsFiles | None = None
    limits: IngestLimits = field(default_factory=IngestLimits)
    shared_spool: bool = False  # group-readable spool (0750/0640) instead of owner-only
    max_steps_per_s: float = 10_000.0

    @classmethod
    def from_args(cls, args: Any, env: Mapping[str, str] | None = None) -> BridgeSettings:
        """Flags first, then environment, then defaults; raises ConfigError naming the problem."""
        env = os.environ if env is None else env

        def pick(name: str, default: Any = None) -> Any:
            value = getattr(args, name, None)
            if value is None or value == "":
                value = env.get(ENV[name]) or None
            return default if value is None else value

        def number(name: str, default: float, kind: type = float, minimum: float = 0) -> Any:
            raw = pick(name, default)
            try:
                value = kind(raw)
            except (TypeError, ValueError):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} / {ENV[name]}: not a number: {raw!r}") from None
            if value <= minimum:
                raise ConfigError(f"--{name.replace('_', '-')} must be > {minimum}, got {value}")
            return value

        def count(name: str) -> int | None:  # an optional integer >= 0
            return None if pick(name) is None else int(number(name, 0, int, -1))

        master = pick("master")
        if not master:
            raise ConfigError("no Determined master: pass --master URL or set DET_MASTER")
        password = env.get("DET_PASS") or None
        creds = Credentials.from_env(
            env,
            user_token_file=pick("token_file"),
            allocation_token_file=pick("allocation_token_file"),
            username=getattr(args, "user", None),
            password=password if getattr(args, "user", None) else None,
            password_file=pick("password_file"),
        )
        if not creds.has_any():
            raise ConfigError(
                "no Determined credentials: pass --token-file (user token), "
                "--allocation-token-file, or --user (password from DET_PASS or "
                "--password-file); or set DET_USER_TOKEN / DET_SESSION_TOKEN / DET_USER"
            )
        route = Route(
            trial_id=count("trial_id"), run_id=count("trial_run_id"), agent=pick("agent_id")
        )
        if route.trial_id is not None and route.run_id is None:
            raise ConfigError("--trial-id needs --trial-run-id (Determined checks the run id)")
        state = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        spool_dir = pick("spool_dir", str(Path(state) / "otelprof" / "determined-bridge"))
        metrics_port = count("metrics_port")
        if metrics_port is not None and metrics_port > 65535:
            raise ConfigError(f"--metrics-port must be a TCP port, got {metrics_port}")
        default_scope = Scope(
            trials=frozenset(int(t) for t in getattr(args, "allow_trial", None) or ()),
            experiments=frozenset(int(e) for e in getattr(args, "allow_experiment", None) or ()),
        )
        tokens_path = pick("ingest_tokens")
        if not tokens_path:
            raise ConfigError(
                "no --ingest-tokens FILE: the bridge takes OTLP only from holders of a token; "
                "make one with `otelprof determined-bridge --new-token` "
                "(see docs/operations/determined-bridge.md)"
            )
        tokens = IngestTokens.from_file(str(tokens_path), default_scope)
        cert, key, client_ca = pick("tls_cert"), pick("tls_key"), pick("tls_client_ca")
        if bool(cert) != bool(key) or (client_ca and not cert):
            raise ConfigError("TLS needs both --tls-cert and --tls-key (--tls-client-ca: mTLS)")
        tls = TlsFiles(str(cert), str(key), client_ca and str(client_ca)) if cert else None
        workers = int(getattr(args, "workers", None) or 8)
        limits = IngestLimits(
            max_request_bytes=int(number("max_request_mb", 4.0) * 1024 * 1024),
            max_inflight_bytes=int(number("max_inflight_mb", 32.0) * 1024 * 1024),
            max_per_credential=max(1, workers // 2),
        )
        return cls(
            ingest_tokens=tokens,
            tls=tls,
            limits=limits,
            shared_spool=bool(getattr(args, "shared_spool", False)),
            max_steps_per_s=number("max_steps_per_second", 10_000.0),
            master=str(master),
            credentials=creds,
            listen=str(pick("listen", DEFAULT_LISTEN)),
            ca_bundle=pick("ca_bundle"),
            window_s=number("report_interval", DEFAULT_WINDOW_S),
            spool_dir=None if spool_dir == "none" else str(spool_dir),
            spool_max_bytes=int(number("spool_max_mb", 256) * 1024 * 1024),
            fsync=not getattr(args, "no_fsync", False),
            route=route,
            timings_group=validate_group(str(pick("timings_group", "timings"))),
            retry_max_s=number("retry_max_delay", 30.0),
            request_timeout_s=number("request_timeout", 10.0),
            workers=workers,
            metrics_port=metrics_port,
        )
