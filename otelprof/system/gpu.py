"""GPU metrics from NVML for the GPUs this job can see (or all of them, on request).

`CUDA_VISIBLE_DEVICES` is read the way CUDA reads it (`parse_visible_devices`,
`select_visible`). Its indices are NVML (PCI bus) indices, which match CUDA's only with
`CUDA_DEVICE_ORDER=PCI_BUS_ID` or GPUs all of one model; `gpu.index` is the NVML index
(nvidia-smi's, dcgm-exporter's), a MIG device's its parent's. Utilization is the mean
of NVML's samples since the last collection, else NVML's last period. What the units do
(GPM): `_gpu_perf.py`; errors: `_gpu_query.QueryPolicy`. Each read is stamped right before
its NVML call (`_stamps`). No pynvml, driver or GPU: GPU metrics off, one log line.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import names
from ._common import LogOnce, Reading, describe, logger
from ._gpu_perf import GpuDevice, GpuPerf, fresh_mean, permanent_codes, skip_history
from ._gpu_query import QueryPolicy
from ._stamps import Clock


def parse_visible_devices(value: str | None) -> list[str] | None:
    """`CUDA_VISIBLE_DEVICES` entries in order, or None when unset (every GPU is visible).

    Like CUDA, parsing stops at the first entry that is not an index, `GPU-…` or `MIG-…`
    (so `-1` or `""` hide every GPU).
    """
    if value is None:
        return None
    entries: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if entry.isdigit() or entry.startswith(("GPU-", "MIG-")):
            entries.append(entry)
        else:
            break
    return entries


def select_visible(
    entries: list[str], every: list[GpuDevice], lookup_mig: Callable[[str], GpuDevice | None]
) -> list[GpuDevice]:
    """The devices `CUDA_VISIBLE_DEVICES`' `entries` name, the way CUDA reads them: an index
    or a unique `GPU-` UUID prefix; a `MIG-` UUID through `lookup_mig` (skipped when not
    found); everything after an entry that names no device is ignored."""
    chosen: list[GpuDevice] = []
    for entry in entries:
        device: GpuDevice | None
        if entry.isdigit():
            device = every[int(entry)] if int(entry) < len(every) else None
        elif entry.startswith("MIG-"):
            device = lookup_mig(entry)
            if device is None:
                continue
        else:
            matches = [d for d in every if d.uuid.startswith(entry)]
            device = matches[0] if len(matches) == 1 else None
        if device is None:
            break
        if all(device.uuid != d.uuid for d in chosen):
            chosen.append(device)
    return chosen


class GpuSampler:
    """Owns the NVML session: init once in `start`, shut down in `close`."""

    def __init__(
        self,
        selection: str = "visible",
        nvml: Any = None,
        env: Mapping[str, str] | None = None,
        log: LogOnce | None = None,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self._selection = selection
        self._nvml = nvml
        self._env = os.environ if env is None else env
        self._log = log or LogOnce()
        self._queries = QueryPolicy(self._log, self._refusal)
        self._query = self._queries.query
        self._initialized = False
        self._clock: Callable[[], int] = clock or Clock()
        self._pids = _ProcessTree(os.getpid())
        self._perf: GpuPerf | None = None
        self.devices: list[GpuDevice] = []

    def start(self) -> bool:
        """Initialize NVML and resolve the GPUs; False (after one log line) if there are none."""
        if self._nvml is None:
            try:
                import pynvml
            except Exception as exc:
                logger.info("GPU metrics off: pynvml cannot be imported (%s)", exc)
                return False
            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:
            logger.info("GPU metrics off: NVML is not available (%s)", describe(exc))
            return False
        self._initialized = True
        try:
            self.devices = self._resolve()
        except Exception as exc:
            logger.info("GPU metrics off: cannot list GPUs through NVML (%s)", describe(exc))
            self.devices = []
        if not self.devices:
            self.close()
            return False
        self._perf = GpuPerf(nvml, self._clock, self._log, self._queries)
        for device in self.devices:
            skip_history(nvml, device, getattr(nvml, "NVML_GPU_UTILIZATION_SAMPLES", 1))
            self._perf.start(device)
        logger.info(
            "GPU metrics for %d GPU(s): %s",
            len(self.devices),
            ", ".join(f"{d.index}={d.uuid}" for d in self.devices),
        )
        return True

    def close(self) -> None:
        if self._initialized:
            self._initialized = False
            if self._perf is not None:
                for device in self.devices:
                    self._perf.free(device)
            try:
                self._nvml.nvmlShutdown()
            except Exception as exc:
                logger.debug("nvmlShutdown failed: %s", describe(exc))

    # -- device selection -------------------------------------------------------------

    def _resolve(self) -> list[GpuDevice]:
        nvml = self._nvml
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            logger.info("GPU metrics off: NVML reports no GPU")
            return []
        every = []
        for index in range(count):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            every.append(GpuDevice(handle, _text(nvml.nvmlDeviceGetUUID(handle)), index))
        if self._selection == "all":
            return every
        raw = self._env.get("CUDA_VISIBLE_DEVICES")
        entries = parse_visible_devices(raw)
        if entries is None:
            return every
        chosen = select_visible(entries, every, self._lookup_mig)
        if not chosen:
            logger.info("GPU metrics off: CUDA_VISIBLE_DEVICES=%r selects no GPU", raw)
        return chosen

    def _lookup_mig(self, entry: str) -> GpuDevice | None:
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(entry)
            parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            return GpuDevice(handle, uuid, nvml.nvmlDeviceGetIndex(parent), parent=parent)
        except Exception as exc:
            logger.info("MIG device %s not found through NVML (%s); omitted", entry, describe(exc))
            return None

    # -- sampling ----------------------------------------------------------------------

    def sample(self) -> list[Reading]:
        out: list[Reading] = []
        pids = self._pids.current()
        for device in self.devices:
            self._sample_device(device, out)
            self._guarded(device, "process memory", self._process_memory, pids, out)
            if self._perf is not None:
                self._guarded(device, "performance", self._perf.sample, out)
        return out

    def _guarded(self, device: GpuDevice, part: str, read: Callable[..., None], *args: Any) -> None:
        """Run one part of a device's sample; a bug in it must not cost the other series."""
        try:
            read(device, *args)
        except Exception as exc:
            self._queries.transient(device, part, exc)

    def _sample_device(self, device: GpuDevice, out: list[Reading]) -> None:
        nvml = self._nvml
        handle = device.handle
        attrs = device.attributes
        clock = self._clock
        now = clock()
        utilization, averaged = self._utilization(device)
        if utilization is not None:
            # NVML's samples average since our last read; its utilization rate covers the
            # driver's own last period, so only the former has a window start
            start, device.last_utilization_ns = device.last_utilization_ns, now
            out.append(
                Reading(
                    names.GPU_UTILIZATION.name, utilization, attrs, now, start if averaged else None
                )
            )
        now = clock()
        memory = self._memory(device)
        if memory is not None:
            out.append(Reading(names.GPU_MEMORY_FREE.name, float(memory.free), attrs, now))
            out.append(Reading(names.GPU_MEMORY_USAGE.name, float(memory.used), attrs, now))
            out.append(Reading(names.GPU_MEMORY_LIMIT.name, float(memory.total), attrs, now))
        hw_attrs = device.hw_attributes
        now = clock()
        milliwatts = self._query(device, "power", lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        if milliwatts is not None:
            out.append(Reading(names.GPU_POWER.name, milliwatts / 1000.0, hw_attrs, now))
        now = clock()
        celsius = self._query(
            device,
            "temperature",
            lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
        )
        if celsius is not None:
            out.append(Reading(names.GPU_TEMPERATURE.name, float(celsius), hw_attrs, now))
        now = clock()
        millijoules = self._query(
            device, "energy", lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        )
        if millijoules is not None:
            out.append(Reading(names.GPU_ENERGY.name, millijoules / 1000.0, hw_attrs, now))

    def _memory(self, device: GpuDevice) -> Any:
        """Device memory as nvidia-smi and DCGM count it: v2's `used` leaves out what the
        driver reserves for itself, which v1's includes. Drivers without v2 give v1."""
        nvml = self._nvml
        v2 = getattr(nvml, "nvmlMemory_v2", None)
        if v2 is not None and "memory v2" not in device.refused:
            try:
                return nvml.nvmlDeviceGetMemoryInfo(device.handle, version=v2)
            except Exception as exc:
                if self._refusal(exc) is None:
                    self._queries.transient(device, "memory", exc)
                    return None
                device.refused.add("memory v2")  # an older driver: v1 from now on
        return self._query(device, "memory", lambda: nvml.nvmlDeviceGetMemoryInfo(device.handle))

    def _process_memory(self, device: GpuDevice, pids: frozenset[int], out: list[Reading]) -> None:
        """GPU memory held on this device by this process and its children (NVML's compute
        and graphics lists, a process in both counted once). Omitted, never undercounted,
        when one of ours has no figure (no permission, WDDM) or none of ours is listed.
        """
        nvml = self._nvml
        now = self._clock()
        compute = self._query(
            device,
            "processes",
            lambda: nvml.nvmlDeviceGetComputeRunningProcesses(device.handle),
        )
        if compute is None:
            return
        graphics = self._query(
            device,
            "graphics-processes",
            lambda: nvml.nvmlDeviceGetGraphicsRunningProcesses(device.handle),
        )
        used: dict[int, int] = {}
        for proc in list(compute) + list(graphics or []):
            pid = int(proc.pid)
            if pid not in pids:
                continue
            if proc.usedGpuMemory is None:
                return  # unknown for one of ours: omit rather than undercount
            used[pid] = max(used.get(pid, 0), int(proc.usedGpuMemory))
        if not used:
            return  # none of ours listed (nothing held, or PIDs of another namespace)
        total = float(sum(used.values()))
        out.append(Reading(names.GPU_PROCESS_MEMORY.name, total, device.attributes, now))

    def _utilization(self, device: GpuDevice) -> tuple[float | None, bool]:
        """(utilization 0-1 or None, whether it is the mean of samples since the last read)."""
        nvml = self._nvml
        if device.use_samples:
            try:
                mean = fresh_mean(nvml, device, nvml.NVML_GPU_UTILIZATION_SAMPLES)
                if mean is not None:
                    return mean / 100.0, True
                # no sample newer than the last one: use the running average
            except Exception as exc:
                if self._refusal(exc) is not None:
                    device.use_samples = False
                    self._log(
                        f"samples:{device.uuid}",
                        logging.INFO,
                        "GPU %s: NVML utilization samples unavailable (%s); "
                        "using nvmlDeviceGetUtilizationRates instead",
                        device.uuid,
                        describe(exc),
                    )
                else:
                    self._queries.transient(device, "utilization samples", exc)
        rates = self._query(
            device, "utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(device.handle)
        )
        return (None if rates is None else float(rates.gpu) / 100.0), False

    def _refusal(self, exc: Exception) -> str | None:
        """Errors that will not go away by asking again: the series is dropped for good."""
        nvml = self._nvml
        if isinstance(exc, nvml.NVMLError) and getattr(exc, "value", None) in permanent_codes(nvml):
            return describe(exc)
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class _ProcessTree:
    """This process and its descendants' PIDs (GPU work can run in children), refreshed at
    most every `refresh_s`. In a container with its own PID namespace NVML's PIDs are the
    host's and match nothing here, so the series is absent.
    """

    def __init__(self, pid: int, refresh_s: float = 10.0) -> None:
        self._pid = pid
        self._refresh_s = refresh_s
        self._pids: frozenset[int] = frozenset({pid})
        self._at = float("-inf")

    def current(self) -> frozenset[int]:
        now = time.monotonic()
        if now - self._at >= self._refresh_s:
            self._at = now
            try:
                import psutil

                children = psutil.Process(self._pid).children(recursive=True)
                self._pids = frozenset({self._pid, *(c.pid for c in children)})
            except Exception:
                self._pids = frozenset({self._pid})
        return self._pids
