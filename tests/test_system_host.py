"""Host sampler on scripted psutil counters: exact rates, wraps, vanishing devices, Δt == 0."""

from __future__ import annotations

import logging
import os
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

from otelprof.system import names
from otelprof.system._common import Reading
from otelprof.system.host import MIN_WINDOW_S, HostSampler, physical_disk_filter

CpuTimes = namedtuple("CpuTimes", "user nice system idle iowait irq softirq steal guest guest_nice")
Net = namedtuple("Net", "bytes_sent bytes_recv packets_sent packets_recv")
Disk = namedtuple("Disk", "read_count write_count read_bytes write_bytes")
Memory = namedtuple("Memory", "total available")


class ScriptedPsutil:
    """psutil's host functions returning whatever the test set last."""

    def __init__(self) -> None:
        self.cpu = CpuTimes(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        self.available = 8 * 2**30
        self.nics: dict[str, Net] = {}
        self.disks: dict[str, Disk] = {}
        self.broken: set[str] = set()

    def cpu_times(self) -> CpuTimes:
        self._fail("cpu_times")
        return self.cpu

    def virtual_memory(self) -> Memory:
        self._fail("virtual_memory")
        return Memory(16 * 2**30, self.available)

    def net_io_counters(self, pernic: bool, nowrap: bool) -> dict[str, Net]:
        assert pernic and not nowrap  # raw per-device counters, our own wrap handling
        self._fail("net_io_counters")
        return dict(self.nics)

    def disk_io_counters(self, perdisk: bool, nowrap: bool) -> dict[str, Disk]:
        assert perdisk and not nowrap
        self._fail("disk_io_counters")
        return dict(self.disks)

    def _fail(self, name: str) -> None:
        if name in self.broken:
            raise PermissionError(f"{name} denied")


def busy_idle(busy: float, idle: float) -> CpuTimes:
    return CpuTimes(busy, 0, 0, idle, 0, 0, 0, 0, 0, 0)


def values(readings: list[Reading]) -> dict[tuple[str, tuple[Any, ...]], float]:
    return {(r.name, tuple(sorted(r.attributes.values()))): r.value for r in readings}


NET_TX = (names.NETWORK_THROUGHPUT.name, ("transmit",))
NET_RX = (names.NETWORK_THROUGHPUT.name, ("receive",))
IOPS_R = (names.DISK_IOPS.name, ("read",))
IOPS_W = (names.DISK_IOPS.name, ("write",))
DISK_R = (names.DISK_THROUGHPUT.name, ("read",))
DISK_W = (names.DISK_THROUGHPUT.name, ("write",))
CPU = (names.CPU_UTILIZATION.name, ())
MEM = (names.MEMORY_AVAILABLE.name, ())


@pytest.fixture
def ps() -> ScriptedPsutil:
    fake = ScriptedPsutil()
    fake.nics = {"lo": Net(0, 0, 0, 0), "eth0": Net(1_000, 2_000, 0, 0)}
    fake.disks = {"vda": Disk(10, 20, 4096, 8192), "loop0": Disk(0, 0, 0, 0)}
    return fake


class ScriptedClock:
    """Monotonic nanoseconds the test sets; `step_s` advances it after every reading."""

    def __init__(self) -> None:
        self.t = 0.0
        self.step_s = 0.0

    def __call__(self) -> int:
        now = round(self.t * 1e9)
        self.t += self.step_s
        return now


class ScriptedHost:
    """A HostSampler whose reads are all stamped at the time the test names."""

    def __init__(self, ps: ScriptedPsutil) -> None:
        self.clock = ScriptedClock()
        self.host = HostSampler(
            ps, is_physical_disk=lambda name: not name.startswith("loop"), clock=self.clock
        )

    def prime(self, t: float) -> None:
        self.clock.t = t
        self.host.prime()

    def sample(self, t: float) -> list[Reading]:
        self.clock.t = t
        return self.host.sample()


def sampler(ps: ScriptedPsutil) -> ScriptedHost:
    return ScriptedHost(ps)


def test_each_rate_divides_by_the_time_between_its_own_two_reads(ps: ScriptedPsutil) -> None:
    """Reads stamped apart within one sample: no source borrows another's time."""
    scripted = sampler(ps)
    ps.nics = {"eth0": Net(0, 0, 0, 0)}
    ps.disks = {"vda": Disk(0, 0, 0, 0)}
    # 100 us per clock reading; each read is stamped at the middle of the two around it:
    # network at t + 50 us, CPU at t + 250 us, disk at t + 450 us, memory at t + 650 us
    scripted.clock.step_s = 0.0001
    scripted.prime(0.0)
    ps.nics = {"eth0": Net(30_000, 0, 0, 0)}
    ps.disks = {"vda": Disk(0, 0, 0, 60_000)}
    ps.cpu = busy_idle(10, 10)
    readings = scripted.sample(10.0)
    got = values(readings)
    # every source's window is 10 s long, from its own first read to its own second
    assert got[NET_TX] == pytest.approx(3_000)
    assert got[DISK_W] == pytest.approx(6_000)
    windows = {(r.name, r.start_ns, r.time_ns) for r in readings if r.start_ns is not None}
    assert (NET_TX[0], 50_000, 10 * 10**9 + 50_000) in windows
    assert (CPU[0], 250_000, 10 * 10**9 + 250_000) in windows
    assert (DISK_W[0], 450_000, 10 * 10**9 + 450_000) in windows
    memory = next(r for r in readings if r.name == MEM[0])
    assert memory.start_ns is None and memory.time_ns == 10 * 10**9 + 650_000


def test_ten_second_interval_reports_exact_averages_of_every_host_rate(
    ps: ScriptedPsutil,
) -> None:
    host = sampler(ps)
    ps.cpu = busy_idle(100, 900)
    host.prime(0.0)
    ps.cpu = busy_idle(105, 915)  # 5 busy of 20 core-seconds
    ps.nics = {"lo": Net(4_000_000, 4_000_000, 0, 0), "eth0": Net(1_000_000 + 1_000, 2_000, 0, 0)}
    ps.disks = {
        "vda": Disk(510, 1_020, 4096 + 10_000, 8192 + 200_000_000),
        "loop0": Disk(9, 9, 9, 9),
    }
    got = values(host.sample(10.0))
    assert got[CPU] == pytest.approx(0.25)
    assert got[NET_TX] == pytest.approx(500_000)  # (4e6 + 1e6) / 10 s, loopback included
    assert got[NET_RX] == pytest.approx(400_000)
    assert got[IOPS_R] == pytest.approx(50)  # loop0 not counted
    assert got[IOPS_W] == pytest.approx(100)
    assert got[DISK_R] == pytest.approx(1_000)
    assert got[DISK_W] == pytest.approx(20_000_000)
    assert got[MEM] == 8 * 2**30


def test_first_sample_after_priming_already_has_rates(ps: ScriptedPsutil) -> None:
    host = sampler(ps)
    host.prime(0.0)
    ps.cpu = busy_idle(1, 1)
    got = values(host.sample(1.0))
    assert got[CPU] == pytest.approx(0.5)  # not psutil.cpu_percent()'s fake first 0.0
    assert {NET_TX, NET_RX, IOPS_R, IOPS_W, DISK_R, DISK_W} <= set(got)


def test_unprimed_first_sample_reports_levels_but_no_rates(ps: ScriptedPsutil) -> None:
    got = values(sampler(ps).sample(0.0))
    assert set(got) == {MEM}


def test_wrapped_32_bit_nic_counter_gives_the_true_rate(ps: ScriptedPsutil) -> None:
    host = sampler(ps)
    ps.nics = {"eth0": Net(2**32 - 1_000, 0, 0, 0)}
    host.prime(0.0)
    ps.nics = {"eth0": Net(3_000, 0, 0, 0)}
    assert values(host.sample(2.0))[NET_TX] == pytest.approx(2_000)


def test_removed_nic_and_disk_drop_out_and_new_ones_start_as_baselines(
    ps: ScriptedPsutil,
) -> None:
    host = sampler(ps)
    ps.nics = {"eth0": Net(100, 100, 0, 0), "eth1": Net(10**9, 10**9, 0, 0)}
    ps.disks = {"vda": Disk(0, 0, 0, 0), "vdb": Disk(0, 0, 0, 10**9)}
    host.prime(0.0)
    ps.nics = {"eth0": Net(1_100, 100, 0, 0), "eth2": Net(10**12, 10**12, 0, 0)}
    ps.disks = {"vda": Disk(0, 4, 0, 4_000), "vdc": Disk(10**6, 10**6, 10**12, 10**12)}
    got = values(host.sample(1.0))
    assert got[NET_TX] == 1_000  # eth1 vanished, eth2 only a baseline so far
    assert got[NET_RX] == 0
    assert got[IOPS_W] == 4
    assert got[DISK_W] == 4_000
    ps.nics = {"eth0": Net(1_100, 100, 0, 0), "eth2": Net(10**12 + 500, 10**12, 0, 0)}
    ps.disks = {"vda": Disk(0, 4, 0, 4_000), "vdc": Disk(10**6, 10**6 + 1, 10**12, 10**12 + 512)}
    got = values(host.sample(2.0))
    assert got[NET_TX] == 500  # eth2 now counted
    assert got[DISK_W] == 512


def test_all_nics_gone_means_no_network_series_not_zero(ps: ScriptedPsutil) -> None:
    host = sampler(ps)
    host.prime(0.0)
    ps.nics = {"wlan9": Net(5, 5, 0, 0)}
    got = values(host.sample(1.0))
    assert NET_TX not in got and NET_RX not in got
    assert CPU not in got or got[CPU] >= 0  # other metrics unaffected
    assert DISK_W in got


def test_zero_length_interval_keeps_the_baseline_and_the_next_rate_spans_both(
    ps: ScriptedPsutil,
) -> None:
    host = sampler(ps)
    ps.nics = {"eth0": Net(0, 0, 0, 0)}
    host.prime(5.0)
    ps.nics = {"eth0": Net(1_000, 0, 0, 0)}
    got = values(host.sample(5.0))  # Δt == 0
    assert NET_TX not in got and CPU not in got and DISK_W not in got
    assert MEM in got
    got = values(host.sample(5.0 + MIN_WINDOW_S / 2))  # still too short to be a rate
    assert NET_TX not in got
    ps.nics = {"eth0": Net(4_000, 0, 0, 0)}
    got = values(host.sample(7.0))
    assert got[NET_TX] == pytest.approx(2_000)  # 4000 bytes over the 2 s since the baseline


def test_clock_stepping_back_gives_no_negative_rate(ps: ScriptedPsutil) -> None:
    host = sampler(ps)
    host.prime(10.0)
    ps.nics = {"eth0": Net(10**6, 10**6, 0, 0)}
    got = values(host.sample(9.0))
    assert all(v >= 0 for v in got.values())
    assert NET_TX not in got


def test_a_failing_psutil_call_omits_only_its_metrics_and_logs_once(
    ps: ScriptedPsutil, caplog: pytest.LogCaptureFixture
) -> None:
    host = sampler(ps)
    host.prime(0.0)
    ps.broken = {"disk_io_counters"}
    with caplog.at_level(logging.WARNING, logger="otelprof.system"):
        for t in (1.0, 2.0, 3.0):
            ps.cpu = busy_idle(t, t)
            got = values(host.sample(t))
            assert DISK_W not in got and IOPS_R not in got
            assert {CPU, MEM, NET_TX} <= set(got)
    disk_lines = [r for r in caplog.records if "disk" in r.getMessage()]
    assert len(disk_lines) == 1
    assert "PermissionError" in disk_lines[0].getMessage()


def make_sys_block(root: Path) -> Path:
    """A /sys/block look-alike: virtual devices link under devices/virtual."""
    block = root / "block"
    block.mkdir()
    for name, target in {
        "vda": "devices/pci0000:00/0000:00:02.0/virtio1/block/vda",
        "nvme0n1": "devices/pci0000:00/0000:00:04.0/nvme/nvme0/nvme0n1",
        "loop0": "devices/virtual/block/loop0",
        "zram0": "devices/virtual/block/zram0",
        "dm-0": "devices/virtual/block/dm-0",
    }.items():
        (root / target).mkdir(parents=True)
        os.symlink(root / target, block / name)
    return block


def test_disk_filter_keeps_whole_physical_disks_only(tmp_path: Path) -> None:
    is_physical = physical_disk_filter(str(make_sys_block(tmp_path)))
    assert is_physical("vda") and is_physical("nvme0n1")
    for name in ("vda1", "nvme0n1p2", "loop0", "zram0", "dm-0", "sr0"):
        assert not is_physical(name), name


def test_disk_filter_without_sysfs_falls_back_to_device_names(tmp_path: Path) -> None:
    is_physical = physical_disk_filter(str(tmp_path / "missing"))
    assert is_physical("disk0") and is_physical("sda")
    assert not is_physical("loop3") and not is_physical("ram0") and not is_physical("dm-1")


def test_this_machine_has_a_physical_disk_under_the_working_directory() -> None:
    """The real filter must see the disk the tests write to, or disk rates stay blind."""
    import psutil

    counters = psutil.disk_io_counters(perdisk=True, nowrap=False)
    is_physical = physical_disk_filter()
    assert any(is_physical(name) for name in counters), sorted(counters)
