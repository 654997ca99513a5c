"""Settings: keywords and environment, validated once with errors that name the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    assert s.run_dir.is_dir()


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
        "OTELPROF_PROMETHEUS_PORT": "9464",
        "OTEL_RESOURCE_ATTRIBUTES": "team=vision,cluster=a%20b",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer x",
    }
    s = settings(tmp_path, env=env)
    assert s.interval_s == 0.25
    assert s.gpus == "all"
    assert s.host_metrics is False
    assert s.prometheus_port == 9464
    assert s.resource_attributes == {"team": "vision", "cluster": "a b"}
    assert s.headers == {"authorization": "Bearer x"}


def test_host_metrics_default_to_local_rank_zero_only(tmp_path: Path) -> None:
    assert settings(tmp_path, env={"LOCAL_RANK": "0"}).host_metrics is True
    assert settings(tmp_path, env={"LOCAL_RANK": "3"}).host_metrics is False
    assert settings(tmp_path, env={"LOCAL_RANK": "3"}, host_metrics=True).host_metrics is True


@pytest.mark.parametrize(
    ("options", "env", "message"),
    [
        ({"intervall": 1}, {}, "unknown option(s) 'intervall'"),
        ({"interval": 0}, {}, "interval must be positive"),
        ({"interval": -1}, {}, "interval must be positive"),
        ({"interval": 0.05}, {}, "at least 0.1 s"),
        ({}, {"OTELPROF_INTERVAL": "fast"}, "OTELPROF_INTERVAL: expected a number, got 'fast'"),
        ({"endpoint": "localhost"}, {}, "malformed endpoint 'localhost'"),
        ({"endpoint": "ftp://host:1"}, {}, "unsupported scheme 'ftp'"),
        ({"endpoint": "http://host:70000"}, {}, "bad port"),
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
