"""`otelprof determined-bridge`: run the OTLP → Determined bridge until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from otelprof.determined.settings import DEFAULT_LISTEN, ENV

log = logging.getLogger("otelprof.determined")

_HELP = """\
Receive OTLP gRPC metrics and traces (from the collector's otlp/determined exporter or
straight from otelprof.instrument), group them by Determined trial (resource attributes
determined.trial.id, determined.trial.run_id, determined.agent.id), average them over a
report window and post them to the master's generic-metrics API, so they appear in the
trial's Profiler tab (gpu/cpu/memory/disk/network) and Metrics tab (timings).
Reports wait in an on-disk spool (owner-only files) while the master is unreachable.
Every OTLP request must carry a bearer token from --ingest-tokens, and may write only
into the trials that token's scope names.
"""


def register(subparsers: Any) -> None:
    """Add the `determined-bridge` subcommand (called by otelprof.cli)."""
    p = subparsers.add_parser(
        "determined-bridge",
        help="forward OTLP metrics/traces to a Determined master's Web UI",
        description=_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    def add(group: Any, flag: str, text: str, **kwargs: Any) -> None:
        """An option whose help ends with its environment variable (settings.ENV)."""
        group.add_argument(flag, help=f"{text} (env {ENV[flag[2:].replace('-', '_')]})", **kwargs)

    add(
        p, "--listen", f"OTLP gRPC address, default {DEFAULT_LISTEN}; beyond loopback only with TLS"
    )
    p.add_argument(
        "--new-token",
        action="store_true",
        help="print a fresh random ingest token and exit (add it to --ingest-tokens' file)",
    )
    ingest = p.add_argument_group(
        "who may send OTLP (required: every request needs `authorization: Bearer <token>`)"
    )
    add(
        ingest,
        "--ingest-tokens",
        "file of ingest tokens, one per line with its scope: "
        "`TOKEN trial=42`, `TOKEN experiment=7`, `TOKEN *`; must be readable by its owner "
        "only",
    )
    ingest.add_argument(
        "--allow-trial",
        type=int,
        action="append",
        help="scope of tokens listed without one (repeatable)",
    )
    ingest.add_argument(
        "--allow-experiment",
        type=int,
        action="append",
        help="scope of tokens listed without one: any trial of this experiment (repeatable)",
    )
    add(ingest, "--tls-cert", "server certificate (PEM)")
    add(ingest, "--tls-key", "server key (PEM)")
    add(ingest, "--tls-client-ca", "CA of client certificates: mutual TLS")
    add(ingest, "--max-request-mb", "largest OTLP request taken, default 4", type=float)
    add(ingest, "--max-inflight-mb", "request bytes being mapped at once, default 32", type=float)
    add(
        ingest,
        "--max-steps-per-second",
        "stepsCompleted may not grow faster than this (a bound "
        "on what a trial can really have trained), default 10000",
        type=float,
    )
    add(p, "--master", "Determined master URL, e.g. http://det:8080")
    auth = p.add_argument_group(
        "authentication (one of; default: DET_USER_TOKEN, DET_SESSION_TOKEN or DET_USER+DET_PASS)"
    )
    add(auth, "--token-file", "file holding a user token (Authorization: Bearer)")
    add(
        auth,
        "--allocation-token-file",
        "file holding a task's allocation token (DET_SESSION_TOKEN)",
    )
    add(auth, "--user", "log in as this user via /api/v1/auth/login")
    add(auth, "--password-file", "file holding --user's password (else DET_PASS)")
    add(p, "--ca-bundle", "CA bundle to verify an https master; 'noverify' turns verification off")
    add(
        p,
        "--report-interval",
        "seconds per report window, default 10 like Determined's profiler",
        type=float,
    )
    add(
        p,
        "--spool-dir",
        "directory of the crash-safe report spool, default "
        "$XDG_STATE_HOME/otelprof/determined-bridge; 'none' keeps it in memory",
    )
    add(
        p,
        "--spool-max-mb",
        "spool size cap; the oldest reports are dropped (and counted) beyond it, default 256",
        type=float,
    )
    p.add_argument(
        "--shared-spool",
        action="store_true",
        help="make the spool group-readable (0750/0640); default owner-only (0700/0600)",
    )
    p.add_argument(
        "--no-fsync",
        action="store_true",
        help="do not fsync spool batches (still safe against a process crash, not a power cut)",
    )
    route = p.add_argument_group("routing data that carries no Determined ids")
    add(route, "--trial-id", "trial to report it under", type=int)
    add(route, "--trial-run-id", "that trial's run id", type=int)
    add(route, "--agent-id", "agent id when neither determined.agent.id nor host.name is set")
    add(p, "--timings-group", "generic metric group for timing spans, default 'timings'")
    add(
        p,
        "--retry-max-delay",
        "cap of the exponential retry backoff in seconds, default 30",
        type=float,
    )
    add(p, "--request-timeout", "HTTP timeout per request in seconds, default 10", type=float)
    add(
        p,
        "--metrics-port",
        "serve the bridge's own metrics (delivered, refused, retries, "
        "pending, ...) in the Prometheus format on 127.0.0.1:PORT; 0 picks a free port",
        type=int,
    )
    p.add_argument("--workers", type=int, help="gRPC worker threads, default 8")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Start the bridge and serve until a signal; exit code 2 on bad settings."""
    if getattr(args, "new_token", False):
        from otelprof.determined.ingest_auth import new_token

        print(new_token())
        return 0
    # Imported here so `otelprof --help` does not pay for grpc/httpx.
    from otelprof.determined.client import ConfigError, DeterminedClient
    from otelprof.determined.pipeline import Pipeline
    from otelprof.determined.server import BridgeServer
    from otelprof.determined.settings import BridgeSettings
    from otelprof.determined.spool import DiskSpool, MemorySpool

    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per POST otherwise
    try:
        settings = BridgeSettings.from_args(args)
        client = DeterminedClient.in_task(  # DET_USE_TLS; a --ca-bundle of noverify: no checks
            settings.master,
            settings.credentials,
            os.environ,
            settings.ca_bundle,
            settings.request_timeout_s,
        )
        spool: DiskSpool | MemorySpool = (
            DiskSpool(
                settings.spool_dir,
                settings.spool_max_bytes,
                settings.fsync,
                shared=settings.shared_spool,
            )
            if settings.spool_dir
            else MemorySpool(settings.spool_max_bytes)
        )
        pipeline = Pipeline(
            client,
            spool,
            window_s=settings.window_s,
            route=settings.route,
            timings_group=settings.timings_group,
            retry_max_s=settings.retry_max_s,
            skip_direct=True,  # processes posting to Determined themselves own their data
            max_steps_per_s=settings.max_steps_per_s,
        )
        server = BridgeServer(
            pipeline,
            settings.listen,
            workers=settings.workers,
            tokens=settings.ingest_tokens,
            tls=settings.tls,
            limits=settings.limits,
        )
    except (ConfigError, OSError, ValueError) as exc:
        print(f"otelprof determined-bridge: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def _signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _signal)
    signal.signal(signal.SIGINT, _signal)
    server.start()
    stop_metrics = None
    metrics_note = ""
    if settings.metrics_port is not None:
        from otelprof.determined.selfmetrics import serve_metrics

        try:
            metrics_port, stop_metrics = serve_metrics(server.stats, settings.metrics_port)
        except OSError as exc:
            print(f"otelprof determined-bridge: --metrics-port: {exc}", file=sys.stderr)
            server.stop()
            return 2
        metrics_note = f", metrics on port {metrics_port}"
    # Machine-readable line for scripts and tests that let the bridge pick a port.
    print(
        f"otelprof determined-bridge listening on port {server.port} -> {client.master} "
        f"(window {settings.window_s:g} s, spool {settings.spool_dir or 'memory'}"
        f"{metrics_note})",
        flush=True,
    )
    last: dict[str, Any] = {}
    while not stop.wait(60.0):
        stats = server.stats()
        if stats != last:
            log.info("stats: %s", stats)
            last = stats
    server.stop()
    if stop_metrics is not None:
        stop_metrics()
    log.info("stopped; stats: %s", server.stats())
    return 0
