"""Instrument names, units and kinds: the one place dashboards and exporters can import.

OpenTelemetry semantic conventions where they define the quantity, except the rate gauges
(`*.throughput`, `*.iops`) and `hw.gpu.memory.free`, named by the design brief; `otelprof.*`
for what the conventions do not cover. The docs' telemetry reference is generated from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from otelprof._schema import CUDA_PEAK_ALLOCATED, CUDA_PEAK_RESERVED, MEMORY_BY_PHASE


@dataclass(frozen=True)
class Instrument:
    name: str
    unit: str
    description: str
    kind: Literal["gauge", "counter"] = "gauge"


# host (local rank 0 by default)
CPU_UTILIZATION = Instrument(
    "system.cpu.utilization", "1", "Share of all logical CPUs busy (not idle/iowait), 0-1"
)
MEMORY_AVAILABLE = Instrument(
    "system.memory.linux.available", "By", "Memory available to start new work (MemAvailable)"
)
NETWORK_THROUGHPUT = Instrument(
    "system.network.throughput", "By/s", "Bytes per second over all interfaces, loopback included"
)
DISK_IOPS = Instrument(
    "system.disk.iops", "{operation}/s", "Completed read or write operations per second"
)
DISK_THROUGHPUT = Instrument(
    "system.disk.throughput", "By/s", "Bytes read or written per second on physical disks"
)

# GPUs (visible to this job by default)
GPU_UTILIZATION = Instrument(
    "hw.gpu.utilization", "1", "Share of time a kernel ran, averaged over the interval, 0-1"
)
GPU_MEMORY_FREE = Instrument("hw.gpu.memory.free", "By", "Free GPU memory")
GPU_MEMORY_USAGE = Instrument("hw.gpu.memory.usage", "By", "Used GPU memory")
GPU_MEMORY_LIMIT = Instrument("hw.gpu.memory.limit", "By", "Total GPU memory")
GPU_POWER = Instrument("hw.power", "W", "Power drawn by the GPU")
GPU_TEMPERATURE = Instrument("hw.temperature", "Cel", "GPU core temperature")
GPU_ENERGY = Instrument(
    "hw.energy", "J", "Energy used by the GPU since the driver loaded", kind="counter"
)
GPU_PROCESS_MEMORY = Instrument(
    "otelprof.gpu.process.memory.usage",
    "By",
    "GPU memory held by this process and its children (NVML running-process list)",
)

# what the GPU's units do (NVML GPM, or classic NVML where noted; `otelprof.gpu.source`)
GPU_SM_ACTIVITY = Instrument(
    "hw.gpu.sm.activity", "1", "Share of SMs busy, averaged over the interval, 0-1 (GPM)"
)
GPU_SM_OCCUPANCY = Instrument(
    "hw.gpu.sm.occupancy", "1", "Active warps / theoretical maximum over the interval, 0-1 (GPM)"
)
GPU_TENSOR_ACTIVITY = Instrument(
    "hw.gpu.tensor.activity", "1", "Share of time tensor pipes were busy over the interval (GPM)"
)
GPU_DRAM_BANDWIDTH = Instrument(
    "hw.gpu.memory.bandwidth.utilization",
    "1",
    "DRAM bandwidth used / peak over the interval (GPM); memory-controller busy share (nvml)",
)
GPU_PCIE_IO = Instrument(
    "hw.gpu.pcie.throughput", "By/s", "PCIe bytes per second over the interval"
)
GPU_NVLINK_IO = Instrument(
    "hw.gpu.nvlink.throughput", "By/s", "NVLink bytes per second over the interval, all links"
)

# GPU figures tied to training (`_gpu_steps.py`)
GPU_ENERGY_PER_STEP = Instrument(
    "otelprof.gpu.energy.per_step",
    "J",
    "Energy of the sampled GPUs per training step completed in the interval",
)
GPU_IDLE = Instrument(
    "otelprof.gpu.idle",
    "s",
    "GPU-idle seconds, (1 - utilization) x interval, by training phase",
    kind="counter",
)

# this process (every rank)
PROCESS_CPU_UTILIZATION = Instrument(
    "process.cpu.utilization", "1", "This process's CPU time over the interval / usable CPUs, 0-1"
)
PROCESS_MEMORY_USAGE = Instrument("process.memory.usage", "By", "This process's resident memory")

# PyTorch caching allocator (when torch has initialized CUDA)
TORCH_CUDA_ALLOCATED = Instrument(
    "otelprof.torch.cuda.memory.allocated", "By", "Bytes held by tensors (caching allocator)"
)
TORCH_CUDA_RESERVED = Instrument(
    "otelprof.torch.cuda.memory.reserved", "By", "Bytes reserved by the caching allocator"
)

# memory by training phase (`memory_peaks.py`), with `otelprof.phase`
PROCESS_MEMORY_BY_PHASE = Instrument(
    MEMORY_BY_PHASE,
    "By",
    "This process's resident memory, sampled, with the training phase current at the sample",
)
TORCH_CUDA_PEAK_ALLOCATED = Instrument(
    CUDA_PEAK_ALLOCATED,
    "By",
    "Highest bytes held by tensors since the last collection, in the phase (allocator peak, "
    "reset at each collection and change of phase)",
)
TORCH_CUDA_PEAK_RESERVED = Instrument(
    CUDA_PEAK_RESERVED,
    "By",
    "Highest bytes reserved by the caching allocator since the last collection, in the phase",
)

HOST = (CPU_UTILIZATION, MEMORY_AVAILABLE, NETWORK_THROUGHPUT, DISK_IOPS, DISK_THROUGHPUT)
GPU = (
    GPU_UTILIZATION,
    GPU_MEMORY_FREE,
    GPU_MEMORY_USAGE,
    GPU_MEMORY_LIMIT,
    GPU_POWER,
    GPU_TEMPERATURE,
    GPU_ENERGY,
    GPU_PROCESS_MEMORY,
    GPU_SM_ACTIVITY,
    GPU_SM_OCCUPANCY,
    GPU_TENSOR_ACTIVITY,
    GPU_DRAM_BANDWIDTH,
    GPU_PCIE_IO,
    GPU_NVLINK_IO,
    GPU_ENERGY_PER_STEP,
    GPU_IDLE,
)
PROCESS = (PROCESS_CPU_UTILIZATION, PROCESS_MEMORY_USAGE)
PHASE_MEMORY = (PROCESS_MEMORY_BY_PHASE,)
PEAK_MEMORY = (TORCH_CUDA_PEAK_ALLOCATED, TORCH_CUDA_PEAK_RESERVED)
TORCH = (TORCH_CUDA_ALLOCATED, TORCH_CUDA_RESERVED)
ALL = HOST + GPU + PROCESS + TORCH + PHASE_MEMORY + PEAK_MEMORY

# attribute keys and values
HW_ID = "hw.id"
HW_TYPE = "hw.type"
GPU_INDEX = "gpu.index"
GPU_SOURCE = "otelprof.gpu.source"  # "gpm" or "nvml": where a value came from
NETWORK_DIRECTION = "network.io.direction"
DISK_DIRECTION = "disk.io.direction"
CUDA_DEVICE = "otelprof.cuda.device"
TRANSMIT, RECEIVE = "transmit", "receive"
READ, WRITE = "read", "write"
