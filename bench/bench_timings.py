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

Targets: bridged <= 1.25 x bare; naive >= 3 x bridged; timing <= 5 x floor. Bridged and
timing bursts run under a plain `otelprof.instrument()` (default detached mode, writing
files, hardware metrics on): the span builder and every exporter thread run freely during
the burst, as they do for users, so their GIL use lands in the measured time. Their CPU per
span (background threads' CPU / spans recorded) is reported beside it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from _machine import background_cpu, cpu_model
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import otelprof
from otelprof._timings._recorder import timing

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

    results: dict[str, list[float]] = {k: [] for k in ("bare", "bridged", "naive", "floor")}
    results["timing"] = []
    background_s = 0.0
    spans = 0
    dropped = 0

    for fn in (bare, floor, naive):  # warm up caches and lazy imports
        fn(n)
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.bursts):
            results["bare"].append(_burst(bare, n))
            results["floor"].append(_burst(floor, n))
            results["naive"].append(_burst(naive, n))
            naive_provider.force_flush()
            # as users run it: default detached mode, nothing held off during the bursts
            prof = otelprof.instrument(output_dir=tmp, run_id=f"burst{index}")
            cpu = background_cpu()
            results["bridged"].append(_burst(bare, n))
            results["timing"].append(_burst(timed, n))
            otelprof.step()
            time.sleep(0.25)  # the builder's interval: let it catch up, still unhelped
            background_s += background_cpu() - cpu
            prof.shutdown()
            stats = prof.stats()
            spans += stats.get("timings.spans_recorded", 0)
            dropped += stats.get("dropped_total", 0)
    naive_provider.shutdown()

    med = {k: statistics.median(v) for k, v in results.items()}
    low = {k: min(v) for k, v in results.items()}
    print(f"machine: {cpu_model()}, {__import__('os').cpu_count()} CPUs; torch {torch.__version__}")
    print(f"{args.bursts} interleaved bursts of {n} ranges; per-range cost in µs (median, min)")
    for key in ("bare", "bridged", "naive", "floor", "timing"):
        print(f"  {key:8s} {med[key]:8.3f}  {low[key]:8.3f}")
    print(
        f"  background threads {background_s / max(spans, 1) * 1e6:.2f} µs CPU per span "
        f"({spans:,} spans, {dropped:,} dropped)"
    )
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
