"""Settings from keyword arguments and the environment, validated once before anything starts.

Every option is one `Settings` field declared by `opt()`; resolution, validation and the
generated options reference all walk those declarations, so an option cannot be resolved,
checked and documented three ways. Keywords win over `OTELPROF_*` variables, which win over
`OTEL_*` ones. Every problem is a `ConfigError` naming where the value came from, so a typo
never silently leaves a run unprofiled, and nothing is created before every value is checked.
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
"""Longer periods overflow the SDK's reader thread wait, and would leave a run without a
sample anyway."""
DEFAULT_INTERVAL_S = 1.0
"""Determined's own profiler samples every second; the cost: BENCHMARKS.md, "Hardware
sampling and read times"."""
MAX_EXPORT_TIMEOUT_S = 3600.0
"""`shutdown()` waits up to the export timeout: an infinite one would never return (and
overflows the SDK's timers)."""
MIN_EXPORT_TIMEOUT_S = 0.1
"""An export across a network takes tens of milliseconds; below this every export fails."""
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


@dataclass(frozen=True)
class Parser:
    """Turns an option's raw value into its typed value, and says in words what it takes.

    `describe` is the range or form of the values it accepts ("0.1 to 3600"), written next to
    the checks that enforce it; the options reference shows it as the option's values."""

    parse: Callable[[_Source], Any]
    describe: str

    def __call__(self, src: _Source) -> Any:
        return self.parse(src)


def parser(describe: str) -> Callable[[Callable[[_Source], Any]], Parser]:
    """Decorator: a parse function, with the values it takes in words."""
    return lambda parse: Parser(parse, describe)


Default = Callable[[dict[str, Any], Mapping[str, str]], Any]


@dataclass(frozen=True)
class Option:
    """One option: environment variables (priority order), keyword aliases, parser, default,
    and what it means (`help`, one or two sentences, shown in the options reference).

    `derive` computes the default from the options resolved before this one (fields resolve
    in order); `unset` says in words what the option is when nothing sets it, where the
    field's default would not. `keyword=False`: a variable only (Determined's `DET_*`, or a
    rarely needed one), checked with the options but not an `instrument()` keyword.
    """

    env: tuple[str, ...]
    parse: Parser
    aliases: tuple[str, ...] = ()
    derive: Default | None = None
    keyword: bool = True
    help: str = ""
    unset: str = ""


def opt(
    *,
    env: tuple[str, ...] = (),
    parse: Parser,
    help: str,
    aliases: tuple[str, ...] = (),
    derive: Default | None = None,
    keyword: bool = True,
    unset: str = "",
) -> dict[str, Option]:
    """A `Settings` field's metadata: its `Option` declaration."""
    if derive is not None and not unset:
        raise TypeError("an option with a derived default says what it is: `unset=`")
    return {"option": Option(env, parse, aliases, derive, keyword, help, unset)}


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


text = Parser(_text_of, "a string")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@parser("true or false (a variable: 1/0, true/false, yes/no, on/off)")
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
    bounds = f"> {low:g}" if low_open else f">= {low:g}"
    describe = f"{low:g} to {high:g}" if high != math.inf else bounds
    if allow_inf:
        describe += ", or `inf`"

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
            high_text = f" and <= {high:g}" if high != math.inf else ""
            raise src.error(f"must be {bounds}{high_text}")
        return value

    return Parser(parse, f"a number, {describe}")


def integer(low: int, high: int | None = None, hint: str = "") -> Parser:
    """An integer in [low, high]; `1.5`, `inf` and `true` are refused, never rounded."""
    describe = f">= {low:,}" if high is None else f"{low:,} to {high:,}"

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

    return Parser(parse, f"a whole number, {describe}{hint}")


def choice(*words: str) -> Parser:
    """One of `words` (case-insensitive)."""

    def parse(src: _Source) -> str:
        word = _text_of(src).strip().lower()
        if word not in words:
            raise src.error(
                "expected " + ", ".join(repr(w) for w in words[:-1]) + f" or {words[-1]!r}"
            )
        return word

    return Parser(parse, ", ".join(f"`{w}`" for w in words[:-1]) + f" or `{words[-1]}`")


