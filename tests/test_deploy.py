"""The cluster deployment (deploy/), checked statically with the real tools.

- every collector config of deploy/collector/ passes the built collector's `validate`, with
  the environment its Kubernetes manifest (or the SLURM script) gives it;
- every Kubernetes manifest validates against the Kubernetes JSON schemas shipped by
  kubernetes-validate (strict: an unknown field is an error), and the manifests agree with
  each other (the config each pod mounts, the Services and ports the tiers name, the Secret);
- the ConfigMap embeds deploy/collector/*.yaml byte for byte (one source of truth);
- the training job's environment, expanded as the kubelet expands it, is what otelprof's own
  settings parser turns into the node agent's endpoint, its token and one run id;
- the SLURM script passes `bash -n` and shellcheck (Debian's package, `make shellcheck`), the
  Prometheus scrape config passes promtool.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from otelprof.config import Settings
from tests.services import COLLECTOR_CONFIG, REPO

DEPLOY = REPO / "deploy"
CONFIGS = DEPLOY / "collector"
TIERS = ("agent", "gateway", "sampler")
K8S = DEPLOY / "kubernetes"
MANIFESTS = sorted(K8S.rglob("*.yaml"))
CONFIGMAP = K8S / "collector" / "configs.yaml"
SBATCH = DEPLOY / "slurm" / "otelprof-train.sbatch"
SCRAPE_CONFIG = DEPLOY / "prometheus" / "scrape-otelprof.yml"
RENDER = REPO / "scripts" / "render_deploy_configs.py"
# custom resources of the Prometheus Operator (the PrometheusRule of the alerting rules)
OPERATOR_API = "monitoring.coreos.com/"
# the oldest release with the Job labels the training job reads, and the newest schemas shipped
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
PLACEHOLDER = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-[^}]*)?\}")
# stand-ins for what the API server and kubelet fill in (Secrets, downward API)
SECRET_VALUES = {"ingest-token": "ingest-6f1c", "gateway-token": "gateway-9a2e"}
FIELD_VALUES = {
    "spec.nodeName": "gpu-node-7",
    "status.hostIP": "10.0.3.7",
    "metadata.name": "otelprof-train-1-x7k2p",
    "metadata.namespace": "otelprof",
    "metadata.labels['batch.kubernetes.io/job-name']": "otelprof-train",
    "metadata.labels['batch.kubernetes.io/controller-uid']": "0b7c1e52-4d1a-4c8e-9f3e-2a6d5b9c8e11",
}


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    """Every Kubernetes object shipped, by (kind, name)."""
    return {(d["kind"], d["metadata"]["name"]): d for p in MANIFESTS for d in _documents(p)}


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _kubelet_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: Secrets and downward API fields
    resolved (stand-in values above), `$(VAR)` expanded from variables defined earlier in the
    list, `$$` kept as a literal `$`, unresolvable references left as they are."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "valueFrom" in var:
            source = var["valueFrom"]
            if "secretKeyRef" in source:
                env[var["name"]] = SECRET_VALUES[source["secretKeyRef"]["key"]]
            else:
                env[var["name"]] = FIELD_VALUES[source["fieldRef"]["fieldPath"]]
            continue

        def expand(match: re.Match[str], defined: dict[str, str] = env) -> str:
            if match.group(0) == "$$":
                return "$"
            return defined.get(match.group(1), match.group(0))

        env[var["name"]] = re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, var["value"])
    return env


def _tier_workload(tier: str) -> dict[str, Any]:
    kind = "DaemonSet" if tier == "agent" else "Deployment"
    return _objects()[(kind, f"otelprof-{tier}")]


def _run_validate(
    binary: Path, config: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTELCOL_")}
    return subprocess.run(
        [str(binary), "validate", f"--config={config}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )


# -- the collector configs -------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_each_tier_config_validates_with_the_environment_its_manifest_gives(
    tier: str, collector_binary: Path
) -> None:
    env = _kubelet_env(_container(_tier_workload(tier)))
    result = _run_validate(collector_binary, CONFIGS / f"{tier}.yaml", env)
    assert result.returncode == 0, result.stderr + result.stdout


def test_sampler_config_validates_with_remote_write_instead_of_the_scrape_endpoint(
    collector_binary: Path,
) -> None:
    env = _kubelet_env(_container(_tier_workload("sampler")))
    env["OTELCOL_METRICS_EXPORTERS"] = "[prometheus_remote_write]"
    env["OTELCOL_STRAGGLER_EXPORTERS"] = "[prometheus_remote_write/straggler]"
    result = _run_validate(collector_binary, CONFIGS / "sampler.yaml", env)
    assert result.returncode == 0, result.stderr + result.stdout


@pytest.mark.parametrize(
    ("tier", "token"),
    [
        ("agent", "OTELCOL_INGEST_TOKEN"),
        ("gateway", "OTELCOL_GATEWAY_TOKEN"),
        ("sampler", "OTELCOL_GATEWAY_TOKEN"),
    ],
)
def test_a_tier_without_the_token_it_checks_fails_validation(
    tier: str, token: str, collector_binary: Path
) -> None:
    env = _kubelet_env(_container(_tier_workload(tier)))
    del env[token]
    result = _run_validate(collector_binary, CONFIGS / f"{tier}.yaml", env)
    assert result.returncode != 0
    assert "no bearer token provided" in result.stderr


def test_every_receiver_of_every_tier_requires_a_bearer_token() -> None:
    for tier in TIERS:
        config = yaml.safe_load((CONFIGS / f"{tier}.yaml").read_text())
        for name, protocol in config["receivers"]["otlp"]["protocols"].items():
            assert protocol["auth"]["authenticator"].startswith("bearertokenauth/"), (tier, name)


def test_each_tier_sends_the_next_tier_the_token_that_tier_checks() -> None:
    agent, gateway, sampler = (yaml.safe_load((CONFIGS / f"{t}.yaml").read_text()) for t in TIERS)
    expected = "Bearer " + gateway["extensions"]["bearertokenauth/gateway"]["token"]
    assert (
        sampler["extensions"]["bearertokenauth/gateway"]
        == gateway["extensions"]["bearertokenauth/gateway"]
    )
    sent = [agent["exporters"]["otlp_grpc/gateway"]["headers"]["authorization"]]
    sent += [
        gateway["exporters"][name]["protocol"]["otlp"]["headers"]["authorization"]
        for name in ("load_balancing/traces", "load_balancing/metrics")
    ]
    assert sent == [expected] * 3


def test_agent_span_metrics_and_sampler_exporters_match_the_single_collector() -> None:
    single = yaml.safe_load(COLLECTOR_CONFIG.read_text())
    agent = yaml.safe_load((CONFIGS / "agent.yaml").read_text())
    sampler = yaml.safe_load((CONFIGS / "sampler.yaml").read_text())
    assert agent["connectors"]["span_metrics"] == single["connectors"]["span_metrics"]
    for name in (
        "prometheus",
        "prometheus_remote_write",
        "prometheus/straggler",
        "prometheus_remote_write/straggler",
    ):
        assert sampler["exporters"][name] == single["exporters"][name], name
    # the straggler path: the same filter, into the same exporters
    assert sampler["processors"]["filter/straggler"] == single["processors"]["filter/straggler"]
    pipelines = sampler["service"]["pipelines"], single["service"]["pipelines"]
    for pipeline in pipelines:
        assert "filter/straggler" in pipeline["metrics/straggler"]["processors"]
    assert (
        pipelines[0]["metrics/straggler"]["exporters"]
        == pipelines[1]["metrics/straggler"]["exporters"]
    )
    deleted = single["processors"]["resource"]["attributes"]
    assert agent["processors"]["resource"]["attributes"][1:] == deleted


def test_gateway_routes_traces_by_trace_id_and_metrics_by_resource() -> None:
    gateway = yaml.safe_load((CONFIGS / "gateway.yaml").read_text())
    pipelines = gateway["service"]["pipelines"]
    routing = {
        signal: gateway["exporters"][exporter]["routing_key"]
        for signal, pipeline in pipelines.items()
        for exporter in pipeline["exporters"]
    }
    assert routing == {"traces": "traceID", "metrics": "resource"}
    sampler = yaml.safe_load((CONFIGS / "sampler.yaml").read_text())
    assert "tail_sampling" in sampler["service"]["pipelines"]["traces"]["processors"]


def test_tail_sampling_keeps_every_reason_otelprof_keeps_a_step_for_beyond_head() -> None:
    sampler = yaml.safe_load((CONFIGS / "sampler.yaml").read_text())
    (policy,) = [
        p
        for p in sampler["processors"]["tail_sampling"]["policies"]
        if p["type"] == "string_attribute"
    ]
    assert policy["string_attribute"]["key"] == "otelprof.sampled"
    source = (REPO / "otelprof" / "_timings" / "_sampling.py").read_text()
    reasons = set(re.findall(r'why = "([a-z.]+)"', source)) | set(
        re.findall(r'ATTR_SAMPLED: "([a-z.]+)"', source)
    )
    assert {"head", "anomaly", "tail.slowest"} <= reasons  # the parse found them
    assert set(policy["string_attribute"]["values"]) == reasons - {"head", "all"}


def test_every_variable_the_slurm_script_exports_to_the_agent_is_read_by_the_agent_config() -> None:
    read = set(PLACEHOLDER.findall((CONFIGS / "agent.yaml").read_text()))
    exported = set(re.findall(r"\b(OTELCOL_[A-Z_]+)=", SBATCH.read_text()))
    exported |= set(re.findall(r"export (OTELCOL_[A-Z_ ]+)\n", SBATCH.read_text())[0].split())
    exported -= {"OTELCOL_BIN", "OTELCOL_AGENT_CONFIG"}  # the script's own, for srun
    assert exported <= read, exported - read
    assert {"OTELCOL_INGEST_TOKEN", "OTELCOL_GATEWAY_TOKEN", "OTELCOL_NODE_NAME"} <= exported


def test_slurm_agent_settings_validate(collector_binary: Path) -> None:
    env = {
        "OTELCOL_INGEST_TOKEN": "0f" * 32,
        "OTELCOL_GATEWAY_TOKEN": "gateway-9a2e",
        "OTELCOL_GATEWAY_ENDPOINT": "collector.example.org:4317",
        "OTELCOL_NODE_ATTRIBUTE": "host.name",
        "OTELCOL_NODE_NAME": "gpu-node-7",
        "OTELCOL_OTLP_GRPC_ENDPOINT": "127.0.0.1:21000",
        "OTELCOL_HEALTH_ENDPOINT": "127.0.0.1:21001",
        "OTELCOL_TELEMETRY_PORT": "21002",
    }
    result = _run_validate(collector_binary, CONFIGS / "agent.yaml", env)
    assert result.returncode == 0, result.stderr + result.stdout


# -- one source of truth -----------------------------------------------------------------------


def test_configmap_embeds_each_tier_config_byte_for_byte() -> None:
    (configmap,) = _documents(CONFIGMAP)
    assert configmap["data"] == {
        f"{tier}.yaml": (CONFIGS / f"{tier}.yaml").read_text() for tier in TIERS
    }


def test_configmap_and_config_hashes_are_what_the_render_script_writes() -> None:
    result = subprocess.run(
        [sys.executable, str(RENDER), "--check"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_each_tier_mounts_and_runs_its_own_config() -> None:
    (configmap,) = _documents(CONFIGMAP)
    for tier in TIERS:
        workload = _tier_workload(tier)
        container = _container(workload)
        (volume,) = workload["spec"]["template"]["spec"]["volumes"]
        assert volume["configMap"]["name"] == configmap["metadata"]["name"]
        assert volume["configMap"]["items"] == [{"key": f"{tier}.yaml", "path": f"{tier}.yaml"}]
        (mount,) = container["volumeMounts"]
        assert mount["name"] == volume["name"] and mount["readOnly"] is True
        assert container["args"] == [f"--config={mount['mountPath']}/{tier}.yaml"]
        assert container["image"] == "otel/opentelemetry-collector-contrib:0.158.0"
        # a changed config changes the pod template: `kubectl apply` rolls the tier's pods
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        digest = hashlib.sha256((CONFIGS / f"{tier}.yaml").read_bytes()).hexdigest()
        assert annotations["checksum/config"] == digest, tier


# -- the Kubernetes manifests ------------------------------------------------------------------


def test_manifests_are_shipped() -> None:
    kinds = {kind for kind, _ in _objects()}
    assert {"Namespace", "ConfigMap", "DaemonSet", "Deployment", "Service", "Job"} <= kinds
    assert {"NetworkPolicy", "PodDisruptionBudget", "PrometheusRule"} <= kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates_against_the_kubernetes_schemas(manifest: Path, version: str) -> None:
    for document in _documents(manifest):
        if document["apiVersion"].startswith(OPERATOR_API):
            continue  # no schema in Kubernetes': tests/test_alerts.py checks it
        try:
            kubernetes_validate.validate(document, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = "/".join(str(p) for p in error.path)
            pytest.fail(f"{manifest.name}: {document['kind']} at {where}: {error.message}")


def test_schema_validation_catches_a_misspelled_field_and_a_wrong_type() -> None:
    daemonset = _tier_workload("agent")
    misspelled = yaml.safe_load(yaml.safe_dump(daemonset))
    misspelled["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    wrong_type = yaml.safe_load(yaml.safe_dump(daemonset))
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["hostPort"] = "4317"
    for broken in (misspelled, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_every_object_lives_in_the_otelprof_namespace_and_secrets_exist_by_key() -> None:
    for (kind, name), obj in _objects().items():
        if kind != "Namespace":
            assert obj["metadata"]["namespace"] == "otelprof", (kind, name)
    for (kind, _), obj in _objects().items():
        if kind not in ("DaemonSet", "Deployment", "Job"):
            continue
        for var in _container(obj).get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == "otelprof-otlp" and ref["key"] in SECRET_VALUES, var


def test_tiers_name_each_others_services_and_ports() -> None:
    objects = _objects()
    agent_env = _kubelet_env(_container(_tier_workload("agent")))
    gateway_env = _kubelet_env(_container(_tier_workload("gateway")))
    sampler_env = _kubelet_env(_container(_tier_workload("sampler")))

    gateway_service = objects[("Service", "otelprof-gateway")]
    (gateway_port,) = gateway_service["spec"]["ports"]
    assert (
        agent_env["OTELCOL_GATEWAY_ENDPOINT"]
        == f"otelprof-gateway.otelprof.svc:{gateway_port['port']}"
    )
    assert gateway_env["OTELCOL_OTLP_GRPC_ENDPOINT"] == "0.0.0.0:4317"

    sampler_service = objects[("Service", "otelprof-sampler")]
    assert sampler_service["spec"]["clusterIP"] == "None"  # DNS lists every sampler pod
    assert gateway_env["OTELCOL_SAMPLER_HOSTNAME"].startswith("otelprof-sampler.otelprof.svc")
    assert (
        gateway_env["OTELCOL_SAMPLER_PORT"]
        == sampler_env["OTELCOL_OTLP_GRPC_ENDPOINT"].split(":")[1]
    )

    for tier, env in (("agent", agent_env), ("gateway", gateway_env), ("sampler", sampler_env)):
        workload = _tier_workload(tier)
        container = _container(workload)
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = {p["name"]: p for p in container["ports"]}
        assert env["OTELCOL_OTLP_GRPC_ENDPOINT"] == f"0.0.0.0:{ports['otlp-grpc']['containerPort']}"
        probe_port = container["readinessProbe"]["httpGet"]["port"]
        assert env["OTELCOL_HEALTH_ENDPOINT"] == f"0.0.0.0:{probe_port}"
    for service in (gateway_service, sampler_service):
        labels = _tier_workload(service["metadata"]["name"].removeprefix("otelprof-"))["spec"][
            "template"
        ]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()

    agent_ports = {p["name"]: p for p in _container(_tier_workload("agent"))["ports"]}
    assert agent_ports["otlp-grpc"]["hostPort"] == 4317


def test_the_straggler_path_is_published_admitted_and_scraped_on_every_sampler() -> None:
    objects = _objects()
    env = _kubelet_env(_container(_tier_workload("sampler")))
    port = int(env["OTELCOL_STRAGGLER_ENDPOINT"].rsplit(":", 1)[1])
    assert env["OTELCOL_STRAGGLER_ENDPOINT"] == f"0.0.0.0:{port}"
    container_ports = {
        p["name"]: p["containerPort"] for p in _container(_tier_workload("sampler"))["ports"]
    }
    assert container_ports["straggler"] == port
    service_ports = {
        p["name"]: p for p in objects[("Service", "otelprof-sampler")]["spec"]["ports"]
    }
    assert service_ports["straggler"]["port"] == port
    assert service_ports["straggler"]["targetPort"] == "straggler"
    policy = objects[("NetworkPolicy", "otelprof-sampler")]["spec"]
    admitted = {
        p["port"] for rule in policy["ingress"] if "from" not in rule for p in rule["ports"]
    }
    assert {port, container_ports["prometheus"]} <= admitted
    scrape = yaml.safe_load(SCRAPE_CONFIG.read_text())
    jobs = {
        job["job_name"]: job for job in scrape["scrape_configs"]
        if any(sd["port"] == port for sd in job.get("dns_sd_configs", []))
    }  # fmt: skip
    (job,) = jobs.values()
    assert job["honor_labels"] is True  # the exporter's job and instance, as the dashboards expect
    assert job["dns_sd_configs"][0]["names"] == ["otelprof-sampler.otelprof.svc"]


def test_network_policies_admit_each_tier_only_from_the_tier_before_it() -> None:
    objects = _objects()
    for tier, sender in (("gateway", "agent"), ("sampler", "gateway")):
        policy = objects[("NetworkPolicy", f"otelprof-{tier}")]["spec"]
        labels = _tier_workload(tier)["spec"]["template"]["metadata"]["labels"]
        assert policy["podSelector"]["matchLabels"].items() <= labels.items()
        sender_labels = _tier_workload(sender)["spec"]["template"]["metadata"]["labels"]
        otlp_port = {p["name"]: p for p in _container(_tier_workload(tier))["ports"]}["otlp-grpc"]
        rules = [
            r
            for r in policy["ingress"]
            if {"port": otlp_port["containerPort"], "protocol": "TCP"} in r["ports"]
        ]
        (rule,) = rules
        (peer,) = rule["from"]
        assert peer["podSelector"]["matchLabels"].items() <= sender_labels.items()


def test_training_job_env_gives_otelprof_the_node_agent_its_token_and_one_run_id() -> None:
    objects = _objects()
    job = objects[("Job", "otelprof-train")]
    env = _kubelet_env(_container(job))
    settings = Settings.from_options(env=env)

    agent = _container(_tier_workload("agent"))
    host_port = {p["name"]: p for p in agent["ports"]}["otlp-grpc"]["hostPort"]
    assert settings.endpoint == f"{FIELD_VALUES['status.hostIP']}:{host_port}"
    assert settings.insecure is True and settings.detached is False
    assert dict(settings.headers) == {"authorization": f"Bearer {SECRET_VALUES['ingest-token']}"}
    uid = FIELD_VALUES["metadata.labels['batch.kubernetes.io/controller-uid']"]
    assert settings.run_id == f"otelprof-train-{uid}"
    assert settings.service_name == "otelprof-train"
    assert dict(settings.resource_attributes) == {
        "k8s.namespace.name": "otelprof",
        "k8s.pod.name": FIELD_VALUES["metadata.name"],
        "k8s.job.name": "otelprof-train",
    }

    args = _container(job)["args"]
    assert "--rdzv-id=$(OTELPROF_RUN_ID)" in args  # torchrun's rendezvous: the same id
    service = objects[("Service", "otelprof-train")]
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert (
        f"--rdzv-endpoint=otelprof-train-0.otelprof-train:{service['spec']['ports'][0]['port']}"
        in args
    )
    assert f"--nnodes={job['spec']['completions']}" in args


# -- SLURM and Prometheus ------------------------------------------------------------------------


def test_slurm_script_parses() -> None:
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_slurm_script_passes_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("shellcheck is not installed; run `make shellcheck` (Debian's package)")
    result = subprocess.run(
        [shellcheck, "--shell=bash", str(SBATCH)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrape_config_passes_promtool() -> None:
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    if not os.access(promtool, os.X_OK):
        pytest.fail("promtool is not installed; run `make prometheus` (Debian's package)")
    result = subprocess.run(
        [promtool, "check", "config", str(SCRAPE_CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
