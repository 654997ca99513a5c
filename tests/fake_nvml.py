"""A stand-in for the NVML driver library, for machines without a GPU.

Only the driver calls are fake: the error classes, constants and ctypes structures are
pynvml's own (they need no driver), so the sampler sees exactly the types and error codes
the real binding produces. Each fake GPU holds the state the driver would report, and
tests change it between collections.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import pynvml

NVMLError = pynvml.NVMLError
NVML_GPU_UTILIZATION_SAMPLES = pynvml.NVML_GPU_UTILIZATION_SAMPLES
NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
NVML_ERROR_NO_PERMISSION = pynvml.NVML_ERROR_NO_PERMISSION
NVML_ERROR_INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
NVML_ERROR_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
NVML_ERROR_NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
NVML_ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
NVML_ERROR_LIBRARY_NOT_FOUND = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
NVML_VALUE_TYPE_UNSIGNED_INT = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
NVML_VALUE_TYPE_DOUBLE = pynvml.NVML_VALUE_TYPE_DOUBLE
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
NVML_MEMORY_UTILIZATION_SAMPLES = pynvml.NVML_MEMORY_UTILIZATION_SAMPLES
NVML_SUCCESS = pynvml.NVML_SUCCESS
NVML_ERROR_INSUFFICIENT_SIZE = pynvml.NVML_ERROR_INSUFFICIENT_SIZE

# GPM metric ids (nvml.h) and the classic counter fields
GPM_SM = pynvml.NVML_GPM_METRIC_SM_UTIL
GPM_OCCUPANCY = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
GPM_TENSOR = pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
GPM_DRAM = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
GPM_PCIE_TX = pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC
GPM_PCIE_RX = pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC
GPM_NVLINK_RX = pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC
GPM_NVLINK_TX = pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC
FI_PCIE_TX = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
FI_PCIE_RX = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
FI_NVLINK_TX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
FI_NVLINK_RX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX


@dataclass
class FakeGpu:
    """What the driver knows about one GPU (or MIG slice)."""

    uuid: str
    samples: list[tuple[int, float]] = field(default_factory=list)  # (timestamp µs, percent)
    sample_type: int = NVML_VALUE_TYPE_UNSIGNED_INT
    utilization_rate: int = 0  # nvmlDeviceGetUtilizationRates().gpu, percent
    memory_total: int = 80 * 2**30
    memory_used: int = 0  # what processes hold (nvidia-smi's memory.used: v2's `used`)
    # what the driver keeps for itself: v1's `used` counts it, v2 names it `reserved` (an
    # H200 with driver 580 reserves 615 MiB); drivers before v2 answer FUNCTION_NOT_FOUND
    memory_reserved: int = 0
    memory_v2: bool = True
    power_mw: int = 100_000
    temperature_c: int = 40
    energy_mj: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code
    parent: FakeGpu | None = None  # set for MIG slices
    gpu_instance_id: int = 0  # MIG slices: the GPU instance they belong to
    lost: bool = False  # fell off the bus: every call answers GPU_IS_LOST
    # GPM: the driver integrates each metric over time; a GPM sample snapshots the
    # integrals and nvmlGpmMetricsGet divides their difference by the elapsed time.
    gpm_supported: bool = False
    gpm_time_s: float = 0.0
    gpm_integrals: dict[int, float] = field(default_factory=dict)  # metric id -> value·s
    gpm_errors: dict[int, int] = field(default_factory=dict)  # metric id -> per-metric error
    # classic counters: field id -> cumulative value (PCIe bytes, NVLink KiB)
    fields: dict[int, int] = field(default_factory=dict)
    field_errors: dict[int, int] = field(default_factory=dict)  # field id -> per-field error
    uint32_fields: set[int] = field(default_factory=set)  # handed back as wrapping 32-bit
    memory_samples: list[tuple[int, float]] = field(default_factory=list)
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes)
    graphics_processes: list[tuple[int, int | None]] = field(default_factory=list)

    def add_sample(self, timestamp_us: int, percent: float) -> None:
        self.samples.append((timestamp_us, percent))

    def run(self, seconds: float, **per_metric: float) -> None:
        """Let `seconds` pass on the GPU with GPM metrics at these averages (id=value).

        Keys are `m<metric id>`, e.g. run(1.0, m2=50.0) for 50 % SM activity.
        """
        self.gpm_time_s += seconds
        for key, value in per_metric.items():
            metric = int(key[1:])
            self.gpm_integrals[metric] = self.gpm_integrals.get(metric, 0.0) + value * seconds


class FakeNvml:
    """Module-like object with pynvml's function names, backed by FakeGpu objects."""

    NVMLError = NVMLError
    NVML_GPU_UTILIZATION_SAMPLES = NVML_GPU_UTILIZATION_SAMPLES
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = NVML_ERROR_NO_PERMISSION
    NVML_ERROR_INVALID_ARGUMENT = NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_NOT_FOUND = NVML_ERROR_NOT_FOUND
    NVML_SUCCESS = NVML_SUCCESS
    nvmlMemory_v2 = pynvml.nvmlMemory_v2
    NVML_MEMORY_UTILIZATION_SAMPLES = NVML_MEMORY_UTILIZATION_SAMPLES
    NVML_GPM_METRICS_GET_VERSION = pynvml.NVML_GPM_METRICS_GET_VERSION
    c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t

    def __init__(
        self, gpus: list[FakeGpu], migs: list[FakeGpu] | None = None, init_error: int | None = None
    ) -> None:
        self.gpus = gpus
        self.migs = migs or []
        self.init_error = init_error
        self.init_count = 0
        self.calls: dict[str, int] = {}
        self.sample_calls: dict[int, int] = {}  # nvmlDeviceGetSamples by sampling type
        self._gpm_samples: dict[int, tuple[FakeGpu, float, dict[int, float]] | None] = {}
        self._keep: list[Any] = []  # the structures behind allocated sample pointers

    # -- library lifecycle

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        if self.init_count == 0:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        self.init_count -= 1

    # -- devices

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        self._check("nvmlDeviceGetHandleByUUID")
        for device in self.gpus + self.migs:
            if device.uuid == uuid:
                return device
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, device: FakeGpu) -> FakeGpu:
        if device.parent is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return device.parent

    def nvmlDeviceGetUUID(self, device: FakeGpu) -> str:
        return device.uuid

    def nvmlDeviceGetIndex(self, device: FakeGpu) -> int:
        if device not in self.gpus:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus.index(device)

    # -- readings

    def nvmlDeviceGetSamples(
        self, device: FakeGpu, sampling_type: int, timestamp: int
    ) -> tuple[int, list[Any]]:
        self.sample_calls[sampling_type] = self.sample_calls.get(sampling_type, 0) + 1
        self._check("nvmlDeviceGetSamples", device)
        assert sampling_type in (NVML_GPU_UTILIZATION_SAMPLES, NVML_MEMORY_UTILIZATION_SAMPLES)
        history = (
            device.samples
            if sampling_type == NVML_GPU_UTILIZATION_SAMPLES
            else device.memory_samples
        )
        newer = [(t, v) for t, v in history if t > timestamp]
        if not newer:  # the driver's answer when nothing is newer than `timestamp`
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        out = []
        for t, v in newer:
            sample = pynvml.c_nvmlSample_t()
            sample.timeStamp = t
            if device.sample_type == NVML_VALUE_TYPE_DOUBLE:
                sample.sampleValue.dVal = v
            else:
                sample.sampleValue.uiVal = int(v)
            out.append(sample)
        return device.sample_type, out

    def nvmlDeviceGetUtilizationRates(self, device: FakeGpu) -> Any:
        self._check("nvmlDeviceGetUtilizationRates", device)
        rates = pynvml.c_nvmlUtilization_t()
        rates.gpu = device.utilization_rate
        rates.memory = 0
        return rates

    def nvmlDeviceGetMemoryInfo(self, device: FakeGpu, version: int | None = None) -> Any:
        self._check("nvmlDeviceGetMemoryInfo", device)
        held = device.memory_used + device.memory_reserved
        if version is None:
            memory = pynvml.c_nvmlMemory_t()
            memory.used = held
        elif version == pynvml.nvmlMemory_v2 and device.memory_v2:
            memory = pynvml.c_nvmlMemory_v2_t()
            memory.version = version
            memory.reserved = device.memory_reserved
            memory.used = device.memory_used
        else:  # pynvml looks the _v2 entry point up in the library: old drivers lack it
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        memory.total = device.memory_total
        memory.free = device.memory_total - held
        return memory

    def nvmlDeviceGetPowerUsage(self, device: FakeGpu) -> int:
        self._check("nvmlDeviceGetPowerUsage", device)
        return device.power_mw

    def nvmlDeviceGetTemperature(self, device: FakeGpu, sensor: int) -> int:
        self._check("nvmlDeviceGetTemperature", device)
        assert sensor == NVML_TEMPERATURE_GPU
        return device.temperature_c

    def nvmlDeviceGetTotalEnergyConsumption(self, device: FakeGpu) -> int:
        self._check("nvmlDeviceGetTotalEnergyConsumption", device)
        return device.energy_mj

    # -- running processes

    def nvmlDeviceGetComputeRunningProcesses(self, device: FakeGpu) -> list[Any]:
        self._check("nvmlDeviceGetComputeRunningProcesses", device)
        return [_process(pid, used, device) for pid, used in device.processes]

    def nvmlDeviceGetGraphicsRunningProcesses(self, device: FakeGpu) -> list[Any]:
        self._check("nvmlDeviceGetGraphicsRunningProcesses", device)
        return [_process(pid, used, device) for pid, used in device.graphics_processes]

    # -- classic counters (field values: per-field return codes, like the driver)

    def nvmlDeviceGetFieldValues(self, device: FakeGpu, field_ids: list[Any]) -> Any:
        self._check("nvmlDeviceGetFieldValues", device)
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for i, spec in enumerate(field_ids):
            field_id, scope = spec if isinstance(spec, tuple) else (spec, 0)
            values[i].fieldId = field_id
            values[i].scopeId = scope
            if field_id in device.field_errors:
                values[i].nvmlReturn = device.field_errors[field_id]
            elif field_id not in device.fields:
                values[i].nvmlReturn = NVML_ERROR_NOT_SUPPORTED
            else:
                values[i].nvmlReturn = NVML_SUCCESS
                if field_id in device.uint32_fields:
                    values[i].valueType = NVML_VALUE_TYPE_UNSIGNED_INT
                    values[i].value.uiVal = device.fields[field_id] % 2**32
                else:
                    values[i].valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                    values[i].value.ullVal = device.fields[field_id]
        return values

    # -- GPM

    def nvmlDeviceGetGpuInstanceId(self, device: FakeGpu) -> int:
        self._check("nvmlDeviceGetGpuInstanceId", device)
        if device.parent is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return device.gpu_instance_id

    def nvmlGpmQueryDeviceSupport(self, device: FakeGpu) -> Any:
        self._check("nvmlGpmQueryDeviceSupport", device)
        if device.parent is not None:  # asked of the physical GPU, not a slice
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(device.gpm_supported)
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        self._check("nvmlGpmSampleAlloc")
        body = pynvml.struct_c_nvmlGpmSample_t()
        self._keep.append(body)
        pointer = ctypes.pointer(body)
        self._gpm_samples[ctypes.addressof(body)] = None
        return ctypes.cast(pointer, pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._check("nvmlGpmSampleFree")
        key = ctypes.addressof(sample.contents)
        if key not in self._gpm_samples:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        del self._gpm_samples[key]

    def nvmlGpmSampleGet(self, device: FakeGpu, sample: Any) -> Any:
        self._check("nvmlGpmSampleGet", device)
        if device.parent is not None:  # slices are sampled through nvmlGpmMigSampleGet
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._snapshot(device, sample)

    def nvmlGpmMigSampleGet(self, device: FakeGpu, gpu_instance_id: int, sample: Any) -> Any:
        self._check("nvmlGpmMigSampleGet", device)
        slices = [m for m in self.migs if m.parent is device]
        match = [m for m in slices if m.gpu_instance_id == gpu_instance_id]
        if not match:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._snapshot(match[0], sample)

    def _snapshot(self, device: FakeGpu, sample: Any) -> Any:
        target = device.parent or device
        if not target.gpm_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        key = ctypes.addressof(sample.contents)
        if key not in self._gpm_samples:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        self._gpm_samples[key] = (device, device.gpm_time_s, dict(device.gpm_integrals))
        return sample

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        self._check("nvmlGpmMetricsGet")
        if request.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        first = self._gpm_samples.get(ctypes.addressof(request.sample1.contents))
        second = self._gpm_samples.get(ctypes.addressof(request.sample2.contents))
        if first is None or second is None or first[0] is not second[0]:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        device, t1, integrals1 = first
        _, t2, integrals2 = second
        if device.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        elapsed = t2 - t1
        for i in range(request.numMetrics):
            metric = request.metrics[i]
            metric_id = int(metric.metricId)
            if metric_id in device.gpm_errors:
                metric.nvmlReturn = device.gpm_errors[metric_id]
            elif elapsed <= 0:
                metric.nvmlReturn = NVML_ERROR_INVALID_ARGUMENT
            else:
                delta = integrals2.get(metric_id, 0.0) - integrals1.get(metric_id, 0.0)
                metric.nvmlReturn = NVML_SUCCESS
                metric.value = delta / elapsed
        return request

    def _check(self, function: str, device: FakeGpu | None = None) -> None:
        self.calls[function] = self.calls.get(function, 0) + 1
        if self.init_count == 0:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if device is not None and (device.lost or (device.parent and device.parent.lost)):
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if device is not None and function in device.errors:
            raise NVMLError(device.errors[function])


def _process(pid: int, used: int | None, device: FakeGpu) -> Any:
    """What pynvml hands back for one process (its friendly object, None when unknown)."""
    info = pynvml.c_nvmlProcessInfo_v2_t()
    info.pid = pid
    info.usedGpuMemory = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value if used is None else used
    info.gpuInstanceId = device.gpu_instance_id if device.parent else 0xFFFFFFFF
    info.computeInstanceId = 0xFFFFFFFF
    obj = pynvml.nvmlStructToFriendlyObject(info)
    if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
        obj.usedGpuMemory = None
    return obj


def four_gpus() -> list[FakeGpu]:
    return [FakeGpu(uuid=f"GPU-{i}{i}{i}{i}aaaa-0000-0000-0000-00000000000{i}") for i in range(4)]
