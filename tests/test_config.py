"""Settings: keywords and environment, validated once with errors that name the problem."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from otelprof import _profiler
from otelprof.config import DEFAULT_INTERVAL_S, ConfigError, Settings


def settings(tmp_path: Path, env: dict[str, str] | None = None, **options: object) -> Settings:
    options.setdefault("output_dir", tmp_path)
    return Settings.from_options(env=env or {}, **options)


def test_defaults_are_detached_with_one_second_interval(tmp_path: Path) -> None:
    s = settings(tmp_path)
    assert s.detached is True
    assert s.endpoint is None
    assert s.interval_s == DEFAULT_INTERVAL_S == 1.0
    assert s.run_dir.parent == tmp_path
    assert not s.run_dir.exists()  # validation creates nothing


def test_endpoint_from_standard_otel_variable_switches_to_attached(tmp_path: Path) -> None:
    s = settings(tmp_path, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert s.endpoint == "collector:4317"
    assert s.insecure is True
    assert s.detached is False


def test_https_endpoint_is_secure_and_detached_can_be_combined(tmp_path: Path) -> None:
    s = settings(tmp_path, endpoint="https://otel.example:4317", detached=True)
    assert (s.endpoint, s.insecure, s.detached) == ("otel.example:4317", False, True)


def test_keyword_wins_over_otelprof_variable_which_wins_over_otel(tmp_path: Path) -> None:
    env = {"OTEL_SERVICE_NAME": "from-otel", "OTELPROF_SERVICE_NAME": "from-otelprof"}
    assert settings(tmp_path, env=env).service_name == "from-otelprof"
    assert settings(tmp_path, env=env, service_name="kw").service_name == "kw"


def test_environment_values_are_parsed(tmp_path: Path) -> None:
    env = {
        "OTELPROF_INTERVAL": "0.25",
        "OTELPROF_GPUS": "all",
        "OTELPROF_HOST_METRICS": "false",
        "OTEL_RESOURCE_ATTRIBUTES": "team=vision,cluster=a%20b",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer x",
    }
    s = settings(tmp_path, env=env)
    assert s.interval_s == 0.25
    assert s.gpus == "all"
    assert s.host_metrics is False
    assert s.resource_attributes == {"team": "vision", "cluster": "a b"}
    assert s.headers == {"authorization": "Bearer x"}


@pytest.mark.parametrize(
    ("options", "env", "where"),
    [
        ({"prometheus_port": 9464}, {}, "option 'prometheus_port'"),
        ({"prometheus_host": "0.0.0.0"}, {}, "option 'prometheus_host'"),
        ({}, {"OTELPROF_PROMETHEUS_PORT": "9464"}, "variable OTELPROF_PROMETHEUS_PORT"),
        ({}, {"OTELPROF_PROMETHEUS_HOST": "0.0.0.0"}, "variable OTELPROF_PROMETHEUS_HOST"),
    ],
)
def test_the_removed_prometheus_endpoint_options_say_what_replaces_them(
    tmp_path: Path, options: dict[str, object], env: dict[str, str], where: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        settings(tmp_path, env=env, **options)
    message = str(raised.value)
    assert f"{where}: the training process's own Prometheus endpoint was removed" in message
    assert "collector" in message and "`prometheus` exporter" in message
    assert "docs/guide/live-stack.md" in message


def test_module_timings_take_a_depth_or_a_switch(tmp_path: Path) -> None:
    assert settings(tmp_path).module_timings == 0
    assert settings(tmp_path, module_timings=True).module_timings == 1
    assert settings(tmp_path, module_timings=3).module_timings == 3
    for text, depth in (("off", 0), ("on", 1), ("true", 1), ("0", 0), ("1", 1), ("2", 2)):
        env = {"OTELPROF_MODULE_TIMINGS": text}
        assert settings(tmp_path, env=env).module_timings == depth, text
    assert settings(tmp_path, env={"OTELPROF_MEMORY_PEAKS": "1"}).memory_peaks is True


def test_host_metrics_default_to_local_rank_zero_only(tmp_path: Path) -> None:
    assert settings(tmp_path, env={"LOCAL_RANK": "0"}).host_metrics is True
    assert settings(tmp_path, env={"LOCAL_RANK": "3"}).host_metrics is False
    assert settings(tmp_path, env={"LOCAL_RANK": "3"}, host_metrics=True).host_metrics is True


@pytest.mark.parametrize(
    ("options", "env", "message"),
    [
        ({"intervall": 1}, {}, "unknown option(s) 'intervall'"),
        ({"interval": 0}, {}, "must be >= 0.1"),
        ({"interval": -1}, {}, "must be >= 0.1"),
        ({"interval": 0.05}, {}, "must be >= 0.1"),
        ({}, {"OTELPROF_INTERVAL": "fast"}, "OTELPROF_INTERVAL: expected a number, got 'fast'"),
        (
            {"endpoint": "localhost"},
            {},
            "malformed endpoint, expected http://host:port or host:port, got 'localhost'",
        ),
        ({"endpoint": "ftp://host:1"}, {}, "unsupported scheme 'ftp'"),
        ({"endpoint": "http://host:70000"}, {}, "malformed endpoint (Port out of range"),
        ({"endpoint": "http://host:4317/v1/traces"}, {}, "take no path"),
        ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "::nonsense"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        ({"gpus": "some"}, {}, "expected 'visible', 'all' or 'none'"),
        ({}, {"OTELPROF_DETACHED": "maybe"}, "OTELPROF_DETACHED: expected true/false"),
        ({"schedule": 3}, {}, "expected a callable"),
        ({"run_id": "a/b"}, {}, "not a usable name"),
        ({}, {"OTEL_RESOURCE_ATTRIBUTES": "novalue"}, "malformed entry 'novalue'"),
    ],
)
def test_bad_configuration_is_refused_with_a_message_naming_it(
    tmp_path: Path, options: dict[str, object], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        settings(tmp_path, env=env, **options)
    assert message in str(raised.value)


def test_unwritable_output_directory_is_refused_before_anything_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="is not writable"):
        Settings.from_options(env={}, output_dir=blocker / "runs")


def test_output_directory_is_not_touched_in_attached_only_mode(tmp_path: Path) -> None:
    target = tmp_path / "never-created"
    Settings.from_options(env={}, endpoint="http://127.0.0.1:4317", output_dir=target)
    assert not target.exists()


# Every option with wrong values, given as a keyword and as its environment variable: each is
# a ConfigError naming the option or variable the value came from, never a raw exception, a
# silent rounding or a value that breaks later (interval=inf turned system metrics off,
# interval=1e10 killed the metric reader, export_timeout=inf overflowed at shutdown).
WRONG_VALUES: list[tuple[str, str, object, str]] = [
    # (keyword, environment variable, wrong value, what the message says)
    ("interval", "OTELPROF_INTERVAL", math.inf, "expected a finite number"),
    ("interval", "OTELPROF_INTERVAL", math.nan, "expected a finite number"),
    ("interval", "OTELPROF_INTERVAL", 1e10, "must be >= 0.1 and <= 3600"),
    ("interval", "OTELPROF_INTERVAL", 0.05, "must be >= 0.1"),
    ("export_timeout", "OTELPROF_EXPORT_TIMEOUT", math.inf, "expected a finite number"),
    ("export_timeout", "OTELPROF_EXPORT_TIMEOUT", 1e12, "must be >= 0.1 and <= 3600"),
    ("export_timeout", "OTELPROF_EXPORT_TIMEOUT", 1e-9, "must be >= 0.1 and <= 3600"),
    ("export_timeout", "OTELPROF_EXPORT_TIMEOUT", math.nan, "expected a finite number"),
    ("trace_budget", "OTELPROF_TRACE_BUDGET", math.nan, "expected a finite number"),
    ("trace_head_fraction", "OTELPROF_TRACE_HEAD_FRACTION", 1.5, "must be >= 0 and <= 1"),
    ("trace_head_fraction", "OTELPROF_TRACE_HEAD_FRACTION", -0.1, "must be >= 0"),
    ("trace_anomaly_budget", "OTELPROF_TRACE_ANOMALY_BUDGET", -1, "must be >= 0"),
    ("trace_anomaly_budget", "OTELPROF_TRACE_ANOMALY_BUDGET", math.nan, "expected a finite"),
    ("max_queued_spans", "OTELPROF_MAX_QUEUED_SPANS", 1.5, "expected an integer"),
    ("max_queued_spans", "OTELPROF_MAX_QUEUED_SPANS", math.inf, "expected an integer"),
    ("max_queued_spans", "OTELPROF_MAX_QUEUED_SPANS", 1 << 40, "must be between 1 and"),
    ("max_attribute_bytes", "OTELPROF_MAX_ATTRIBUTE_BYTES", 0, "must be between 1 and"),
    ("max_attribute_bytes", "OTELPROF_MAX_ATTRIBUTE_BYTES", 1.5, "expected an integer"),
    ("max_trace_bytes", "OTELPROF_MAX_TRACE_BYTES", 1.5, "expected an integer"),
    ("max_trace_bytes", "OTELPROF_MAX_TRACE_BYTES", math.inf, "expected an integer"),
    ("max_metrics_bytes", "OTELPROF_MAX_METRICS_BYTES", 2.5, "expected an integer"),
    ("output_dir", "OTELPROF_OUTPUT_DIR", "runs\x00x", "contains a NUL byte"),
    ("output_dir", "OTELPROF_OUTPUT_DIR", "d" * 300 + "/runs", "longer than 255 bytes"),
    ("run_id", "OTELPROF_RUN_ID", "run\x00x", "contains a NUL byte"),
    ("run_id", "OTELPROF_RUN_ID", "r" * 300, "longer than 255 bytes"),
    ("run_id", "TORCHELASTIC_RUN_ID", "r" * 300, "longer than 255 bytes"),
    ("run_id", "OTELPROF_RUN_ID", "run\nid", "not a usable name"),
    ("run_id", "OTELPROF_RUN_ID", "..\\x", "not a usable name"),
    ("run_id", "OTELPROF_RUN_ID", "-rf", "not starting with . or -"),
    ("run_id", "TORCHELASTIC_RUN_ID", "job 42", "letters, digits and"),
    # variables read and checked with the options, not keywords (Option.keyword=False)
    ("peak_flops", "OTELPROF_PEAK_FLOPS", "abc", "expected a number"),
    ("peak_flops", "OTELPROF_PEAK_FLOPS", "0", "must be > 0"),
    ("determined_trial_id", "DET_TRIAL_ID", "abc", "expected an integer"),
    ("determined_trial_id", "DET_TRIAL_ID", "0", "must be between 1 and 2147483647"),
    ("determined_trial_run_id", "DET_TRIAL_RUN_ID", "1.5", "expected an integer"),
    ("determined_experiment_id", "DET_EXPERIMENT_ID", "\u00b2", "expected an integer"),
    ("determined_steps_completed", "DET_STEPS_COMPLETED", "-1", "must be between 0 and"),
    ("determined_steps_per_batch", "OTELPROF_DETERMINED_STEPS_PER_BATCH", "x", "an integer"),
    ("service_name", "OTELPROF_SERVICE_NAME", "svc\x00", "contains a NUL byte"),
    ("endpoint", "OTELPROF_ENDPOINT", "http://[::1", "malformed endpoint"),
    ("endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT", "http://[::1:4317", "malformed endpoint"),
    ("endpoint", "OTELPROF_ENDPOINT", "http://collector:0", "port 0"),
    ("endpoint", "OTELPROF_ENDPOINT", "collector:0", "port 0"),
    ("endpoint", "OTELPROF_ENDPOINT", "http://me:secret@collector:4317", "user info"),
    ("endpoint", "OTELPROF_ENDPOINT", "http://collector:4317?x=1", "no path, query"),
    ("headers", "OTEL_EXPORTER_OTLP_HEADERS", "bad key=1", "metadata keys are 0-9 a-z"),
    ("headers", "OTEL_EXPORTER_OTLP_HEADERS", "grpc-timeout=1", "reserved by gRPC"),
    ("headers", "OTEL_EXPORTER_OTLP_HEADERS", "x=caf%C3%A9", "printable ASCII"),
    ("headers", "OTEL_EXPORTER_OTLP_HEADERS", "A=1,a=2", "given twice"),
    ("resource_attributes", "OTEL_RESOURCE_ATTRIBUTES", "team=a%00b", "NUL byte"),
    ("gpus", "OTELPROF_GPUS", "\x00", "contains a NUL byte"),
    ("module_timings", "OTELPROF_MODULE_TIMINGS", 9, "must be between 0 and 8 (0 = off)"),
    ("module_timings", "OTELPROF_MODULE_TIMINGS", 1.5, "expected an integer"),
    ("module_timings", "OTELPROF_MODULE_TIMINGS", "deep", "expected an integer"),
    ("memory_peaks", "OTELPROF_MEMORY_PEAKS", "maybe", "expected"),
]


def _wrong_value_cases() -> list[tuple[dict[str, object], dict[str, str], str]]:
    from otelprof.config import OPTIONS

    cases = []
    for keyword, variable, value, message in WRONG_VALUES:
        kw_value: object = value if OPTIONS.get(keyword, OPTIONS["interval_s"]).keyword else None
        if keyword in ("headers", "resource_attributes"):  # the same entries, as a mapping
            entries = [item.split("=", 1) for item in str(value).split(",")]
            decoded = [(k, v.replace("%00", "\x00").replace("%C3%A9", "é")) for k, v in entries]
            kw_value = dict(decoded) if len(decoded) == len(dict(decoded)) else None
        if kw_value is not None:
            cases.append(({keyword: kw_value}, {}, f"option {keyword!r}: |{message}"))
        text = repr(value) if isinstance(value, float) else str(value)
        text = {"inf": "inf", "nan": "nan"}.get(text, text)
        cases.append(({}, {variable: text}, f"environment variable {variable}: |{message}"))
    return cases


@pytest.mark.parametrize(("options", "env", "message"), _wrong_value_cases())
def test_every_option_with_a_wrong_value_is_a_config_error_naming_its_source(
    tmp_path: Path, options: dict[str, object], env: dict[str, str], message: str
) -> None:
    if "OTELPROF_OUTPUT_DIR" in env:
        options["output_dir"] = None  # unset: the variable is the value
    with pytest.raises(ConfigError) as raised:
        settings(tmp_path, env=env, **options)
    where, _, what = message.partition("|")
    assert str(raised.value).startswith(where)
    assert what in str(raised.value)
    assert not any(tmp_path.iterdir()), "validation created something"


@pytest.mark.parametrize(
    ("options", "env", "message"),
    [
        # launcher variables: a ConfigError, not a ValueError from inside or a silent rank 0
        ({}, {"LOCAL_RANK": "abc"}, "environment variable LOCAL_RANK (set by the launcher)"),
        ({}, {"LOCAL_RANK": "1.5"}, "LOCAL_RANK (set by the launcher): expected an integer"),
        ({}, {"RANK": "-1"}, "RANK (set by the launcher): must be between 0"),
        ({}, {"WORLD_SIZE": "0"}, "WORLD_SIZE (set by the launcher): must be between 1"),
        ({}, {"RANK": "4", "WORLD_SIZE": "4"}, "RANK='4' is not below WORLD_SIZE='4'"),
        ({}, {"TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT"),
        # compression the OTLP exporter would refuse at start (raw exception today)
        (
            {"endpoint": "http://127.0.0.1:4317"},
            {"OTEL_EXPORTER_OTLP_COMPRESSION": "brotli"},
            "environment variable OTEL_EXPORTER_OTLP_COMPRESSION: the OTLP gRPC exporter takes",
        ),
        (
            {"endpoint": "http://127.0.0.1:4317"},
            {"OTEL_EXPORTER_OTLP_METRICS_COMPRESSION": "zstd"},
            "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION",
        ),
        # contradictions: no silent winner
        ({"detached": False}, {}, "option 'detached' is false and there is no endpoint"),
        ({}, {"OTELPROF_DETACHED": "0"}, "OTELPROF_DETACHED is false and there is no endpoint"),
        ({"interval": 1.0, "interval_s": 2.0}, {}, "are the same option; give only one"),
        ({"export_timeout": 1, "export_timeout_s": 2}, {}, "are the same option"),
        (
            {"endpoint": "https://collector:4317", "insecure": True},
            {},
            "option 'insecure': contradicts the scheme of the endpoint",
        ),
        (
            {},
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_INSECURE": "0"},
            "environment variable OTEL_EXPORTER_OTLP_INSECURE: contradicts the scheme",
        ),
        # keyword-only options and keyword types
        ({"service_name": 5}, {}, "option 'service_name': expected a string"),
    ],
)
def test_launcher_variables_compression_and_contradictions_are_refused(
    tmp_path: Path, options: dict[str, object], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        settings(tmp_path, env=env, **options)
    assert message in str(raised.value)


def test_a_too_long_run_id_is_blamed_on_the_run_id_not_the_output_directory(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as raised:
        settings(tmp_path, env={"OTELPROF_RUN_ID": "x" * 256, "OTELPROF_OUTPUT_DIR": "runs"})
    assert str(raised.value).startswith("environment variable OTELPROF_RUN_ID:")
    assert "OUTPUT_DIR" not in str(raised.value)


def test_header_keys_are_lowercased_as_the_sdk_does_so_grpc_accepts_them(tmp_path: Path) -> None:
    s = settings(tmp_path, headers={"Authorization": "Bearer x"}, endpoint="http://c:4317")
    assert s.headers == {"authorization": "Bearer x"}
    env = {"OTEL_EXPORTER_OTLP_HEADERS": "X-Team=vision"}
    assert settings(tmp_path, env=env).headers == {"x-team": "vision"}


def test_endpoints_ipv6_and_default_port(tmp_path: Path) -> None:
    assert settings(tmp_path, endpoint="http://[::1]:4317").endpoint == "[::1]:4317"
    assert settings(tmp_path, endpoint="[::1]:4318").endpoint == "[::1]:4318"
    assert settings(tmp_path, endpoint="https://collector").endpoint == "collector:4317"


def test_valid_edge_values_are_kept_exactly(tmp_path: Path) -> None:
    s = settings(tmp_path, trace_budget=math.inf, max_queued_spans=2.0, interval=3600)
    assert (s.trace_budget, s.max_queued_spans, s.interval_s) == (math.inf, 2, 3600.0)
    assert settings(tmp_path, env={"OTELPROF_TRACE_BUDGET": "inf"}).trace_budget == math.inf
    anomalies = {"OTELPROF_TRACE_ANOMALY_BUDGET": "inf"}
    assert settings(tmp_path, env=anomalies).trace_anomaly_budget == math.inf
    assert settings(tmp_path, trace_anomaly_budget=0).trace_anomaly_budget == 0.0
    # nothing collected and nowhere to send it is not a contradiction (the A/A benchmark)
    nothing = {"timings": False, "host_metrics": False, "process_metrics": False, "gpus": "none"}
    assert settings(tmp_path, detached=False, **nothing).detached is False


def test_a_lower_priority_variable_that_loses_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = {"OTELPROF_SERVICE_NAME": "a", "OTEL_SERVICE_NAME": "b"}
    with caplog.at_level("WARNING", logger="otelprof"):
        assert settings(tmp_path, env=env).service_name == "a"
    assert "OTELPROF_SERVICE_NAME='a' wins over OTEL_SERVICE_NAME='b'" in caplog.text


def test_every_option_is_declared_once_with_its_variables() -> None:
    from dataclasses import fields

    from otelprof.config import ENVIRONMENT, OPTIONS

    assert set(OPTIONS) == {f.name for f in fields(Settings)} == set(ENVIRONMENT)
    assert ENVIRONMENT["run_id"] == ("OTELPROF_RUN_ID", "TORCHELASTIC_RUN_ID")
    assert OPTIONS["interval_s"].aliases == ("interval",)


def test_instrument_refuses_a_bad_value_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import otelprof

    for options in (
        {"interval": math.inf},
        {"export_timeout": math.inf},
        {"export_timeout": 1e-9},
        {"max_queued_spans": 1.5},
        {"run_id": "..\\x"},
    ):
        with pytest.raises(ConfigError):
            otelprof.instrument(output_dir=tmp_path, **options)
        assert _profiler.active_profiler() is None
    for variable, value in (
        ("DET_TRIAL_ID", "abc"),
        ("OTELPROF_PEAK_FLOPS", "abc"),
        ("OTELPROF_DETERMINED_STEPS_PER_BATCH", "x"),
        ("OTELPROF_RUN_ID", "a\nb"),
    ):
        with monkeypatch.context() as env:
            env.setenv(variable, value)
            with pytest.raises(ConfigError, match=f"environment variable {variable}: "):
                otelprof.instrument(output_dir=tmp_path)
        assert _profiler.active_profiler() is None
    assert not any(tmp_path.iterdir())


def test_environment_only_variables_are_not_keywords(tmp_path: Path) -> None:
    env = {"DET_TRIAL_ID": "42", "DET_STEPS_COMPLETED": "3000", "OTELPROF_PEAK_FLOPS": "312e12"}
    s = settings(tmp_path, env=env)
    assert (s.determined_trial_id, s.determined_steps_completed, s.peak_flops) == (
        42, 3000, 312e12,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="unknown option"):
        settings(tmp_path, determined_trial_id=42)


def test_every_option_says_what_it_means_and_what_values_it_takes() -> None:
    """The options reference is generated from these declarations (docs/hooks/reference.py)."""
    from otelprof.config import OPTIONS

    for name, option in OPTIONS.items():
        assert option.help.strip().endswith("."), name
        assert option.parse.describe.strip(), name
        assert option.derive is None or option.unset, name  # a derived default says what it is


def test_a_parser_describes_the_range_it_checks(tmp_path: Path) -> None:
    from otelprof.config import OPTIONS

    interval = OPTIONS["interval_s"].parse
    assert interval.describe == "a number, 0.1 to 3600"
    assert settings(tmp_path, interval=0.1).interval_s == 0.1
    assert settings(tmp_path, interval=3600).interval_s == 3600
    for outside in (0.099, 3600.5):
        with pytest.raises(ConfigError, match=r"must be >= 0\.1 and <= 3600"):
            settings(tmp_path, interval=outside)
    assert OPTIONS["max_queued_spans"].parse.describe == "a whole number, 1 to 1,073,741,824"
    assert OPTIONS["trace_budget"].parse.describe == "a number, >= 0, or `inf`"
    assert OPTIONS["gpus"].parse.describe == "`visible`, `all` or `none`"
