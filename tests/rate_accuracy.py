"""otelprof's rate windows against an independent /proc reader, at the same instants.

Three processes besides the caller:
- `flow`: a steady loopback TCP flow of known rate (sender and receiver in one process);
- `worker`: the instrumented process, with N busy Python threads competing for the GIL,
  exporting host and process metrics to OTLP JSON Lines; with a file to read, its main
  thread reads it in bursts meanwhile, from the disk (page cache dropped for the file);
- `sampler`: reads /proc/net/dev, /proc/<worker>/stat and /proc/diskstats every ~2 ms in
  a separate process (no GIL shared with the worker), stamping CLOCK_MONOTONIC right
  before each read and discarding reads that took longer than 0.5 ms (preempted: time
  uncertain).

Each exported window [start_time_unix_nano, time_unix_nano] is converted to the monotonic
clock and the sampler's counters are interpolated linearly at exactly those two instants:
the reference rate covers the same interval as otelprof's, so the comparison does not
depend on when either process got the CPU. Used by tests/test_system_rate_accuracy.py and
bench/bench_rate_accuracy.py; run a role with `python -m tests.rate_accuracy ROLE ...`.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SAMPLER_PERIOD_S = 0.002
MAX_READ_NS = 500_000


# --- roles (each runs in its own process) ----------------------------------------------


def flow(rate_bytes_per_s: float) -> None:
    """Send `rate` bytes/s over loopback TCP in 1 ms chunks until stdin closes."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()

    def drain() -> None:
        while receiver.recv(1 << 20):
            pass

    threading.Thread(target=drain, daemon=True).start()
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    chunk = b"x" * int(rate_bytes_per_s / 1000)
    start = time.monotonic()
    print("flowing", flush=True)
    sent = 0
    while True:
        sender.sendall(chunk)
        sent += 1
        delay = start + sent / 1000 - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def _read_all(fd: int) -> bytes:
    """A /proc file whole: files of one record per device come one page per call."""
    parts = []
    while part := os.pread(fd, 65536, sum(map(len, parts))):
        parts.append(part)
    return b"".join(parts)


def sampler(pid: int, out: str, disks: str) -> None:
    """Sample net, process CPU and disk counters (the comma-separated `disks` summed) until
    the watched process exits; write JSON."""
    # a real-time sampler is not delayed by the machine's other work; best effort
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    watched = set(disks.split(",")) - {""}
    net = os.open("/proc/net/dev", os.O_RDONLY)
    stat = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    diskstats = os.open("/proc/diskstats", os.O_RDONLY)
    offset = time.time_ns() - time.monotonic_ns()
    rows: list[tuple[int, ...]] = []
    print("sampling", flush=True)
    while True:
        t_net = time.monotonic_ns()
        raw_net = _read_all(net)
        t_cpu = time.monotonic_ns()
        try:
            raw_stat = os.pread(stat, 4096, 0)
        except OSError:
            break  # the worker exited
        t_disk = time.monotonic_ns()
        raw_disk = _read_all(diskstats)
        done = time.monotonic_ns()
        if not raw_stat:
            break
        if max(t_cpu - t_net, t_disk - t_cpu, done - t_disk) < MAX_READ_NS:
            sent = recv = 0
            for line in raw_net.split(b"\n")[2:]:
                _, colon, rest = line.partition(b":")
                if colon:
                    fields = rest.split()
                    recv += int(fields[0])
                    sent += int(fields[8])
            after = raw_stat[raw_stat.rindex(b")") + 2 :].split()
            ticks = int(after[11]) + int(after[12])
            reads = read_bytes = 0
            for line in raw_disk.split(b"\n"):
                fields = line.split()
                if len(fields) > 5 and fields[2].decode() in watched:
                    reads += int(fields[3])
                    read_bytes += int(fields[5]) * 512
            rows.append((t_net, sent, recv, t_cpu, ticks, t_disk, reads, read_bytes))
        time.sleep(SAMPLER_PERIOD_S)
    Path(out).write_text(json.dumps({"offset_ns": offset, "rows": rows}))


BURST_S = 0.3
PAUSE_S = 0.45


def read_in_bursts(
    path: str,
    duration_s: float,
    burst_s: float = BURST_S,
    pause_s: float = PAUSE_S,
    readers: int = 4,
) -> None:
    """Read `path` from the disk for `burst_s`, pause `pause_s`, and so on, for `duration_s`:
    64 KiB reads without readahead (each its own I/O) by `readers` threads (each read
    releases the GIL, and getting it back from a busy thread takes a switch interval, so one
    reader would make few reads), the file's cached pages dropped before every pass over
    it. The bursts' edges fall anywhere in the rate windows."""
    chunk = 65536
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    size = os.fstat(fd).st_size
    lock = threading.Lock()
    position = [size]  # a first pass from the disk too
    end = time.monotonic() + duration_s
    bursting = threading.Event()

    def next_position() -> int:
        with lock:
            if position[0] + chunk > size:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                position[0] = 0
            position[0] += chunk
            return position[0] - chunk

    def read() -> None:
        while time.monotonic() < end:
            if bursting.wait(0.05):
                os.pread(fd, chunk, next_position())

    threads = [threading.Thread(target=read) for _ in range(readers)]
    for thread in threads:
        thread.start()
    try:
        while (now := time.monotonic()) < end:
            bursting.set()
            time.sleep(max(0.0, min(burst_s, end - now)))
            bursting.clear()
            time.sleep(max(0.0, min(pause_s, end - time.monotonic())))
    finally:
        bursting.clear()
        for thread in threads:
            thread.join()
        os.close(fd)


