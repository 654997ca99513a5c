"""compose.yaml, checked as far as possible without a Docker engine.

The file is loaded by the Compose Specification's own Go loader (scripts/compose-check: the
library `docker compose config` uses: schema validation, interpolation, normalization), and
by `docker compose config` too where a Compose plugin is installed. Then: every file it
mounts exists, every published port binds loopback and matches the port the service's
config listens on, service-to-service addresses match, images are pinned, the collector
config validates with the environment compose gives it, and Prometheus's config passes
promtool.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import grafana_provisioning, tempo_config
from tests.services import COLLECTOR_CONFIG, PROMETHEUS_CONFIG, REPO, validate_collector_config

COMPOSE = REPO / "compose.yaml"
CHECKER = REPO / "scripts" / "compose-check"
TEMPO_CONFIG = REPO / "tempo" / "tempo.yaml"
ENV = {"GRAFANA_ADMIN_PASSWORD": "test-only-password"}


@pytest.fixture(scope="module")
def compose_check(tmp_path_factory: pytest.TempPathFactory) -> Path:
    go = shutil.which("go")
    if go is None:
        pytest.fail("Go is not installed; it builds the collector and scripts/compose-check")
    binary = tmp_path_factory.mktemp("compose-check") / "compose-check"
    built = subprocess.run(
        [go, "build", "-o", str(binary), "."],
        cwd=CHECKER,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CGO_ENABLED": "0"},
    )
    assert built.returncode == 0, built.stderr
    return binary


def _load(checker: Path, *profiles: str, env: dict[str, str] | None = None) -> Any:
    # only what the test sets: no OTELCOL_*, GRAFANA_*, DET_* or bind address from the shell
    prefixes = ("OTELCOL_", "GRAFANA_", "DET_", "OTELPROF_", "PROMETHEUS_")
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    run_env.update(ENV if env is None else env)
    args = [str(checker), *(f"--profile={p}" for p in profiles), str(COMPOSE)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, env=run_env)
    if result.returncode != 0:
        return result
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def project(compose_check: Path) -> dict[str, Any]:
    loaded = _load(compose_check)
    assert isinstance(loaded, dict), loaded.stderr
    return loaded


@pytest.fixture(scope="module")
def project_with_bridge(compose_check: Path) -> dict[str, Any]:
    loaded = _load(compose_check, "determined")
    assert isinstance(loaded, dict), loaded.stderr
    return loaded


def _published(service: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(p["target"]): p for p in service.get("ports", [])}


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


# -- loading -------------------------------------------------------------------------------


def test_compose_file_loads_with_the_stack_and_the_bridge_only_in_its_profile(
    project: dict[str, Any], project_with_bridge: dict[str, Any]
) -> None:
    assert set(project["services"]) == {"setup", "otelcol", "prometheus", "tempo", "grafana"}
    assert set(project_with_bridge["services"]) == set(project["services"]) | {"determined-bridge"}


def test_docker_compose_config_accepts_it_where_the_plugin_is_installed() -> None:
    docker = shutil.which("docker")
    plugin = docker and subprocess.run(
        [docker, "compose", "version"], capture_output=True, text=True, timeout=30
    )
    if not plugin or plugin.returncode != 0:
        # No Compose plugin on this machine: the Go loader above is the check.
        assert not plugin or "compose" in (plugin.stderr + plugin.stdout)
        return
    result = subprocess.run(
        [str(docker), "compose", "-f", str(COMPOSE), "--profile", "determined", "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **ENV},
    )
    assert result.returncode == 0, result.stderr


def test_the_loader_rejects_a_dependency_condition_compose_does_not_know(
    compose_check: Path, tmp_path: Path
) -> None:
    """The schema check is real: a misspelt `condition` (which Docker would refuse at `up`)
    fails to load, so the file's conditions and healthchecks passed the same check."""
    broken = tmp_path / "compose.yaml"
    text = COMPOSE.read_text()
    assert "condition: service_healthy" in text
    broken.write_text(text.replace("condition: service_healthy", "condition: service_healty", 1))
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFANA_")}
    result = subprocess.run(
        [str(compose_check), str(broken)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**run_env, **ENV},
        cwd=REPO,
    )
    assert result.returncode != 0, "a compose file with an unknown condition loaded"
    assert "condition value must be one of" in result.stderr, result.stderr


