"""Real services for end-to-end tests: the otelprof collector build and Prometheus.

Everything here starts real processes on free loopback ports, with its own configuration,
storage and logs under a directory the caller gives (a pytest tmp_path), and stops them.
Nothing is mocked and nothing is skipped: a missing component raises `MissingComponent`
with the command that provides it (`make collector`, `make prometheus`).

    collector = start_collector(tmp_path / "otelcol", traces_exporters=["span_metrics"])
    prom = start_prometheus(tmp_path / "prom", collector=collector)
    prom.wait_for_series('system_cpu_utilization_ratio')
    ...
    prom.stop(); collector.stop()

The pytest fixtures in tests/conftest.py wrap these for the common cases.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
COLLECTOR_DIR = REPO / "collector-config"
MANIFEST = COLLECTOR_DIR / "builder-config.yaml"
COLLECTOR_CONFIG = COLLECTOR_DIR / "otelcol.yaml"
PROMETHEUS_CONFIG = REPO / "prometheus" / "prometheus.yml"
BUILD_SCRIPT = REPO / "scripts" / "build-collector.sh"

T = TypeVar("T")


class MissingComponent(RuntimeError):
    """A real component the tests need is not installed; the message says how to get it."""


class ServiceFailed(RuntimeError):
    """A started service exited or never became ready; the message carries its log tail."""


# -- locating binaries --------------------------------------------------------------------


def cache_dir() -> Path:
    """The collector build cache, computed exactly like scripts/build-collector.sh."""
    if os.environ.get("OTELPROF_CACHE_DIR"):
        return Path(os.environ["OTELPROF_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "otelprof"


def collector_binary_path(manifest: Path = MANIFEST) -> Path:
    """Where `make collector` puts the binary for this manifest (keyed by its sha256)."""
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest()[:12]
    return cache_dir() / f"otelcol-otelprof-{digest}"


def require_collector() -> Path:
    """The otelcol-otelprof binary: $OTELPROF_COLLECTOR, else the build cache entry."""
    explicit = os.environ.get("OTELPROF_COLLECTOR")
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise MissingComponent(
                f"OTELPROF_COLLECTOR={explicit} is not an executable file; "
                "run `make collector` and point OTELPROF_COLLECTOR at the path it prints"
            )
        return path
    path = collector_binary_path()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise MissingComponent(
            f"the otelprof collector is not built for the current manifest ({path} is missing); "
            "run `make collector` (builds otelcol-otelprof from collector-config/"
            "builder-config.yaml, a few minutes the first time)"
        )
    return path


def require_prometheus() -> Path:
    """Debian's prometheus binary (or any `prometheus` on PATH)."""
    found = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None
    )
    if not found:
        raise MissingComponent(
            "prometheus is not installed; run `make prometheus` "
            "(installs Debian's prometheus package)"
        )
    return Path(found)


# -- small utilities ----------------------------------------------------------------------


_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it) that this process has not
    handed out before: a collector made with `wait=False` holds its ports only once it
    starts, and a Prometheus started in between was given one of them (the collector then
    failed with "address already in use")."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no loopback port left that this test run has not handed out")


def wait_for(
    check: Callable[[], T | None],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.25,
    on_timeout: Callable[[], str] | None = None,
) -> T:
    """Poll `check` until it returns something truthy; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except Exception as error:  # a service still starting answers with errors
            last_error = error
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            extra = f"\n{on_timeout()}" if on_timeout else ""
            raise TimeoutError(
                f"timed out after {timeout_s:.0f}s waiting for {what}{detail}{extra}"
            )
        time.sleep(interval_s)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class ManagedProcess:
    """A child process with its output in a log file; stop() is idempotent."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    cwd: Path | None = None
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,  # our own process group: a Ctrl-C in pytest is ours
            )
        finally:
            log.close()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return f"--- last lines of {self.log_path} ---\n{_tail(self.log_path, lines)}"

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise ServiceFailed(
                f"{self.name} exited with status {self.process.returncode}\n{self.log_tail()}"
            )

    def kill(self) -> None:
        """SIGKILL: the abrupt death of a crashed or OOM-killed service."""
        if self.running and self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        if not self.running or self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


# -- the collector ------------------------------------------------------------------------


