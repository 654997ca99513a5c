"""Hardware metrics as OpenTelemetry observable instruments (psutil, NVML).

Units and meanings: `names.py` (rendered into docs/reference/telemetry.md) and
docs/guide/hardware.md. A value that cannot be read is absent, never 0. Sampling, read
times and sources: DEVELOPING.md, "system/ contract". The instruments, by what enables them:

- `host_metrics`: `system.cpu.utilization`, `system.memory.linux.available`,
  `system.network.throughput`, `system.disk.iops`, `system.disk.throughput`;
- a GPU (`gpus`): `hw.gpu.utilization`, `hw.gpu.memory.free`, `hw.gpu.memory.usage`,
  `hw.gpu.memory.limit`, `hw.power`, `hw.temperature`, `hw.energy`,
  `otelprof.gpu.process.memory.usage`, `hw.gpu.sm.activity`, `hw.gpu.sm.occupancy`,
  `hw.gpu.tensor.activity`, `hw.gpu.memory.bandwidth.utilization`, `hw.gpu.pcie.throughput`,
  `hw.gpu.nvlink.throughput`, `otelprof.gpu.energy.per_step`, `otelprof.gpu.idle`;
- `process_metrics`: `process.cpu.utilization`, `process.memory.usage`,
  `otelprof.process.memory.by_phase`; once CUDA is initialized,
  `otelprof.torch.cuda.memory.allocated`, `otelprof.torch.cuda.memory.reserved`;
- `memory_peaks`: `otelprof.torch.cuda.memory.peak.allocated`,
  `otelprof.torch.cuda.memory.peak.reserved`.
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
