"""The /proc fast path reads what psutil reads, with one system call per file."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from otelprof.system import _procfs
from otelprof.system.host import HostSampler
from otelprof.system.process import ProcessSampler


def test_a_file_bigger_than_the_buffer_is_read_whole_in_one_larger_read() -> None:
    proc = _procfs.ProcFile("/proc/self/status", size=16)
    try:
        content = proc.read(time.monotonic_ns).value
    finally:
        proc.close()
    assert content.startswith(b"Name:") and content.endswith(b"\n")
    assert b"VmRSS:" in content


def test_a_read_is_stamped_inside_the_clock_readings_around_it() -> None:
    proc = _procfs.ProcFile("/proc/stat")
    try:
        before = time.monotonic_ns()
        stamped = proc.read(time.monotonic_ns)
        after = time.monotonic_ns()
    finally:
        proc.close()
    assert before <= stamped.time_ns - stamped.width_ns // 2
    assert stamped.time_ns + stamped.width_ns // 2 <= after
    assert stamped.value.startswith(b"cpu ")


def test_a_file_slow_to_read_is_not_read_three_times_each_time() -> None:
    """A read interrupted by a thread switch is made again; one that is merely slow (a
    host with thousands of interfaces) is, at most, the first time."""
    calls = [0]

    def slow_kernel(fd: int, address: int, count: int, offset: int) -> int:
        calls[0] += 1
        end = time.monotonic_ns() + 400_000  # 0.4 ms a call, more than TIGHT_NS
        while time.monotonic_ns() < end:
            pass
        return 0  # an empty file

    proc = _procfs.ProcFile("/proc/stat", pread=slow_kernel)
    try:
        for _ in range(10):
            proc.read(time.monotonic_ns)
    finally:
        proc.close()
    # 3 tries the first time, then one each (two when preempted): 12 or a few more, not 30
    assert calls[0] < 20


def test_a_file_of_one_record_per_device_is_read_past_its_first_page() -> None:
    """/proc/diskstats and /proc/net/dev give one page per read call; a host with many
    devices has more. /proc/<pid>/maps of a sleeping process with many mappings (one
    record each) is such a file, and stable."""
    many_mappings = "import mmap, time; m = [mmap.mmap(-1, 4096) for _ in range(200)]"
    child = subprocess.Popen(
        [sys.executable, "-c", f"{many_mappings}; print(flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"\n"
        path = f"/proc/{child.pid}/maps"
        with open(path, "rb") as f:
            whole = f.read()
        proc = _procfs.ProcFile(path)
        try:
            content = proc.read(time.monotonic_ns).value
        finally:
            proc.close()
    finally:
        child.kill()
        child.wait()
    assert len(whole) > 2 * os.sysconf("SC_PAGE_SIZE")  # several pages, not one call's
    assert content == whole


def test_a_closed_file_refuses_to_read() -> None:
    proc = _procfs.ProcFile("/proc/stat")
    proc.close()
    with pytest.raises(ValueError, match="closed"):
        proc.read(time.monotonic_ns)


def test_host_counters_match_psutils_accounting() -> None:
    files = {k: _procfs.ProcFile(p) for k, p in (("net", "/proc/net/dev"), ("stat", "/proc/stat"))}
    files["disk"] = _procfs.ProcFile("/proc/diskstats")
    try:
        sent, recv = _procfs.parse_net_dev(files["net"].read(time.monotonic_ns).value)
        cpu = _procfs.parse_cpu_times(files["stat"].read(time.monotonic_ns).value)
        disks = _procfs.parse_diskstats(files["disk"].read(time.monotonic_ns).value)
        nics = psutil.net_io_counters(pernic=True, nowrap=False)
        ps_cpu = psutil.cpu_times()
        ps_disks = psutil.disk_io_counters(perdisk=True, nowrap=False)
    finally:
        for proc in files.values():
            proc.close()
    assert set(sent) == set(nics)
    for nic, counters in nics.items():  # psutil read later: counters only grew
        assert 0 <= counters.bytes_sent - sent[nic] < 10**7, nic
        assert 0 <= counters.bytes_recv - recv[nic] < 10**7, nic
    assert cpu._fields == ps_cpu._fields
    for ours, theirs in zip(cpu, ps_cpu, strict=True):
        assert 0 <= theirs - ours < 1.0
    for name, (reads, writes, read_bytes, write_bytes) in disks.items():
        if name in ps_disks:
            theirs = ps_disks[name]
            assert 0 <= theirs.read_count - reads < 1000, name
            assert 0 <= theirs.write_bytes - write_bytes < 10**8, name
            assert theirs.read_bytes >= read_bytes and theirs.write_count >= writes, name


def test_memory_and_process_values_match_psutil() -> None:
    meminfo = _procfs.ProcFile("/proc/meminfo")
    stat = _procfs.ProcFile(f"/proc/{os.getpid()}/stat")
    statm = _procfs.ProcFile(f"/proc/{os.getpid()}/statm")
    try:
        available = _procfs.parse_meminfo_available(meminfo.read(time.monotonic_ns).value)
        cpu_s = _procfs.parse_process_cpu_seconds(stat.read(time.monotonic_ns).value)
        rss = _procfs.parse_statm_rss(statm.read(time.monotonic_ns).value)
        me = psutil.Process()
        times, ps_rss = me.cpu_times(), me.memory_info().rss
        ps_available = psutil.virtual_memory().available
    finally:
        for proc in (meminfo, stat, statm):
            proc.close()
    assert available == pytest.approx(ps_available, rel=0.05)
    # read later, psutil's figure is never smaller (to float rounding: 53.48 + 3.23 < 56.71)
    assert -1e-9 <= times.user + times.system - cpu_s < 0.1
    assert rss == pytest.approx(ps_rss, rel=0.05)


def test_samplers_use_the_proc_path_by_default_and_psutil_when_given_one() -> None:
    host, process = HostSampler(), ProcessSampler()
    try:
        assert host.reads_procfs and process.reads_procfs
    finally:
        host.close()
        process.close()
    assert not HostSampler(psutil).reads_procfs
    assert not ProcessSampler(psutil.Process()).reads_procfs
