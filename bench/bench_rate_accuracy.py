"""Rate accuracy and sampling promptness while the instrumented process is busy.

1. Window accuracy (tests/rate_accuracy.py): a 40 MB/s loopback flow in one process, the
   instrumented process with 0 or 4 busy Python threads, and a /proc sampler process
   every ~2 ms. Every exported network-throughput and process-CPU window is compared with
   the reference interpolated at the window's own start and end. Three ways of sampling:
   - otelprof: the shipped path (otelprof.instrument, /proc files kept open, each read
     stamped right before its pread);
   - psutil, each read stamped: psutil's open/read/close per call, stamped before it;
   - psutil, shared now: every read of a snapshot stamped with one instant taken before
     the first read (otelprof before issue 16).
2. Promptness, in process: how long after a snapshot begins each source has been read
   (the last read's stamp minus the start) and the whole sample's wall time, for the
   /proc and psutil paths, with 0 and 4 busy threads.
3. Read times (issue 49), in process with one busy thread: each stamp against the
   kernel's own time of the read (/proc/timer_list opens with `now at <CLOCK_MONOTONIC>`,
   written as the read runs; root only), stamped as before (clock, then pread) and as
   shipped (`_stamps.timed`); and the brackets of /proc/diskstats reads.
4. Disk windows: the window comparison of 1 with the worker's threads reading a file
   from the disk in bursts (its page cache dropped) beside one busy thread; read IOPS and
   read bytes/s against /proc/diskstats. The file goes in --disk-dir (on a disk).

    .venv/bin/python bench/bench_rate_accuracy.py              # ~4 min
    .venv/bin/python bench/bench_rate_accuracy.py --quick      # fewer runs
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from _machine import cpu_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from otelprof.system._procfs import ProcFile  # noqa: E402
from otelprof.system._stamps import TIGHT_NS, Clock, Stamped  # noqa: E402
from otelprof.system.host import HostSampler  # noqa: E402
from otelprof.system.process import ProcessSampler  # noqa: E402
from tests.rate_accuracy import compare, make_file_on_disk  # noqa: E402

MODES = {
    "profiler": "otelprof (/proc, stamped)",
    "psutil": "psutil, each stamped",
    "shared-now": "psutil, shared now",
}


def accuracy(runs: int) -> None:
    print("per-window error vs /proc at the same instants (worst over all windows and runs)")
    print(f"{'sampling':<28} {'busy':>4} {'windows':>7} {'network':>8} {'proc CPU':>8}")
    for mode, label in MODES.items():
        for threads in (0, 4):
            worst_net = worst_cpu = 0.0
            count = 0
            for _ in range(runs):
                with tempfile.TemporaryDirectory() as tmp:
                    result = compare(Path(tmp), busy_threads=threads, mode=mode)
                net = result.of("network.transmit") + result.of("network.receive")
                cpu = [w for w in result.of("process.cpu") if threads == 0 or w.reference > 0]
                count += len(result.of("network.transmit"))
                worst_net = max([worst_net, *(w.error for w in net)])
                if threads:  # an idle process has no CPU share to be relatively wrong about
                    worst_cpu = max([worst_cpu, *(w.error for w in cpu)])
            cpu_text = f"{worst_cpu:.2%}" if threads else "idle"
            print(f"{label:<28} {threads:>4} {count:>7} {worst_net:>8.2%} {cpu_text:>8}")


def spin(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def promptness(samples: int) -> None:
    import psutil

    print()
    print("one host + process sample: last read's stamp after the start / whole sample (ms)")
    print(
        f"{'path':<8} {'busy':>4} {'last read p50':>13} {'p90':>7} {'max':>7} "
        f"{'sample p50':>10} {'p90':>7} {'max':>7}"
    )
    for path in ("procfs", "psutil"):
        for threads in (0, 4):
            ps = None if path == "procfs" else psutil
            host = HostSampler(ps)
            process = ProcessSampler(None if ps is None else psutil.Process())
            assert host.reads_procfs == (path == "procfs")
            stop = threading.Event()
            busy = [threading.Thread(target=spin, args=(stop,)) for _ in range(threads)]
            for thread in busy:
                thread.start()
            last_read, whole = [], []
            try:
                for _ in range(samples):
                    time.sleep(0.06)
                    start = time.monotonic_ns()
                    readings = host.sample() + process.sample()
                    done = time.monotonic_ns()
                    stamps = [r.time_ns for r in readings if r.time_ns is not None]
                    if stamps:
                        last_read.append((max(stamps) - start) / 1e6)
                    whole.append((done - start) / 1e6)
            finally:
                stop.set()
                for thread in busy:
                    thread.join()
                host.close()
                process.close()
            print(
                f"{path:<8} {threads:>4} {statistics.median(last_read):>13.2f} "
                f"{p90(last_read):>7.2f} {max(last_read):>7.2f} "
                f"{statistics.median(whole):>10.2f} {p90(whole):>7.2f} {max(whole):>7.2f}"
            )


def _libc_pread() -> Callable[[int, int, int, int], int]:
    pread = ctypes.PyDLL(None, use_errno=True).pread
    pread.restype = ctypes.c_ssize_t
    pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    return pread  # type: ignore[no-any-return]


def _summary(values_ns: list[int]) -> str:
    ordered = sorted(abs(v) for v in values_ns)
    p99 = ordered[int(len(ordered) * 0.99)]
    over = sum(v > 1_000_000 for v in ordered)
    return (
        f"p50 {statistics.median(ordered) / 1e3:7.1f} us  p99 {p99 / 1e3:7.1f} us  "
        f"max {ordered[-1] / 1e6:6.2f} ms  >1 ms: {over}"
    )


def read_times(reads: int) -> None:
    """Stamp minus the kernel's time of the read, before and now; diskstats brackets."""
    print()
    print(f"read times, one busy thread, {reads} reads each (|stamp - kernel's read time|)")
    pread = _libc_pread()
    clock = Clock()
    stop = threading.Event()
    busy = threading.Thread(target=spin, args=(stop,))
    busy.start()
    try:
        if os.access("/proc/timer_list", os.R_OK):
            # the first page only: "now at" is in it, and that is one pread like diskstats'
            def first_page(fd: int, address: int, count: int, offset: int) -> int:
                return pread(fd, address, min(count, 4096), 0) if offset == 0 else 0

            timer_list = ProcFile("/proc/timer_list", pread=first_page)
            fd = os.open("/proc/timer_list", os.O_RDONLY)
            buffer = ctypes.create_string_buffer(4096)
            before: list[int] = []
            now: list[int] = []
            for _ in range(reads):
                t = clock()  # as before issue 49: the clock, then the read
                n = pread(fd, buffer, 4096, 0)
                before.append(t - _now_at(buffer.raw[:n]))
                stamped = timer_list.read(clock)
                now.append(stamped.time_ns - _now_at(stamped.value))
            os.close(fd)
            timer_list.close()
            print(f"  clock, then pread (before)   {_summary(before)}")
            print(f"  bracket midpoint (shipped)   {_summary(now)}")
        else:
            print("  /proc/timer_list is not readable (root only): stamp errors not measured")
        calls = [0]

        def counted(fd: int, address: int, count: int, offset: int) -> int:
            calls[0] += 1
            return pread(fd, address, count, offset)

        diskstats = ProcFile("/proc/diskstats", pread=counted)
        stamped_reads: list[Stamped[bytes]] = [diskstats.read(clock) for _ in range(reads)]
        diskstats.close()
        widths = [s.width_ns for s in stamped_reads]
        per_read = calls[0] / reads
        wide = sum(w > TIGHT_NS for w in widths)
        print(
            f"  /proc/diskstats brackets     {_summary(widths)}; "
            f"{per_read:.4f} preads per read, {wide} kept wider than {TIGHT_NS / 1e3:.0f} us"
        )
    finally:
        stop.set()
        busy.join()


