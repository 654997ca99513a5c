"""Linux /proc counters read with one system call each on files kept open.

psutil opens, reads and closes a file per call; each of those system calls releases the
GIL and waits to get it back, so with busy Python threads a read can land many
milliseconds after any timestamp taken around it. Here every file is opened once and
re-read with a single `os.pread(fd, size, 0)` (seq_file-backed /proc files regenerate
their content at offset 0), and the clock is stamped right before that call, so the
stamp and the kernel's snapshot are microseconds apart however busy the process is.

The pread goes through `ctypes.PyDLL`, which keeps the GIL during the call: a /proc read
takes microseconds, so holding the lock costs the training threads nothing noticeable,
while releasing it (what `os.pread` does) means waiting to get it back, up to
milliseconds per read behind busy threads. A whole sample then runs in one stretch and
stays prompt (bench/bench_rate_accuracy.py measures both). Where ctypes cannot find libc's
pread, `os.pread` is used: still exact stamps, only less prompt.

The parsers reproduce psutil's accounting (same fields, same units), so values do not
change when this path replaces psutil's.
"""

from __future__ import annotations

import ctypes
import os
from collections import namedtuple
from collections.abc import Callable

from ._stamps import Stamped

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_SECTOR_SIZE = 512  # /proc/diskstats counts 512-byte sectors whatever the device's size

CpuTimes = namedtuple("CpuTimes", "user nice system idle iowait irq softirq steal guest guest_nice")
"""Same fields and units (seconds) as `psutil.cpu_times()` on Linux."""


def _libc_pread() -> Callable[..., int] | None:
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
    """One /proc file kept open and re-read whole with a single pread per reading."""

    def __init__(self, path: str, size: int = 16384, hold_gil: bool = True) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._pread = _PREAD if hold_gil else None
        self._buffer = ctypes.create_string_buffer(size)

    def read(self, clock: Callable[[], int]) -> Stamped[bytes]:
        """The file's content, stamped right before the system call that produced it."""
        fd = self._fd
        if fd is None:
            raise ValueError(f"{self.path} is closed")
        while True:
            size = len(self._buffer)
            pread = self._pread
            if pread is not None:
                t = clock()
                n = pread(fd, self._buffer, size, 0)
                if n < 0:
                    error = ctypes.get_errno()
                    raise OSError(error, os.strerror(error), self.path)
                data = self._buffer.raw[:n]
            else:
                t = clock()
                data = os.pread(fd, size, 0)
            if len(data) < size:
                return Stamped(data, t)
            # did not fit: one larger read, so the content stays one consistent snapshot
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
