"""What a running profiler installs for distributed jobs, and removes at shutdown."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otelprof._distributed import collectives
from otelprof._distributed.identity import hook_init_process_group
from otelprof._patch import Patches
from otelprof._schema import COLLECTIVE_DURATION as COLLECTIVE_METRIC


class DistributedHooks(Patches):
    """Collective timing, the init_process_group hook and the live collective-time counter:
    its patches (the counter lives with the meter)."""

    @classmethod
    def start(cls, meter: Meter, on_new_identity: Callable[[], None]) -> DistributedHooks:
        """Install the hooks; `on_new_identity` is called after a process group is set up
        (the Profiler restarts under its ranks if they differ)."""
        hooks = cls()
        if "torch" in sys.modules:  # a process group needs the program to import torch
            import torch.distributed as dist

            if dist.is_available():
                try:
                    collectives.install(dist, hooks)
                    hook_init_process_group(dist, hooks, on_new_identity)
                except Exception:
                    hooks.remove()
                    raise

        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            for op, (seconds, _calls) in collectives.snapshot().items():
                yield Observation(seconds, {collectives.ATTR_COLLECTIVE: op})

        meter.create_observable_counter(
            COLLECTIVE_METRIC,
            callbacks=[observe],
            unit="s",
            description="Time this rank spent in collectives (communication plus waiting for "
            "the other ranks); in synchronous training the straggler waits least",
        )
        return hooks

    remove = Patches.restore
