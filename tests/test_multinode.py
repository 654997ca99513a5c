"""One job on several nodes, for real: network + UTS namespaces as hosts (tests/netns_cluster.py),
a multi-node torchrun (c10d rendezvous, gloo, CPU, 2 ranks per node) across them.

- 2 nodes, live: a collector agent per node forwards OTLP to a gateway collector, Prometheus
  scrapes the gateway, and the ranks also write one shared run directory. Host metrics come
  from one process per node, ranks and local ranks are right, one run id, each node's host
  name on its telemetry, and a rank made slow on one node is named by node and rank in
  `otelprof report` and by the dashboard's straggler panel (its real PromQL).
- 4 nodes, detached: every node writes into one shared run directory; torchrun gets no
  --rdzv-id and the workers no LOCAL_RANK, so the run id and the local ranks are agreed
  across hosts by otelprof; a node is killed mid-run and the report says so.

Skipped only where namespaces cannot be made (not root); CI runs as root.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import netns_cluster as nc
from tests.otlp_files import read_points
from tests.services import (
    COLLECTOR_CONFIG,
    REPO,
    ManagedProcess,
    collector_env,
    require_collector,
    require_prometheus,
    start_prometheus,
    wait_for,
)

JOB = str(REPO / "tests" / "ddp_job.py")
SLOW_RANK = 3  # on whichever node the rendezvous put it: the test finds out from the job
LAUNCH_TIMEOUT_S = 900  # 2-4 nodes x 2 ranks each starting PyTorch on a busy 2-core machine


@pytest.fixture(autouse=True)
def _namespaces() -> None:
    reason = nc.unavailable()
    if reason:
        pytest.skip(reason)


def _wait_exit(launchers: list[ManagedProcess]) -> list[int]:
    def done() -> bool:
        return all(p.process is not None and p.process.poll() is not None for p in launchers)

    logs = lambda: "\n".join(p.log_tail() for p in launchers)  # noqa: E731
    wait_for(done, timeout_s=LAUNCH_TIMEOUT_S, what="every node's torchrun to exit",
             interval_s=1.0, on_timeout=logs)  # fmt: skip
    return [p.process.returncode for p in launchers if p.process is not None]


def _while_running(launchers: list[ManagedProcess], done: Any, what: str) -> None:
    """Wait for `done()` while every launcher runs (one that exits fails the test at once)."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not done():
        for launcher in launchers:
            launcher.check_alive()
        if time.monotonic() > deadline:
            logs = "\n".join(p.log_tail() for p in launchers)
            raise TimeoutError(f"timed out waiting for {what}\n{logs}")
        time.sleep(1.0)


def _holds(path: Path, text: str) -> bool:
    """Whether `path` exists with a whole line containing `text`."""
    try:
        content = path.read_text(errors="replace")
    except OSError:
        return False
    return any(text in line for line in content.splitlines(keepends=True) if line.endswith("\n"))


def _only_run_dir(runs: Path) -> Path:
    dirs = [p for p in runs.iterdir() if p.is_dir()]
    assert len(dirs) == 1, f"one run directory for the whole job, got {dirs}"
    return dirs[0]


def _truth(cluster: nc.Cluster, launchers: list[ManagedProcess]) -> dict[int, tuple[str, int]]:
    """rank -> (host name, local rank), from where each rank actually ran (its launcher's
    output); torchrun numbers a node's ranks consecutively."""
    out: dict[int, tuple[str, int]] = {}
    for node, launcher in zip(cluster.nodes, launchers, strict=True):
        ranks = sorted(nc.ranks_printed(launcher))
        assert len(ranks) == 2, (node.hostname, ranks, launcher.log_tail())
        out.update({rank: (node.hostname, local) for local, rank in enumerate(ranks)})
    assert sorted(out) == list(range(2 * len(cluster.nodes))), out
    return out


def _check_run_files(run_dir: Path, truth: dict[int, tuple[str, int]]) -> dict[int, Any]:
    """Every rank's run.json: its node's host name, right ranks, the job's one run id; host
    metrics in the files of exactly one process per node (its local rank 0)."""
    infos = {r: json.loads((run_dir / f"run.rank{r}.json").read_text()) for r in truth}
    sampled_host: dict[str, list[int]] = {}
    for rank, (host, local) in truth.items():
        resource = infos[rank]["resource"]
        assert resource["host.name"] == host, (rank, resource)
        assert (resource["otelprof.rank"], resource["otelprof.local_rank"]) == (rank, local)
        assert resource["otelprof.world_size"] == len(truth)
        assert resource["otelprof.run_id"] == infos[rank]["run_id"] == run_dir.name
        points = read_points(run_dir / f"metrics.rank{rank}.jsonl")
        assert {p.resource["host.name"] for p in points} == {host}
        if any(p.name == "system.cpu.utilization" for p in points):
            sampled_host.setdefault(host, []).append(rank)
    hosts = sorted({host for host, _ in truth.values()})
    expected = {h: [r for r, (host, local) in truth.items() if host == h and local == 0]
                for h in hosts}  # fmt: skip
    assert sampled_host == expected, "host metrics come from one process per node"
    return infos


