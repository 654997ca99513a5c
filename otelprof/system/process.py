"""This process's CPU utilization and resident memory (every rank reports its own)."""

from __future__ import annotations

import logging
import os
from typing import Any

from . import names
from ._common import LogOnce, Reading
from .host import Baseline
from .rates import share_of_cpus


def usable_cpus() -> int:
    """CPUs this process may run on (affinity/cgroup cpuset), the denominator of utilization."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ProcessSampler:
    """Samples `psutil.Process()`: utilization is CPU seconds / (Δt × usable CPUs)."""

    def __init__(self, process: Any = None, cpus: int | None = None, log: LogOnce | None = None):
        if process is None:
            import psutil

            process = psutil.Process()
        self._process = process
        self._cpus = cpus or usable_cpus()
        self._log = log or LogOnce()
        self._cpu: Baseline[float] = Baseline()

    def prime(self, now: float) -> None:
        self.sample(now)

    def sample(self, now: float) -> list[Reading]:
        out: list[Reading] = []
        try:
            with self._process.oneshot():
                times = self._process.cpu_times()
                rss = self._process.memory_info().rss
        except Exception as exc:
            self._log(
                f"process:{type(exc).__name__}",
                logging.WARNING,
                "cannot read this process's CPU/memory (%s: %s); process metrics omitted",
                type(exc).__name__,
                exc,
            )
            return out
        out.append(Reading(names.PROCESS_MEMORY_USAGE.name, float(rss)))
        step = self._cpu.advance(now, float(times.user + times.system))
        if step is not None:
            before, dt = step
            used = share_of_cpus(times.user + times.system - before, dt, self._cpus)
            if used is not None:
                out.append(Reading(names.PROCESS_CPU_UTILIZATION.name, used))
        return out