def _now_at(timer_list: bytes) -> int:
    return int(timer_list.split(b"now at ", 1)[1].split(b" ", 1)[0])


def disk_windows(runs: int, directory: Path) -> None:
    print()
    print("disk read windows vs /proc/diskstats, one busy thread, a file read in bursts")
    print(f"{'run':>3} {'windows':>7} {'read IOPS':>9} {'read B/s':>9}  worst window")
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        data = Path(tmp) / "data.bin"
        make_file_on_disk(data)
        for run in range(runs):
            result = compare(Path(tmp) / f"run{run}", busy_threads=1, read_file=data)
            ops, volume = result.of("disk.read_ops"), result.of("disk.read_bytes")
            if not any(w.reference for w in ops):
                print(f"  no disk reads seen: {directory} is not on a physical disk")
                return
            worst = max(ops, key=lambda w: w.error)
            final = " (final)" if worst.final else ""
            print(
                f"{run:>3} {len(ops):>7} {max(w.error for w in ops):>9.2%} "
                f"{max(w.error for w in volume):>9.2%}  read IOPS over "
                f"{(worst.end_ns - worst.start_ns) / 1e9:.2f} s{final}, {worst.detail}: "
                f"{worst.otelprof:.6g} vs {worst.reference:.6g}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="accuracy runs per configuration")
    parser.add_argument("--samples", type=int, default=100, help="promptness samples")
    parser.add_argument("--quick", action="store_true", help="1 run, 40 samples")
    parser.add_argument("--reads", type=int, default=20_000, help="reads per read-time row")
    parser.add_argument(
        "--disk-dir", type=Path, default=Path(tempfile.gettempdir()), help="on a physical disk"
    )
    args = parser.parse_args(argv)
    runs, samples = (1, 40) if args.quick else (args.runs, args.samples)
    print(f"machine: {os.cpu_count()} CPUs, {cpu_model()}, Python {platform.python_version()}")
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    promptness(samples)
    read_times(args.reads // 4 if args.quick else args.reads)
    disk_windows(runs, args.disk_dir)
    print()
    accuracy(runs)
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
