"""What a running profiler installs for distributed jobs, and removes at shutdown."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otelprof._distributed import collectives
from otelprof._distributed.identity import InitProcessGroupHook
from otelprof._schema import COLLECTIVE_DURATION as COLLECTIVE_METRIC


class DistributedHooks:
    """Collective timing, the init_process_group hook and the live collective-time counter."""

    def __init__(self, timing: collectives.CollectiveTiming, init: InitProcessGroupHook) -> None:
        self._timing = timing
        self._init = init

    @classmethod
    def start(cls, meter: Meter, on_new_identity: Callable[[], None]) -> DistributedHooks:
        """Install the hooks; `on_new_identity` is called after a process group is set up
        (the Profiler restarts under its ranks if they differ)."""
        timing = collectives.CollectiveTiming()
        init = InitProcessGroupHook(on_new_identity)
        hooks = cls(timing, init)
        try:
            timing.install()
            init.install()
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

    def remove(self) -> None:
        self._init.remove()
        self._timing.remove()
