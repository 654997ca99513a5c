"""Hot-path cost of otelprof timings, side by side in one process.

    .venv/bin/python bench/bench_timings.py [--bursts 40] [--burst 2000]

Variants, measured in interleaved bursts (a burst = `--burst` empty ranges in a loop) so a
noisy neighbour hits all of them alike; per-range cost = median over bursts:

  bare      torch.profiler.record_function, no otelprof
  bridged   the same range with the otelprof bridge installed and recording
  naive     record_function + an OTel SDK span per range (BatchSpanProcessor), the approach
            the bridge replaces
  floor     two perf_counter_ns() calls and a list append
  timing    `with otelprof.timing("x")` while recording, no torch profiler running

Targets: bridged <= 1.25 x bare; naive >= 3 x bridged; timing <= 5 x floor. The span
builder thread's cost per span (ReadableSpan + processor hand-over) is reported apart: it
runs off the training thread, after each burst (`engine.flush()` outside the timed region).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from _machine import cpu_model
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from otelprof.config import Settings
from otelprof.timings import TimingsEngine, timing

record_function = torch.profiler.record_function


class DiscardingExporter(SpanExporter):
    """Export succeeds and keeps nothing: measures the span path, not an encoder."""

    def export(self, spans):  # type: ignore[no-untyped-def]
        return SpanExportResult.SUCCESS


def _provider() -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(DiscardingExporter(), max_queue_size=1 << 17))
    return provider


def bare(n: int) -> None:
    for _ in range(n):
        with record_function("x"):
            pass


def floor(n: int) -> None:
    stamps = []
    clock = time.perf_counter_ns
    for _ in range(n):
        a = clock()
        b = clock()
        stamps.append((a, b))


def timed(n: int) -> None:
    for _ in range(n):
        with timing("x"):
            pass


def _burst(fn: Callable[[int], None], n: int) -> float:
    """Per-iteration cost of one burst, in microseconds."""
    start = time.perf_counter_ns()
    fn(n)
    return (time.perf_counter_ns() - start) / n / 1000.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=40)
    parser.add_argument("--burst", type=int, default=2000, help="ranges per burst")
    args = parser.parse_args()
    n = args.burst

    naive_provider = _provider()
    tracer = naive_provider.get_tracer("bench")

    def naive(count: int) -> None:
        for _ in range(count):
            with record_function("x"), tracer.start_as_current_span("x"):
                pass

    engine_provider = _provider()
    settings = Settings.from_options(detached=False, env={}, max_queued_spans=1 << 20)
    results: dict[str, list[float]] = {k: [] for k in ("bare", "bridged", "naive", "floor")}
    results["timing"] = []
    builder_us: list[float] = []

    for fn in (bare, floor, naive):  # warm up caches and lazy imports
        fn(n)
    for _ in range(args.bursts):
        results["bare"].append(_burst(bare, n))
        results["floor"].append(_burst(floor, n))
        results["naive"].append(_burst(naive, n))
        naive_provider.force_flush()
        # the builder thread is held off during the bursts (long interval) and drained by
        # flush() in between, so each burst measures the training thread's cost only
        engine = TimingsEngine(engine_provider, settings, builder_interval_s=3600)
        engine.start()
        results["bridged"].append(_burst(bare, n))
        started = time.perf_counter_ns()
        engine.flush()
        builder_us.append((time.perf_counter_ns() - started) / n / 1000.0)
        engine_provider.force_flush()
        results["timing"].append(_burst(timed, n))
        engine.flush()
        engine.shutdown()
        engine_provider.force_flush()
    naive_provider.shutdown()
    engine_provider.shutdown()

    med = {k: statistics.median(v) for k, v in results.items()}
    low = {k: min(v) for k, v in results.items()}
    print(f"machine: {cpu_model()}, {__import__('os').cpu_count()} CPUs; torch {torch.__version__}")
    print(f"{args.bursts} interleaved bursts of {n} ranges; per-range cost in µs (median, min)")
    for key in ("bare", "bridged", "naive", "floor", "timing"):
        print(f"  {key:8s} {med[key]:8.3f}  {low[key]:8.3f}")
    print(f"  builder  {statistics.median(builder_us):8.3f}  (off the training thread, per span)")
    checks = [
        ("bridged / bare", med["bridged"] / med["bare"], low["bridged"] / low["bare"], "<= 1.25"),
        ("naive / bridged", med["naive"] / med["bridged"], low["naive"] / low["bridged"], ">= 3"),
        ("timing / floor", med["timing"] / med["floor"], low["timing"] / low["floor"], "<= 5"),
    ]
    print("ratios (median, min) and targets:")
    for name, ratio_med, ratio_min, target in checks:
        print(f"  {name:16s} {ratio_med:6.2f}x  {ratio_min:6.2f}x   target {target}")
    print(
        f"  otelprof adds {med['bridged'] - med['bare']:.2f} µs per record_function range "
        f"({(med['bridged'] / med['bare'] - 1) * 100:.0f}% of torch's own cost)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
