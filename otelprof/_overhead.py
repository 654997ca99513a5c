"""Overhead self-telemetry: what profiling costs, as metrics beside the data it produces.

Training thread: ranges per second (from the timing histograms, which count every range)
x one range's cost, calibrated when the engine starts; an estimate, since timers on the hot
path would double its cost. Background: CPU time of otelprof's and the SDK's threads per
second, from each thread's CPU clock.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otelprof._schema import OVERHEAD_BACKGROUND_CPU, OVERHEAD_TRAINING_THREAD
from otelprof._timings import _recorder as rec

THREAD_PREFIXES = ("otelprof", "Otel")


def calibrate_range_cost(rounds: int = 5, n: int = 2000) -> float:
    """Seconds one `timing()` range costs the thread that opens it (median of `rounds`).

    Runs the real hot path with a private step context, then removes what it queued; call
    it before the span builder starts (the engine does, in `start()`)."""
    timing = rec.timing("otelprof.calibration")
    costs = []
    try:
        with rec.recorder.isolated(n) as discard:
            for _ in range(rounds):
                start = time.perf_counter_ns()
                for _ in range(n):
                    with timing:
                        pass
                costs.append((time.perf_counter_ns() - start) / n / 1e9)
                discard()  # the ranges its step collected and chunks it queued
    finally:
        rec.forget_timing("otelprof.calibration")
    return statistics.median(costs)


class _ThreadCpu:
    """CPU seconds used by the background threads since creation, summed per thread so a
    thread that ends (or a new one) never makes the total go backwards."""

    def __init__(self) -> None:
        self._seen: dict[int, float] = {}
        self.total = 0.0

    def read(self) -> float:
        for thread in threading.enumerate():
            ident = thread.ident
            if ident is None or not thread.name.startswith(THREAD_PREFIXES):
                continue
            try:
                cpu = time.clock_gettime(time.pthread_getcpuclockid(ident))
            except (OSError, ValueError, AttributeError):
                continue  # the thread ended between enumerate() and the read
            last = self._seen.get(ident, 0.0)
            if cpu > last:  # a reused ident restarts below `last`: count from there
                self.total += cpu - last
            self._seen[ident] = cpu
        return self.total


class OverheadGauges:
    """Rates between two collections: ranges x calibrated cost, and background CPU."""

    def __init__(self, meter: Meter, engine: Any) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._cpu = _ThreadCpu()
        self._last = self._read()
        meter.create_observable_gauge(
            OVERHEAD_TRAINING_THREAD,
            callbacks=[self._observe_training],
            unit="1",
            description="Estimated share of wall time the training thread spends recording "
            "otelprof ranges (ranges/s x calibrated cost per range)",
        )
        meter.create_observable_gauge(
            OVERHEAD_BACKGROUND_CPU,
            callbacks=[self._observe_background],
            unit="1",
            description="CPU cores used by otelprof's and the OTel SDK's background threads",
        )
        self._rates: tuple[float, float] | None = None

    def _read(self) -> tuple[float, int, float]:
        ranges = sum(h.count for _, _, h in self._engine.aggregates.snapshot())
        return time.monotonic(), ranges, self._cpu.read()

    def _update(self) -> tuple[float, float] | None:
        """(training-thread share, background cores) since the previous read, shared by
        both callbacks of one collection."""
        with self._lock:
            now = self._read()
            dt = now[0] - self._last[0]
            if dt >= 0.05:
                cost = getattr(self._engine, "range_cost_s", 0.0)
                self._rates = ((now[1] - self._last[1]) * cost / dt, (now[2] - self._last[2]) / dt)
                self._last = now
            return self._rates

    def _observe_training(self, _options: CallbackOptions) -> Iterable[Observation]:
        rates = self._update()
        if rates is not None:
            yield Observation(rates[0])

    def _observe_background(self, _options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            rates = self._rates
        if rates is None:
            rates = self._update()
        if rates is not None:
            yield Observation(rates[1])
