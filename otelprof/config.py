"""Settings from keyword arguments and the environment, validated once before anything starts.

Every option is declared once, as a field of `Settings` made by `option()`: its environment
variables, its parser (which also checks the value) and its default. Resolution and
validation both walk those declarations, so an option cannot be resolved one way and checked
another. Keywords win over `OTELPROF_*` variables, which win over the standard `OTEL_*` ones.
Every problem is a `ConfigError` naming the option or variable the value came from, so a typo
never silently turns a profiled run into an unprofiled one, and nothing (no directory, no
thread) is created before every value has been checked.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

_log = logging.getLogger("otelprof")

MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 3600.0
"""Longer periods overflow the SDK's reader thread wait (`interval=1e10` killed it) and
would leave a run without a single sample anyway."""
DEFAULT_INTERVAL_S = 1.0
"""Default collection interval: Determined's own profiler samples every second, and 1 s keeps
sampling well under 0.5% of one core while still resolving step-scale dips."""
MAX_EXPORT_TIMEOUT_S = 3600.0
"""`shutdown()` waits up to the export timeout; an infinite one never returns (and
`export_timeout=inf` overflowed the SDK's timers)."""
MIN_EXPORT_TIMEOUT_S = 0.1
"""An export to a collector on loopback takes milliseconds, one across a network tens of
them; below 0.1 s every export fails (`export_timeout=1e-9` was taken, and lost all)."""
INT32_MAX = 2**31 - 1
"""Determined's ids and step counts are int32 (its API refuses larger ones)."""
NAME_MAX = 255
"""Longest file name (bytes) Linux file systems take: the run id is a directory name."""

GpuSelection = Literal["visible", "all", "none"]


class ConfigError(ValueError):
    """A configuration value is unknown, malformed or unusable."""


@dataclass(frozen=True)
class _Source:
    """Where a raw value came from, for error messages: a keyword or an environment variable."""

    where: str
    value: Any
    from_env: bool

    def error(self, problem: str) -> ConfigError:
        return ConfigError(f"{self.where}: {problem}, got {self.value!r}")


Parser = Callable[[_Source], Any]
Default = Callable[[dict[str, Any], Mapping[str, str]], Any]


@dataclass(frozen=True)
class Option:
    """One option: environment variables (priority order), keyword aliases, parser, default.

    `parse` turns a raw value (a keyword's value, or a variable's string) into the typed value
    and raises `ConfigError` for anything it cannot use. `derive`, when set, computes the
    default from the options resolved before this one (fields are resolved in order).
    `keyword=False`: a variable another program sets (Determined's `DET_*`) or a rarely
    needed one, read and checked with the options but not an `instrument()` keyword.
    """

    env: tuple[str, ...]
    parse: Parser
    aliases: tuple[str, ...] = ()
    derive: Default | None = None
    keyword: bool = True


def opt(
    *,
    env: tuple[str, ...] = (),
    parse: Parser,
    aliases: tuple[str, ...] = (),
    derive: Default | None = None,
    keyword: bool = True,
) -> dict[str, Option]:
    """A `Settings` field's metadata: its `Option` declaration."""
    return {"option": Option(env, parse, aliases, derive, keyword)}


# ---- parsers: each takes a `_Source` and returns the typed value or raises ConfigError ----


def _text_of(src: _Source, what: str = "a string") -> str:
    value = src.value
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise src.error(f"expected {what}")
    if "\x00" in value:
        raise src.error("contains a NUL byte")
    return value


def text(src: _Source) -> str:
    return _text_of(src)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def boolean(src: _Source) -> bool:
    if src.from_env:
        word = src.value.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise src.error("expected true/false")
    if isinstance(src.value, bool):
        return src.value
    raise src.error("expected a bool")


def number(
    low: float, high: float = math.inf, *, allow_inf: bool = False, low_open: bool = False
) -> Parser:
    """A float in [low, high] (`(low, high]` with low_open); inf only where it means 'no limit'."""

    def parse(src: _Source) -> float:
        raw = src.value
        if isinstance(raw, bool) or not isinstance(raw, int | float | str):
            raise src.error("expected a number")
        try:
            value = float(raw.strip() if isinstance(raw, str) else raw)
        except (ValueError, OverflowError):
            raise src.error("expected a number") from None
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            raise src.error("expected a finite number")
        if value == math.inf and allow_inf:
            return value
        too_low = value <= low if low_open else value < low
        if too_low or value > high:
            low_text = f"> {low:g}" if low_open else f">= {low:g}"
            high_text = f" and <= {high:g}" if high != math.inf else ""
            raise src.error(f"must be {low_text}{high_text}")
        return value

    return parse


def integer(low: int, high: int | None = None, hint: str = "") -> Parser:
    """An integer in [low, high]; `1.5`, `inf` and `true` are refused, never rounded."""

    def parse(src: _Source) -> int:
        raw = src.value
        if isinstance(raw, str):
            if not re.fullmatch(r"\s*[+-]?\d+\s*", raw):
                raise src.error("expected an integer")
            value = int(raw)
        elif isinstance(raw, int) and not isinstance(raw, bool):
            value = raw
        elif isinstance(raw, float) and math.isfinite(raw) and raw.is_integer():
            value = int(raw)
        else:
            raise src.error("expected an integer")
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"between {low} and {high}"
            raise src.error(f"must be {bound}{hint}")
        return value

    return parse


def choice(*words: str) -> Parser:
    def parse(src: _Source) -> str:
        word = _text_of(src).strip().lower()
        if word not in words:
            raise src.error(
                "expected " + ", ".join(repr(w) for w in words[:-1]) + f" or {words[-1]!r}"
            )
        return word

    return parse


def _pairs(src: _Source) -> dict[str, str]:
    """`k=v,k2=v2` (the OTEL_* format, values URL-decoded) or a mapping of strings."""
    if isinstance(src.value, Mapping):
        out = {}
        for key, value in src.value.items():
            if not isinstance(key, str) or not key.strip():
                raise src.error(f"key {key!r} is not a non-empty string")
            if not isinstance(value, str | int | float) or isinstance(value, bool):
                raise src.error(f"value of {key!r} is not a string")
            out[key] = str(value)
    else:
        out = {}
        for item in filter(None, (part.strip() for part in _text_of(src, "a mapping").split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise src.error(f"malformed entry {item!r}, expected key=value")
            out[key.strip()] = unquote(value.strip())
    for key, value in out.items():
        if "\x00" in key or "\x00" in value:
            raise src.error(f"entry {key!r} contains a NUL byte")
    return out


def attributes(src: _Source) -> dict[str, str]:
    return _pairs(src)


_METADATA_KEY = re.compile(r"[0-9a-z_.\-]+")
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")


def grpc_headers(src: _Source) -> dict[str, str]:
    """gRPC metadata: keys lowercased as the OTel SDK does for OTEL_EXPORTER_OTLP_HEADERS (gRPC
    refuses capitals: every export failed with `Invalid metadata`), then checked against
    gRPC's rules, so a header that cannot be sent is refused before anything starts."""
    out: dict[str, str] = {}
    for key, value in _pairs(src).items():
        name = key.strip().lower()
        if not _METADATA_KEY.fullmatch(name):
            raise src.error(f"header {key!r}: gRPC metadata keys are 0-9 a-z _ . - only")
        if name.startswith("grpc-"):
            raise src.error(f"header {key!r}: 'grpc-' keys are reserved by gRPC")
        if not name.endswith("-bin") and not _PRINTABLE_ASCII.fullmatch(value):
            raise src.error(f"header {key!r}: gRPC metadata values are printable ASCII only")
        if name in out:
            raise src.error(f"header {key!r} given twice (keys are case-insensitive)")
        out[name] = value
    return out


_OTLP_PORT = 4317


def endpoint(src: _Source) -> tuple[str, bool | None]:
    """`http(s)://host:port` or `host:port` -> (host:port, insecure implied by the scheme)."""
    given = _text_of(src).strip()
    url = given if "://" in given else f"//{given}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise src.error(f"malformed endpoint ({error}), expected http://host:port") from None
    if "://" in given and parts.scheme not in ("http", "https", "grpc", "grpcs"):
        raise src.error(f"unsupported scheme {parts.scheme!r}")
    if not parts.hostname:
        raise src.error("malformed endpoint, no host; expected http://host:port")
    if parts.username is not None or parts.password is not None:
        raise src.error("user info in an endpoint is never sent; put credentials in `headers`")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise src.error("OTLP gRPC endpoints take no path, query or fragment")
    if "://" not in given and port is None:
        raise src.error("malformed endpoint, expected http://host:port or host:port")
    if port == 0:
        raise src.error("port 0 is not a collector's port")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    scheme_insecure = parts.scheme in ("http", "grpc") if parts.scheme else None
    return f"{host}:{port or _OTLP_PORT}", scheme_insecure


def web_url(src: _Source) -> str:
    """`http(s)://host[:port][/path]` of a web UI, without a trailing slash.

    It is written where every user of the master can read it (an experiment's notes), so
    credentials in it are refused, and a query or fragment would break the links built on it.
    """
    given = _text_of(src).strip()
    try:
        parts = urlsplit(given)
        _ = parts.port  # raises on a malformed port
    except ValueError as error:
        raise src.error(f"malformed URL ({error}), expected https://host[:port][/path]") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise src.error("expected an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None:
        raise src.error("user info in the URL would be shown to every user of the master")
    if parts.query or parts.fragment:
        raise src.error("a query or fragment in the URL would break the links built on it")
    if any(c.isspace() for c in given) or not given.isascii():
        raise src.error("spaces and non-ASCII characters must be percent-encoded")
    return given.rstrip("/")


def directory(src: _Source) -> Path:
    path = Path(_text_of(src, "a path")).expanduser()
    if not str(path):
        raise src.error("expected a directory path")
    if any(len(os.fsencode(part)) > NAME_MAX for part in path.parts):
        raise src.error(f"a directory name in it is longer than {NAME_MAX} bytes")
    return path


RUN_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=@:,-]*")
"""A run id: one directory name that is safe to type in a shell and to put in a label or a
URL: ASCII letters, digits and `_ . + = @ : , -`, not starting with `.` or `-` (no `..`, no
hidden directory, nothing a command line takes for an option); at most `NAME_MAX` bytes."""


def run_name(src: _Source) -> str:
    name = _text_of(src).strip()
    if not RUN_ID.fullmatch(name):
        raise src.error(
            "not a usable name for the run directory: letters, digits and _ . + = @ : , - "
            "only, not starting with . or -"
        )
    if len(name) > NAME_MAX:
        raise src.error(f"longer than {NAME_MAX} bytes, the longest directory name")
    if src.where == "environment variable TORCHELASTIC_RUN_ID":
        return torchelastic_run_id(name)
    return name


MAX_MODULE_DEPTH = 8


def module_depth(src: _Source) -> int:
    """`module_timings`: a depth (0 = off), or a boolean (on = 1, the model's children)."""
    raw = src.value
    if isinstance(raw, bool):
        return int(raw)
    if isinstance(raw, str):
        word = raw.strip().lower()
        if word in _TRUE or word in _FALSE:
            return int(word in _TRUE)
    return integer(0, MAX_MODULE_DEPTH, hint=" (0 = off)")(src)


def schedule_function(src: _Source) -> Callable[[int], Any]:
    if src.from_env or not callable(src.value):
        raise src.error("expected a callable step -> action")
    return src.value


# ---- defaults derived from other options ----


def _scheme_insecure(values: dict[str, Any], _env: Mapping[str, str]) -> bool:
    implied = values.get("_scheme_insecure")
    return True if implied is None else bool(implied)


def _no_endpoint(values: dict[str, Any], _env: Mapping[str, str]) -> bool:
    return values["endpoint"] is None


def _local_rank_zero(_values: dict[str, Any], env: Mapping[str, str]) -> bool:
    return launcher_int(env, "LOCAL_RANK", 0) == 0


def _new_run_id(_values: dict[str, Any], _env: Mapping[str, str]) -> str:
    return _default_run_id()


@dataclass(frozen=True)
class Settings:
    """Everything `instrument()` needs, resolved and validated. Each field is one option."""

    service_name: str = field(
        default="otelprof",
        metadata=opt(env=("OTELPROF_SERVICE_NAME", "OTEL_SERVICE_NAME"), parse=text),
    )
    endpoint: str | None = field(
        default=None,
        metadata=opt(env=("OTELPROF_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"), parse=endpoint),
    )
    insecure: bool = field(
        default=True,
        metadata=opt(
            env=("OTELPROF_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE"),
            parse=boolean,
            derive=_scheme_insecure,
        ),
    )
    headers: Mapping[str, str] = field(
        default_factory=dict, metadata=opt(env=("OTEL_EXPORTER_OTLP_HEADERS",), parse=grpc_headers)
    )
    detached: bool = field(
        default=True, metadata=opt(env=("OTELPROF_DETACHED",), parse=boolean, derive=_no_endpoint)
    )
    output_dir: Path = field(
        default=Path("otelprof-runs"), metadata=opt(env=("OTELPROF_OUTPUT_DIR",), parse=directory)
    )
    run_id: str = field(
        default="",
        metadata=opt(
            env=("OTELPROF_RUN_ID", "TORCHELASTIC_RUN_ID"), parse=run_name, derive=_new_run_id
        ),
    )
    prometheus_port: int | None = field(
        default=None, metadata=opt(env=("OTELPROF_PROMETHEUS_PORT",), parse=integer(0, 65535))
    )
    prometheus_host: str = field(
        default="127.0.0.1", metadata=opt(env=("OTELPROF_PROMETHEUS_HOST",), parse=text)
    )
    interval_s: float = field(
        default=DEFAULT_INTERVAL_S,
        metadata=opt(
            env=("OTELPROF_INTERVAL",),
            parse=number(MIN_INTERVAL_S, MAX_INTERVAL_S),
            aliases=("interval",),
        ),
    )
    host_metrics: bool = field(
        default=True,
        metadata=opt(env=("OTELPROF_HOST_METRICS",), parse=boolean, derive=_local_rank_zero),
    )
    gpus: GpuSelection = field(
        default="visible",
        metadata=opt(env=("OTELPROF_GPUS",), parse=choice("visible", "all", "none")),
    )
    process_metrics: bool = field(
        default=True, metadata=opt(env=("OTELPROF_PROCESS_METRICS",), parse=boolean)
    )
    timings: bool = field(default=True, metadata=opt(env=("OTELPROF_TIMINGS",), parse=boolean))
    record_function: bool = field(
        default=True, metadata=opt(env=("OTELPROF_RECORD_FUNCTION",), parse=boolean)
    )
    schedule: Callable[[int], Any] | None = field(
        default=None, metadata=opt(parse=schedule_function)
    )
    kineto: bool = field(default=False, metadata=opt(env=("OTELPROF_KINETO",), parse=boolean))
    cuda_events: bool = field(
        default=True, metadata=opt(env=("OTELPROF_CUDA_EVENTS",), parse=boolean)
    )
    sync_cuda: bool = field(default=False, metadata=opt(env=("OTELPROF_SYNC_CUDA",), parse=boolean))
    # forward/backward ranges of nn.Module models to this depth (1: the model's children)
    module_timings: int = field(
        default=0, metadata=opt(env=("OTELPROF_MODULE_TIMINGS",), parse=module_depth)
    )
    # the CUDA allocator's peak by phase, every interval (resets torch's peak counters)
    memory_peaks: bool = field(
        default=False, metadata=opt(env=("OTELPROF_MEMORY_PEAKS",), parse=boolean)
    )
    max_queued_spans: int = field(
        default=65536,
        metadata=opt(env=("OTELPROF_MAX_QUEUED_SPANS",), parse=integer(1, 1 << 30)),
    )
    # bytes of `timing()` attributes held at once (otelprof/_limits.py: AttributeBudget)
    max_attribute_bytes: int = field(
        default=64 << 20,
        metadata=opt(env=("OTELPROF_MAX_ATTRIBUTE_BYTES",), parse=integer(1, 1 << 40)),
    )
    resource_attributes: Mapping[str, str] = field(
        default_factory=dict, metadata=opt(env=("OTEL_RESOURCE_ATTRIBUTES",), parse=attributes)
    )
    determined: bool = field(
        default=False, metadata=opt(env=("OTELPROF_DETERMINED",), parse=boolean)
    )
    # Grafana's base URL: a Determined trial's experiment notes get a link to its training
    # dashboard (otelprof/determined/links.py)
    grafana_url: str | None = field(
        default=None, metadata=opt(env=("OTELPROF_GRAFANA_URL",), parse=web_url)
    )
    export_timeout_s: float = field(
        default=10.0,
        metadata=opt(
            env=("OTELPROF_EXPORT_TIMEOUT",),
            parse=number(MIN_EXPORT_TIMEOUT_S, MAX_EXPORT_TIMEOUT_S),
            aliases=("export_timeout",),
        ),
    )
    trace_budget: float = field(
        default=10.0, metadata=opt(env=("OTELPROF_TRACE_BUDGET",), parse=number(0, allow_inf=True))
    )
    # a fixed share of steps for head sampling, the same steps on every rank (None: the
    # share follows trace_budget)
    trace_head_fraction: float | None = field(
        default=None,
        metadata=opt(env=("OTELPROF_TRACE_HEAD_FRACTION",), parse=number(0, 1)),
    )
    # anomaly steps kept per minute (their own token bucket, burst 20; inf: every one)
    trace_anomaly_budget: float = field(
        default=10.0,
        metadata=opt(env=("OTELPROF_TRACE_ANOMALY_BUDGET",), parse=number(0, allow_inf=True)),
    )
    compress: bool = field(default=False, metadata=opt(env=("OTELPROF_COMPRESS",), parse=boolean))
    max_trace_bytes: int | None = field(
        default=1 << 30,
        metadata=opt(env=("OTELPROF_MAX_TRACE_BYTES",), parse=integer(0, hint=" (0 = no cap)")),
    )
    max_metrics_bytes: int | None = field(
        default=1 << 30,
        metadata=opt(env=("OTELPROF_MAX_METRICS_BYTES",), parse=integer(0, hint=" (0 = no cap)")),
    )
    # the run directory is 0750 (group-readable) instead of owner-only 0700
    shared_run_dir: bool = field(
        default=False, metadata=opt(env=("OTELPROF_SHARED_RUN_DIR",), parse=boolean)
    )
    # one device's peak FLOP/s for MFU when `set_peak_flops()` declares none (_throughput.py)
    peak_flops: float | None = field(
        default=None,
        metadata=opt(env=("OTELPROF_PEAK_FLOPS",), parse=number(0, low_open=True), keyword=False),
    )
    # The Determined task's ids, set by the master (resource attributes determined.*)
    determined_experiment_id: int | None = field(
        default=None,
        metadata=opt(env=("DET_EXPERIMENT_ID",), parse=integer(1, INT32_MAX), keyword=False),
    )
    determined_trial_id: int | None = field(
        default=None,
        metadata=opt(env=("DET_TRIAL_ID",), parse=integer(1, INT32_MAX), keyword=False),
    )
    determined_trial_run_id: int | None = field(
        default=None,
        metadata=opt(env=("DET_TRIAL_RUN_ID",), parse=integer(0, INT32_MAX), keyword=False),
    )
    # a resumed trial's batches: otelprof's Determined step counts go on from it
    determined_steps_completed: int | None = field(
        default=None,
        metadata=opt(env=("DET_STEPS_COMPLETED",), parse=integer(0, INT32_MAX), keyword=False),
    )
    # otelprof.step() calls per Determined batch (micro-batches per optimizer step)
    determined_steps_per_batch: int | None = field(
        default=None,
        metadata=opt(
            env=("OTELPROF_DETERMINED_STEPS_PER_BATCH",),
            parse=integer(1, INT32_MAX),
            keyword=False,
        ),
    )

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.run_id

    @classmethod
    def from_options(cls, env: Mapping[str, str] | None = None, **options: Any) -> Settings:
        """Resolve keywords + environment into validated settings (raises ConfigError).

        Creates nothing: the run directory is made when the file exporters start."""
        env = os.environ if env is None else env
        unknown = sorted(set(options) - _OPTION_NAMES)
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(map(repr, unknown))}; "
                f"valid options: {', '.join(sorted(_OPTION_NAMES))}"
            )
        check_launcher(env)
        values: dict[str, Any] = {}
        for f in fields(cls):
            values[f.name] = _resolve_one(f.name, f.metadata["option"], f, options, env, values)
        values.pop("_scheme_insecure", None)
        for name in ("max_trace_bytes", "max_metrics_bytes"):
            values[name] = values[name] or None  # 0 = no cap
        settings = cls(**values)
        _check_combination(settings, env, options)
        return settings


OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in fields(Settings)}
ENVIRONMENT: dict[str, tuple[str, ...]] = {name: o.env for name, o in OPTIONS.items()}
"""option name -> environment variables consulted, in priority order"""
_OPTION_NAMES = frozenset(n for n, o in OPTIONS.items() if o.keyword) | {
    a for o in OPTIONS.values() if o.keyword for a in o.aliases
}