def make_file_on_disk(path: Path, size: int = 64 << 20) -> None:
    """A file for `read_in_bursts`, written through to the disk (so it can be dropped from
    the page cache: dirty pages cannot)."""
    with path.open("wb") as f:
        block = os.urandom(1 << 20)
        for _ in range(size >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def worker(
    out_dir: str, interval_s: float, duration_s: float, threads: int, mode: str, read_file: str
) -> None:
    """The instrumented process: busy threads, otelprof sampling, then a clean shutdown;
    with `read_file` (not "-"), the main thread reads that file in bursts meanwhile."""
    import otelprof
    from otelprof.system.process import usable_cpus

    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    busy = [threading.Thread(target=spin, daemon=True) for _ in range(threads)]
    for thread in busy:
        thread.start()

    def load() -> None:
        if read_file == "-":
            time.sleep(duration_s)
        else:
            read_in_bursts(read_file, duration_s)

    print("ready", flush=True)
    sys.stdin.readline()  # the sampler is running
    if mode == "profiler":
        prof = otelprof.instrument(
            output_dir=out_dir, run_id="accuracy", interval=interval_s, gpus="none", timings=False
        )
        metrics = prof.files["metrics"]
        load()
        prof.shutdown()
    else:
        metrics = _legacy_worker(Path(out_dir), interval_s, load, mode)
    stop.set()
    print(json.dumps({"metrics": str(metrics), "cpus": usable_cpus()}), flush=True)


def _legacy_worker(out_dir: Path, interval_s: float, load: Callable[[], None], mode: str) -> Path:
    """For the benchmark: psutil reads, stamped each ("psutil") or all at one instant
    taken before any of them ("shared-now", what otelprof did before issue 16)."""
    import psutil
    from opentelemetry.exporter.otlp.json.file import FileMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    from otelprof.export.counters import CountingMetricExporter, ExportCounters
    from otelprof.system import SystemMetricsSettings, register_system_metrics
    from otelprof.system._stamps import Clock

    class SharedNow(Clock):
        """Every read of one snapshot stamped with the instant the snapshot began."""

        # host: net, cpu, disk, memory; process: cpu, memory; each read between two readings
        readings_per_sample = 12
        frozen: int | None = None
        left = 0

        def __call__(self) -> int:
            if self.left > 0 and self.frozen is not None:
                self.left -= 1
                return self.frozen
            return super().__call__()

        def resync(self) -> None:
            super().resync()
            self.frozen, self.left = super().__call__(), self.readings_per_sample

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "metrics.jsonl"
    exporter = CountingMetricExporter("files", FileMetricExporter(path), ExportCounters())
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval_s * 1000)
    provider = MeterProvider(metric_readers=[reader])
    clock = SharedNow() if mode == "shared-now" else Clock()
    handle = register_system_metrics(
        provider.get_meter("bench"),
        SystemMetricsSettings(interval_s=interval_s, gpus="none", torch_cuda_memory=False),
        psutil_module=psutil,
        clock=clock,
    )
    load()
    handle.final_sample()
    provider.shutdown()
    handle.close()
    return path


# --- the comparison (in the caller) ----------------------------------------------------


@dataclass
class Window:
    metric: str
    start_ns: int
    end_ns: int
    otelprof: float
    reference: float
    detail: str = ""
    final: bool = False  # the collection at shutdown

    @property
    def error(self) -> float:
        return abs(self.otelprof - self.reference) / self.reference if self.reference else 0.0


@dataclass
class Comparison:
    windows: list[Window]
    cpus: int
    sampler_rows: int

    def worst(self, metric: str) -> Window:
        return max((w for w in self.windows if w.metric == metric), key=lambda w: w.error)

    def of(self, metric: str) -> list[Window]:
        return [w for w in self.windows if w.metric == metric]


