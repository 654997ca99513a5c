"""A stand-in for the NVML driver library, for machines without a GPU.

Only the driver calls are fake: the error classes, constants and ctypes structures are
pynvml's own (they need no driver), so the sampler sees exactly the types and error codes
the real binding produces. Each fake GPU holds the state the driver would report, and
tests change it between collections.
"""

from __future__ import annotations

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


@dataclass
class FakeGpu:
    """What the driver knows about one GPU (or MIG slice)."""

    uuid: str
    samples: list[tuple[int, float]] = field(default_factory=list)  # (timestamp µs, percent)
    sample_type: int = NVML_VALUE_TYPE_UNSIGNED_INT
    utilization_rate: int = 0  # nvmlDeviceGetUtilizationRates().gpu, percent
    memory_total: int = 80 * 2**30
    memory_used: int = 0
    power_mw: int = 100_000
    temperature_c: int = 40
    energy_mj: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code
    parent: FakeGpu | None = None  # set for MIG slices

    def add_sample(self, timestamp_us: int, percent: float) -> None:
        self.samples.append((timestamp_us, percent))


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

    def __init__(
        self, gpus: list[FakeGpu], migs: list[FakeGpu] | None = None, init_error: int | None = None
    ) -> None:
        self.gpus = gpus
        self.migs = migs or []
        self.init_error = init_error
        self.init_count = 0
        self.calls: dict[str, int] = {}

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
        self._check("nvmlDeviceGetSamples", device)
        assert sampling_type == NVML_GPU_UTILIZATION_SAMPLES
        newer = [(t, v) for t, v in device.samples if t > timestamp]
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

    def nvmlDeviceGetMemoryInfo(self, device: FakeGpu) -> Any:
        self._check("nvmlDeviceGetMemoryInfo", device)
        memory = pynvml.c_nvmlMemory_t()
        memory.total = device.memory_total
        memory.used = device.memory_used
        memory.free = device.memory_total - device.memory_used
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

    def _check(self, function: str, device: FakeGpu | None = None) -> None:
        self.calls[function] = self.calls.get(function, 0) + 1
        if self.init_count == 0:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if device is not None and function in device.errors:
            raise NVMLError(device.errors[function])


def four_gpus() -> list[FakeGpu]:
    return [FakeGpu(uuid=f"GPU-{i}{i}{i}{i}aaaa-0000-0000-0000-00000000000{i}") for i in range(4)]
