"""The machine a benchmark ran on, for the figures BENCHMARKS.md records."""

from __future__ import annotations

import platform


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
