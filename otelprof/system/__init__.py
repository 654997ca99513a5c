"""Hardware metrics as OpenTelemetry observable instruments (psutil + NVML).

    handle = register_system_metrics(meter, SystemMetricsSettings(interval_s=1.0))
    ...
    handle.close()

Instruments (gauges unless noted; rates are Δcounter/Δt between two reads of the same
counter, each stamped at the read (the middle of the clock readings around it); the
exported point's time is the read and its start time the window's start, see `_stamps.py`):

| instrument | unit | attributes | source |
|---|---|---|---|
| `system.cpu.utilization` | `1` | – | psutil.cpu_times, busy = not idle/iowait, all cores |
| `system.memory.linux.available` | `By` | – | psutil.virtual_memory().available |
| `system.network.throughput` | `By/s` | `network.io.direction`=transmit/receive | NICs + lo |
| `system.disk.iops` | `{operation}/s` | `disk.io.direction`=read/write | physical disks |
| `system.disk.throughput` | `By/s` | `disk.io.direction`=read/write | physical disks |
| `hw.gpu.utilization` | `1` | `hw.id`=UUID, `gpu.index` | mean of NVML samples |
| `hw.gpu.memory.free` | `By` | `hw.id`, `gpu.index` | nvmlDeviceGetMemoryInfo |
| `hw.gpu.memory.usage` | `By` | `hw.id`, `gpu.index` | nvmlDeviceGetMemoryInfo |
| `hw.gpu.memory.limit` | `By` | `hw.id`, `gpu.index` | nvmlDeviceGetMemoryInfo |
| `hw.power` | `W` | `hw.id`, `gpu.index`, `hw.type`=gpu | nvmlDeviceGetPowerUsage |
| `hw.temperature` | `Cel` | `hw.id`, `gpu.index`, `hw.type`=gpu | nvmlDeviceGetTemperature |
| `hw.energy` (counter) | `J` | `hw.id`, `gpu.index`, `hw.type`=gpu | NVML total energy |
| `otelprof.gpu.process.memory.usage` | `By` | `hw.id`, `gpu.index` | NVML process lists |
| `hw.gpu.sm.activity` | `1` | `hw.id`, `gpu.index`, src | GPM SM_UTIL |
| `hw.gpu.sm.occupancy` | `1` | `hw.id`, `gpu.index`, src | GPM SM_OCCUPANCY |
| `hw.gpu.tensor.activity` | `1` | `hw.id`, `gpu.index`, src | GPM ANY_TENSOR_UTIL |
| `hw.gpu.memory.bandwidth.utilization` | `1` | `hw.id`, `gpu.index`, src | GPM / NVML |
| `hw.gpu.pcie.throughput` | `By/s` | same + direction | GPM / NVML byte counters |
| `hw.gpu.nvlink.throughput` | `By/s` | same + direction | GPM / NVML byte counters |
| `otelprof.gpu.energy.per_step` | `J` | – | Δ`hw.energy` / training steps in the interval |
| `otelprof.gpu.idle` (counter) | `s` | `hw.id`, `gpu.index`, phase | (1 - util) × interval |
| `process.cpu.utilization` | `1` | – | this process, ÷ usable CPUs |
| `process.memory.usage` | `By` | – | this process's RSS |
| `otelprof.torch.cuda.memory.allocated` | `By` | `otelprof.cuda.device`, `hw.id` | torch |
| `otelprof.torch.cuda.memory.reserved` | `By` | `otelprof.cuda.device`, `hw.id` | torch |
| `otelprof.process.memory.by_phase` | `By` | phase | this process's RSS, labelled by phase |
| `otelprof.torch.cuda.memory.peak.allocated` | `By` | device, `hw.id`, phase | torch, reset |
| `otelprof.torch.cuda.memory.peak.reserved` | `By` | device, `hw.id`, phase | torch, reset |

src = `otelprof.gpu.source` (`gpm` or `nvml`: where the value came from, `_gpu_perf.py`);
direction = `network.io.direction`; phase = `otelprof.phase`; device =
`otelprof.cuda.device`. The memory rows by phase are `memory_peaks.py`'s (the peaks with the
`memory_peaks` option: the allocator's peak of each interval and phase block, then reset).
`otelprof.gpu.process.memory.usage` is the memory this process and its children hold on
that GPU, beside the device-wide `hw.gpu.memory.usage`.
Host rows come with `host_metrics` (local rank 0 by default, decided in config), GPU rows
with `gpus="visible"|"all"` when NVML finds a GPU, process rows with `process_metrics`,
torch rows once this process has initialized CUDA. A value that cannot be read is absent
from that collection, never 0. Details: `host.py`, `gpu.py`, `_gpu_perf.py`, `rates.py`,
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
