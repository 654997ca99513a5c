"""Resource attributes: service, host, pid, ranks from torchrun/DeepSpeed, Determined ids."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from otelprof.config import Settings
from otelprof.resource import build_resource


def test_single_process_gets_host_pid_and_rank_zero_of_one(tmp_path: Path) -> None:
    resource = build_resource(Settings.from_options(env={}, output_dir=tmp_path), env={})
    attrs = resource.attributes
    assert attrs["service.name"] == "otelprof"
    assert attrs["host.name"] == socket.gethostname()
    assert attrs["process.pid"] == os.getpid()
    assert (attrs["otelprof.rank"], attrs["otelprof.local_rank"], attrs["otelprof.world_size"]) == (
        0,
        0,
        1,
    )


def test_torchrun_ranks_and_determined_ids_come_from_the_environment(tmp_path: Path) -> None:
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "DET_EXPERIMENT_ID": "12",
        "DET_TRIAL_ID": "42",
        "DET_TRIAL_RUN_ID": "3",
        "DET_AGENT_ID": "agent-7",
    }
    settings = Settings.from_options(env=env, output_dir=tmp_path, service_name="train")
    attrs = build_resource(settings, env=env).attributes
    assert attrs["service.name"] == "train"
    assert attrs["otelprof.rank"] == 5
    assert attrs["otelprof.local_rank"] == 1
    assert attrs["otelprof.world_size"] == 8
    assert attrs["determined.experiment.id"] == 12
    assert attrs["determined.trial.id"] == 42
    assert attrs["determined.trial.run_id"] == 3
    assert attrs["determined.agent.id"] == "agent-7"


def test_configured_resource_attributes_are_added(tmp_path: Path) -> None:
    settings = Settings.from_options(
        env={}, output_dir=tmp_path, resource_attributes={"team": "vision"}
    )
    assert build_resource(settings, env={}).attributes["team"] == "vision"