def test_grafana_refuses_to_start_without_an_admin_password(compose_check: Path) -> None:
    result = _load(compose_check, env={})
    assert not isinstance(result, dict), "compose loaded without GRAFANA_ADMIN_PASSWORD"
    assert "GRAFANA_ADMIN_PASSWORD" in result.stderr


def test_grafana_has_no_default_admin_password_and_anonymous_users_only_view(
    project: dict[str, Any],
) -> None:
    env = project["services"]["grafana"]["environment"]
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == ENV["GRAFANA_ADMIN_PASSWORD"]  # from the user
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert env["GF_USERS_ALLOW_SIGN_UP"] == "false"


# -- files and images ------------------------------------------------------------------------


def test_every_bind_mounted_file_exists_in_the_repository(
    project_with_bridge: dict[str, Any],
) -> None:
    mounts = [
        (name, volume)
        for name, service in project_with_bridge["services"].items()
        for volume in service.get("volumes", [])
        if volume["type"] == "bind"
    ]
    assert len(mounts) >= 8
    for name, volume in mounts:
        source = Path(volume["source"])
        assert source.exists(), f"{name} mounts {source}, which does not exist"
        assert volume.get("read_only"), f"{name} mounts {source} writable"
        if source != Path("/dev/null"):
            assert source.resolve().is_relative_to(REPO.resolve()), source


def test_every_image_is_pinned_to_a_version(project_with_bridge: dict[str, Any]) -> None:
    for name, service in project_with_bridge["services"].items():
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and re.fullmatch(r"v?\d+\.\d+\.\d+(-[a-z]+)?", tag), (
            f"{name}: {image} is not pinned"
        )
    inline = project_with_bridge["services"]["determined-bridge"]["build"]["dockerfile_inline"]
    base = re.search(r"^FROM (\S+)", inline, re.MULTILINE)
    assert base and re.search(r":\d+\.\d+\.\d+", base.group(1)), inline


def test_collector_image_matches_the_release_our_build_uses(project: dict[str, Any]) -> None:
    manifest = yaml.safe_load((REPO / "collector-config" / "builder-config.yaml").read_text())
    image = project["services"]["otelcol"]["image"]
    assert image == f"otel/opentelemetry-collector-contrib:{manifest['dist']['version']}"


# -- ports and addresses -----------------------------------------------------------------------


def test_published_ports_bind_loopback_by_default(project_with_bridge: dict[str, Any]) -> None:
    published = [
        (name, port)
        for name, service in project_with_bridge["services"].items()
        for port in service.get("ports", [])
    ]
    assert published
    for name, port in published:
        assert port["host_ip"] == "127.0.0.1", f"{name} publishes {port} beyond loopback"
        assert str(port["published"]) == str(port["target"]), (name, port)


def test_collector_publishes_exactly_the_ports_its_config_listens_on(
    project: dict[str, Any],
) -> None:
    otelcol = project["services"]["otelcol"]
    env = otelcol["environment"]
    listening = {
        _port(env["OTELCOL_OTLP_GRPC_ENDPOINT"]): 4317,
        _port(env["OTELCOL_OTLP_HTTP_ENDPOINT"]): 4318,
        _port(env["OTELCOL_HEALTH_ENDPOINT"]): 13133,
        _port(env["OTELCOL_PROMETHEUS_ENDPOINT"]): 8889,
        _port(env["OTELCOL_STRAGGLER_ENDPOINT"]): 8890,
    }
    assert all(port == expected for port, expected in listening.items()), listening
    assert set(_published(otelcol)) == set(listening)
    for key in (
        "OTELCOL_OTLP_GRPC_ENDPOINT",
        "OTELCOL_PROMETHEUS_ENDPOINT",
        "OTELCOL_STRAGGLER_ENDPOINT",
    ):
        assert env[key].startswith("0.0.0.0:"), "inside the container it must listen on all"
    mounted = {v["target"]: v["source"] for v in otelcol["volumes"] if v["type"] == "bind"}
    config_arg = otelcol["command"][0].removeprefix("--config=")
    assert Path(mounted[config_arg]) == COLLECTOR_CONFIG