class _Series:
    def __init__(self, times: list[int], values: list[int]) -> None:
        self.times, self.values = times, values

    def at(self, t: int) -> float:
        i = bisect.bisect_right(self.times, t)
        if i == 0 or i == len(self.times):
            raise ValueError("instant outside the sampler's coverage")
        t0, t1 = self.times[i - 1], self.times[i]
        v0, v1 = self.values[i - 1], self.values[i]
        return v0 + (v1 - v0) * (t - t0) / (t1 - t0)

    def ticks_near(self, t: int) -> tuple[int, int]:
        """Counter values just before and just after `t` (its step there, if any)."""
        i = bisect.bisect_right(self.times, t)
        return self.values[i - 1], self.values[i]


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.rate_accuracy", *args],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _expect(proc: subprocess.Popen[str], word: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != word:
        proc.kill()
        raise RuntimeError(f"{proc.args!r} said {line!r}, expected {word!r}")


def compare(
    out_dir: Path,
    *,
    busy_threads: int,
    interval_s: float = 1.0,
    duration_s: float = 6.7,
    flow_bytes_per_s: float = 40e6,
    mode: str = "profiler",
    read_file: Path | None = None,
) -> Comparison:
    """Run flow + worker + sampler; every exported window beside the reference's."""
    from otelprof.system.host import physical_disk_filter

    out_dir.mkdir(parents=True, exist_ok=True)
    is_physical = physical_disk_filter()
    with open("/proc/diskstats", "rb") as f:
        disks = [line.split()[2].decode() for line in f if len(line.split()) > 2]
    watched = ",".join(d for d in disks if is_physical(d))
    flow_proc = _spawn("flow", str(flow_bytes_per_s))
    procs = [flow_proc]
    try:
        _expect(flow_proc, "flowing")
        work = _spawn(
            "worker",
            str(out_dir),
            str(interval_s),
            str(duration_s),
            str(busy_threads),
            mode,
            str(read_file or "-"),
        )
        procs.append(work)
        _expect(work, "ready")
        reference_file = out_dir / "reference.json"
        sample = _spawn("sampler", str(work.pid), str(reference_file), watched)
        procs.append(sample)
        _expect(sample, "sampling")
        assert work.stdin is not None and work.stdout is not None
        work.stdin.write("go\n")
        work.stdin.flush()
        result = json.loads(work.stdout.readline())
        work.wait(timeout=60)
        sample.wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                if proc.stdin is not None:
                    proc.stdin.close()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    reference = json.loads(reference_file.read_text())
    return _windows(Path(result["metrics"]), reference, int(result["cpus"]))


def _windows(metrics: Path, reference: dict[str, Any], cpus: int) -> Comparison:
    from tests.otlp_files import read_points

    offset = int(reference["offset_ns"])
    rows = reference["rows"]
    net_times = [r[0] for r in rows]
    sent = _Series(net_times, [r[1] for r in rows])
    recv = _Series(net_times, [r[2] for r in rows])
    cpu = _Series([r[3] for r in rows], [r[4] for r in rows])
    disk_times = [r[5] for r in rows]
    disk_reads = _Series(disk_times, [r[6] for r in rows])
    disk_read_bytes = _Series(disk_times, [r[7] for r in rows])
    windows: list[Window] = []
    points = list(read_points(metrics))
    last_end = {point.name: point.time_ns for point in points}
    for point in points:
        if point.name == "system.network.throughput":
            series = sent if point.attributes["network.io.direction"] == "transmit" else recv
            metric = f"network.{point.attributes['network.io.direction']}"
        elif point.name == "process.cpu.utilization":
            series, metric = cpu, "process.cpu"
        elif point.name == "system.disk.iops" and point.attributes["disk.io.direction"] == "read":
            series, metric = disk_reads, "disk.read_ops"
        elif (
            point.name == "system.disk.throughput"
            and point.attributes["disk.io.direction"] == "read"
        ):
            series, metric = disk_read_bytes, "disk.read_bytes"
        else:
            continue
        if point.start_ns is None:
            raise AssertionError(f"{point.name} point without a start time")
        start, end = point.start_ns - offset, point.time_ns - offset
        dt = (end - start) / 1e9
        delta = series.at(end) - series.at(start)
        if metric == "process.cpu":
            ref = delta / CLOCK_TICKS / (dt * cpus)
            detail = f"{delta:.1f} ticks"
        elif metric == "disk.read_ops":
            ref = delta / dt
            detail = f"{delta:.1f} reads"
        else:
            ref = delta / dt
            detail = f"{delta / 1e6:.1f} MB"
        final = point.time_ns == last_end[point.name]
        windows.append(Window(metric, start, end, point.value, ref, detail, final))
    return Comparison(windows, cpus, len(rows))


if __name__ == "__main__":
    role, *arguments = sys.argv[1:]
    if role == "flow":
        flow(float(arguments[0]))
    elif role == "sampler":
        sampler(int(arguments[0]), arguments[1], arguments[2])
    elif role == "worker":
        worker(
            arguments[0],
            float(arguments[1]),
            float(arguments[2]),
            int(arguments[3]),
            arguments[4],
            arguments[5],
        )
    else:
        raise SystemExit(f"unknown role {role!r}")
