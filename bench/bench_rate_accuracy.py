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

    .venv/bin/python bench/bench_rate_accuracy.py              # ~3 min
    .venv/bin/python bench/bench_rate_accuracy.py --quick      # fewer runs
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from _machine import cpu_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from otelprof.system.host import HostSampler  # noqa: E402
from otelprof.system.process import ProcessSampler  # noqa: E402
from tests.rate_accuracy import compare  # noqa: E402

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="accuracy runs per configuration")
    parser.add_argument("--samples", type=int, default=100, help="promptness samples")
    parser.add_argument("--quick", action="store_true", help="1 run, 40 samples")
    args = parser.parse_args(argv)
    runs, samples = (1, 40) if args.quick else (args.runs, args.samples)
    print(f"machine: {os.cpu_count()} CPUs, {cpu_model()}, Python {platform.python_version()}")
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    promptness(samples)
    print()
    accuracy(runs)
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
