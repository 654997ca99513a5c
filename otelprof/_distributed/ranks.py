"""A process's place in a distributed job, from any launcher.

An initialized `torch.distributed` process group wins over the launcher's `RANK`,
`LOCAL_RANK`, `WORLD_SIZE`; without `LOCAL_RANK` (`mp.spawn`) the local rank comes from the
host names ranks publish in the group's store, and the ranks agree on rank 0's run id
through it too. Nothing here imports torch: a group exists only if the program imported
`torch.distributed`.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from otelprof import _torch_compat

_log = logging.getLogger("otelprof")

STORE_PREFIX = "otelprof"
STORE_TIMEOUT_S = 60.0
"""How long a rank waits for lower ranks' keys in the store before going on alone."""

_generation = 0  # instrument() calls under the current process group (keys stay unique)


@dataclass(frozen=True)
class Identity:
    """Rank, local rank and world size of this process; `source` says where they came from."""

    rank: int
    local_rank: int
    world_size: int
    source: str  # "torch.distributed" or "environment"

    def env(self) -> dict[str, str]:
        """The launcher variables this identity stands for (settings and resource read them)."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
        }


def dist_with_group() -> Any:
    """`torch.distributed` if the program imported it and a default group exists, else None."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist
    except Exception:
        return None
    return None


def _int(env: Mapping[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def _wait(store: Any, keys: list[str], timeout_s: float) -> bool:
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
        return True
    except Exception:
        return False


def _local_rank_from_store(dist: Any, rank: int, timeout_s: float) -> int | None:
    """Rank's position among the ranks on its host: each rank publishes its host name and
    reads those of the lower ranks only, so rank 0 never waits."""
    store = _torch_compat.default_store(dist)
    if store is None:
        return None
    host = socket.gethostname()
    prefix = f"{STORE_PREFIX}/{_generation}/host"
    try:
        store.set(f"{prefix}/{rank}", host)
        keys = [f"{prefix}/{r}" for r in range(rank)]
        if keys and not _wait(store, keys, timeout_s):
            return None
        return sum(1 for key in keys if store.get(key).decode() == host)
    except Exception:
        return None


def detect(env: Mapping[str, str] | None = None, *, timeout_s: float = STORE_TIMEOUT_S) -> Identity:
    """This process's identity; a process group, when there is one, wins over the environment."""
    env = os.environ if env is None else env
    dist = dist_with_group()
    if dist is not None:
        try:
            rank, world = int(dist.get_rank()), int(dist.get_world_size())
        except Exception:
            dist = None
    if dist is None:
        return Identity(
            rank=_int(env, "RANK") or 0,
            local_rank=_int(env, "LOCAL_RANK") or 0,
            world_size=_int(env, "WORLD_SIZE") or 1,
            source="environment",
        )
    local = _int(env, "LOCAL_RANK")
    if local is None:
        local = _local_rank_from_store(dist, rank, timeout_s)
        if local is None:
            _log.warning(
                "otelprof: rank %d could not learn its local rank (no LOCAL_RANK, store "
                "unavailable); assuming every rank runs on this host",
                rank,
            )
            local = rank
    return Identity(rank=rank, local_rank=local, world_size=world, source="torch.distributed")


def agree_run_id(candidate: str, rank: int, *, timeout_s: float = STORE_TIMEOUT_S) -> str:
    """The run id of rank 0, published in the process group's store; `candidate` when there
    is no store or rank 0 does not publish within `timeout_s` (logged)."""
    dist = dist_with_group()
    store = _torch_compat.default_store(dist) if dist is not None else None
    if store is None:
        return candidate
    key = f"{STORE_PREFIX}/{_generation}/run_id"
    try:
        if rank == 0:
            store.set(key, candidate)
            return candidate
        if _wait(store, [key], timeout_s):
            return str(store.get(key).decode())
    except Exception as error:
        _log.warning("otelprof: could not agree on a run id with rank 0: %r", error)
        return candidate
    _log.warning(
        "otelprof: rank %d: rank 0 published no run id within %.0f s (did it call "
        "otelprof.instrument()?); writing to run %s alone",
        rank,
        timeout_s,
        candidate,
    )
    return candidate


def next_generation() -> None:
    """A new instrument() under the same process group uses fresh store keys."""
    global _generation
    _generation += 1
