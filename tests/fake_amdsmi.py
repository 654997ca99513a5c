"""A stand-in for AMD SMI (`amdsmi`), for machines without an AMD GPU.

The real `amdsmi` package cannot even be imported without ROCm's libamd_smi.so, so its
error class and constants are reproduced here as `amdsmi_exception.py` and
`amdsmi_wrapper.py` (amdsmi 7.0) define them: `AmdSmiLibraryException(err_code)` with
`get_error_code()`, the `amdsmi_status_t` codes, the IntEnums' values. The functions return
what `amdsmi_interface.py` returns: dicts with the same keys and units (VRAM in MiB, power
in W, energy as accumulator × resolution in µJ), "N/A" where the driver has no value, and
raise the library exception where the driver refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

AMDSMI_STATUS_INVAL = 1
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_NO_PERM = 10
AMDSMI_STATUS_INIT_ERROR = 18
AMDSMI_STATUS_NOT_FOUND = 31
AMDSMI_STATUS_DRM_ERROR = 6


class AmdSmiException(Exception):
    """Base smi exception class (as in amdsmi_exception.py)."""


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int) -> None:
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code

    def __str__(self) -> str:
        return f"Error code:\n\t{self.err_code}"

    def get_error_code(self) -> int:
        return self.err_code


class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_CPUS = 1
    INIT_AMD_GPUS = 2


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0
    MAX = 1


@dataclass
class FakeAmdGpu:
    """What the driver knows about one AMD GPU."""

    uuid: str
    gfx_activity: int | str = 0  # percent, "N/A" when the board lacks it
    umc_activity: int | str = 0
    vram_total_mib: int = 192 * 1024
    vram_used_mib: int = 0
    current_socket_power: int | str = "N/A"  # MI200 reports only the average
    average_socket_power: int | str = 300
    edge_c: int | None = None  # None: no edge sensor (MI300): NOT_SUPPORTED
    hotspot_c: int = 60
    energy_accumulator: int = 0
    counter_resolution: float = 15.3  # µJ per count
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, VRAM bytes)
    errors: dict[str, int] = field(default_factory=dict)  # function -> amdsmi_status_t
    lost: bool = False


class FakeAmdSmi:
    """Module-like object with amdsmi's function names, backed by FakeAmdGpu objects."""

    AmdSmiException = AmdSmiException
    AmdSmiLibraryException = AmdSmiLibraryException
    AmdSmiInitFlags = AmdSmiInitFlags
    AmdSmiTemperatureType = AmdSmiTemperatureType
    AmdSmiTemperatureMetric = AmdSmiTemperatureMetric

    def __init__(self, gpus: list[FakeAmdGpu], init_error: int | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.initialized = False
        self.calls: dict[str, int] = {}

    def amdsmi_init(self, flag: int = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
        if self.init_error is not None:
            raise AmdSmiLibraryException(self.init_error)
        assert flag == AmdSmiInitFlags.INIT_AMD_GPUS
        self.initialized = True

    def amdsmi_shut_down(self) -> None:
        if not self.initialized:
            raise AmdSmiLibraryException(AMDSMI_STATUS_INIT_ERROR)
        self.initialized = False

    def amdsmi_get_processor_handles(self) -> list[FakeAmdGpu]:
        self._check("amdsmi_get_processor_handles")
        return list(self.gpus)

    def amdsmi_get_gpu_device_uuid(self, gpu: FakeAmdGpu) -> str:
        self._check("amdsmi_get_gpu_device_uuid", gpu)
        return gpu.uuid

    def amdsmi_get_gpu_activity(self, gpu: FakeAmdGpu) -> dict[str, Any]:
        self._check("amdsmi_get_gpu_activity", gpu)
        return {
            "gfx_activity": gpu.gfx_activity,
            "umc_activity": gpu.umc_activity,
            "mm_activity": "N/A",
        }

    def amdsmi_get_gpu_vram_usage(self, gpu: FakeAmdGpu) -> dict[str, Any]:
        self._check("amdsmi_get_gpu_vram_usage", gpu)
        return {"vram_total": gpu.vram_total_mib, "vram_used": gpu.vram_used_mib}

    def amdsmi_get_power_info(self, gpu: FakeAmdGpu) -> dict[str, Any]:
        self._check("amdsmi_get_power_info", gpu)
        return {
            "socket_power": gpu.average_socket_power,
            "current_socket_power": gpu.current_socket_power,
            "average_socket_power": gpu.average_socket_power,
            "gfx_voltage": "N/A",
            "soc_voltage": "N/A",
            "mem_voltage": "N/A",
        }

    def amdsmi_get_temp_metric(self, gpu: FakeAmdGpu, sensor: int, metric: int) -> int:
        self._check("amdsmi_get_temp_metric", gpu)
        assert metric == AmdSmiTemperatureMetric.CURRENT
        if sensor == AmdSmiTemperatureType.EDGE:
            if gpu.edge_c is None:
                raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
            return gpu.edge_c
        return gpu.hotspot_c

    def amdsmi_get_energy_count(self, gpu: FakeAmdGpu) -> dict[str, Any]:
        self._check("amdsmi_get_energy_count", gpu)
        return {
            "energy_accumulator": gpu.energy_accumulator,
            "counter_resolution": gpu.counter_resolution,
            "timestamp": 0,
        }

    def amdsmi_get_gpu_process_list(self, gpu: FakeAmdGpu) -> list[dict[str, Any]]:
        self._check("amdsmi_get_gpu_process_list", gpu)
        return [
            {
                "name": f"python{pid}",
                "pid": pid,
                "mem": vram,
                "engine_usage": {"gfx": 0, "enc": 0},
                "memory_usage": {"gtt_mem": 0, "cpu_mem": 0, "vram_mem": vram},
                "cu_occupancy": "N/A",
            }
            for pid, vram in gpu.processes
        ]

    def _check(self, function: str, gpu: FakeAmdGpu | None = None) -> None:
        self.calls[function] = self.calls.get(function, 0) + 1
        if not self.initialized:
            raise AmdSmiLibraryException(AMDSMI_STATUS_INIT_ERROR)
        if gpu is not None and gpu.lost:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_FOUND)
        if gpu is not None and function in gpu.errors:
            raise AmdSmiLibraryException(gpu.errors[function])
