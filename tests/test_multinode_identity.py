"""What a job on several hosts must agree on, checked on exact inputs (the namespace harness,
tests/test_multinode.py, proves the same on real nodes): torchrun's default run id "none" is
no run id, so the ranks agree on rank 0's; a node whose ranks all stopped without an end,
while another node's ranks recorded theirs, is reported once as a lost node."""

from __future__ import annotations

import os
from typing import Any

from otelprof._distributed.identity import _candidate_run_id, run_id_explicit
from otelprof.analysis.rank_problems import lost_hosts


def test_torchruns_default_run_id_none_is_not_an_id_every_node_shares() -> None:
    # every node's launcher sets "none" without --rdzv-id: each would derive its own id
    assert not run_id_explicit({}, {"TORCHELASTIC_RUN_ID": "none"})
    assert run_id_explicit({}, {"TORCHELASTIC_RUN_ID": "job-7"})
    assert run_id_explicit({}, {"OTELPROF_RUN_ID": "mine", "TORCHELASTIC_RUN_ID": "none"})
    assert run_id_explicit({"run_id": "mine"}, {"TORCHELASTIC_RUN_ID": "none"})


def test_rank_0_proposes_its_launchers_id_under_torchrun_else_a_fresh_one() -> None:
    proposed = _candidate_run_id({"TORCHELASTIC_RUN_ID": "none"})
    # the launcher's (this process's parent) id: restart attempts of the job share it
    assert proposed.startswith("torchrun-") and proposed.endswith(f"-{os.getppid()}")
    assert not _candidate_run_id({}).startswith("torchrun-")


def _info(host: str, rank: int, finished: bool, run_id: str = "job", **extra: Any) -> dict:
    info: dict[str, Any] = {
        "run_id": run_id,
        "resource": {"host.name": host, "otelprof.rank": rank, "otelprof.world_size": 6},
        **extra,
    }
    if finished:
        info["finished_unix_nano"] = 1
    return info


def test_a_node_whose_ranks_all_vanished_while_others_ended_is_a_lost_node() -> None:
    infos = [
        _info("node0", 0, True),
        _info("node0", 1, True),
        _info("node1", 2, True),
        _info("node1", 3, False),  # one rank killed: not a node lost
        _info("node2", 4, False),
        _info("node2", 5, False),
    ]
    [message] = lost_hosts(infos)
    assert message.startswith("run job: node node2 lost: ranks 4, 5 (every rank on it)")


def test_no_lost_node_while_every_node_runs_or_on_a_single_host() -> None:
    running = [_info(f"node{r // 2}", r, False) for r in range(4)]  # a job still running
    assert lost_hosts(running) == []
    one_host = [_info("node0", 0, True), _info("node0", 1, False)]
    assert lost_hosts(one_host) == []
    # attempts are judged apart: attempt 1 restarted on every node
    attempts = [
        _info("node0", 0, True, attempt=1),
        _info("node1", 1, False, attempt=1),
        _info("node1", 1, True),
        _info("node0", 0, True),
    ]
    assert lost_hosts(attempts) == ["run job, attempt 1: node node1 lost: rank 1 (every rank on "
                                    "it) stopped without recording an end while ranks on other "
                                    "nodes recorded theirs (the node died, its processes were "
                                    "killed, or it lost the network); its telemetry ends at its "
                                    "last export"]  # fmt: skip
