"""The machine a benchmark ran on, for the figures BENCHMARKS.md records."""

from __future__ import annotations

import contextlib
import os
import platform
import threading
import time


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (what `lscpu` shows), else the platform's."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as the figures quote them."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def print_machine(torch_version: str) -> None:
    """The two lines a bench's figures open with: the machine, and its load as it starts."""
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; torch {torch_version}")
    print(f"load average at start: {load_average()}")


BACKGROUND_THREADS = ("otelprof-", "Otel")
"""Name prefixes of otelprof's and the OpenTelemetry SDK's background threads."""


def background_cpu() -> float:
    """CPU seconds used so far by otelprof's and the OTel SDK's background threads, from each
    thread's own CPU clock (exact to the ns; psutil's per-thread times count 10 ms ticks, and
    charge a whole tick to whichever thread it lands on)."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith(BACKGROUND_THREADS) and thread.ident is not None:
            with contextlib.suppress(OSError):  # it ended since enumerate()
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total
