"""deploy/slurm/otelprof-train.sbatch run as a one-node SLURM job on this machine.

SLURM itself cannot run here, so two stand-ins play its commands for a single node, the way
they behave there: `srun` runs the step's command once on "the node" (SLURMD_NODENAME set,
`--output` with `%N` expanded, signals reaching the task directly), and `scontrol show
hostnames` lists the job's node list. Everything else is real: the script, the built collector
as the node agent with deploy/collector/agent.yaml, torchrun (c10d rendezvous) and a training
script under otelprof; a real OTLP gRPC server plays the gateway. It proves the script starts
the agent, waits for it, gives otelprof the agent's endpoint, its token and the job's run id,
has the node's name stamped on what otelprof sends, and stops (and so flushes) the agent.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from otelprof._schema import ATTR_RANK
from tests.otlp_sink import OtlpSink
from tests.services import REPO

SBATCH = REPO / "deploy" / "slurm" / "otelprof-train.sbatch"
NODE = "slurm-node-1"
TIMEOUT_S = 600  # torchrun and torch take minutes to start on a loaded 2-core machine

SRUN = """#!/bin/bash
# stand-in srun for a one-node allocation: run the step's command on this node
output=""
while [[ $# -gt 0 && "$1" == -* ]]; do
    case "$1" in
        --output=*) output="${1#--output=}" ;;
    esac
    shift
done
export SLURMD_NODENAME="$STANDIN_NODE"
if [[ -n "$output" ]]; then
    exec "$@" >"${output//%N/$SLURMD_NODENAME}" 2>&1
fi
exec "$@"
"""

SCONTROL = """#!/bin/bash
# stand-in scontrol: `show hostnames LIST` for a list of plain names
[[ "$1 $2" == "show hostnames" ]] || { echo "stand-in scontrol: only show hostnames" >&2; exit 2; }
tr ',' '\\n' <<<"$3"
"""

TRAIN = """
import sys

import otelprof

with otelprof.instrument() as prof:
    for _ in range(3):
        with otelprof.timing("work"):
            sum(range(10_000))
        otelprof.step()
sys.exit(int(sys.argv[1]))
"""


def _job_id_with_free_ports() -> int:
    """A job id whose derived ports (the script's port_base .. +3) are free on loopback."""
    for job_id in range(4242, 7242):
        base = 20000 + (job_id % 3000) * 4
        try:
            for port in range(base, base + 4):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return job_id
    raise RuntimeError("no free port range for the job")


def _job_env(tmp_path: Path, collector_binary: Path, gateway: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    token = tmp_path / "gateway-token"
    token.write_text("gateway-5d7e\n")
    token.chmod(0o600)
    (tmp_path / "train.py").write_text(TRAIN)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL", "SLURM"))}
    return {
        **clean,
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "STANDIN_NODE": NODE,
        "SLURM_JOB_ID": str(_job_id_with_free_ports()),
        "SLURM_JOB_NAME": "otelprof-train",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "OTELPROF_AGENT_CONFIG": str(REPO / "deploy" / "collector" / "agent.yaml"),
        "OTELCOL_BIN": str(collector_binary),
        "OTELPROF_GATEWAY": gateway,
        "OTELPROF_GATEWAY_TOKEN_FILE": str(token),
        "GPUS_PER_NODE": "1",
        "OTELPROF_OUTPUT_DIR": str(tmp_path / "runs"),
    }


def _run(env: dict[str, str], tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SBATCH), *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_sbatch_script_runs_agent_and_torchrun_and_otelprof_reaches_the_gateway_from_the_node(
    collector_binary: Path, tmp_path: Path
) -> None:
    gateway = OtlpSink().start()
    try:
        env = _job_env(tmp_path, collector_binary, f"127.0.0.1:{gateway.port}")
        done = _run(env, tmp_path, str(tmp_path / "train.py"), "0")
    finally:
        gateway.stop()
    agent_log = tmp_path / f"otelprof-agents-{env['SLURM_JOB_ID']}" / f"agent-{NODE}.log"
    detail = f"{done.stdout}\n{done.stderr}\n--- agent ---\n" + (
        agent_log.read_text() if agent_log.exists() else "(no agent log)"
    )
    assert done.returncode == 0, detail
    assert "Shutdown complete" in agent_log.read_text(), detail  # stopped, after its flush

    resources = gateway.resources()
    assert resources, detail
    run_id = f"otelprof-train-{env['SLURM_JOB_ID']}"
    for resource in resources:
        assert resource["host.name"] == NODE
        assert resource["otelprof.run_id"] == run_id
        assert resource["slurm.job.id"] == env["SLURM_JOB_ID"]
        assert resource[ATTR_RANK] == 0
    assert any(span.name == "work" for span in gateway.spans()), detail
    # attached mode: nothing in the run directory's place
    assert not (tmp_path / "runs").exists()


def test_sbatch_script_refuses_a_gateway_token_file_others_can_read(
    collector_binary: Path, tmp_path: Path
) -> None:
    env = _job_env(tmp_path, collector_binary, "127.0.0.1:1")
    token = Path(env["OTELPROF_GATEWAY_TOKEN_FILE"])
    token.chmod(0o644)
    done = _run(env, tmp_path, "train.py")
    assert done.returncode == 2
    assert "readable by others (mode 644)" in done.stderr
    assert stat.S_IMODE(token.stat().st_mode) == 0o644  # left as it was


@pytest.mark.parametrize(
    "missing", ["OTELCOL_BIN", "OTELPROF_GATEWAY", "OTELPROF_GATEWAY_TOKEN_FILE"]
)
def test_sbatch_script_names_a_missing_setting(
    missing: str, collector_binary: Path, tmp_path: Path
) -> None:
    env = _job_env(tmp_path, collector_binary, "127.0.0.1:1")
    del env[missing]
    done = _run(env, tmp_path, "train.py")
    assert done.returncode != 0
    assert f"set {missing}" in done.stderr
