"""This process's CPU utilization and resident memory (every rank reports its own)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from . import _procfs, names
from ._common import LogOnce, Reading
from ._stamps import Baseline, Clock, Stamped, timed
from .rates import share_of_cpus


def usable_cpus() -> int:
    """CPUs this process may run on (affinity/cgroup cpuset), the denominator of utilization."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ProcessSampler:
    """Utilization is CPU seconds / (Δt × usable CPUs). With `process=None` on Linux from
    /proc/<pid>/stat and statm kept open (`_procfs`), otherwise from a `psutil.Process`.
    """

    def __init__(
        self,
        process: Any = None,
        cpus: int | None = None,
        log: LogOnce | None = None,
        clock: Callable[[], int] | None = None,
    ):
        self._stat: _procfs.ProcFile | None = None
        self._statm: _procfs.ProcFile | None = None
        if process is None:
            import psutil

            process = psutil.Process()
            try:
                self._stat = _procfs.ProcFile(f"/proc/{os.getpid()}/stat")
                self._statm = _procfs.ProcFile(f"/proc/{os.getpid()}/statm")
            except OSError:
                self.close()
        self._process = process
        self._cpus = cpus or usable_cpus()
        self._log = log or LogOnce()
        self._clock = clock or Clock()
        self._cpu: Baseline[float] = Baseline()

    @property
    def reads_procfs(self) -> bool:
        return self._stat is not None

    def prime(self) -> None:
        self.sample()

    def sample(self) -> list[Reading]:
        out: list[Reading] = []
        try:
            cpu, rss = self._read()
        except Exception as exc:
            doing = "cannot read this process's CPU/memory"
            self._log.error("process", exc, doing, "process metrics omitted")
            return out
        step = self._cpu.advance(cpu.time_ns, cpu.value)
        if step is not None:
            before, dt, start = step
            used = share_of_cpus(cpu.value - before, dt, self._cpus)
            if used is not None:
                out.append(
                    Reading(names.PROCESS_CPU_UTILIZATION.name, used, {}, cpu.time_ns, start)
                )
        out.append(Reading(names.PROCESS_MEMORY_USAGE.name, rss.value, {}, rss.time_ns))
        return out

    def close(self) -> None:
        for proc in (self._stat, self._statm):
            if proc is not None:
                proc.close()
        self._stat = self._statm = None

    def _read(self) -> tuple[Stamped[float], Stamped[float]]:
        if self._stat is not None and self._statm is not None:
            stat = self._stat.read(self._clock)
            statm = self._statm.read(self._clock)
            return (
                Stamped(_procfs.parse_process_cpu_seconds(stat.value), stat.time_ns),
                Stamped(_procfs.parse_statm_rss(statm.value), statm.time_ns),
            )
        times = timed(self._process.cpu_times, self._clock)
        rss = timed(self._process.memory_info, self._clock)
        return (
            Stamped(float(times.value.user + times.value.system), times.time_ns),
            Stamped(float(rss.value.rss), rss.time_ns),
        )
