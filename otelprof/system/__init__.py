"""Hardware metrics as OpenTelemetry observable instruments (psutil, NVML, AMD SMI).

The instruments are `names.py`'s (rendered into docs/reference/telemetry.md); what each
means and when it is present, docs/guide/hardware.md. A value that cannot be read is
absent from that collection, never 0. Sampling, read times and sources: DEVELOPING.md,
"system/ contract".
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
