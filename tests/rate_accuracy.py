"""otelprof's rate windows against an independent /proc reader, at the same instants.

Three processes besides the caller:
- `flow`: a steady loopback TCP flow of known rate (sender and receiver in one process);
- `worker`: the instrumented process, with N busy Python threads competing for the GIL,
  exporting host and process metrics to OTLP JSON Lines;
- `sampler`: reads /proc/net/dev and /proc/<worker>/stat every ~2 ms in a separate
  process (no GIL shared with the worker), stamping CLOCK_MONOTONIC right before each
  read and discarding reads that took longer than 0.5 ms (preempted: time uncertain).

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


def sampler(pid: int, out: str) -> None:
    """Sample net + process CPU counters until the watched process exits; write JSON."""
    # a real-time sampler is not delayed by the machine's other work; best effort
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    net = os.open("/proc/net/dev", os.O_RDONLY)
    stat = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    offset = time.time_ns() - time.monotonic_ns()
    rows: list[tuple[int, int, int, int, int]] = []
    print("sampling", flush=True)
    while True:
        t_net = time.monotonic_ns()
        raw_net = os.pread(net, 65536, 0)
        t_cpu = time.monotonic_ns()
        try:
            raw_stat = os.pread(stat, 4096, 0)
        except OSError:
            break  # the worker exited
        done = time.monotonic_ns()
        if not raw_stat:
            break
        if t_cpu - t_net < MAX_READ_NS and done - t_cpu < MAX_READ_NS:
            sent = recv = 0
            for line in raw_net.split(b"\n")[2:]:
                _, colon, rest = line.partition(b":")
                if colon:
                    fields = rest.split()
                    recv += int(fields[0])
                    sent += int(fields[8])
            after = raw_stat[raw_stat.rindex(b")") + 2 :].split()
            ticks = int(after[11]) + int(after[12])
            rows.append((t_net, sent, recv, t_cpu, ticks))
        time.sleep(SAMPLER_PERIOD_S)
    Path(out).write_text(json.dumps({"offset_ns": offset, "rows": rows}))


def worker(out_dir: str, interval_s: float, duration_s: float, threads: int, mode: str) -> None:
    """The instrumented process: busy threads, otelprof sampling, then a clean shutdown."""
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
    print("ready", flush=True)
    sys.stdin.readline()  # the sampler is running
    if mode == "profiler":
        prof = otelprof.instrument(
            output_dir=out_dir, run_id="accuracy", interval=interval_s, gpus="none", timings=False
        )
        metrics = prof.files["metrics"]
        time.sleep(duration_s)
        prof.shutdown()
    else:
        metrics = _legacy_worker(Path(out_dir), interval_s, duration_s, mode)
    stop.set()
    print(json.dumps({"metrics": str(metrics), "cpus": usable_cpus()}), flush=True)


def _legacy_worker(out_dir: Path, interval_s: float, duration_s: float, mode: str) -> Path:
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

        reads_per_sample = 6  # host: net, cpu, disk, memory; process: cpu, memory
        frozen: int | None = None
        left = 0

        def __call__(self) -> int:
            if self.left > 0 and self.frozen is not None:
                self.left -= 1
                return self.frozen
            return super().__call__()

        def resync(self) -> None:
            super().resync()
            self.frozen, self.left = super().__call__(), self.reads_per_sample

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
    time.sleep(duration_s)
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
) -> Comparison:
    """Run flow + worker + sampler; every exported window beside the reference's."""
    out_dir.mkdir(parents=True, exist_ok=True)
    flow_proc = _spawn("flow", str(flow_bytes_per_s))
    procs = [flow_proc]
    try:
        _expect(flow_proc, "flowing")
        work = _spawn(
            "worker", str(out_dir), str(interval_s), str(duration_s), str(busy_threads), mode
        )
        procs.append(work)
        _expect(work, "ready")
        reference_file = out_dir / "reference.json"
        sample = _spawn("sampler", str(work.pid), str(reference_file))
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
    windows: list[Window] = []
    for point in read_points(metrics):
        if point.name == "system.network.throughput":
            series = sent if point.attributes["network.io.direction"] == "transmit" else recv
            metric = f"network.{point.attributes['network.io.direction']}"
        elif point.name == "process.cpu.utilization":
            series, metric = cpu, "process.cpu"
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
        else:
            ref = delta / dt
            detail = f"{delta / 1e6:.1f} MB"
        windows.append(Window(metric, start, end, point.value, ref, detail))
    return Comparison(windows, cpus, len(rows))


if __name__ == "__main__":
    role, *arguments = sys.argv[1:]
    if role == "flow":
        flow(float(arguments[0]))
    elif role == "sampler":
        sampler(int(arguments[0]), arguments[1])
    elif role == "worker":
        worker(
            arguments[0],
            float(arguments[1]),
            float(arguments[2]),
            int(arguments[3]),
            arguments[4],
        )
    else:
        raise SystemExit(f"unknown role {role!r}")
