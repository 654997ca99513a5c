"""Ranks of a job that left nothing behind, per elastic attempt (a problem to show first).

From the run files (`run.rank<N>[.attempt<K>].json`, written when a process starts
otelprof): a rank with none never started it; a node whose ranks all stopped without an end
while other nodes' ranks recorded theirs is lost (`host.name` says where a rank ran); two
processes claiming one rank of one attempt (in run files or data: one run id reused where
nothing kept the second out) mix their telemetry in the figures.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from otelprof._schema import ATTR_ATTEMPT, ATTR_RANK, ATTR_RUN_ID, ATTR_WORLD_SIZE


def missing_ranks(run_info: Iterable[dict[str, Any]]) -> list[str]:
    """One message per attempt of a multi-rank job whose ranks did not all write a run file."""
    seen: dict[tuple[str, int], set[int]] = {}
    world: dict[tuple[str, int], int] = {}
    for info in run_info:
        resource = info.get("resource")
        if not isinstance(resource, dict):
            continue
        size, rank = resource.get(ATTR_WORLD_SIZE), resource.get(ATTR_RANK)
        if not isinstance(size, int) or not isinstance(rank, int) or size <= 1:
            continue
        attempt = info.get("attempt")
        key = (str(info.get("run_id", "")), attempt if isinstance(attempt, int) else 0)
        seen.setdefault(key, set()).add(rank)
        world[key] = max(world.get(key, 0), size)
    out = []
    for key in sorted(seen):
        absent = sorted(set(range(world[key])) - seen[key])
        if absent:
            run_id, attempt = key
            where = f"run {run_id}" + (f", attempt {attempt}" if attempt else "")
            names = ", ".join(str(r) for r in absent[:16]) + (" ..." if len(absent) > 16 else "")
            out.append(
                f"{where}: rank(s) {names} of {world[key]} left no run file (they never started "
                "otelprof, or wrote to another directory); their telemetry is missing"
            )
    return out


def lost_hosts(run_info: Iterable[dict[str, Any]]) -> list[str]:
    """One message per lost node, said once rather than left for the reader to infer from
    its ranks' lines."""
    ranks: dict[tuple[str, int], dict[str, list[tuple[int, bool]]]] = {}
    for info in run_info:
        resource = info.get("resource")
        if not isinstance(resource, dict):
            continue
        host, rank = resource.get("host.name"), resource.get(ATTR_RANK)
        if not isinstance(host, str) or not isinstance(rank, int):
            continue
        attempt = info.get("attempt")
        key = (str(info.get("run_id", "")), attempt if isinstance(attempt, int) else 0)
        ended = "finished_unix_nano" in info
        ranks.setdefault(key, {}).setdefault(host, []).append((rank, ended))
    out = []
    for key in sorted(ranks):
        hosts = ranks[key]
        if len(hosts) < 2:
            continue
        for host in sorted(hosts):
            gone = not any(ended for _, ended in hosts[host])
            others_ended = any(ended for h, rs in hosts.items() if h != host for _, ended in rs)
            if gone and others_ended:
                run_id, attempt = key
                where = f"run {run_id}" + (f", attempt {attempt}" if attempt else "")
                numbers = ", ".join(str(r) for r, _ in sorted(hosts[host]))
                word = "rank" if len(hosts[host]) == 1 else "ranks"
                out.append(
                    f"{where}: node {host} lost: {word} {numbers} (every rank on it) stopped "
                    "without recording an end while ranks on other nodes recorded theirs (the "
                    "node died, its processes were killed, or it lost the network); its "
                    "telemetry ends at its last export"
                )
    return out


def claimed_twice(
    run_info: Iterable[dict[str, Any]], resources: Iterable[Mapping[str, Any]] = ()
) -> list[str]:
    """One message per rank of a run (and attempt) that more than one process claimed: in
    its run files (`run_info`) or in the data (`resources`: each process's resource)."""
    claims: dict[tuple[str, int, int], set[tuple[str, int]]] = {}
    for resource in [*(info.get("resource") for info in run_info), *resources]:
        if not isinstance(resource, Mapping):
            continue
        rank, pid = resource.get(ATTR_RANK), resource.get("process.pid")
        if not isinstance(rank, int) or not isinstance(pid, int):
            continue
        attempt = resource.get(ATTR_ATTEMPT)
        key = (
            str(resource.get(ATTR_RUN_ID, "")),
            attempt if isinstance(attempt, int) else 0,
            rank,
        )
        claims.setdefault(key, set()).add((str(resource.get("host.name", "")), pid))
    out = []
    for (run_id, attempt, rank), processes in sorted(claims.items()):
        if len(processes) < 2:
            continue
        where = f"run {run_id}" + (f", attempt {attempt}" if attempt else "")
        names = ", ".join(f"pid {pid} on {host}" for host, pid in sorted(processes)[:8])
        out.append(
            f"{where}: rank {rank} was claimed by {len(processes)} processes ({names}): two runs "
            "started with one run id wrote into one directory, and its figures mix them; give "
            "each run its own run_id"
        )
    return out