def test_prometheus_scrapes_the_collector_where_compose_runs_it(project: dict[str, Any]) -> None:
    services = project["services"]
    env = services["otelcol"]["environment"]
    scrape = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {
        job["job_name"]: job["static_configs"][0]["targets"][0] for job in scrape["scrape_configs"]
    }
    assert targets["otelcol"] == f"otelcol:{_port(env['OTELCOL_PROMETHEUS_ENDPOINT'])}"
    assert targets["otelcol-straggler"] == f"otelcol:{_port(env['OTELCOL_STRAGGLER_ENDPOINT'])}"
    assert targets["otelcol-self"] == f"otelcol:{env['OTELCOL_TELEMETRY_PORT']}"
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert jobs["otelcol"]["honor_labels"] is True
    assert jobs["otelcol-straggler"]["honor_labels"] is True
    command = services["prometheus"]["command"]
    assert "--web.enable-remote-write-receiver" in command
    assert "--enable-feature=exemplar-storage" in command
    mounted = {v["target"]: v["source"] for v in services["prometheus"]["volumes"]}
    config_path = next(c for c in command if c.startswith("--config.file=")).split("=", 1)[1]
    assert Path(mounted[config_path]) == PROMETHEUS_CONFIG
    assert 9090 in _published(services["prometheus"])


def test_collector_sends_traces_to_tempos_otlp_port_and_the_bridge_to_its_listen_port(
    project_with_bridge: dict[str, Any],
) -> None:
    services = project_with_bridge["services"]
    env = services["otelcol"]["environment"]
    tempo = tempo_config.load()  # as Tempo expands it, compose's defaults
    tempo_grpc = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert env["OTELCOL_TEMPO_ENDPOINT"] == f"tempo:{_port(tempo_grpc)}"
    bridge = services["determined-bridge"]
    bridge_listen = bridge["environment"]["OTELPROF_BRIDGE_LISTEN"]
    # the bridge refuses to listen beyond loopback without TLS: it joins the collector's
    # network namespace and listens on its loopback, where only the collector reaches it
    assert bridge["network_mode"] == "service:otelcol"
    assert bridge_listen.startswith("127.0.0.1:")
    assert env["OTELCOL_DETERMINED_BRIDGE_ENDPOINT"] == bridge_listen
    # one token, given to both: the bridge's token file and the collector's bearer header
    assert env["OTELCOL_DETERMINED_BRIDGE_TOKEN"] == bridge["environment"]["OTELPROF_BRIDGE_TOKEN"]
    script = " ".join(bridge["entrypoint"])
    assert "--ingest-tokens" in script and "umask 077" in script
    tempo_http = tempo["server"]["http_listen_port"]
    assert tempo_http in _published(services["tempo"])
    mounted = {
        v["target"]: v["source"] for v in services["tempo"]["volumes"] if v["type"] == "bind"
    }
    config_path = services["tempo"]["command"][0].split("=", 1)[1]
    assert Path(mounted[config_path]) == TEMPO_CONFIG


def test_grafana_datasources_point_at_the_compose_services(project: dict[str, Any]) -> None:
    services = project["services"]
    tempo = tempo_config.load()  # as Tempo expands it, compose's defaults
    env = services["grafana"]["environment"]
    # every variable the provisioning files use is set by compose
    for path in (grafana_provisioning.DATASOURCES, grafana_provisioning.PROVIDERS):
        assert grafana_provisioning.variables(path) <= set(env), path
    urls = grafana_provisioning.datasource_urls(env)
    assert urls["prometheus"] == "http://prometheus:9090"
    assert urls["tempo"] == f"http://tempo:{tempo['server']['http_listen_port']}"
    dashboards = grafana_provisioning.dashboards_path(env)
    for volume in services["grafana"]["volumes"]:
        if volume["source"].endswith(".json"):
            assert volume["target"] == f"{dashboards}/{Path(volume['source']).name}"
    mounted = {v["target"] for v in services["grafana"]["volumes"]}
    assert "/etc/grafana/provisioning/datasources" in mounted
    assert "/etc/grafana/provisioning/dashboards" in mounted
    assert 3000 in _published(services["grafana"])


# -- the configs compose hands to the services ----------------------------------------------


