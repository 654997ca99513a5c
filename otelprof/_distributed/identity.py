"""Settle a process's identity before (or again after) its providers exist.

Resources are immutable once providers are built, so ranks are settled at `instrument()`
when a process group already exists, and again at `init_process_group()` (patched while
otelprof runs) when the group appears later with other ranks: the profiler then restarts
under them and moves what it wrote into the agreed run directory (`RunLayout.relocate_from`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from otelprof._distributed import ranks
from otelprof._patch import Patches
from otelprof._schema import ATTR_LOCAL_RANK, ATTR_RANK, ATTR_WORLD_SIZE
from otelprof.config import ENVIRONMENT

_log = logging.getLogger("otelprof")

_INIT = "init_process_group"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"


def run_id_explicit(options: Mapping[str, Any], env: Mapping[str, str]) -> bool:
    """Whether the run id comes from the user or the launcher (then every rank has it).

    torchrun's default id "none" (no --rdzv-id) is no id: otelprof makes one per launcher
    process, and a job on several nodes has one launcher per node, so the ranks must agree."""
    if options.get("run_id"):
        return True
    return any(
        env.get(v) and not (v == TORCHELASTIC_RUN_ID and env[v] == "none")
        for v in ENVIRONMENT["run_id"]
    )


def _candidate_run_id(env: Mapping[str, str]) -> str:
    """The id rank 0 proposes: under torchrun without --rdzv-id, its launcher's (so restart
    attempts of the job share the directory), else a fresh one."""
    from otelprof.config import _default_run_id, torchelastic_run_id

    if env.get(TORCHELASTIC_RUN_ID) == "none":
        return torchelastic_run_id("none")
    return _default_run_id()


def resolve(
    options: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    *,
    run_id: str | None = None,
) -> tuple[dict[str, str], dict[str, Any], bool]:
    """(environment, options, settled) to build settings and the resource from: with a
    process group, its ranks and rank 0's run id, and settled True. `run_id`: the id this
    process already runs under, which rank 0 proposes so the directory it named stays the job's.
    """
    environment = dict(os.environ if env is None else env)
    opts = dict(options)
    if ranks.dist_with_group() is None:
        return environment, opts, False
    ident = ranks.detect(environment)
    environment.update(ident.env())
    if ident.world_size > 1 and not run_id_explicit(opts, environment):
        opts["run_id"] = ranks.agree_run_id(run_id or _candidate_run_id(environment), ident.rank)
    ranks.next_generation()
    return environment, opts, True


def differs(resource: Mapping[str, Any], env: Mapping[str, str]) -> bool:
    """Whether the ranks in `env` differ from those a resource was built with."""
    ranks = ((ATTR_RANK, "RANK"), (ATTR_LOCAL_RANK, "LOCAL_RANK"), (ATTR_WORLD_SIZE, "WORLD_SIZE"))
    return any(str(resource.get(key)) != env.get(variable) for key, variable in ranks)


def hook_init_process_group(dist: Any, patches: Patches, callback: Callable[[], None]) -> None:
    """Call `callback()` after every successful `torch.distributed.init_process_group`,
    until `patches` is restored."""
    original = dist.distributed_c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            callback()
        except Exception:  # telemetry never breaks training
            _log.exception("otelprof: could not take the process group's ranks")
        return result

    patches.patch_where((dist, dist.distributed_c10d), _INIT, original, init_process_group)