def _report(*args: str) -> str:
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "otelprof", "report", *args],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def _start_gateway(cluster: nc.Cluster, workdir: Path) -> tuple[ManagedProcess, dict[str, str]]:
    """The gateway collector (the shipped config) in the hub, receiving OTLP on the bridge;
    returns it and Prometheus's scrape targets: root-namespace ports relayed to its full
    and straggler-path endpoints."""
    hub = cluster.hub
    ports = {
        "grpc": 4317,
        "http": 4318,
        "health": 13133,
        "prometheus": 8889,
        "straggler": 8890,
        "telemetry": 8888,
    }
    env = collector_env(
        workdir, ports=ports, extra={"OTELCOL_OTLP_GRPC_ENDPOINT": f"{hub.address}:4317"}
    )
    gateway = hub.start("gateway", [str(require_collector()), f"--config={COLLECTOR_CONFIG}"], env)
    hub.wait_listening(4317, "gateway OTLP receiver", gateway, host=hub.address)
    return gateway, {
        "otelcol": f"127.0.0.1:{hub.forward(ports['prometheus'])}",
        "otelcol-straggler": f"127.0.0.1:{hub.forward(ports['straggler'])}",
    }


def _start_agents(cluster: nc.Cluster, gateway: str) -> list[ManagedProcess]:
    agents = []
    for node in cluster.nodes:
        node.workdir.mkdir(parents=True, exist_ok=True)
        config = node.workdir / "agent.yaml"
        config.write_text(yaml.safe_dump(nc.agent_config(gateway)))
        agents.append(node.start("agent", [str(require_collector()), f"--config={config}"]))
    for node, agent in zip(cluster.nodes, agents, strict=True):
        node.wait_listening(nc.AGENT_OTLP_PORT, "collector agent", agent)
    return agents


def _labels(prometheus: Any, promql: str, at: float) -> list[dict[str, str]]:
    return [sample["metric"] for sample in prometheus.query(promql, at=at)]


@pytest.mark.e2e
def test_two_nodes_live_through_agents_and_a_gateway_name_the_slow_rank_by_node(
    tmp_path: Path,
) -> None:
    require_prometheus()
    service = f"multinode-{uuid.uuid4().hex[:8]}"
    rdzv_id = f"job-{uuid.uuid4().hex[:8]}"
    runs = tmp_path / "runs"
    with nc.Cluster(2, tmp_path / "nodes") as cluster:
        _gateway, scrape_targets = _start_gateway(cluster, tmp_path / "gateway")
        prometheus = start_prometheus(tmp_path / "prom", scrape_targets=scrape_targets)
        try:
            _start_agents(cluster, f"{cluster.hub.address}:4317")
            env = nc.job_env(
                OTELPROF_ENDPOINT=f"http://127.0.0.1:{nc.AGENT_OTLP_PORT}",
                OTELPROF_DETACHED="true",  # and files: the report reads the same job
                OTELPROF_OUTPUT_DIR=str(runs),
                OTELPROF_SERVICE_NAME=service,
                OTELPROF_INTERVAL="0.5",
            )
            job = [JOB, "--steps", "250", "--slow-rank", str(SLOW_RANK), "--slow-ms", "20"]
            started = time.time()
            launchers = [
                node.start("torchrun", nc.torchrun_argv(cluster, i, job, rdzv_id), env)
                for i, node in enumerate(cluster.nodes)
            ]
            codes = _wait_exit(launchers)
            finished = time.time()
            assert codes == [0, 0], "\n".join(p.log_tail() for p in launchers)
            truth = _truth(cluster, launchers)
            slow_host = truth[SLOW_RANK][0]

            # -- the files: one run directory named by the job, ranks and hosts right
            run_dir = _only_run_dir(runs)
            assert run_dir.name == rdzv_id
            _check_run_files(run_dir, truth)
            report = _report(str(run_dir))
            assert f"rank {SLOW_RANK} on {slow_host} is the straggler" in report, report

            # -- live: what reached Prometheus through each node's agent and the gateway
            selector = f'service_name="{service}"'
            prometheus.wait_for_series(f"otelprof_collective_duration_seconds_total{{{selector}}}")
            # and through the gateway's straggler path, which the straggler panel reads first
            prometheus.wait_for_series(
                f"straggler_otelprof_collective_duration_seconds_total{{{selector}}}"
            )
            wait_for(  # the last export of every rank has been scraped
                lambda: len(_labels(prometheus, f"group by (otelprof_rank) (last_over_time("
                                    f"otelprof_collective_duration_seconds_total{{{selector}}}[10m]))",
                                    time.time())) == len(truth),
                timeout_s=120, what="every rank's collective counter in Prometheus",
            )  # fmt: skip
            at = time.time()
            seen = _labels(
                prometheus,
                "group by (host_name, otelprof_rank, otelprof_local_rank, otelprof_run_id) "
                f"(last_over_time({{{selector}}}[10m]))",
                at,
            )
            assert {s["otelprof_run_id"] for s in seen} == {rdzv_id}
            assert {
                (int(s["otelprof_rank"]), (s["host_name"], int(s["otelprof_local_rank"])))
                for s in seen
            } == set(truth.items())
            host_cpu = _labels(
                prometheus,
                "group by (host_name, process_pid, otelprof_local_rank) "
                f"(last_over_time(system_cpu_utilization_ratio{{{selector}}}[10m]))",
                at,
            )
            assert sorted((s["host_name"], s["otelprof_local_rank"]) for s in host_cpu) == [
                (node.hostname, "0") for node in cluster.nodes
            ], "host metrics come from one process per node"

            # -- the live straggler panel names the node and the rank
            from dashboards.build import STRAGGLER_PANEL
            from tests.dashboard_queries import panel_expr, run_range

            lateness = {}
            for labels, _times, values in run_range(
                prometheus, panel_expr(STRAGGLER_PANEL, service), started, finished + 2
            ):
                label = dict(kv.split("=", 1) for kv in labels.split(","))
                lateness[(label["host_name"], int(label["otelprof_rank"]))] = sum(values) / len(
                    values
                )
            assert set(lateness) == {(host, rank) for rank, (host, _) in truth.items()}
            latest = max(lateness, key=lambda key: lateness[key])
            assert latest == (slow_host, SLOW_RANK), lateness
            others = [v for key, v in lateness.items() if key != latest]
            assert lateness[latest] > 2 * max(others), lateness  # it stands out
        finally:
            prometheus.stop()