@dataclass
class Collector:
    """A running otelcol-otelprof with collector-config/otelcol.yaml and its own ports.

    Ports stay fixed across stop()/start(), so an SDK exporter pointed at `otlp_endpoint`
    reconnects to the restarted collector, as it would to a restarted node service.
    """

    binary: Path
    config: Path
    workdir: Path
    env: dict[str, str]
    ports: dict[str, int]
    overlays: list[Path] = field(default_factory=list)
    process: ManagedProcess | None = None
    starts: int = 0

    @property
    def otlp_endpoint(self) -> str:
        """OTLP gRPC endpoint for `otelprof.instrument(endpoint=...)` and SDK exporters."""
        return f"http://127.0.0.1:{self.ports['grpc']}"

    @property
    def otlp_http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    @property
    def prometheus_target(self) -> str:
        """host:port of the prometheus exporter's /metrics (what Prometheus scrapes)."""
        return f"127.0.0.1:{self.ports['prometheus']}"

    @property
    def straggler_target(self) -> str:
        """host:port of the straggler path's small /metrics (prometheus/straggler)."""
        return f"127.0.0.1:{self.ports['straggler']}"

    @property
    def telemetry_target(self) -> str:
        """host:port of the collector's own metrics (accepted/refused/failed counters)."""
        return f"127.0.0.1:{self.ports['telemetry']}"

    @property
    def debug_dir(self) -> Path:
        """Where the file/traces and file/metrics exporters write (when switched on)."""
        return Path(self.env["OTELCOL_DEBUG_DIR"])

    def start(self, *, wait: bool = True, timeout_s: float = 30.0) -> Collector:
        self.starts += 1
        self.process = ManagedProcess(
            "collector",
            [
                str(self.binary),
                *(f"--config={path}" for path in (self.config, *self.overlays)),
            ],
            self.workdir / f"collector.{self.starts}.log",
            env=self.env,
            cwd=self.workdir,
        )
        self.process.start()
        if wait:
            self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        url = f"http://127.0.0.1:{self.ports['health']}/"
        process = self.process
        assert process is not None

        def healthy() -> bool:
            process.check_alive()
            return httpx.get(url, timeout=1.0).status_code == 200

        wait_for(
            healthy,
            timeout_s=timeout_s,
            what=f"collector health_check at {url}",
            on_timeout=process.log_tail,
        )

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()

    def log_text(self) -> str:
        """All of this collector's logs so far (every start), for assertions on warnings."""
        return "\n".join(
            p.read_text(errors="replace") for p in sorted(self.workdir.glob("collector.*.log"))
        )

    def scrape(self) -> str:
        """The prometheus exporter's current /metrics text."""
        return httpx.get(f"http://{self.prometheus_target}/metrics", timeout=5.0).text

    def scrape_straggler(self) -> str:
        """The straggler path's current /metrics text."""
        return httpx.get(f"http://{self.straggler_target}/metrics", timeout=5.0).text

    def self_metrics(self) -> str:
        """The collector's own /metrics text (otelcol_receiver_accepted_spans, ...)."""
        return httpx.get(f"http://{self.telemetry_target}/metrics", timeout=5.0).text


