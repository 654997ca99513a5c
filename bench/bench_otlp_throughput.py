"""OTLP gRPC throughput into the real collector, and its cost to the training loop.

    .venv/bin/python bench/bench_otlp_throughput.py [--seconds 8]

Needs the built collector (`make collector`). Three measurements, one process:

1. Span throughput: timing spans paced at rising rates through `otelprof.timing()` →
   otelprof's span builder → BatchSpanProcessor → OTLP gRPC → collector (span_metrics on,
   as shipped). A rate counts as sustained when nothing is dropped anywhere (otelprof's
   stats, the collector's refused/failed counters) and the collector accepted every span.
2. Metric throughput: all of otelprof's gauges at a 0.1 s interval (10 collections/s).
3. Overhead: the same CPU PyTorch step (small MLP forward/backward/optimizer) without
   otelprof and with it attached, emitting spans at roughly the sustained rate; ratio of
   median step times.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import cpu_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import otelprof  # noqa: E402
from tests.services import Collector, start_collector  # noqa: E402

SPANS_PER_STEP = 8


def _counter(text: str, name: str) -> float:
    return sum(
        float(m.group(1))
        for m in re.finditer(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    )


def _collector_totals(collector: Collector) -> dict[str, float]:
    text = collector.self_metrics()
    return {
        "accepted_spans": _counter(text, "otelcol_receiver_accepted_spans"),
        "accepted_points": _counter(text, "otelcol_receiver_accepted_metric_points"),
        "refused": _counter(text, "otelcol_receiver_refused_spans")
        + _counter(text, "otelcol_receiver_refused_metric_points")
        + _counter(text, "otelcol_receiver_failed_spans")
        + _counter(text, "otelcol_receiver_failed_metric_points"),
    }


def span_run(collector: Collector, rate: float | None, seconds: float) -> dict[str, Any]:
    """Emit timing spans at `rate` per second (None: as fast as possible) for `seconds`."""
    before = _collector_totals(collector)
    prof = otelprof.instrument(
        endpoint=collector.otlp_endpoint,
        service_name="bench-throughput",
        interval=1.0,
        host_metrics=False,
        process_metrics=False,
        gpus="none",
        record_function=False,
    )
    emitted = 0
    started = time.perf_counter()
    deadline = started + seconds
    try:
        while True:
            now = time.perf_counter()
            if now >= deadline:
                break
            if rate is not None:
                due = int((now - started) * rate)
                if emitted >= due:
                    time.sleep(0.0005)
                    continue
            for _ in range(SPANS_PER_STEP - 1):  # the step span is the eighth
                with otelprof.timing("bench_phase"):
                    pass
            otelprof.step()
            emitted += SPANS_PER_STEP
        elapsed = time.perf_counter() - started
    finally:
        prof.shutdown()
    stats = prof.stats()
    deadline = time.monotonic() + 15
    recorded = stats.get("timings.spans_recorded", 0)
    while time.monotonic() < deadline:  # the collector counts what it accepted
        after = _collector_totals(collector)
        if after["accepted_spans"] - before["accepted_spans"] >= recorded:
            break
        time.sleep(0.2)
    accepted = after["accepted_spans"] - before["accepted_spans"]
    return {
        "target": rate,
        "rate": recorded / elapsed,
        "recorded": recorded,
        "accepted": accepted,
        "dropped": stats["dropped_total"] + (after["refused"] - before["refused"]),
        "lossless": stats["dropped_total"] == 0
        and after["refused"] == before["refused"]
        and accepted >= recorded,
    }


def metric_run(collector: Collector, seconds: float) -> dict[str, Any]:
    before = _collector_totals(collector)
    prof = otelprof.instrument(
        endpoint=collector.otlp_endpoint, service_name="bench-metrics", interval=0.1, timings=False
    )
    time.sleep(seconds)
    prof.shutdown()
    time.sleep(1.0)
    after = _collector_totals(collector)
    stats = prof.stats()
    points = after["accepted_points"] - before["accepted_points"]
    return {
        "points_per_s": points / seconds,
        "exported": stats.get("otlp.metric_points_exported", 0),
        "dropped": stats["dropped_total"],
    }


def _training_step_fn() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    loss_fn = nn.CrossEntropyLoss()

    def step(extra_spans: int) -> None:
        with otelprof.timing("dataloader_next"):
            batch = (x, y)
        with otelprof.timing("train_batch"):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(batch[0]), batch[1])
            loss.backward()
            optimizer.step()
        for _ in range(extra_spans):
            with otelprof.timing("reduce_metrics"):
                pass

    return step


def overhead_run(
    collector: Collector, extra_spans: int, blocks: int = 6, steps: int = 250
) -> tuple[list[float], list[float]]:
    """Step times without and with otelprof, in interleaved blocks (machine drift cancels)."""
    step = _training_step_fn()
    baseline: list[float] = []
    profiled: list[float] = []
    for _ in range(blocks):
        for attached in (False, True):
            prof = None
            if attached:
                prof = otelprof.instrument(
                    endpoint=collector.otlp_endpoint, service_name="bench-overhead", interval=1.0
                )
            times = []
            try:
                for _ in range(steps):
                    t0 = time.perf_counter()
                    step(extra_spans)
                    if prof is not None:
                        otelprof.step()
                    times.append(time.perf_counter() - t0)
            finally:
                if prof is not None:
                    prof.shutdown()
            (profiled if attached else baseline).extend(times[steps // 10 :])
    return baseline, profiled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="duration of each rate step")
    args = parser.parse_args(argv)
    print(f"machine: {os.cpu_count()} CPUs, {cpu_model()}, Python {platform.python_version()}")
    with tempfile.TemporaryDirectory(prefix="otelprof-bench-") as work:
        collector = start_collector(Path(work) / "otelcol", spanmetrics_flush_interval="5s")
        try:
            print("\n1. spans through OTLP gRPC into the collector (span_metrics on)")
            print(
                f"{'target/s':>10} {'achieved/s':>11} {'recorded':>9} {'accepted':>9} "
                f"{'dropped':>8}  verdict"
            )
            flat_out = span_run(collector, None, args.seconds)
            ceiling = flat_out["rate"]
            results = [flat_out]
            for fraction in (0.25, 0.5, 0.75):
                results.append(span_run(collector, ceiling * fraction, args.seconds))
            good = max((r["target"] for r in results if r["lossless"] and r["target"]), default=0.0)
            bad = min(
                (r["target"] or ceiling for r in results if not r["lossless"]), default=ceiling
            )
            for _ in range(2):  # bisect between the best lossless and the worst lossy rate
                if not good or bad <= good:
                    break
                r = span_run(collector, (good + bad) / 2, args.seconds)
                results.append(r)
                good, bad = (r["target"], bad) if r["lossless"] else (good, r["target"])
            sustained = 0.0
            for r in results:
                target = "max" if r["target"] is None else f"{r['target']:.0f}"
                verdict = "lossless" if r["lossless"] else "LOSS"
                print(
                    f"{target:>10} {r['rate']:>11.0f} {r['recorded']:>9} {r['accepted']:>9.0f} "
                    f"{r['dropped']:>8.0f}  {verdict}"
                )
                if r["lossless"]:
                    sustained = max(sustained, r["rate"])
            print(
                f"sustained without drops: {sustained:.0f} spans/s "
                f"(producer ceiling {ceiling:.0f} spans/s from one Python thread)"
            )

            print("\n2. metric points through OTLP gRPC (all gauges, 0.1 s interval)")
            m = metric_run(collector, args.seconds)
            print(
                f"collector accepted {m['points_per_s']:.0f} points/s, "
                f"otelprof exported {m['exported']}, dropped {m['dropped']}"
            )

            print("\n3. training-step overhead (CPU MLP step), baseline vs otelprof attached")
            probe, _ = overhead_run(collector, 0, blocks=1, steps=200)
            extra = max(0, int(sustained * statistics.median(probe)) - 3)  # spans/step for it
            for label, n_extra in (("realistic (3 spans/step)", 0), ("at sustained rate", extra)):
                base, prof = overhead_run(collector, n_extra)
                b, p = statistics.median(base), statistics.median(prof)
                print(
                    f"{label:<26} spans/step {3 + n_extra:>4}  ~{(3 + n_extra) / p:>7.0f} spans/s  "
                    f"baseline {b * 1e3:7.3f} ms  otelprof {p * 1e3:7.3f} ms  ratio {p / b:5.3f}"
                )
        finally:
            collector.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
