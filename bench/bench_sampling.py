"""CPU cost of otelprof's hardware sampling, as a fraction of one core.

Side by side in one process, at each interval:
- baseline: a MeterProvider whose PeriodicExportingMetricReader runs at the interval with
  no instruments (the SDK's own collection thread, idle);
- gauges:   the same, plus `register_system_metrics` (host + process + torch; GPUs when
  NVML finds one), every gauge collected by the periodic reader.
The main thread sleeps, so the process CPU time (`time.process_time`) over the window is
the background work; (gauges - baseline) / wall seconds is the sampling overhead as a
fraction of one core. A per-sample micro-measurement (thread CPU time of each source's
sample call) is printed beside it, split by source.

    .venv/bin/python bench/bench_sampling.py            # 20 s windows
    .venv/bin/python bench/bench_sampling.py --seconds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Sequence

from _machine import cpu_model
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)

from otelprof.system import SystemMetricsSettings, register_system_metrics
from otelprof.system.host import HostSampler
from otelprof.system.process import ProcessSampler
from otelprof.system.torch_memory import TorchMemorySampler


class CountingExporter(MetricExporter):
    """Keeps only a count of exported points, so export cost does not hide sampling cost."""

    def __init__(self) -> None:
        super().__init__()
        self.points = 0

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object
    ) -> MetricExportResult:
        for rm in metrics_data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    self.points += len(list(m.data.data_points))
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        pass


def cpu_per_wall_second(interval_s: float, seconds: float, gauges: bool) -> tuple[float, int]:
    exporter = CountingExporter()
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval_s * 1000)
    provider = MeterProvider(metric_readers=[reader])
    handle = None
    if gauges:
        handle = register_system_metrics(
            provider.get_meter("bench"), SystemMetricsSettings(interval_s=interval_s)
        )
    time.sleep(interval_s)  # settle: first export, lazy imports
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    cpu1, wall1 = time.process_time(), time.monotonic()
    if handle is not None:
        handle.close()
    provider.shutdown()
    return (cpu1 - cpu0) / (wall1 - wall0), exporter.points


def per_sample_cost(samples: int) -> dict[str, float]:
    """Mean thread CPU seconds of one sample, per source, called back to back.

    The samplers get a clock that advances 0.1 s from one read to the next, so every call
    computes its rates (back-to-back real reads would be closer than MIN_WINDOW_S and skip
    them), and stands still within a read (its two readings around it), whose bracket
    would otherwise look interrupted and the read be made again (`_stamps.timed`).
    """
    ticks = [time.monotonic_ns()]
    readings = [0]

    def clock() -> int:
        readings[0] += 1
        if readings[0] % 2:
            ticks[0] += 100_000_000
        return ticks[0]

    host = HostSampler(clock=clock)
    process = ProcessSampler(clock=clock)
    sources = {
        "host": host.sample,
        "process": process.sample,
        "torch": TorchMemorySampler(clock=clock).sample,
    }
    costs: dict[str, float] = {}
    for label, source in sources.items():
        source()
        t0 = time.thread_time()
        for _ in range(samples):
            source()
        costs[label] = (time.thread_time() - t0) / samples
    host.close()
    process.close()
    return costs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="window per measurement")
    parser.add_argument("--samples", type=int, default=300, help="micro-benchmark samples")
    args = parser.parse_args(argv)

    print(f"machine: {os.cpu_count()} CPUs, {cpu_model()}, Python {platform.python_version()}")
    costs = per_sample_cost(args.samples)
    total = sum(costs.values())
    parts = ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in costs.items())
    print(f"one sample: {total * 1e6:.0f} us CPU ({parts})")
    print()
    print(
        f"{'interval':>8}  {'baseline':>10}  {'gauges':>10}  {'overhead':>10}  "
        f"{'per-sample est.':>15}  {'points':>7}"
    )
    for interval in (1.0, 0.1):
        base, _ = cpu_per_wall_second(interval, args.seconds, gauges=False)
        with_gauges, points = cpu_per_wall_second(interval, args.seconds, gauges=True)
        overhead = with_gauges - base
        print(
            f"{interval:>7.1f}s  {base * 100:>9.3f}%  {with_gauges * 100:>9.3f}%  "
            f"{overhead * 100:>9.3f}%  {total / interval * 100:>14.3f}%  {points:>7}"
        )
    print()
    print("columns: process CPU time per wall second as % of one core; overhead = gauges -")
    print("baseline (goal at 1 s: under 0.5%); per-sample est. = one sample's CPU / interval.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