@pytest.mark.parametrize("with_bridge", [False, True], ids=["default", "determined-profile"])
def test_collector_config_validates_with_the_environment_compose_gives_it(
    project: dict[str, Any], collector_binary: Path, with_bridge: bool
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTELCOL_")}
    env.update(project["services"]["otelcol"]["environment"])
    if with_bridge:  # the switches README gives for the determined profile
        env["OTELCOL_METRICS_EXPORTERS"] = "[prometheus, otlp_grpc/determined]"
        env["OTELCOL_TRACES_EXPORTERS"] = "[span_metrics, otlp_grpc/tempo, otlp_grpc/determined]"
    result = validate_collector_config(COLLECTOR_CONFIG, env, collector_binary)
    assert result.returncode == 0, result.stderr


def test_prometheus_config_passes_promtool(prometheus_binary: Path) -> None:
    promtool = prometheus_binary.with_name("promtool")
    if not promtool.exists():
        promtool = Path(shutil.which("promtool") or "promtool")
    result = subprocess.run(
        [str(promtool), "check", "config", str(PROMETHEUS_CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- what each image holds: commands, user, directories it owns ------------------------------


@dataclass(frozen=True)
class Image:
    """What an image's documented base provides (no engine here to look inside it)."""

    source: str  # where this is documented
    user: str  # uid the container runs as
    executables: frozenset[str]  # what `CMD` healthchecks and commands may name
    owned: tuple[str, ...] = ()  # directories the image ships owned by `user`


BUSYBOX_APPLETS = frozenset({"sh", "chown", "chmod", "cp", "wget"})
IMAGES = {
    "busybox:1.37.0-musl": Image(
        "hub.docker.com/_/busybox: the musl variant is one statically linked /bin/busybox "
        "with its applets linked in /bin; runs as root",
        "0",
        BUSYBOX_APPLETS | {"/bin/busybox"},
    ),
    "otel/opentelemetry-collector-contrib:0.158.0": Image(
        "open-telemetry/opentelemetry-collector-releases, distributions/otelcol-contrib/"
        "Dockerfile: FROM scratch, USER 10001, only /otelcol-contrib (ENTRYPOINT) and CA "
        "certificates: no shell, no wget/curl, no directory owned by 10001",
        "10001",
        frozenset({"/otelcol-contrib"}),
    ),
    "grafana/tempo:2.10.8": Image(
        "grafana/tempo cmd/tempo/Dockerfile since v2.10.0: FROM gcr.io/distroless/static-"
        "debian12, USER 10001, /var/tempo made and owned by 10001, ENTRYPOINT /tempo: no shell",
        "10001",
        frozenset({"/tempo"}),
        ("/var/tempo",),
    ),
    "prom/prometheus:v2.42.0": Image(
        "prometheus/prometheus Dockerfile (v2.42.0): FROM quay.io/prometheus/busybox, "
        "USER nobody, /prometheus chowned to nobody, ENTRYPOINT /bin/prometheus",
        "65534",
        BUSYBOX_APPLETS | {"/bin/prometheus", "/bin/promtool"},
        ("/prometheus",),
    ),
    "grafana/grafana:13.1.3": Image(
        "grafana/grafana Dockerfile: FROM alpine (busybox applets) plus apk bash, curl; "
        "USER 472 (grafana), GF_PATHS_DATA /var/lib/grafana owned by 472",
        "472",
        BUSYBOX_APPLETS | {"bash", "curl", "/run.sh"},
        ("/var/lib/grafana",),
    ),
    "otelprof/determined-bridge:0.1.0": Image(
        "built from this repository (compose.yaml dockerfile_inline): FROM "
        "python:3.12.8-slim-bookworm (Debian, python on PATH), pip-installs otelprof, "
        "USER 10001, /var/lib/otelprof-bridge chowned to 10001",
        "10001",
        frozenset({"python", "otelprof", "sh"}),
        ("/var/lib/otelprof-bridge",),
    ),
}
ONE_SHOT = {"setup"}  # runs to completion before the others start; nothing to health-check


def _setup_chowns(setup: dict[str, Any]) -> dict[str, str]:
    """{volume: uid} for every `chown UID:GID /path` the setup step runs on a mounted volume."""
    script = " ".join(setup["command"])
    mounted = {v["target"]: v["source"] for v in setup["volumes"]}
    return {mounted[path]: uid for uid, path in re.findall(r"chown (\d+):\d+ (\S+)", script)}


def _setup_copies(setup: dict[str, Any]) -> dict[str, str]:
    """{"volume/name": executable in the setup image} for every `cp EXE /volume-path/name`."""
    script = " ".join(setup["command"])
    mounted = {v["target"]: v["source"] for v in setup["volumes"]}
    out = {}
    for exe, dest in re.findall(r"cp (\S+) (\S+)", script):
        directory, name = dest.rsplit("/", 1)
        out[f"{mounted[directory]}/{name}"] = exe
    return out


def test_every_image_has_a_documented_base_in_the_table(
    project_with_bridge: dict[str, Any],
) -> None:
    images = {service["image"] for service in project_with_bridge["services"].values()}
    assert images == set(IMAGES)
    inline = project_with_bridge["services"]["determined-bridge"]["build"]["dockerfile_inline"]
    assert "FROM python:3.12.8-slim-bookworm" in inline and "USER 10001" in inline
    assert "chown 10001 /var/lib/otelprof-bridge" in inline


def test_every_command_a_service_runs_exists_in_its_image(
    project_with_bridge: dict[str, Any],
) -> None:
    services = project_with_bridge["services"]
    copies = _setup_copies(services["setup"])
    for executable in copies.values():
        assert executable in IMAGES[services["setup"]["image"]].executables
    for name, service in services.items():
        image = IMAGES[service["image"]]
        if service.get("entrypoint"):
            assert service["entrypoint"][0] in image.executables, name
        elif name in ONE_SHOT:
            assert service["command"][0] in image.executables, name
        # else: the image's own ENTRYPOINT runs, `command` holds its arguments
        if name in ONE_SHOT:
            continue
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD", f"{name}: CMD-SHELL needs a shell; say the command itself"
        program = test[1]
        if program in image.executables:
            continue
        # a tool the setup step copied into a volume this service mounts
        mounts = {v["target"]: v for v in service["volumes"] if v["type"] == "volume"}
        directory, exe = program.rsplit("/", 1)
        assert directory in mounts, f"{name}: {program} is not in {service['image']}"
        assert mounts[directory].get("read_only"), f"{name} mounts {directory} writable"
        assert f"{mounts[directory]['source']}/{exe}" in copies, f"{name}: nothing puts {exe}"
        if exe == "busybox":
            assert test[2] in BUSYBOX_APPLETS, name


def test_every_long_running_service_has_a_healthcheck_that_dependents_wait_for(
    project_with_bridge: dict[str, Any],
) -> None:
    services = project_with_bridge["services"]
    for name, service in services.items():
        if name not in ONE_SHOT:
            check = service.get("healthcheck")
            assert check and not check.get("disable"), f"{name} has no healthcheck"
        for dependency, how in service.get("depends_on", {}).items():
            expected = (
                "service_completed_successfully" if dependency in ONE_SHOT else "service_healthy"
            )
            assert how["condition"] == expected, (name, dependency, how)
    assert services["grafana"]["depends_on"].keys() == {"prometheus", "tempo"}
    assert "otelcol" in services["prometheus"]["depends_on"]
    for name in ("otelcol", "tempo"):  # their images cannot run the healthcheck without it
        assert "setup" in services[name]["depends_on"], name


def test_healthchecks_probe_the_ports_the_services_listen_on(project: dict[str, Any]) -> None:
    services = project["services"]
    env = services["otelcol"]["environment"]
    tempo = tempo_config.load()

    def url(name: str) -> str:
        return services[name]["healthcheck"]["test"][-1]

    assert url("otelcol") == f"http://127.0.0.1:{_port(env['OTELCOL_HEALTH_ENDPOINT'])}/"
    assert url("tempo") == f"http://127.0.0.1:{tempo['server']['http_listen_port']}/ready"
    assert url("prometheus") == "http://127.0.0.1:9090/-/ready"
    assert url("grafana") == "http://127.0.0.1:3000/api/health"


def test_every_writable_volume_belongs_to_the_user_its_container_runs_as(
    project_with_bridge: dict[str, Any],
) -> None:
    services = project_with_bridge["services"]
    chowned = _setup_chowns(services["setup"])
    assert chowned == {"otelcol-debug": "10001"}
    for name, service in services.items():
        image = IMAGES[service["image"]]
        user = str(service.get("user") or image.user).split(":")[0]
        for volume in service.get("volumes", []):
            if volume["type"] != "volume" or volume.get("read_only"):
                continue
            if name in ONE_SHOT:
                assert user == "0", "the setup step must run as root to chown"
                continue
            source, target = volume["source"], volume["target"]
            # an empty named volume takes the owner of the image's directory it is mounted on
            writable = target in image.owned or chowned.get(source) == user
            assert writable, f"{name}: {source} at {target} is not owned by uid {user}"
    debug_dir = services["otelcol"]["environment"]["OTELCOL_DEBUG_DIR"]
    debug_mount = next(v for v in services["otelcol"]["volumes"] if v["target"] == debug_dir)
    assert debug_mount["source"] == "otelcol-debug"
