"""Host metrics: CPU, available memory, network and disk rates (/proc, else psutil).

Raw per-device counters (psutil with `nowrap=False`: its process-global wrap cache stays
out, the edge cases are `rates.py`'s). Network: every interface, loopback included (single
node jobs talk over it), summed per direction like `psutil.net_io_counters()` and
Determined. Disk: whole physical disks only, those in /sys/block not under
/sys/devices/virtual (partitions, loop, dm, md would count the same I/O twice); without
/sys/block, every disk but loop/ram/dm/md-like names.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from . import _procfs, names
from ._common import AttrValue, LogOnce, Reading
from ._stamps import MIN_WINDOW_S, Baseline, Clock, Stamped, timed
from .rates import busy_fraction, summed_rate

__all__ = ["MIN_WINDOW_S", "Baseline", "HostSampler", "physical_disk_filter"]

T = TypeVar("T")


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
    """Samples host counters, each source stamped at its own read, into readings. With
    `ps=None` on Linux from /proc files kept open (`open_proc`, a stand-in kernel in tests);
    otherwise, or with a psutil stand-in, from psutil.
    """

    def __init__(
        self,
        ps: Any = None,
        is_physical_disk: Callable[[str], bool] | None = None,
        log: LogOnce | None = None,
        clock: Callable[[], int] | None = None,
        open_proc: Callable[[str], _procfs.ProcFile] = _procfs.ProcFile,
    ) -> None:
        self._proc: dict[str, _procfs.ProcFile] = {}
        if ps is None:
            import psutil as ps

            self._proc = _open_proc_files(open_proc)
        self._ps = ps
        self._clock = clock or Clock()
        self._is_physical_disk = is_physical_disk or physical_disk_filter()
        self._log = log or LogOnce()
        self._cpu: Baseline[Any] = Baseline()
        self._net: Baseline[NetCounters] = Baseline()
        self._disk: Baseline[DiskCounters] = Baseline()

    @property
    def reads_procfs(self) -> bool:
        """True when counters come from kept-open /proc files rather than psutil."""
        return bool(self._proc)

    def prime(self) -> None:
        """Take baselines now, so the first collection reports a real interval (not 0)."""
        self.sample()

    def sample(self) -> list[Reading]:
        out: list[Reading] = []
        # the rates first, each stamped at its own read; the level (memory) last
        net = self._read("network", self._read_net)
        if net is not None and net.value is not None:
            self._net_rates(out, net.value, net.time_ns)
        cpu = self._read("cpu", self._read_cpu)
        if cpu is not None and cpu.value is not None:
            step = self._cpu.advance(cpu.time_ns, cpu.value)
            if step is not None:
                value = busy_fraction(step[0], cpu.value)
                self._add(out, names.CPU_UTILIZATION, value, None, cpu.time_ns, step[2])
        disk = self._read("disk", self._read_disk)
        if disk is not None and disk.value is not None:
            self._disk_rates(out, disk.value, disk.time_ns)
        memory = self._read("memory", self._read_memory)
        if memory is not None and memory.value is not None:
            self._add(out, names.MEMORY_AVAILABLE, memory.value, None, memory.time_ns, None)
        return out

    def close(self) -> None:
        for proc in self._proc.values():
            proc.close()
        self._proc = {}

    def _net_rates(self, out: list[Reading], net: NetCounters, now: int) -> None:
        step = self._net.advance(now, net)
        if step is None:
            return
        before, dt, start = step
        direction = names.NETWORK_DIRECTION
        sent = summed_rate(before.sent, net.sent, dt)
        recv = summed_rate(before.recv, net.recv, dt)
        self._add(out, names.NETWORK_THROUGHPUT, sent, {direction: names.TRANSMIT}, now, start)
        self._add(out, names.NETWORK_THROUGHPUT, recv, {direction: names.RECEIVE}, now, start)

    def _disk_rates(self, out: list[Reading], disk: DiskCounters, now: int) -> None:
        step = self._disk.advance(now, disk)
        if step is None:
            return
        before, dt, start = step
        read = {names.DISK_DIRECTION: names.READ}
        write = {names.DISK_DIRECTION: names.WRITE}
        for instrument, attrs, previous, current in (
            (names.DISK_IOPS, read, before.read_count, disk.read_count),
            (names.DISK_IOPS, write, before.write_count, disk.write_count),
            (names.DISK_THROUGHPUT, read, before.read_bytes, disk.read_bytes),
            (names.DISK_THROUGHPUT, write, before.write_bytes, disk.write_bytes),
        ):
            self._add(out, instrument, summed_rate(previous, current, dt), attrs, now, start)

    def _read_net(self) -> Stamped[NetCounters | None]:
        proc = self._proc.get("net")
        if proc is not None:
            raw = proc.read(self._clock)
            sent, recv = _procfs.parse_net_dev(raw.value)
            return Stamped(NetCounters(sent, recv) if sent else None, raw.time_ns)
        stamped = timed(lambda: self._ps.net_io_counters(pernic=True, nowrap=False), self._clock)
        per_nic = stamped.value
        if not per_nic:
            return Stamped(None, stamped.time_ns)
        return Stamped(
            NetCounters(
                sent={nic: c.bytes_sent for nic, c in per_nic.items()},
                recv={nic: c.bytes_recv for nic, c in per_nic.items()},
            ),
            stamped.time_ns,
        )

    def _read_cpu(self) -> Stamped[Any]:
        proc = self._proc.get("cpu")
        if proc is not None:
            raw = proc.read(self._clock)
            return Stamped(_procfs.parse_cpu_times(raw.value), raw.time_ns)
        return timed(self._ps.cpu_times, self._clock)

    def _read_memory(self) -> Stamped[float | None]:
        proc = self._proc.get("memory")
        if proc is not None:
            raw = proc.read(self._clock)
            available = _procfs.parse_meminfo_available(raw.value)
            if available is not None:
                return Stamped(available, raw.time_ns)
        stamped = timed(self._ps.virtual_memory, self._clock)
        return Stamped(float(stamped.value.available), stamped.time_ns)

    def _read_disk(self) -> Stamped[DiskCounters | None]:
        proc = self._proc.get("disk")
        if proc is not None:
            raw = proc.read(self._clock)
            per_disk = _procfs.parse_diskstats(raw.value)
            t = raw.time_ns
        else:
            stamped = timed(
                lambda: self._ps.disk_io_counters(perdisk=True, nowrap=False), self._clock
            )
            t = stamped.time_ns
            if not stamped.value:
                return Stamped(None, t)
            per_disk = {
                name: (c.read_count, c.write_count, c.read_bytes, c.write_bytes)
                for name, c in stamped.value.items()
            }
        disks = {name: c for name, c in per_disk.items() if self._is_physical_disk(name)}
        if not disks:
            self._log("disk:none", logging.INFO, "no physical disk found; disk metrics omitted")
            return Stamped(None, t)
        # (reads, writes, read bytes, written bytes) per disk -> one dict per counter
        return Stamped(DiskCounters(*({d: c[i] for d, c in disks.items()} for i in range(4))), t)

    def _read(self, what: str, read: Callable[[], Stamped[T]]) -> Stamped[T] | None:
        try:
            return read()
        except Exception as exc:
            self._log.error(
                f"host:{what}", exc, f"cannot read {what} counters", "those metrics are omitted"
            )
            return None

    @staticmethod
    def _add(
        out: list[Reading],
        instrument: names.Instrument,
        value: float | None,
        attributes: Mapping[str, AttrValue] | None,
        time_ns: int,
        start_ns: int | None,
    ) -> None:
        if value is not None:
            out.append(Reading(instrument.name, value, dict(attributes or {}), time_ns, start_ns))


_PROC_FILES = {
    "net": "/proc/net/dev",
    "cpu": "/proc/stat",
    "disk": "/proc/diskstats",
    "memory": "/proc/meminfo",
}


def _open_proc_files(open_proc: Callable[[str], _procfs.ProcFile]) -> dict[str, _procfs.ProcFile]:
    """Every host /proc file that opens; a missing one is read through psutil instead."""
    opened: dict[str, _procfs.ProcFile] = {}
    for key, path in _PROC_FILES.items():
        try:
            opened[key] = open_proc(path)
        except OSError:
            continue
    return opened
