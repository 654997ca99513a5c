"""Linux /proc counters read on files kept open, with the GIL held, stamped tightly.

psutil's open/read/close each release the GIL and wait to get it back, so a read lands
far from any stamp around it. Here each file is opened once and re-read from offset 0 with
`pread` through `ctypes.PyDLL`, which keeps the GIL for the microseconds a /proc read takes.
A file is read until pread returns 0, not until a short read: /proc/diskstats and
/proc/net/dev return one page per call, and a host with many devices (a Kubernetes node's
veths) would otherwise lose those past the first page. The parsers keep psutil's fields
and units, so values do not change when this path replaces psutil's.
"""

from __future__ import annotations

import ctypes
import os
from collections import namedtuple
from collections.abc import Callable

from ._stamps import TIGHT_NS, Stamped, timed

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_SECTOR_SIZE = 512  # /proc/diskstats counts 512-byte sectors whatever the device's size

CpuTimes = namedtuple("CpuTimes", "user nice system idle iowait irq softirq steal guest guest_nice")
"""Same fields and units (seconds) as `psutil.cpu_times()` on Linux."""


Pread = Callable[[int, int, int, int], int]
"""pread(fd, buffer address, count, offset) -> bytes read, or -1 with errno set (libc's)."""


def _libc_pread() -> Pread | None:
    """libc's pread called with the GIL held (PyDLL), or None where that is unavailable."""
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        pread = libc.pread
    except (OSError, AttributeError):
        return None
    pread.restype = ctypes.c_ssize_t
    pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    return pread


_PREAD = _libc_pread()


class ProcFile:
    """One /proc file kept open and re-read whole, with the GIL held, per reading.

    `pread` replaces libc's (tests: a stand-in kernel). Without libc through ctypes it
    raises OSError, and the samplers read that source through psutil instead.
    """

    def __init__(self, path: str, size: int = 16384, pread: Pread | None = None) -> None:
        read = pread or _PREAD
        if read is None:
            raise OSError(f"no libc pread to read {path} with")
        self.path = path
        self._pread = read
        self._fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._buffer = ctypes.create_string_buffer(size)
        self._fastest_ns: int | None = None  # the narrowest bracket of a read so far

    def read(self, clock: Callable[[], int]) -> Stamped[bytes]:
        """The file's content, stamped at the middle of the clock readings around it.

        A file that takes long to read (thousands of interfaces) is not read again for
        that alone: a bracket counts as interrupted past twice the narrowest one seen.
        """
        fastest = self._fastest_ns
        tight = TIGHT_NS if fastest is None else max(TIGHT_NS, 2 * fastest)
        stamped = timed(self._read_whole, clock, tight)
        if fastest is None or stamped.width_ns < fastest:
            self._fastest_ns = stamped.width_ns
        return stamped

    def _read_whole(self) -> bytes:
        fd = self._fd
        if fd is None:
            raise ValueError(f"{self.path} is closed")
        while True:
            buffer = self._buffer
            size = len(buffer)
            base = ctypes.addressof(buffer)
            got = 0
            while got < size:
                n = self._pread(fd, base + got, size - got, got)
                if n < 0:
                    error = ctypes.get_errno()
                    raise OSError(error, os.strerror(error), self.path)
                if n == 0:
                    return ctypes.string_at(base, got)
                got += n
            # did not fit: read it all again into a larger buffer
            self._buffer = ctypes.create_string_buffer(size * 4)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def parse_cpu_times(stat: bytes) -> CpuTimes:
    """The aggregate `cpu` line of /proc/stat, in seconds."""
    line = stat.split(b"\n", 1)[0]
    fields = line.split()
    if not fields or fields[0] != b"cpu":
        raise ValueError("/proc/stat does not start with the cpu line")
    values = [int(v) / _CLOCK_TICKS for v in fields[1:11]]
    values += [0.0] * (10 - len(values))
    return CpuTimes(*values)


def parse_net_dev(content: bytes) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes sent, bytes received) per interface from /proc/net/dev."""
    sent: dict[str, int] = {}
    recv: dict[str, int] = {}
    for line in content.split(b"\n")[2:]:
        name, colon, rest = line.partition(b":")
        if not colon:
            continue
        fields = rest.split()
        nic = name.strip().decode()
        recv[nic] = int(fields[0])
        sent[nic] = int(fields[8])
    return sent, recv


def parse_diskstats(content: bytes) -> dict[str, tuple[int, int, int, int]]:
    """(reads, writes, read bytes, written bytes) per device from /proc/diskstats."""
    out: dict[str, tuple[int, int, int, int]] = {}
    for line in content.split(b"\n"):
        fields = line.split()
        if len(fields) < 10:
            continue
        out[fields[2].decode()] = (
            int(fields[3]),
            int(fields[7]),
            int(fields[5]) * _SECTOR_SIZE,
            int(fields[9]) * _SECTOR_SIZE,
        )
    return out


def parse_meminfo_available(content: bytes) -> float | None:
    """MemAvailable in bytes (None on kernels before 3.14, which lack it)."""
    for line in content.split(b"\n"):
        if line.startswith(b"MemAvailable:"):
            return float(int(line.split()[1]) * 1024)
    return None


def parse_process_cpu_seconds(stat: bytes) -> float:
    """utime + stime of /proc/<pid>/stat in seconds (the whole process, every thread)."""
    after_name = stat[stat.rindex(b")") + 2 :].split()
    return (int(after_name[11]) + int(after_name[12])) / _CLOCK_TICKS


def parse_statm_rss(statm: bytes) -> float:
    """Resident set size in bytes from /proc/<pid>/statm (what psutil reports as rss)."""
    return float(int(statm.split()[1]) * _PAGE_SIZE)