@parser("`key=value,...` (values URL-decoded) or a mapping of strings")
def attributes(src: _Source) -> dict[str, str]:
    """`k=v,k2=v2` (the OTEL_* format, values URL-decoded) or a mapping of strings."""
    out: dict[str, str] = {}
    if isinstance(src.value, Mapping):
        for key, value in src.value.items():
            if not isinstance(key, str) or not key.strip():
                raise src.error(f"key {key!r} is not a non-empty string")
            if not isinstance(value, str | int | float) or isinstance(value, bool):
                raise src.error(f"value of {key!r} is not a string")
            out[key] = str(value)
    else:
        for item in filter(None, (part.strip() for part in _text_of(src, "a mapping").split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise src.error(f"malformed entry {item!r}, expected key=value")
            out[key.strip()] = unquote(value.strip())
    for key, value in out.items():
        if "\x00" in key or "\x00" in value:
            raise src.error(f"entry {key!r} contains a NUL byte")
    return out


_METADATA_KEY = re.compile(r"[0-9a-z_.\-]+")
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")


@parser(
    "`key=value,...` (values URL-decoded) or a mapping; keys lowercased, then only "
    "`0-9 a-z _ . -` and not `grpc-*`; printable ASCII values"
)
def grpc_headers(src: _Source) -> dict[str, str]:
    """gRPC metadata: keys lowercased as the OTel SDK does (gRPC refuses capitals), then
    checked against gRPC's rules, so a header that cannot be sent is refused up front."""
    out: dict[str, str] = {}
    for key, value in attributes(src).items():
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


@parser(
    "`http://host:port` (`https://` for TLS) or `host:port`; IPv6 as `[::1]:4317`; no port "
    "means 4317; port 0, a path, a query and user info are refused"
)
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


@parser("`http(s)://host[:port][/path]`; no user info, query or fragment")
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


@parser(f"a directory path (`~` expanded), each name at most {NAME_MAX} bytes")
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


@parser(
    f"one directory name: at most {NAME_MAX} ASCII letters, digits and `_ . + = @ : , -`, "
    "not starting with `.` or `-`"
)
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


@parser(f"a depth, 0 (off) to {MAX_MODULE_DEPTH}, or true (1) / false (0)")
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


@parser("a callable step -> action (a keyword only)")
def schedule_function(src: _Source) -> Callable[[int], Any]:
    if src.from_env or not callable(src.value):
        raise src.error("expected a callable step -> action")
    return src.value


@dataclass(frozen=True)
class Settings:
    """Everything `instrument()` needs, resolved and validated. Each field is one option."""

    service_name: str = field(
        default="otelprof",
        metadata=opt(
            env=("OTELPROF_SERVICE_NAME", "OTEL_SERVICE_NAME"),
            parse=text,
            help="`service.name` of everything this process exports.",
        ),
    )
    endpoint: str | None = field(
        default=None,
        metadata=opt(
            env=("OTELPROF_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
            parse=endpoint,
            help="The OTLP **gRPC** collector to send to; setting it turns on attached mode.",
            unset="none (detached mode)",
        ),
    )
    insecure: bool = field(
        default=True,
        metadata=opt(
            env=("OTELPROF_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE"),
            parse=boolean,
            derive=lambda values, _env: values.get("_scheme_insecure") is not False,
            help="Plaintext gRPC to the endpoint; contradicting the endpoint's scheme is an error.",
            unset="from the endpoint's scheme (`https://` is TLS); plaintext without one",
        ),
    )
    headers: Mapping[str, str] = field(
        default_factory=dict,
        metadata=opt(
            env=("OTEL_EXPORTER_OTLP_HEADERS",),
            parse=grpc_headers,
            help="gRPC metadata sent with every export: where credentials go (an ingest "
            "token as `authorization=Bearer%20...`).",
            unset="none",
        ),
    )
    detached: bool = field(
        default=True,
        metadata=opt(
            env=("OTELPROF_DETACHED",),
            parse=boolean,
            derive=lambda values, _env: values["endpoint"] is None,
            help="Write OTLP JSON Lines files into a run directory (with `endpoint` too, "
            "both). False with nowhere else to send is an error.",
            unset="true without an endpoint",
        ),
    )
    output_dir: Path = field(
        default=Path("otelprof-runs"),
        metadata=opt(
            env=("OTELPROF_OUTPUT_DIR",),
            parse=directory,
            help="Where run directories are created; it must be writable (checked before "
            "anything starts, created when the files open).",
        ),
    )
    run_id: str = field(
        default="",
        metadata=opt(
            env=("OTELPROF_RUN_ID", "TORCHELASTIC_RUN_ID"),
            parse=run_name,
            derive=lambda _values, _env: _default_run_id(),
            help="The run directory's name. The ranks of a job agree on one and write a file "
            "each; an id whose directory holds a finished run's files, or files another live "
            "process is writing, is refused; an elastic restart writes `*.attempt<N>` files.",
            unset="`<UTC time>-<random>` (rank 0's, shared through the process group); "
            "torchrun's default `none` is no id",
        ),
    )
    interval_s: float = field(
        default=DEFAULT_INTERVAL_S,
        metadata=opt(
            env=("OTELPROF_INTERVAL",),
            parse=number(MIN_INTERVAL_S, MAX_INTERVAL_S),
            aliases=("interval",),
            help="Seconds between metric collections; every rate is an exact average over "
            "its own window.",
        ),
    )
    host_metrics: bool = field(
        default=True,
        metadata=opt(
            env=("OTELPROF_HOST_METRICS",),
            parse=boolean,
            derive=lambda _values, env: launcher_int(env, "LOCAL_RANK", 0) == 0,
            help="The node's CPU, memory, disk and network: one set per node.",
            unset="on local rank 0 only",
        ),
    )
    gpus: GpuSelection = field(
        default="visible",
        metadata=opt(
            env=("OTELPROF_GPUS",),
            parse=choice("visible", "all", "none"),
            help="Which GPUs to sample: the job's (`CUDA_VISIBLE_DEVICES`), every GPU of the "
            "node, or none.",
        ),
    )
    process_metrics: bool = field(
        default=True,
        metadata=opt(
            env=("OTELPROF_PROCESS_METRICS",),
            parse=boolean,
            help="This process's CPU and memory, and torch's CUDA allocator.",
        ),
    )
    timings: bool = field(
        default=True,
        metadata=opt(env=("OTELPROF_TIMINGS",), parse=boolean, help="Timing spans."),
    )
    record_function: bool = field(
        default=True,
        metadata=opt(
            env=("OTELPROF_RECORD_FUNCTION",),
            parse=boolean,
            help="Bridge `torch.profiler.record_function` ranges to spans.",
        ),
    )
    schedule: Callable[[int], Any] | None = field(
        default=None,
        metadata=opt(
            parse=schedule_function,
            help="Record spans on a schedule's active steps only: `otelprof.schedule(...)` "
            "or `otelprof.cyclic_schedule(...)`.",
            unset="none (every step)",
        ),
    )
    kineto: bool = field(
        default=False,
        metadata=opt(
            env=("OTELPROF_KINETO",),
            parse=boolean,
            help="Also run `torch.profiler` in active windows (and after an anomaly); its "
            "operators and kernels become child spans.",
        ),
    )
    cuda_events: bool = field(
        default=True,
        metadata=opt(
            env=("OTELPROF_CUDA_EVENTS",),
            parse=boolean,
            help="Device-side durations of `timing()` ranges from CUDA events, read back on "
            "a background thread.",
        ),
    )
    sync_cuda: bool = field(
        default=False,
        metadata=opt(
            env=("OTELPROF_SYNC_CUDA",),
            parse=boolean,
            help="Synchronize CUDA at the end of each timing (Determined's synchronized timings).",
        ),
    )
    module_timings: int = field(
        default=0,
        metadata=opt(
            env=("OTELPROF_MODULE_TIMINGS",),
            parse=module_depth,
            help="Forward and backward time of each `nn.Module` of the model down to this "
            "depth (1: the model's children). Each hooked module call costs something: "
            'BENCHMARKS.md, "Per-module times and memory peaks by phase".',
        ),
    )
    memory_peaks: bool = field(
        default=False,
        metadata=opt(
            env=("OTELPROF_MEMORY_PEAKS",),
            parse=boolean,
            help="The CUDA allocator's peak by phase at every collection. It resets torch's "
            "peak counters at each read, so the program's own "
            "`torch.cuda.max_memory_allocated()` then means the peak since that read.",
        ),
    )
    max_queued_spans: int = field(
        default=65536,
        metadata=opt(
            env=("OTELPROF_MAX_QUEUED_SPANS",),
            parse=integer(1, 1 << 30),
            help="Bound of the recorder's queue (ranges waiting for the span builder); "
            "overflow is dropped and counted, never waited for.",
        ),
    )
    max_attribute_bytes: int = field(
        default=64 << 20,
        metadata=opt(
            env=("OTELPROF_MAX_ATTRIBUTE_BYTES",),
            parse=integer(1, 1 << 40),
            help="Bytes of `timing()` attributes held at once until their spans are written "
            "(`_limits.AttributeBudget`); past it a range keeps its timing, its attributes "
            "are dropped and counted (`timings.attributes_dropped_over_budget`).",
        ),
    )
    resource_attributes: Mapping[str, str] = field(
        default_factory=dict,
        metadata=opt(
            env=("OTEL_RESOURCE_ATTRIBUTES",),
            parse=attributes,
            help="Extra resource attributes on everything this process exports.",
            unset="none",
        ),
    )
    determined: bool = field(
        default=False,
        metadata=opt(
            env=("OTELPROF_DETERMINED",),
            parse=boolean,
            help="Also post metrics and timings straight to the Determined master of the "
            "trial this process runs in.",
        ),
    )
    grafana_url: str | None = field(
        default=None,
        metadata=opt(
            env=("OTELPROF_GRAFANA_URL",),
            parse=web_url,
            help="Grafana's base URL: in a Determined trial, global rank 0 links the trial "
            "to its training dashboard in the experiment's notes "
            "(`otelprof/determined/links.py`).",
            unset="none (no link)",
        ),
    )
    export_timeout_s: float = field(
        default=10.0,
        metadata=opt(
            env=("OTELPROF_EXPORT_TIMEOUT",),
            parse=number(MIN_EXPORT_TIMEOUT_S, MAX_EXPORT_TIMEOUT_S),
            aliases=("export_timeout",),
            help="Seconds one export may take, retries included; `shutdown()` returns "
            "within it plus 2 s whatever hangs.",
        ),
    )
    trace_budget: float = field(
        default=10.0,
        metadata=opt(
            env=("OTELPROF_TRACE_BUDGET",),
            parse=number(0, allow_inf=True),
            help="Spans per second of step traces kept (half head, half tail sampling); "
            "`inf` keeps every step's trace. Every range's duration is in the histograms "
            "regardless.",
        ),
    )
    trace_head_fraction: float | None = field(
        default=None,
        metadata=opt(
            env=("OTELPROF_TRACE_HEAD_FRACTION",),
            parse=number(0, 1),
            help="A fixed share of steps for head sampling, rounded down to a power of two "
            "(0.1: 1 in 16), the same steps on every rank, still capped by the budget's head "
            "half; 0: no head sampling.",
            unset="follows `trace_budget`",
        ),
    )
    trace_anomaly_budget: float = field(
        default=10.0,
        metadata=opt(
            env=("OTELPROF_TRACE_ANOMALY_BUDGET",),
            parse=number(0, allow_inf=True),
            help="Anomaly steps per minute whose traces are kept (a token bucket of their "
            "own, burst 20); refused ones are counted in `timings.anomalies_refused`. "
            "`inf`: every anomaly, 0: none.",
        ),
    )
    compress: bool = field(
        default=False,
        metadata=opt(
            env=("OTELPROF_COMPRESS",),
            parse=boolean,
            help="Detached files as gzip'd OTLP JSON Lines (`*.jsonl.gz`), which every "
            "command reads.",
        ),
    )
    max_trace_bytes: int | None = field(
        default=1 << 30,
        metadata=opt(
            env=("OTELPROF_MAX_TRACE_BYTES",),
            parse=integer(0, hint=" (0 = no cap)"),
            help="Cap of one process's detached trace file; spans past it are dropped and "
            "counted (`files.spans_dropped_size_cap`).",
        ),
    )
    max_metrics_bytes: int | None = field(
        default=1 << 30,
        metadata=opt(
            env=("OTELPROF_MAX_METRICS_BYTES",),
            parse=integer(0, hint=" (0 = no cap)"),
            help="Cap of one process's detached metrics file (compressed size with "
            "`compress`); an export that would pass it is not written, its points counted "
            "(`files.metric_points_dropped_size_cap`). The last quarter of the cap (at most "
            "16 MiB) is kept for the final export, which carries the exact timing histograms.",
        ),
    )
    shared_run_dir: bool = field(
        default=False,
        metadata=opt(
            env=("OTELPROF_SHARED_RUN_DIR",),
            parse=boolean,
            help="The run directory and its files readable by your group (`0750`/`0640`) "
            "instead of owner-only (`0700`/`0600`, whatever the umask).",
        ),
    )
    peak_flops: float | None = field(
        default=None,
        metadata=opt(
            env=("OTELPROF_PEAK_FLOPS",),
            parse=number(0, low_open=True),
            keyword=False,
            help="One device's peak FLOP/s for MFU when `otelprof.set_peak_flops()` "
            "declares none (`_throughput.py`).",
            unset="from a table of common GPUs; none on a CPU",
        ),
    )
    determined_experiment_id: int | None = field(
        default=None,
        metadata=opt(
            env=("DET_EXPERIMENT_ID",),
            parse=integer(1, INT32_MAX),
            keyword=False,
            help="The Determined task's experiment, set by the master (resource attribute "
            "`determined.experiment.id`).",
            unset="none (not in Determined)",
        ),
    )
    determined_trial_id: int | None = field(
        default=None,
        metadata=opt(
            env=("DET_TRIAL_ID",),
            parse=integer(1, INT32_MAX),
            keyword=False,
            help="The trial, set by the master (`determined.trial.id`).",
            unset="none",
        ),
    )
    determined_trial_run_id: int | None = field(
        default=None,
        metadata=opt(
            env=("DET_TRIAL_RUN_ID",),
            parse=integer(0, INT32_MAX),
            keyword=False,
            help="The trial's run, set by the master (`determined.trial.run_id`).",
            unset="none",
        ),
    )
    determined_steps_completed: int | None = field(
        default=None,
        metadata=opt(
            env=("DET_STEPS_COMPLETED",),
            parse=integer(0, INT32_MAX),
            keyword=False,
            help="A resumed trial's batches, set by the master: otelprof's Determined step "
            "counts go on from it.",
            unset="none",
        ),
    )
    determined_steps_per_batch: int | None = field(
        default=None,
        metadata=opt(
            env=("OTELPROF_DETERMINED_STEPS_PER_BATCH",),
            parse=integer(1, INT32_MAX),
            keyword=False,
            help="`otelprof.step()` calls per Determined batch (micro-batches per optimizer "
            "step), so the batch count never passes what was trained.",
            unset="1",
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
        for option, variable in _REMOVED.items():
            if option in options:
                raise ConfigError(f"option {option!r}: {_NO_PULL}")
            if env.get(variable):
                raise ConfigError(f"environment variable {variable}: {_NO_PULL}")
        unknown = sorted(set(options) - _OPTION_NAMES)
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(map(repr, unknown))}; "
                f"valid options: {', '.join(sorted(_OPTION_NAMES))}"
            )
        check_launcher(env)
        values: dict[str, Any] = {}
        for f in fields(cls):
            values[f.name] = _resolve_one(f, options, env, values)
        values.pop("_scheme_insecure", None)
        for name in ("max_trace_bytes", "max_metrics_bytes"):
            values[name] = values[name] or None  # 0 = no cap
        settings = cls(**values)
        _check_combination(settings, env, options)
        return settings


OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in fields(Settings)}
_NO_PULL = (
    "the training process's own Prometheus endpoint was removed; send to a collector "
    "(`endpoint`) and scrape its `prometheus` exporter, which serves the same series "
    "(docs/guide/live-stack.md)"
)
_REMOVED = {
    "prometheus_port": "OTELPROF_PROMETHEUS_PORT",
    "prometheus_host": "OTELPROF_PROMETHEUS_HOST",
}
"""removed option -> its variable: either, set, is a ConfigError saying what replaces it"""
ENVIRONMENT: dict[str, tuple[str, ...]] = {name: o.env for name, o in OPTIONS.items()}
"""option name -> environment variables consulted, in priority order"""
_OPTION_NAMES = frozenset(n for n, o in OPTIONS.items() if o.keyword) | {
    a for o in OPTIONS.values() if o.keyword for a in o.aliases
}


def _resolve_one(
    f: Any, options: Mapping[str, Any], env: Mapping[str, str], values: dict[str, Any]
) -> Any:
    """Field `f`'s value: its winning raw value parsed, else its (derived) default."""
    name, declared = f.name, f.metadata["option"]
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
    destination = settings.detached or settings.endpoint or settings.determined
    if collects and not destination:
        where = "option 'detached'" if "detached" in options else "OTELPROF_DETACHED"
        raise ConfigError(
            f"{where} is false and there is no endpoint or Determined master: "
            "everything collected would be discarded; set `endpoint` or leave `detached` on"
        )
    if settings.detached:
        _check_writable(settings, env, options)


def _check_writable(settings: Settings, env: Mapping[str, str], options: Mapping[str, Any]) -> None:
    """The run directory can be made (or exists, as a writable directory), without making it."""
    target = settings.run_dir
    given = _source("output_dir", OPTIONS["output_dir"], options, env)
    where = given.where if given is not None else "default output directory"
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