def test_four_nodes_share_one_run_directory_and_a_killed_node_is_reported(
    tmp_path: Path,
) -> None:
    runs = tmp_path / "runs"
    with nc.Cluster(4, tmp_path / "nodes") as cluster:
        # no --rdzv-id (torchrun's id is "none" on every node) and no LOCAL_RANK: otelprof
        # agrees on the run id and learns local ranks from host names, across hosts
        env = nc.job_env(OTELPROF_OUTPUT_DIR=str(runs), OTELPROF_INTERVAL="0.5")
        job = [JOB, "--steps", "1000000", "--forget-local-rank"]
        launchers = [
            node.start("torchrun", nc.torchrun_argv(cluster, i, job, None), env)
            for i, node in enumerate(cluster.nodes)
        ]
        victim, victim_launcher = cluster.nodes[-1], launchers[-1]

        def victim_mid_run() -> bool:  # its ranks have trained and exported; the job runs on
            ranks = nc.ranks_printed(victim_launcher)
            dirs = [p for p in runs.iterdir() if p.is_dir()] if runs.is_dir() else []
            assert len(dirs) <= 1, f"one run directory for the whole job, got {dirs}"
            if len(ranks) < 2 or not dirs:
                return False
            return all(
                _holds(dirs[0] / f"traces.rank{r}.jsonl", '"step"')
                and _holds(dirs[0] / f"metrics.rank{r}.jsonl", "system.cpu" if local == 0 else "")
                for local, r in enumerate(sorted(ranks))
            )

        _while_running(launchers, victim_mid_run, f"{victim.hostname}'s ranks to train and export")
        assert victim.kill_all(), "the node's processes were killed"
        codes = _wait_exit(launchers[:-1])
        assert all(code != 0 for code in codes), codes  # the job failed with its node
        truth = _truth(cluster, launchers)

    run_dir = _only_run_dir(runs)
    assert run_dir.name.startswith("torchrun-"), run_dir.name  # rank 0's launcher's id
    infos = _check_run_files(run_dir, truth)
    lost = sorted(r for r, (host, _) in truth.items() if host == victim.hostname)
    for rank, info in infos.items():
        assert ("finished_unix_nano" in info) == (rank not in lost), (rank, info.get("end"))
    report = _report(str(run_dir))
    problems = report.split("problems")[1].split("Timings")[0]
    ranks_text = ", ".join(str(r) for r in lost)
    assert f"node {victim.hostname} lost" in problems, problems
    assert f"ranks {ranks_text}" in problems, problems