def _resolve_one(
    name: str,
    declared: Option,
    f: Any,
    options: Mapping[str, Any],
    env: Mapping[str, str],
    values: dict[str, Any],
) -> Any:
    src = _source(name, declared, options, env)
    if src is None:
        if declared.derive is not None:
            return declared.derive(values, env)
        return f.default_factory() if f.default is MISSING else f.default
    value = declared.parse(src)
    if name == "endpoint":  # (host:port, insecure implied by its scheme) for `insecure`
        value, values["_scheme_insecure"] = value
    implied = values.get("_scheme_insecure")
    if name == "insecure" and implied is not None and value != implied:
        raise src.error(
            f"contradicts the scheme of the endpoint ({'plaintext' if implied else 'TLS'} for "
            f"{values['endpoint']!r}); give one of them"
        )
    return value


def _given(value: Any) -> bool:
    """None and "" leave an option to its variables and default, as if it were not passed."""
    return value is not None and not (isinstance(value, str) and value == "")


def _source(
    name: str, declared: Option, options: Mapping[str, Any], env: Mapping[str, str]
) -> _Source | None:
    """The raw value that wins: a keyword (two spellings of one option are refused), else the
    first set variable (a lower-priority variable set to something else is warned about)."""
    keywords = (name, *declared.aliases) if declared.keyword else ()
    given = [k for k in keywords if _given(options.get(k))]
    if len(given) > 1:
        raise ConfigError(
            f"options {given[0]!r} and {given[1]!r} are the same option; give only one"
        )
    if given:
        return _Source(f"option {given[0]!r}", options[given[0]], from_env=False)
    set_vars = [v for v in declared.env if env.get(v)]
    for other in set_vars[1:]:
        if env[other] != env[set_vars[0]]:
            _log.warning(
                "otelprof: %s=%r wins over %s=%r (option %r)",
                set_vars[0], env[set_vars[0]], other, env[other], name,
            )  # fmt: skip
    if set_vars:
        return _Source(f"environment variable {set_vars[0]}", env[set_vars[0]], from_env=True)
    return None


