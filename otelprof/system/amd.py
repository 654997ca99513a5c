"""AMD GPU metrics through AMD SMI (`amdsmi`, ROCm's Python binding), under the same names.

Used when NVML finds no NVIDIA GPU: NVIDIA's instruments and attributes, so dashboards and
reports need no AMD branch (DRAM bandwidth is the memory controller's busy share, source
`amdsmi`). Visible devices: `HIP_VISIBLE_DEVICES`, else `CUDA_VISIBLE_DEVICES` (HIP honours
both), else `ROCR_VISIBLE_DEVICES`, read like CUDA's. What a board lacks ("N/A" or
NOT_SUPPORTED) is absent, never 0. Each read is stamped right before its call, like NVML's.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
from collections.abc import Callable, Mapping
from typing import Any

from . import names
from ._common import LogOnce, Reading, logger
from ._gpu_query import GpuIdentity, QueryPolicy, select_visible
from ._stamps import Clock
from .gpu import _ProcessTree, parse_visible_devices

MIB = 2**20
VISIBILITY_VARIABLES = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
SOURCE_AMDSMI = "amdsmi"

# amdsmi_status_t codes that will not change by asking again (amdsmi_wrapper.py)
_STATUS_INVAL = 1
_STATUS_NOT_SUPPORTED = 2
_STATUS_NOT_YET_IMPLEMENTED = 3
_STATUS_NO_PERM = 10
_PERMANENT = {_STATUS_INVAL, _STATUS_NOT_SUPPORTED, _STATUS_NOT_YET_IMPLEMENTED, _STATUS_NO_PERM}


class AmdGpuSampler:
    """Owns the AMD SMI session: `start` initializes it, `close` shuts it down."""

    def __init__(
        self,
        selection: str = "visible",
        amdsmi: Any = None,
        env: Mapping[str, str] | None = None,
        log: LogOnce | None = None,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self._selection = selection
        self._amdsmi = amdsmi
        self._env = os.environ if env is None else env
        self._log = log or LogOnce()
        self._queries = QueryPolicy("AMD SMI", self._log, _refusal, "amd-")
        self._query = self._queries.query
        self._clock: Callable[[], int] = clock or Clock()
        self._pids = _ProcessTree(os.getpid())
        self._initialized = False
        self.devices: list[GpuIdentity] = []

    def start(self) -> bool:
        """Initialize AMD SMI and resolve the GPUs; False (quietly, at debug) if none."""
        if self._amdsmi is None:
            try:
                # amdsmi prints to stdout when libamd_smi.so is missing, then raises
                with contextlib.redirect_stdout(io.StringIO()):
                    import amdsmi
            except Exception as exc:
                logger.debug("AMD GPU metrics off: amdsmi cannot be imported (%s)", exc)
                return False
            self._amdsmi = amdsmi
        smi = self._amdsmi
        try:
            smi.amdsmi_init(smi.AmdSmiInitFlags.INIT_AMD_GPUS)
        except Exception as exc:
            logger.debug("AMD GPU metrics off: AMD SMI is not available (%s)", exc)
            return False
        self._initialized = True
        try:
            self.devices = self._resolve()
        except Exception as exc:
            logger.info("AMD GPU metrics off: cannot list GPUs through AMD SMI (%s)", exc)
            self.devices = []
        if not self.devices:
            self.close()
            return False
        logger.info(
            "GPU metrics (AMD SMI) for %d GPU(s): %s",
            len(self.devices),
            ", ".join(f"{d.index}={d.uuid}" for d in self.devices),
        )
        return True

    def close(self) -> None:
        if self._initialized:
            self._initialized = False
            try:
                self._amdsmi.amdsmi_shut_down()
            except Exception as exc:
                logger.debug("amdsmi_shut_down failed: %s", exc)

    def _resolve(self) -> list[GpuIdentity]:
        smi = self._amdsmi
        every = [
            GpuIdentity(h, str(smi.amdsmi_get_gpu_device_uuid(h)), i)
            for i, h in enumerate(smi.amdsmi_get_processor_handles())
        ]
        if self._selection == "all" or not every:
            return every
        variable = next((v for v in VISIBILITY_VARIABLES if v in self._env), None)
        entries = parse_visible_devices(self._env.get(variable) if variable else None)
        if entries is None:
            return every
        chosen = select_visible(entries, every)
        if not chosen:
            logger.info("AMD GPU metrics off: %s selects no GPU", variable)
        return chosen

    # -- sampling ----------------------------------------------------------------------

    def sample(self) -> list[Reading]:
        out: list[Reading] = []
        pids = self._pids.current()
        for device in self.devices:
            self._sample_device(device, pids, out)
        return out

    def _sample_device(self, device: GpuIdentity, pids: frozenset[int], out: list[Reading]) -> None:
        smi = self._amdsmi
        h = device.handle
        attrs, hw_attrs = device.attributes, device.hw_attributes
        clock = self._clock

        now = clock()
        activity = self._query(device, "activity", lambda: smi.amdsmi_get_gpu_activity(h))
        if activity is not None:
            gfx = _number(activity.get("gfx_activity"))
            if gfx is not None:
                out.append(Reading(names.GPU_UTILIZATION.name, gfx / 100.0, attrs, now))
            umc = _number(activity.get("umc_activity"))
            if umc is not None:
                bw_attrs = {**attrs, names.GPU_SOURCE: SOURCE_AMDSMI}
                out.append(Reading(names.GPU_DRAM_BANDWIDTH.name, umc / 100.0, bw_attrs, now))

        now = clock()
        vram = self._query(device, "vram", lambda: smi.amdsmi_get_gpu_vram_usage(h))
        if vram is not None:
            total, used = _number(vram.get("vram_total")), _number(vram.get("vram_used"))
            if total is not None and used is not None:
                out.append(Reading(names.GPU_MEMORY_FREE.name, (total - used) * MIB, attrs, now))
                out.append(Reading(names.GPU_MEMORY_USAGE.name, used * MIB, attrs, now))
                out.append(Reading(names.GPU_MEMORY_LIMIT.name, total * MIB, attrs, now))

        now = clock()
        power = self._query(device, "power", lambda: smi.amdsmi_get_power_info(h))
        if power is not None:
            watts = _number(power.get("current_socket_power"))
            if watts is None:
                watts = _number(power.get("average_socket_power"))
            if watts is not None:
                out.append(Reading(names.GPU_POWER.name, float(watts), hw_attrs, now))

        now = clock()
        celsius = self._temperature(device)
        if celsius is not None:
            out.append(Reading(names.GPU_TEMPERATURE.name, celsius, hw_attrs, now))

        now = clock()
        energy = self._query(device, "energy", lambda: smi.amdsmi_get_energy_count(h))
        if energy is not None:
            count = _number(energy.get("energy_accumulator"))
            resolution = _number(energy.get("counter_resolution"))
            if count is not None and resolution:
                joules = count * resolution / 1e6
                out.append(Reading(names.GPU_ENERGY.name, joules, hw_attrs, now))

        now = clock()
        processes = self._query(device, "processes", lambda: smi.amdsmi_get_gpu_process_list(h))
        if processes is not None:
            mine = [p for p in processes if int(p.get("pid", -1)) in pids]
            vram = [_number((p.get("memory_usage") or {}).get("vram_mem")) for p in mine]
            known = [u for u in vram if u is not None]
            if mine and len(known) == len(vram):
                total_b = float(sum(known))
                out.append(Reading(names.GPU_PROCESS_MEMORY.name, total_b, attrs, now))

    def _temperature(self, device: GpuIdentity) -> float | None:
        smi = self._amdsmi
        current = smi.AmdSmiTemperatureMetric.CURRENT
        for sensor in ("EDGE", "HOTSPOT"):
            kind = getattr(smi.AmdSmiTemperatureType, sensor)
            read = functools.partial(smi.amdsmi_get_temp_metric, device.handle, kind, current)
            number = _number(self._query(device, f"temperature-{sensor.lower()}", read))
            if number is not None:
                return number
        return None


def _refusal(exc: Exception) -> str | None:
    code = _code(exc)
    return f"status {code}" if code in _PERMANENT else None


def _code(exc: BaseException) -> int | None:
    """The amdsmi_status_t of an AmdSmiLibraryException (None for any other error)."""
    get = getattr(exc, "get_error_code", None)
    try:
        return int(get()) if callable(get) else None
    except Exception:
        return None


def _number(value: Any) -> float | None:
    """A reading as a float; AMD SMI's "N/A" (and anything non-numeric) is None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
