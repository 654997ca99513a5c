"""Hardware metrics as OpenTelemetry observable instruments (psutil + NVML).

    handle = register_system_metrics(meter, SystemMetricsSettings(interval_s=1.0))
    ...
    handle.close()

Each instrument's name, unit, kind and meaning is in `names.py` (rendered in
docs/reference/telemetry.md), its attributes and sources in docs/guide/hardware.md. Rates
are Δcounter/Δt between two reads of the same counter, each stamped at the read (the middle
of the clock readings around it); the exported point's time is the read and its start time
the window's start, see `_stamps.py`.

Host rows come with `host_metrics` (local rank 0 by default, decided in config), GPU rows
with `gpus="visible"|"all"` when NVML (or AMD SMI) finds a GPU, process rows with
`process_metrics`, torch rows once this process has initialized CUDA, the memory rows by
phase as `memory_peaks.py` says. A value that cannot be read is absent from that
collection, never 0. Details: `host.py`, `gpu.py`, `_gpu_perf.py`, `amd.py`, `rates.py`,
`gauges.py`.
"""

from . import names
from .gauges import (
    MIN_INTERVAL_S,
    SystemMetricsHandle,
    SystemMetricsSettings,
    register_system_metrics,
)
from .gpu import parse_visible_devices

__all__ = [
    "MIN_INTERVAL_S",
    "SystemMetricsHandle",
    "SystemMetricsSettings",
    "names",
    "parse_visible_devices",
    "register_system_metrics",
]
