"""Real runs in detached mode, read back from the OTLP JSON Lines files by the tests' reader.

Known work is done while otelprof runs (an fsync'd 200 MB file, 100 MB over loopback) and
the rates in the file, integrated over time, must account for it. The kernel's own
counters, read here without psutil, bound the result from above: other activity on the
machine can only add to both.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import otelprof
from tests.otlp_files import Point, read_lines, read_points

INTERVAL_S = 0.5
MB = 10**6


@pytest.fixture(autouse=True)
def _no_profiler_left_running() -> Iterator[None]:
    yield
    otelprof.uninstrument()


def run_detached(tmp_path: Path, work: Callable[[], None]) -> tuple[list[Point], float, float]:
    """Run `work` under otelprof; return the points and the wall-clock span of `work`."""
    prof = otelprof.instrument(output_dir=tmp_path, interval=INTERVAL_S, timings=False)
    try:
        time.sleep(2.5 * INTERVAL_S)  # a baseline and a first full interval before the work
        start = time.time()
        work()
        end = time.time()
        time.sleep(2.5 * INTERVAL_S)  # let a sample after the work be exported
    finally:
        prof.shutdown()
    assert prof.run_dir is not None
    metrics = prof.run_dir / "metrics.jsonl"
    assert read_lines(metrics), "no metrics written"
    return read_points(metrics), start, end


def series(points: list[Point], name: str, **attributes: str) -> list[Point]:
    chosen = [
        p
        for p in points
        if p.name == name and all(p.attributes.get(k) == v for k, v in attributes.items())
    ]
    return sorted(chosen, key=lambda p: p.time_ns)


def integrate(rates: list[Point], start: float | None = None, end: float | None = None) -> float:
    """Σ rate_k × (t_k − t_{k−1}): the amount a rate series accounts for.

    With `start`/`end`, only the intervals that overlap [start, end] are summed.
    """
    total = 0.0
    for before, after in itertools.pairwise(rates):
        t0, t1 = before.time_ns / 1e9, after.time_ns / 1e9
        if start is not None and end is not None and (t1 < start or t0 > end):
            continue
        total += after.value * (t1 - t0)
    return total


def kernel_disk_bytes_written() -> int:
    """Bytes written to every whole block device, straight from /proc/diskstats."""
    total = 0
    for line in Path("/proc/diskstats").read_text().splitlines():
        fields = line.split()
        name = fields[2]
        if Path(f"/sys/class/block/{name}/partition").exists():
            continue
        total += int(fields[9]) * 512  # sectors written; always 512-byte units
    return total


def kernel_network_bytes() -> tuple[int, int]:
    """(transmitted, received) bytes over all interfaces, from /proc/net/dev."""
    tx = rx = 0
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        _, counters = line.split(":", 1)
        fields = counters.split()
        rx += int(fields[0])
        tx += int(fields[8])
    return tx, rx


def test_every_host_metric_is_present_with_plausible_values(tmp_path: Path) -> None:
    points, _, _ = run_detached(tmp_path, lambda: time.sleep(INTERVAL_S))
    by_name: dict[str, list[Point]] = defaultdict(list)
    for p in points:
        by_name[p.name].append(p)
    for name in (
        "system.cpu.utilization",
        "system.memory.linux.available",
        "system.network.throughput",
        "system.disk.iops",
        "system.disk.throughput",
        "process.cpu.utilization",
        "process.memory.usage",
    ):
        assert len(by_name[name]) >= 3, f"{name}: {len(by_name[name])} points"
    assert all(0 <= p.value <= 1 for p in by_name["system.cpu.utilization"])
    assert all(0 <= p.value <= 1 for p in by_name["process.cpu.utilization"])
    assert any(p.value > 0 for p in by_name["system.cpu.utilization"])
    mem_total = int(Path("/proc/meminfo").read_text().split()[1]) * 1024  # MemTotal kB
    assert all(0 < p.value <= mem_total for p in by_name["system.memory.linux.available"])
    assert all(p.unit == "By" for p in by_name["system.memory.linux.available"])
    rss = by_name["process.memory.usage"]
    assert all(10 * MB < p.value < mem_total for p in rss)  # a Python process with the SDK
    for name, key, values in (
        ("system.network.throughput", "network.io.direction", {"transmit", "receive"}),
        ("system.disk.iops", "disk.io.direction", {"read", "write"}),
        ("system.disk.throughput", "disk.io.direction", {"read", "write"}),
    ):
        assert {p.attributes[key] for p in by_name[name]} == values, name
        assert all(p.value >= 0 for p in by_name[name]), name
        assert all(set(p.attributes) == {key} for p in by_name[name]), name
    gpu_points = [p for p in points if p.name.startswith("hw.")]
    assert gpu_points == [] or all("hw.id" in p.attributes for p in gpu_points)


def test_writing_200_mb_with_fsync_shows_up_in_disk_write_throughput(tmp_path: Path) -> None:
    size = 200 * MB
    chunk = os.urandom(MB)
    target = tmp_path / "written.bin"

    def write_and_fsync() -> None:
        with open(target, "wb") as f:
            for _ in range(size // MB):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())

    kernel_before = kernel_disk_bytes_written()
    points, start, end = run_detached(tmp_path, write_and_fsync)
    kernel_total = kernel_disk_bytes_written() - kernel_before
    target.unlink()

    writes = series(points, "system.disk.throughput", **{"disk.io.direction": "write"})
    assert len(writes) >= 4
    in_window = integrate(writes, start, end)
    assert in_window >= 0.9 * size, (
        f"disk write rates account for {in_window / MB:.0f} MB around a {size / MB:.0f} MB "
        "fsync'd write"
    )
    # never more than the kernel saw over the whole run (no double counting of partitions)
    assert integrate(writes) <= 1.1 * kernel_total + MB
    iops = series(points, "system.disk.iops", **{"disk.io.direction": "write"})
    assert integrate(iops, start, end) > 0


def test_sending_100_mb_over_loopback_shows_up_in_network_throughput(tmp_path: Path) -> None:
    size = 100 * MB
    received = [0]

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def sink() -> None:
            conn, _ = server.accept()
            with conn:
                while data := conn.recv(1 << 20):
                    received[0] += len(data)

        def send() -> None:
            thread = threading.Thread(target=sink, daemon=True)
            thread.start()
            chunk = b"\0" * MB
            with socket.create_connection(("127.0.0.1", port)) as client:
                for _ in range(size // MB):
                    client.sendall(chunk)
            thread.join(timeout=30)

        tx_before, rx_before = kernel_network_bytes()
        points, start, end = run_detached(tmp_path, send)
        tx_after, rx_after = kernel_network_bytes()
    assert received[0] == size

    for direction, kernel_total in (
        ("transmit", tx_after - tx_before),
        ("receive", rx_after - rx_before),
    ):
        rates = series(points, "system.network.throughput", **{"network.io.direction": direction})
        assert len(rates) >= 4
        in_window = integrate(rates, start, end)
        assert in_window >= 0.95 * size, (
            f"{direction}: rates account for {in_window / MB:.1f} MB around a "
            f"{size / MB:.0f} MB loopback transfer"
        )
        assert integrate(rates) <= 1.1 * kernel_total + MB, direction
