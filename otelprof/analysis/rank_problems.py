"""Ranks of a job that left nothing behind, per elastic attempt (a problem to show first).

Each process of a job writes `run.rank<N>[.attempt<K>].json` when it starts otelprof, so a
rank with no such file never started it (crashed before `instrument()`, or wrote elsewhere).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def missing_ranks(run_info: Iterable[dict[str, Any]]) -> list[str]:
    """One message per attempt of a multi-rank job whose ranks did not all write a run file."""
    seen: dict[tuple[str, int], set[int]] = {}
    world: dict[tuple[str, int], int] = {}
    for info in run_info:
        resource = info.get("resource")
        if not isinstance(resource, dict):
            continue
        size, rank = resource.get("otelprof.world_size"), resource.get("otelprof.rank")
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
