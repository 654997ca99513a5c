"""Settings from keyword arguments and the environment, validated once before anything starts.

Keywords win over `OTELPROF_*` variables, which win over the standard `OTEL_*` ones. Every
problem is reported as a `ConfigError` naming the option and what was wrong with it, so a
typo never silently turns a profiled run into an unprofiled one.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from otelprof import _private_files

MIN_INTERVAL_S = 0.1
DEFAULT_INTERVAL_S = 1.0
"""Default collection interval: Determined's own profiler samples every second, and 1 s keeps
sampling well under 0.5% of one core while still resolving step-scale dips."""

GpuSelection = Literal["visible", "all", "none"]


class ConfigError(ValueError):
    """A configuration value is unknown, malformed or unusable."""


@dataclass(frozen=True)
class Settings:
    """Everything `instrument()` needs, resolved and validated."""

    service_name: str = "otelprof"
    endpoint: str | None = None
    insecure: bool = True
    headers: Mapping[str, str] = field(default_factory=dict)
    detached: bool = True
    output_dir: Path = Path("otelprof-runs")
    run_id: str = ""
    prometheus_port: int | None = None
    prometheus_host: str = "127.0.0.1"
    interval_s: float = DEFAULT_INTERVAL_S
    host_metrics: bool = True
    gpus: GpuSelection = "visible"
    process_metrics: bool = True
    timings: bool = True
    record_function: bool = True
    schedule: Callable[[int], Any] | None = None
    kineto: bool = False
    cuda_events: bool = True
    sync_cuda: bool = False
    max_queued_spans: int = 65536
    resource_attributes: Mapping[str, str] = field(default_factory=dict)
    determined: bool = False
    export_timeout_s: float = 10.0
    trace_budget: float = 10.0
    compress: bool = False
    max_trace_bytes: int | None = 1 << 30
    max_metrics_bytes: int | None = 1 << 30
    shared_run_dir: bool = False  # run directory 0750 (group-readable) instead of 0700

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.run_id

    @classmethod
    def from_options(cls, env: Mapping[str, str] | None = None, **options: Any) -> Settings:
        """Resolve keywords + environment into validated settings (raises ConfigError)."""
        env = os.environ if env is None else env
        unknown = sorted(set(options) - _OPTION_NAMES)
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(map(repr, unknown))}; "
                f"valid options: {', '.join(sorted(_OPTION_NAMES))}"
            )
        resolved = {name: _resolve(name, options, env) for name in _OPTION_NAMES}
        return _validate(resolved, env)


def _opt(name: str, options: Mapping[str, Any], env: Mapping[str, str], *env_names: str) -> Any:
    if name in options and options[name] is not None:
        return options[name]
    for env_name in env_names:
        value = env.get(env_name)
        if value is not None and value != "":
            return _FromEnv(env_name, value)
    return None


@dataclass(frozen=True)
class _FromEnv:
    """A raw string from the environment, remembered with its variable for error messages."""

    variable: str
    value: str


# option name -> environment variables consulted, in priority order
ENVIRONMENT: dict[str, tuple[str, ...]] = {
    "service_name": ("OTELPROF_SERVICE_NAME", "OTEL_SERVICE_NAME"),
    "endpoint": (
        "OTELPROF_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ),
    "insecure": ("OTELPROF_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE"),
    "headers": ("OTEL_EXPORTER_OTLP_HEADERS",),
    "detached": ("OTELPROF_DETACHED",),
    "output_dir": ("OTELPROF_OUTPUT_DIR",),
    "run_id": ("OTELPROF_RUN_ID", "TORCHELASTIC_RUN_ID"),
    "prometheus_port": ("OTELPROF_PROMETHEUS_PORT",),
    "prometheus_host": ("OTELPROF_PROMETHEUS_HOST",),
    "interval_s": ("OTELPROF_INTERVAL",),
    "host_metrics": ("OTELPROF_HOST_METRICS",),
    "gpus": ("OTELPROF_GPUS",),
    "process_metrics": ("OTELPROF_PROCESS_METRICS",),
    "timings": ("OTELPROF_TIMINGS",),
    "record_function": ("OTELPROF_RECORD_FUNCTION",),
    "schedule": (),
    "kineto": ("OTELPROF_KINETO",),
    "cuda_events": ("OTELPROF_CUDA_EVENTS",),
    "sync_cuda": ("OTELPROF_SYNC_CUDA",),
    "max_queued_spans": ("OTELPROF_MAX_QUEUED_SPANS",),
    "resource_attributes": ("OTEL_RESOURCE_ATTRIBUTES",),
    "determined": ("OTELPROF_DETERMINED",),
    "export_timeout_s": ("OTELPROF_EXPORT_TIMEOUT",),
    "trace_budget": ("OTELPROF_TRACE_BUDGET",),
    "compress": ("OTELPROF_COMPRESS",),
    "max_trace_bytes": ("OTELPROF_MAX_TRACE_BYTES",),
    "max_metrics_bytes": ("OTELPROF_MAX_METRICS_BYTES",),
    "shared_run_dir": ("OTELPROF_SHARED_RUN_DIR",),
}
# `interval` is accepted as the friendly keyword for interval_s.
_ALIASES = {"interval": "interval_s", "export_timeout": "export_timeout_s"}
_OPTION_NAMES = frozenset({f.name for f in fields(Settings)} | set(_ALIASES))


def _resolve(name: str, options: Mapping[str, Any], env: Mapping[str, str]) -> Any:
    if name in _ALIASES:
        return None
    merged = dict(options)
    for alias, target in _ALIASES.items():
        if alias in options and target not in options:
            merged[target] = options[alias]
    return _opt(name, merged, env, *ENVIRONMENT[name])


def _where(name: str, raw: Any) -> str:
    if isinstance(raw, _FromEnv):
        return f"environment variable {raw.variable}"
    return f"option {name!r}"


def _as_bool(name: str, raw: Any, default: bool) -> bool:
    if raw is None:
        return default
    if isinstance(raw, _FromEnv):
        text = raw.value.strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{_where(name, raw)}: expected true/false, got {raw.value!r}")
    if isinstance(raw, bool):
        return raw
    raise ConfigError(f"{_where(name, raw)}: expected a bool, got {raw!r}")


def _as_number(name: str, raw: Any, kind: type, default: Any) -> Any:
    if raw is None:
        return default
    value = raw.value if isinstance(raw, _FromEnv) else raw
    if isinstance(value, bool):
        raise ConfigError(f"{_where(name, raw)}: expected a number, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{_where(name, raw)}: expected a number, got {value!r}") from None


def _as_str(raw: Any) -> str | None:
    if raw is None:
        return None
    return raw.value if isinstance(raw, _FromEnv) else str(raw)


def _as_mapping(name: str, raw: Any) -> dict[str, str]:
    """`k=v,k2=v2` (the OTEL_* format) or a mapping."""
    if raw is None:
        return {}
    if isinstance(raw, Mapping):
        return {str(k): str(v) for k, v in raw.items()}
    text = raw.value if isinstance(raw, _FromEnv) else raw
    if not isinstance(text, str):
        raise ConfigError(f"{_where(name, raw)}: expected a mapping or 'k=v,...', got {text!r}")
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{_where(name, raw)}: malformed entry {item!r}, expected key=value")
        out[key.strip()] = unquote(value.strip())
    return out


_HOST_PORT = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


def normalize_endpoint(name: str, raw: Any) -> tuple[str, bool | None]:
    """Accept `http(s)://host:port` or `host:port`; return (host:port, scheme-implied insecure)."""
    text = (_as_str(raw) or "").strip()
    where = _where(name, raw)
    if "://" in text:
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https", "grpc", "grpcs"):
            raise ConfigError(f"{where}: unsupported scheme {parts.scheme!r} in {text!r}")
        try:
            port = parts.port
        except ValueError:
            raise ConfigError(f"{where}: bad port in {text!r}") from None
        if not parts.hostname:
            raise ConfigError(f"{where}: no host in {text!r}")
        if parts.path not in ("", "/"):
            raise ConfigError(
                f"{where}: OTLP gRPC endpoints take no path, got {parts.path!r} in {text!r}"
            )
        port = port or 4317
        if not 0 < port < 65536:
            raise ConfigError(f"{where}: port out of range in {text!r}")
        host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        return f"{host}:{port}", parts.scheme in ("http", "grpc")
    if not _HOST_PORT.match(text):
        raise ConfigError(f"{where}: malformed endpoint {text!r}, expected http://host:port")
    port = int(text.rsplit(":", 1)[1])
    if not 0 < port < 65536:
        raise ConfigError(f"{where}: port out of range in {text!r}")
    return text, None


def _default_run_id() -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{stamp}-{uuid.uuid4().hex[:6]}"


def _check_writable(directory: Path, raw: Any, shared: bool = False) -> None:
    try:
        # owner-only (group-readable when shared): a run holds one user's data
        _private_files.make_dir(directory, shared)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".otelprof-probe-"):
            pass
    except OSError as error:
        where = _where("output_dir", raw) if raw is not None else "default output directory"
        raise ConfigError(
            f"{where}: output directory {str(directory)!r} is not writable ({error.strerror})"
        ) from None


def _validate(raw: dict[str, Any], env: Mapping[str, str]) -> Settings:
    values: dict[str, Any] = {}
    values["service_name"] = _as_str(raw["service_name"]) or "otelprof"

    endpoint = None
    scheme_insecure = None
    if raw["endpoint"] is not None:
        endpoint, scheme_insecure = normalize_endpoint("endpoint", raw["endpoint"])
    values["endpoint"] = endpoint
    default_insecure = True if scheme_insecure is None else scheme_insecure
    values["insecure"] = _as_bool("insecure", raw["insecure"], default_insecure)
    values["headers"] = _as_mapping("headers", raw["headers"])
    values["detached"] = _as_bool("detached", raw["detached"], endpoint is None)

    interval = _as_number("interval_s", raw["interval_s"], float, DEFAULT_INTERVAL_S)
    if not interval > 0:
        raise ConfigError(
            f"{_where('interval', raw['interval_s'])}: interval must be positive, got {interval}"
        )
    if interval < MIN_INTERVAL_S:
        raise ConfigError(
            f"{_where('interval', raw['interval_s'])}: interval must be at least "
            f"{MIN_INTERVAL_S} s, got {interval}"
        )
    values["interval_s"] = interval

    port = _as_number("prometheus_port", raw["prometheus_port"], int, None)
    if port is not None and not 0 <= port < 65536:
        raise ConfigError(f"{_where('prometheus_port', raw['prometheus_port'])}: bad port {port}")
    values["prometheus_port"] = port
    values["prometheus_host"] = _as_str(raw["prometheus_host"]) or "127.0.0.1"

    local_rank = int(env.get("LOCAL_RANK", "0") or 0)
    values["host_metrics"] = _as_bool("host_metrics", raw["host_metrics"], local_rank == 0)
    gpus = (_as_str(raw["gpus"]) or "visible").strip().lower()
    if gpus not in ("visible", "all", "none"):
        raise ConfigError(
            f"{_where('gpus', raw['gpus'])}: expected 'visible', 'all' or 'none', got {gpus!r}"
        )
    values["gpus"] = gpus
    for name, default in (
        ("process_metrics", True),
        ("timings", True),
        ("record_function", True),
        ("kineto", False),
        ("cuda_events", True),
        ("sync_cuda", False),
        ("determined", False),
        ("shared_run_dir", False),
    ):
        values[name] = _as_bool(name, raw[name], default)

    schedule = raw["schedule"]
    if schedule is not None and not callable(schedule):
        raise ConfigError(
            f"option 'schedule': expected a callable step -> action, got {schedule!r}"
        )
    values["schedule"] = schedule

    queued = _as_number("max_queued_spans", raw["max_queued_spans"], int, 65536)
    if queued < 1:
        raise ConfigError(f"{_where('max_queued_spans', raw['max_queued_spans'])}: must be >= 1")
    values["max_queued_spans"] = queued
    timeout = _as_number("export_timeout_s", raw["export_timeout_s"], float, 10.0)
    if not timeout > 0:
        raise ConfigError(f"{_where('export_timeout', raw['export_timeout_s'])}: must be > 0")
    values["export_timeout_s"] = timeout
    budget = _as_number("trace_budget", raw["trace_budget"], float, 10.0)
    if not budget >= 0:  # also refuses NaN
        raise ConfigError(
            f"{_where('trace_budget', raw['trace_budget'])}: must be >= 0 spans per second "
            "(inf keeps every step's trace)"
        )
    values["trace_budget"] = budget
    values["compress"] = _as_bool("compress", raw["compress"], False)
    cap = _as_number("max_trace_bytes", raw["max_trace_bytes"], int, 1 << 30)
    if cap < 0:
        raise ConfigError(
            f"{_where('max_trace_bytes', raw['max_trace_bytes'])}: must be >= 0 (0 = no cap)"
        )
    values["max_trace_bytes"] = cap or None
    cap = _as_number("max_metrics_bytes", raw["max_metrics_bytes"], int, 1 << 30)
    if cap < 0:
        raise ConfigError(
            f"{_where('max_metrics_bytes', raw['max_metrics_bytes'])}: must be >= 0 (0 = no cap)"
        )
    values["max_metrics_bytes"] = cap or None
    values["resource_attributes"] = _as_mapping("resource_attributes", raw["resource_attributes"])

    run_id = _as_str(raw["run_id"]) or _default_run_id()
    if isinstance(raw["run_id"], _FromEnv) and raw["run_id"].variable == "TORCHELASTIC_RUN_ID":
        from otelprof._distributed.ranks import torchelastic_run_id

        run_id = torchelastic_run_id(run_id)
    if "/" in run_id or run_id in (".", ".."):
        raise ConfigError(f"{_where('run_id', raw['run_id'])}: not a usable name: {run_id!r}")
    values["run_id"] = run_id
    output_dir = Path(_as_str(raw["output_dir"]) or "otelprof-runs").expanduser()
    values["output_dir"] = output_dir
    if values["detached"]:
        _check_writable(output_dir / run_id, raw["output_dir"], values["shared_run_dir"])
    return Settings(**values)
