"""The shipped collector configs and builder manifest, checked against the real build.

`otelcol-otelprof validate` parses each config, resolves its ${env:...} placeholders and
checks every component against the binary, so a config that validates here also starts.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.pipeline_run import DETERMINED_TIMINGS, STEP_SPAN, training_loop
from tests.services import (
    BUILD_SCRIPT,
    COLLECTOR_CONFIG,
    COLLECTOR_DIR,
    MANIFEST,
    Collector,
    Prometheus,
    collector_binary_path,
    validate_collector_config,
)

REPLAY_OVERLAY = COLLECTOR_DIR / "replay.yaml"
SHIPPED_CONFIGS = sorted(p for p in COLLECTOR_DIR.glob("*.yaml") if p != MANIFEST)
# the cluster deployment's tiers (validated in tests/test_deploy.py)
DEPLOY_CONFIGS = sorted((COLLECTOR_DIR.parent / "deploy" / "collector").glob("*.yaml"))
PLACEHOLDER = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}")

EVERY_SWITCH_ON = {
    "OTELCOL_TRACES_EXPORTERS": "[span_metrics, otlp_grpc/tempo, otlp_grpc/determined, "
    "file/traces]",
    "OTELCOL_METRICS_EXPORTERS": "[prometheus, prometheus_remote_write, otlp_grpc/determined, "
    "file/metrics]",
}


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTELCOL_")}
    env.update(extra)
    return env


def _resolved(path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The config with placeholders replaced as the collector's env provider would."""
    env = env or {}

    def substitute(match: re.Match[str]) -> str:
        return env.get(match.group(1), match.group(3) or "")

    return dict(yaml.safe_load(PLACEHOLDER.sub(substitute, path.read_text())))


def _validate(
    args: list[Path], env: dict[str, str], binary: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), "validate", *(f"--config={p}" for p in args)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


# -- validate ------------------------------------------------------------------------------


def test_collector_configs_are_shipped() -> None:
    assert COLLECTOR_CONFIG in SHIPPED_CONFIGS and REPLAY_OVERLAY in SHIPPED_CONFIGS