_LAUNCHER_INTS = {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "TORCHELASTIC_RESTART_COUNT": 0}
"""Launcher variables otelprof reads (torchrun, DeepSpeed, Determined) and their minimum."""


def launcher_int(env: Mapping[str, str], variable: str, default: int) -> int:
    """A launcher's rank variable as an int (`check_launcher` has refused bad ones)."""
    text_value = env.get(variable, "").strip()
    return int(text_value) if text_value else default


def check_launcher(env: Mapping[str, str]) -> None:
    """Rank variables are whole numbers in range; `LOCAL_RANK=abc` is a ConfigError, not a
    ValueError from deep inside, nor a silent rank 0."""
    for variable, low in _LAUNCHER_INTS.items():
        value = env.get(variable, "")
        if value.strip() == "":
            continue
        src = _Source(f"environment variable {variable} (set by the launcher)", value, True)
        integer(low, 1 << 31)(src)
    world = launcher_int(env, "WORLD_SIZE", 1)
    for variable in ("RANK", "LOCAL_RANK"):
        if launcher_int(env, variable, 0) >= world and env.get("WORLD_SIZE", "").strip():
            raise ConfigError(
                f"environment variable {variable}={env[variable]!r} is not below "
                f"WORLD_SIZE={env['WORLD_SIZE']!r}"
            )