def collector_env(
    workdir: Path,
    *,
    ports: Mapping[str, int],
    traces_exporters: Iterable[str] = ("span_metrics",),
    metrics_exporters: Iterable[str] = ("prometheus",),
    straggler_exporters: Iterable[str] = ("prometheus/straggler",),
    spanmetrics_flush_interval: str = "1s",
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The OTELCOL_* environment collector-config/otelcol.yaml reads, for these ports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTELCOL_")}
    env.update(
        {
            "OTELCOL_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{ports['grpc']}",
            "OTELCOL_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{ports['http']}",
            "OTELCOL_HEALTH_ENDPOINT": f"127.0.0.1:{ports['health']}",
            "OTELCOL_PROMETHEUS_ENDPOINT": f"127.0.0.1:{ports['prometheus']}",
            "OTELCOL_STRAGGLER_ENDPOINT": f"127.0.0.1:{ports['straggler']}",
            "OTELCOL_TELEMETRY_HOST": "127.0.0.1",
            "OTELCOL_TELEMETRY_PORT": str(ports["telemetry"]),
            "OTELCOL_DEBUG_DIR": str(workdir / "debug"),
            "OTELCOL_SPANMETRICS_FLUSH_INTERVAL": spanmetrics_flush_interval,
            "OTELCOL_BATCH_TIMEOUT": "200ms",
            "OTELCOL_TRACES_EXPORTERS": "[" + ", ".join(traces_exporters) + "]",
            "OTELCOL_METRICS_EXPORTERS": "[" + ", ".join(metrics_exporters) + "]",
            "OTELCOL_STRAGGLER_EXPORTERS": "[" + ", ".join(straggler_exporters) + "]",
        }
    )
    env.update(extra or {})
    return env


def start_collector(
    workdir: Path,
    *,
    traces_exporters: Iterable[str] = ("span_metrics",),
    metrics_exporters: Iterable[str] = ("prometheus",),
    straggler_exporters: Iterable[str] = ("prometheus/straggler",),
    spanmetrics_flush_interval: str = "1s",
    extra_env: Mapping[str, str] | None = None,
    config: Path = COLLECTOR_CONFIG,
    overlays: Iterable[Path] = (),
    wait: bool = True,
) -> Collector:
    """Start the built collector with the shipped config on free loopback ports.

    `traces_exporters` / `metrics_exporters` / `straggler_exporters` are the config's
    switches (exporter names, e.g. "file/traces", "prometheus_remote_write"); `extra_env`
    overrides any OTELCOL_* variable.
    `overlays` are further config files merged over `config` (e.g. collector-config/replay.yaml).
    With wait=False the collector is prepared but not started (call `.start()`), which is how
    a test begins with the collector down.
    """
    binary = require_collector()
    workdir.mkdir(parents=True, exist_ok=True)
    ports = {
        name: free_port()
        for name in ("grpc", "http", "health", "prometheus", "straggler", "telemetry")
    }
    env = collector_env(
        workdir,
        ports=ports,
        traces_exporters=traces_exporters,
        metrics_exporters=metrics_exporters,
        straggler_exporters=straggler_exporters,
        spanmetrics_flush_interval=spanmetrics_flush_interval,
        extra=extra_env,
    )
    collector = Collector(
        binary=binary,
        config=config,
        workdir=workdir,
        env=env,
        ports=ports,
        overlays=list(overlays),
    )
    if wait:
        collector.start()
    return collector


def validate_collector_config(
    config: Path, env: Mapping[str, str] | None = None, binary: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`otelcol-otelprof validate --config=...`: parses, resolves env and checks components."""
    binary = binary or require_collector()
    return subprocess.run(
        [str(binary), "validate", f"--config={config}"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(env) if env is not None else None,
    )


# -- Prometheus ---------------------------------------------------------------------------


@dataclass
class Prometheus:
    """A private Prometheus (own config, storage and port) with a small query API."""

    port: int
    workdir: Path
    process: ManagedProcess
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10.0))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def remote_write_url(self) -> str:
        return f"{self.url}/api/v1/write"

    def _api(self, path: str, params: Mapping[str, Any]) -> Any:
        response = self.client.get(f"{self.url}/api/v1/{path}", params=dict(params))
        body = response.json()
        if response.status_code != 200 or body.get("status") != "success":
            raise PromQueryError(
                f"Prometheus {path} {dict(params)!r} failed: HTTP {response.status_code} "
                f"{body.get('errorType', '')}: {body.get('error', body)}"
            )
        return body["data"]

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; returns the result list (vector samples: metric + value)."""
        params: dict[str, Any] = {"query": promql}
        if at is not None:
            params["time"] = at
        data = self._api("query", params)
        result = data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        return list(result)

    def query_range(
        self, promql: str, start: float, end: float, step_s: float = 1.0
    ) -> list[dict[str, Any]]:
        """Range query; returns the matrix (metric + values)."""
        data = self._api(
            "query_range", {"query": promql, "start": start, "end": end, "step": step_s}
        )
        return list(data["result"])

    def values(self, promql: str) -> list[float]:
        """The instant query's sample values as floats."""
        return [float(sample["value"][1]) for sample in self.query(promql)]

    def series(self, match: str, start: float | None = None) -> list[dict[str, str]]:
        params: dict[str, Any] = {"match[]": match}
        if start is not None:
            params["start"] = start
        return list(self._api("series", params))

    def label_values(self, label: str) -> list[str]:
        response = self.client.get(f"{self.url}/api/v1/label/{label}/values")
        return list(response.json()["data"])

    def exemplars(self, promql: str, start: float, end: float) -> list[dict[str, Any]]:
        return list(self._api("query_exemplars", {"query": promql, "start": start, "end": end}))

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending and firing), each with labels, annotations and state."""
        return list(self._api("alerts", {})["alerts"])

    def rule_groups(self) -> list[dict[str, Any]]:
        """Loaded rule groups with their rules' health and last evaluation error."""
        return list(self._api("rules", {})["groups"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self._api("targets", {})["activeTargets"])

    def targets_up(self) -> bool:
        active = self.targets()
        return bool(active) and all(t["health"] == "up" for t in active)

    def wait_for_series(self, promql: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Wait until the query returns at least one sample; return the samples."""
        return wait_for(
            lambda: self.query(promql),
            timeout_s=timeout_s,
            what=f"Prometheus to return data for {promql}",
            interval_s=0.5,
        )

    def stop(self) -> None:
        self.process.stop()
        self.client.close()


class PromQueryError(RuntimeError):
    """Prometheus answered a query with an error (bad PromQL, bad parameters)."""


def prometheus_config(
    scrape_targets: Mapping[str, str | Sequence[str]],
    *,
    scrape_interval: str = "1s",
    template: Path = PROMETHEUS_CONFIG,
    rule_files: Sequence[Path] | None = None,
) -> dict[str, Any]:
    """The shipped prometheus/prometheus.yml with its jobs' targets replaced.

    `scrape_targets` maps job names of the template ("otelcol", "otelcol-straggler",
    "otelcol-self") to
    host:port (or a list of them); jobs not named are dropped, so the test scrapes only what
    it started. The template's rule files (the shipped alerting rules) are loaded from where
    the template names them (relative to it, as Prometheus resolves them), or `rule_files`
    instead.
    """
    config = yaml.safe_load(template.read_text())
    if rule_files is None:
        rule_files = [template.parent / name for name in config.get("rule_files", [])]
        missing = [str(path) for path in rule_files if not path.is_file()]
        if missing:  # Prometheus would load nothing from a pattern that matches no file
            raise ValueError(f"{template} names rule files that do not exist: {missing}")
    config["rule_files"] = [str(path) for path in rule_files]
    config.setdefault("global", {})
    config["global"]["scrape_interval"] = scrape_interval
    config["global"]["evaluation_interval"] = scrape_interval
    jobs = []
    for job in config.get("scrape_configs", []):
        name = job["job_name"]
        if name in scrape_targets:
            given = scrape_targets[name]
            job["static_configs"] = [
                {"targets": [given] if isinstance(given, str) else list(given)}
            ]
            jobs.append(job)
    unknown = set(scrape_targets) - {job["job_name"] for job in jobs}
    if unknown:
        raise ValueError(f"no scrape job named {sorted(unknown)} in {template}")
    config["scrape_configs"] = jobs
    return config


def start_prometheus(
    workdir: Path,
    *,
    collector: Collector | None = None,
    scrape_targets: Mapping[str, str | Sequence[str]] | None = None,
    scrape_interval: str = "1s",
    rule_files: Sequence[Path] | None = None,
    timeout_s: float = 60.0,
) -> Prometheus:
    """Start Debian's Prometheus with a generated config on a free loopback port.

    Scrapes `collector`'s prometheus exporter (job "otelcol", honor_labels), its straggler
    path (job "otelcol-straggler") and its own metrics (job "otelcol-self"), or the explicit
    `scrape_targets`. The remote-write
    receiver and exemplar storage are on, as in compose.yaml. The shipped alerting rules
    are loaded, or `rule_files` instead.
    """
    binary = require_prometheus()
    workdir.mkdir(parents=True, exist_ok=True)
    targets: dict[str, str | Sequence[str]] = dict(scrape_targets or {})
    if collector is not None:
        targets.setdefault("otelcol", collector.prometheus_target)
        targets.setdefault("otelcol-straggler", collector.straggler_target)
        targets.setdefault("otelcol-self", collector.telemetry_target)
    config_path = workdir / "prometheus.yml"
    config_path.write_text(
        yaml.safe_dump(
            prometheus_config(targets, scrape_interval=scrape_interval, rule_files=rule_files)
        )
    )
    expected = sum(1 if isinstance(t, str) else len(t) for t in targets.values())
    last_error: Exception | None = None
    for _attempt in range(3):  # a free port can be taken between choosing and binding
        port = free_port()
        process = ManagedProcess(
            "prometheus",
            [str(binary), *prometheus_flags(config_path, workdir / "data", port)],
            workdir / f"prometheus.{port}.log",
            cwd=workdir,
        )
        process.start()
        prom = Prometheus(port=port, workdir=workdir, process=process)
        url = f"{prom.url}/-/ready"

        def ready(process: ManagedProcess = process, url: str = url) -> bool:
            process.check_alive()
            return httpx.get(url, timeout=1.0).status_code == 200

        try:
            wait_for(
                ready,
                timeout_s=timeout_s,
                what=f"Prometheus ready at {url}",
                on_timeout=process.log_tail,
            )

            # Service discovery hands targets to the scrape manager at most every 5 s:
            # return once they are active, so callers do not race the first scrape.
            def active(prom: Prometheus = prom, expected: int = expected) -> bool:
                return len(prom.targets()) >= expected

            wait_for(active, timeout_s=timeout_s, what="Prometheus to activate its scrape targets")
            return prom
        except (ServiceFailed, TimeoutError) as error:
            last_error = error
            prom.stop()
            if "address already in use" not in process.log_tail():
                break
    raise ServiceFailed(f"Prometheus did not start: {last_error}")


def prometheus_flags(config: Path, storage: Path, port: int) -> list[str]:
    """Command-line flags for a private Prometheus 2.42 (same features as compose.yaml)."""
    return [
        f"--config.file={config}",
        f"--storage.tsdb.path={storage}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--web.enable-remote-write-receiver",
        "--enable-feature=exemplar-storage",
        "--storage.tsdb.retention.time=1d",
        "--log.level=warn",
    ]


@contextlib.contextmanager
def running(*services: Any) -> Any:
    """Stop the given services (anything with .stop()) however the block ends."""
    try:
        yield services
    finally:
        for service in reversed(services):
            with contextlib.suppress(Exception):
                service.stop()
