"""Host metrics from psutil: CPU, available memory, network and disk rates.

Rates are Δcounter/Δt between consecutive samples, computed from raw per-device counters
(`nowrap=False`, so psutil's process-global wrap cache is not involved and the edge cases
stay ours, see `rates.py`).

Which devices count:
- network: every interface psutil reports, loopback included, summed per direction (the
  same totals as `psutil.net_io_counters()`, which Determined reports). Loopback is kept
  because single-node jobs talk over it (gloo, data servers); traffic that crosses a
  bridge or veth pair is counted once per interface, as in Determined.
- disk: whole physical disks only: names listed in /sys/block whose device is not under
  /sys/devices/virtual (this drops partitions, loop, ram, zram, device-mapper and md
  devices, which would count the same I/O twice). Without /sys/block (not Linux), every
  disk psutil reports except loop/ram/dm/md names.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from . import names
from ._common import AttrValue, LogOnce, Reading
from .rates import busy_fraction, summed_rate

MIN_WINDOW_S = 0.05
"""Shortest interval a rate is computed over: CPU times tick every 10 ms, so a shorter
window measures the tick, not the load. A shorter gap keeps the old baseline."""

T = TypeVar("T")


class Baseline(Generic[T]):
    """The previous reading of one source and when it was taken."""

    def __init__(self) -> None:
        self.time: float | None = None
        self.value: T | None = None

    def advance(self, now: float, value: T) -> tuple[T, float] | None:
        """Move the baseline to `value`; return (previous value, Δt), or None if unusable.

        The first reading only sets the baseline. A reading less than MIN_WINDOW_S after
        the baseline (including Δt == 0 or a clock that stepped back) is dropped and the
        baseline kept, so the next rate covers the whole span.
        """
        if self.time is None or self.value is None:
            self.time, self.value = now, value
            return None
        dt = now - self.time
        if dt < MIN_WINDOW_S:
            return None
        previous = self.value
        self.time, self.value = now, value
        return previous, dt


_VIRTUAL_NAME = re.compile(r"^(loop|ram|zram|dm-|md|sr|fd|nbd)\d*")


def physical_disk_filter(sys_block: str = "/sys/block") -> Callable[[str], bool]:
    """A predicate `name -> bool` telling whole physical disks from everything else."""
    if not os.path.isdir(sys_block):
        return lambda name: not _VIRTUAL_NAME.match(name)
    cache: dict[str, bool] = {}

    def is_physical(name: str) -> bool:
        known = cache.get(name)
        if known is None:
            path = os.path.join(sys_block, name.replace("/", "!"))
            known = os.path.exists(path) and "/devices/virtual/" not in os.path.realpath(path)
            cache[name] = known
        return known

    return is_physical


@dataclass(frozen=True)
class NetCounters:
    sent: dict[str, int]
    recv: dict[str, int]


@dataclass(frozen=True)
class DiskCounters:
    read_count: dict[str, int]
    write_count: dict[str, int]
    read_bytes: dict[str, int]
    write_bytes: dict[str, int]


class HostSampler:
    """Samples host counters and turns consecutive samples into readings."""

    def __init__(
        self,
        ps: Any = None,
        is_physical_disk: Callable[[str], bool] | None = None,
        log: LogOnce | None = None,
    ) -> None:
        if ps is None:
            import psutil as ps
        self._ps = ps
        self._is_physical_disk = is_physical_disk or physical_disk_filter()
        self._log = log or LogOnce()
        self._cpu: Baseline[Any] = Baseline()
        self._net: Baseline[NetCounters] = Baseline()
        self._disk: Baseline[DiskCounters] = Baseline()

    def prime(self, now: float) -> None:
        """Take baselines now, so the first collection reports a real interval (not 0)."""
        self.sample(now)

    def sample(self, now: float) -> list[Reading]:
        out: list[Reading] = []
        cpu_times = self._read("cpu", self._ps.cpu_times)
        if cpu_times is not None:
            step = self._cpu.advance(now, cpu_times)
            if step is not None:
                self._add(out, names.CPU_UTILIZATION, busy_fraction(step[0], cpu_times))
        memory = self._read("memory", self._ps.virtual_memory)
        if memory is not None:
            self._add(out, names.MEMORY_AVAILABLE, float(memory.available))
        net = self._read("network", self._read_net)
        if net is not None:
            self._net_rates(out, net, now)
        disk = self._read("disk", self._read_disk)
        if disk is not None:
            self._disk_rates(out, disk, now)
        return out

    def _net_rates(self, out: list[Reading], net: NetCounters, now: float) -> None:
        step = self._net.advance(now, net)
        if step is None:
            return
        before, dt = step
        direction = names.NETWORK_DIRECTION
        sent = summed_rate(before.sent, net.sent, dt)
        recv = summed_rate(before.recv, net.recv, dt)
        self._add(out, names.NETWORK_THROUGHPUT, sent, {direction: names.TRANSMIT})
        self._add(out, names.NETWORK_THROUGHPUT, recv, {direction: names.RECEIVE})

    def _disk_rates(self, out: list[Reading], disk: DiskCounters, now: float) -> None:
        step = self._disk.advance(now, disk)
        if step is None:
            return
        before, dt = step
        read = {names.DISK_DIRECTION: names.READ}
        write = {names.DISK_DIRECTION: names.WRITE}
        self._add(out, names.DISK_IOPS, summed_rate(before.read_count, disk.read_count, dt), read)
        self._add(
            out, names.DISK_IOPS, summed_rate(before.write_count, disk.write_count, dt), write
        )
        self._add(
            out, names.DISK_THROUGHPUT, summed_rate(before.read_bytes, disk.read_bytes, dt), read
        )
        self._add(
            out,
            names.DISK_THROUGHPUT,
            summed_rate(before.write_bytes, disk.write_bytes, dt),
            write,
        )

    def _read_net(self) -> NetCounters | None:
        per_nic = self._ps.net_io_counters(pernic=True, nowrap=False)
        if not per_nic:
            return None
        return NetCounters(
            sent={nic: c.bytes_sent for nic, c in per_nic.items()},
            recv={nic: c.bytes_recv for nic, c in per_nic.items()},
        )

    def _read_disk(self) -> DiskCounters | None:
        per_disk = self._ps.disk_io_counters(perdisk=True, nowrap=False)
        if not per_disk:
            return None
        disks = {name: c for name, c in per_disk.items() if self._is_physical_disk(name)}
        if not disks:
            self._log("disk:none", logging.INFO, "no physical disk found; disk metrics omitted")
            return None
        return DiskCounters(
            read_count={d: c.read_count for d, c in disks.items()},
            write_count={d: c.write_count for d, c in disks.items()},
            read_bytes={d: c.read_bytes for d, c in disks.items()},
            write_bytes={d: c.write_bytes for d, c in disks.items()},
        )

    def _read(self, what: str, read: Callable[[], T | None]) -> T | None:
        try:
            return read()
        except Exception as exc:
            self._log(
                f"host:{what}:{type(exc).__name__}",
                logging.WARNING,
                "cannot read %s counters (%s: %s); those metrics are omitted",
                what,
                type(exc).__name__,
                exc,
            )
            return None

    @staticmethod
    def _add(
        out: list[Reading],
        instrument: names.Instrument,
        value: float | None,
        attributes: Mapping[str, AttrValue] | None = None,
    ) -> None:
        if value is not None:
            out.append(Reading(instrument.name, value, dict(attributes or {})))