@pytest.mark.parametrize("config", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates_with_its_defaults(
    config: Path, collector_binary: Path
) -> None:
    configs = [COLLECTOR_CONFIG] if config == COLLECTOR_CONFIG else [COLLECTOR_CONFIG, config]
    result = _validate(configs, _clean_env(), collector_binary)
    assert result.returncode == 0, result.stderr + result.stdout


@pytest.mark.parametrize("overlay", [None, REPLAY_OVERLAY], ids=["otelcol", "with-replay"])
def test_config_validates_with_every_exporter_switched_on(
    overlay: Path | None, collector_binary: Path
) -> None:
    configs = [COLLECTOR_CONFIG] + ([overlay] if overlay else [])
    result = _validate(configs, _clean_env(**EVERY_SWITCH_ON), collector_binary)
    assert result.returncode == 0, result.stderr + result.stdout


def test_dropping_span_metrics_from_the_traces_switch_fails_validation_naming_it(
    collector_binary: Path,
) -> None:
    env = _clean_env(OTELCOL_TRACES_EXPORTERS="[otlp_grpc/tempo]")
    result = _validate([COLLECTOR_CONFIG], env, collector_binary)
    assert result.returncode != 0
    assert "span_metrics" in result.stderr


def test_an_unknown_exporter_in_a_switch_fails_validation_naming_it(collector_binary: Path) -> None:
    env = _clean_env(OTELCOL_METRICS_EXPORTERS="[prometheus, promethus]")
    result = validate_collector_config(COLLECTOR_CONFIG, env, collector_binary)
    assert result.returncode != 0
    assert '"promethus"' in result.stderr


def test_a_malformed_duration_in_the_environment_fails_validation(collector_binary: Path) -> None:
    env = _clean_env(OTELCOL_SPANMETRICS_FLUSH_INTERVAL="soon")
    result = validate_collector_config(COLLECTOR_CONFIG, env, collector_binary)
    assert result.returncode != 0
    assert "metrics_flush_interval" in result.stderr


# -- what the config says ------------------------------------------------------------------


@pytest.mark.parametrize("config", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_every_environment_placeholder_has_a_default(config: Path) -> None:
    placeholders = PLACEHOLDER.findall(config.read_text())
    assert placeholders
    missing = [name for name, default, _ in placeholders if not default]
    assert not missing, f"{config.name}: ${{env:...}} without a :- default: {missing}"


def test_default_endpoints_listen_on_loopback_only() -> None:
    config = _resolved(COLLECTOR_CONFIG)
    listening = [
        config["extensions"]["health_check"]["endpoint"],
        *(p["endpoint"] for p in config["receivers"]["otlp"]["protocols"].values()),
        config["exporters"]["prometheus"]["endpoint"],
    ]
    assert all(e.startswith("127.0.0.1:") for e in listening), listening
    reader = config["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]
    assert reader["prometheus"]["host"] == "127.0.0.1"


def test_timing_histograms_have_an_explicit_unit_buckets_from_100us_to_60s_and_exemplars() -> None:
    connector = _resolved(COLLECTOR_CONFIG)["connectors"]["span_metrics"]
    assert connector["histogram"]["unit"] == "s"
    buckets = connector["histogram"]["explicit"]["buckets"]
    assert buckets[0] == "100us" and buckets[-1] == "60s"
    assert [d["name"] for d in connector["dimensions"]] == ["host.name", "otelprof.rank"]
    assert connector["exemplars"]["enabled"] is True


def test_resource_attributes_become_labels_on_both_prometheus_exporters() -> None:
    exporters = _resolved(COLLECTOR_CONFIG)["exporters"]
    for name in ("prometheus", "prometheus_remote_write"):
        assert exporters[name]["resource_to_telemetry_conversion"]["enabled"] is True
    assert exporters["prometheus"]["enable_open_metrics"] is True  # exemplars need it


def test_memory_limiter_runs_first_and_batch_last_in_every_pipeline() -> None:
    for name, pipeline in _resolved(COLLECTOR_CONFIG)["service"]["pipelines"].items():
        assert pipeline["processors"][0] == "memory_limiter", name
        assert pipeline["processors"][-1] == "batch", name


# -- the manifest and the build -------------------------------------------------------------


def _manifest_modules() -> list[tuple[str, str, str]]:
    """(section, module, version) of every component in builder-config.yaml."""
    manifest = yaml.safe_load(MANIFEST.read_text())
    out = []
    for section in (
        "receivers",
        "processors",
        "exporters",
        "connectors",
        "extensions",
        "providers",
    ):
        for entry in manifest.get(section, []):
            module, version = entry["gomod"].split()
            out.append((section, module, version))
    return out


def _component_types(config: dict[str, Any]) -> dict[str, set[str]]:
    """Component types (the part before '/') each section of a config declares."""
    return {
        section: {key.split("/")[0] for key in config.get(section) or {}}
        for section in ("receivers", "processors", "exporters", "connectors", "extensions")
    }


def test_manifest_pins_one_consistent_release() -> None:
    modules = _manifest_modules()
    beta = {v for section, _, v in modules if section != "providers"}
    stable = {v for section, _, v in modules if section == "providers"}
    assert len(beta) == 1 and len(stable) == 1, (beta, stable)
    (release,) = beta
    assert release.startswith("v0.") and next(iter(stable)).startswith("v1.")
    assert yaml.safe_load(MANIFEST.read_text())["dist"]["version"] == release.removeprefix("v")


def test_built_collector_has_exactly_the_components_the_shipped_configs_use(
    collector_binary: Path,
) -> None:
    """otelcol.yaml, the replay overlay and the cluster tiers of deploy/collector/."""
    listed = subprocess.run(
        [str(collector_binary), "components"], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    components = yaml.safe_load(listed.stdout)
    built = {
        section: {c["name"] for c in components.get(section) or []}
        for section in ("receivers", "processors", "exporters", "connectors", "extensions")
    }
    used = _component_types(_resolved(COLLECTOR_CONFIG))
    for config in (REPLAY_OVERLAY, *DEPLOY_CONFIGS):
        for section, types in _component_types(_resolved(config)).items():
            used[section] |= types
    assert "otlp_json_file" in used["receivers"]
    assert {"load_balancing", "tail_sampling", "bearertokenauth"} <= set().union(*used.values())
    assert built == used
    versions = {c["module"].split()[-1] for s in built for c in components.get(s) or []}
    assert versions == {v for section, _, v in _manifest_modules() if section != "providers"}


def test_build_script_prints_the_cached_binary_path_last_without_rebuilding(
    collector_binary: Path,
) -> None:
    expected = collector_binary_path()
    if os.environ.get("OTELPROF_COLLECTOR"):
        assert Path(os.environ["OTELPROF_COLLECTOR"]).resolve() == expected.resolve()
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(expected)
    assert "up to date" in result.stderr
    assert time.monotonic() - started < 10.0  # no Go toolchain work when the cache is valid


def test_build_cache_key_changes_with_the_manifest(tmp_path: Path) -> None:
    edited = tmp_path / "builder-config.yaml"
    edited.write_text(MANIFEST.read_text() + "\n# a change\n")
    assert collector_binary_path(edited) != collector_binary_path(MANIFEST)
    assert collector_binary_path(edited).parent == collector_binary_path(MANIFEST).parent


def test_build_script_refuses_a_missing_manifest_with_a_clear_message(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT), str(tmp_path / "nope.yaml")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "manifest not found" in result.stderr


# -- the replay overlay, for real ---------------------------------------------------------


@pytest.mark.e2e
def test_replay_overlay_feeds_a_detached_runs_files_through_the_pipeline(
    tmp_path: Path,
    collector_factory: Callable[..., Collector],
    prometheus_factory: Callable[..., Prometheus],
) -> None:
    import otelprof

    steps = 12
    prof = otelprof.instrument(
        detached=True,
        output_dir=tmp_path / "runs",
        run_id="replayed",
        service_name="replayed",
        interval=0.5,
    )
    try:
        training_loop(prof, steps=steps, pause_s=0.01)
    finally:
        prof.shutdown()
    run_dir = tmp_path / "runs" / "replayed"
    assert (run_dir / "traces.jsonl").stat().st_size > 0

    collector = collector_factory(
        overlays=[REPLAY_OVERLAY], extra_env={"OTELCOL_REPLAY_DIR": str(run_dir)}
    )
    prom = prometheus_factory(collector=collector)
    names = "|".join((*DETERMINED_TIMINGS, STEP_SPAN))
    query = (
        f'count(traces_span_metrics_calls_total{{service_name="replayed",span_name=~"{names}"}}'
        f" == {steps})"
    )
    prom.wait_for_series(f"{query} == {len(DETERMINED_TIMINGS) + 1}", timeout_s=60)
    prom.wait_for_series('system_cpu_utilization_ratio{service_name="replayed"}', timeout_s=30)