_COMPRESSION_VARIABLES = (
    "OTEL_EXPORTER_OTLP_COMPRESSION",
    "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
    "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION",
)


def _check_combination(
    settings: Settings, env: Mapping[str, str], options: Mapping[str, Any]
) -> None:
    """Rules that involve several options, or variables the OTel exporters read themselves."""
    if settings.endpoint is not None:
        for variable in _COMPRESSION_VARIABLES:
            value = env.get(variable)
            if value is not None and value.strip().lower() != "gzip":
                raise ConfigError(
                    f"environment variable {variable}: the OTLP gRPC exporter takes 'gzip' "
                    f"(or the variable unset), got {value!r}"
                )
    collects = settings.timings or settings.host_metrics or settings.process_metrics
    collects = collects or settings.gpus != "none"
    destination = (
        settings.detached or settings.endpoint or settings.determined
    ) or settings.prometheus_port is not None
    if collects and not destination:
        where = "option 'detached'" if "detached" in options else "OTELPROF_DETACHED"
        raise ConfigError(
            f"{where} is false and there is no endpoint, Prometheus port or Determined master: "
            "everything collected would be discarded; set `endpoint` or leave `detached` on"
        )
    if settings.detached:
        _check_writable(settings, env, options)


def _check_writable(settings: Settings, env: Mapping[str, str], options: Mapping[str, Any]) -> None:
    """The run directory can be made (or exists, as a writable directory), without making it."""
    target = settings.run_dir
    if "output_dir" in options:
        where = "option 'output_dir'"
    elif env.get("OTELPROF_OUTPUT_DIR"):
        where = "environment variable OTELPROF_OUTPUT_DIR"
    else:
        where = "default output directory"
    try:
        if len(os.fsencode(os.path.abspath(target))) >= os.pathconf("/", "PC_PATH_MAX"):
            raise ConfigError(f"{where}: run directory path {str(target)!r} is too long")
    except (OSError, ValueError):
        pass
    existing = target
    try:
        while not existing.exists():
            if existing.is_symlink():  # dangling link
                raise ConfigError(f"{where}: {str(existing)!r} is a dangling symbolic link")
            if existing.parent == existing:
                break
            existing = existing.parent
        usable = existing.is_dir()
    except OSError as error:
        raise ConfigError(
            f"{where}: output directory {str(target)!r} cannot be checked ({error.strerror})"
        ) from None
    if not usable:
        raise ConfigError(
            f"{where}: output directory {str(target)!r} is not writable "
            f"({str(existing)!r} is not a directory)"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{where}: output directory {str(target)!r} is not writable "
            f"(no write permission on {str(existing)!r})"
        )


def _default_run_id() -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{stamp}-{uuid.uuid4().hex[:6]}"


def torchelastic_run_id(run_id: str) -> str:
    """torchrun's run id, unless it is its default "none" (every job without --rdzv-id): then
    one id per launcher process, the agent that starts every rank and restart attempt of a
    node (its pid and start time), so jobs do not share a directory and attempts do."""
    if run_id != "none":
        return run_id
    try:
        import psutil

        agent = psutil.Process(os.getppid())
        started = time.strftime("%Y%m%d-%H%M%S", time.gmtime(agent.create_time()))
        return f"torchrun-{started}-{socket.gethostname()}-{agent.pid}"
    except Exception:
        return f"torchrun-{socket.gethostname()}-{os.getppid()}"
