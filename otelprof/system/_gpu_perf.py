"""What a GPU's units actually do: NVML GPM where the GPU has it, classic NVML otherwise.

Why: `hw.gpu.utilization` only says that some kernel ran. GPM (Hopper and later, MIG
slices included) averages SM, occupancy, tensor, DRAM and PCIe/NVLink activity between two
samples; one sample per collection makes each value cover exactly the interval. Where GPM
is missing or refuses a metric, classic NVML gives what it has: DRAM from memory-controller
samples (a coarser proxy), PCIe/NVLink as Δbytes/Δt of cumulative field values, where one
wrap of a 32-bit counter per interval is undone (past 4 GiB per interval it cannot be told).
Every series carries `otelprof.gpu.source` (`gpm`/`nvml`); SM activity, occupancy and tensor
activity exist only through GPM, else they are absent.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import names
from ._common import Attributes, LogOnce, Reading, describe
from ._gpu_query import QueryPolicy
from ._stamps import Baseline

SOURCE_GPM = "gpm"
SOURCE_NVML = "nvml"
UINT_MAX = 0xFFFFFFFF  # field-value scope: summed over every NVLink
MIB = 2**20


@dataclass(frozen=True)
class GpmMetric:
    """One GPM metric id and the series it becomes."""

    key: str  # which quantity (also the key for fallbacks)
    constant: str  # pynvml constant name
    default_id: int  # its value in nvml.h, when the binding lacks the constant
    instrument: names.Instrument
    scale: float  # GPM unit -> instrument unit
    direction: str | None = None


GPM_METRICS = (
    GpmMetric("sm", "NVML_GPM_METRIC_SM_UTIL", 2, names.GPU_SM_ACTIVITY, 0.01),
    GpmMetric("occupancy", "NVML_GPM_METRIC_SM_OCCUPANCY", 3, names.GPU_SM_OCCUPANCY, 0.01),
    GpmMetric("tensor", "NVML_GPM_METRIC_ANY_TENSOR_UTIL", 5, names.GPU_TENSOR_ACTIVITY, 0.01),
    GpmMetric("dram", "NVML_GPM_METRIC_DRAM_BW_UTIL", 10, names.GPU_DRAM_BANDWIDTH, 0.01),
    GpmMetric(
        "pcie_tx", "NVML_GPM_METRIC_PCIE_TX_PER_SEC", 20, names.GPU_PCIE_IO, MIB, names.TRANSMIT
    ),
    GpmMetric(
        "pcie_rx", "NVML_GPM_METRIC_PCIE_RX_PER_SEC", 21, names.GPU_PCIE_IO, MIB, names.RECEIVE
    ),
    GpmMetric(
        "nvlink_rx",
        "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC",
        60,
        names.GPU_NVLINK_IO,
        MIB,
        names.RECEIVE,
    ),
    GpmMetric(
        "nvlink_tx",
        "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC",
        61,
        names.GPU_NVLINK_IO,
        MIB,
        names.TRANSMIT,
    ),
)


@dataclass(frozen=True)
class CounterField:
    """A cumulative NVML field value whose Δ/Δt is a classic-NVML rate: the series of the
    GPM metric of the same `key`."""

    key: str
    constant: str
    default_id: int
    scope: int | None
    scale: float  # counter unit -> bytes


COUNTER_FIELDS = (
    CounterField("pcie_tx", "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", 197, None, 1),
    CounterField("pcie_rx", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", 198, None, 1),
    CounterField("nvlink_tx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", 138, UINT_MAX, 1024),
    CounterField("nvlink_rx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", 139, UINT_MAX, 1024),
)
_GPM_BY_KEY = {m.key: m for m in GPM_METRICS}

_UINT32 = 1  # NVML_VALUE_TYPE_UNSIGNED_INT: a counter that wraps at 2**32
_VALUE_FIELDS = dict(enumerate(("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")))


@dataclass
class PerfState:
    """Per-device GPM session and counter baselines."""

    gpm: bool = False
    gpm_keys: set[str] = field(default_factory=set)  # quantities GPM delivers on this device
    samples: list[Any] = field(default_factory=list)  # two allocated GPM samples
    previous: int = 0  # index in `samples` of the previous sample
    gpm_baseline: Baseline[int] = field(default_factory=Baseline)
    mig_instance: int | None = None
    counters: dict[str, Baseline[float]] = field(default_factory=dict)
    refused_fields: set[str] = field(default_factory=set)


@dataclass
class GpuDevice:
    """One GPU (or MIG slice) being sampled: its NVML handle, the attributes every series of
    it carries, the metrics NVML has refused, and NVML's state for it."""

    handle: Any
    uuid: str
    index: int
    refused: set[str] = field(default_factory=set)
    parent: Any = None  # the physical GPU's handle, for a MIG slice
    use_samples: bool = True
    last_samples_us: dict[int, int] = field(default_factory=dict)  # by kind of sample
    last_utilization_ns: int | None = None
    perf: PerfState = field(default_factory=PerfState)

    @property
    def attributes(self) -> Attributes:
        return {names.HW_ID: self.uuid, names.GPU_INDEX: self.index}

    @property
    def hw_attributes(self) -> Attributes:
        return {**self.attributes, names.HW_TYPE: "gpu"}


class GpuPerf:
    """GPM (or classic) performance series for the sampler's devices."""

    def __init__(
        self, nvml: Any, clock: Callable[[], int], log: LogOnce, queries: QueryPolicy
    ) -> None:
        self._nvml = nvml
        self._clock = clock
        self._log = log
        self._queries = queries

    def _const(self, name: str, default: int) -> int:
        return int(getattr(self._nvml, name, default))

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, device: GpuDevice) -> None:
        """Find out whether GPM works on this device; if so take the first sample."""
        state = device.perf
        nvml = self._nvml
        target = device.parent if device.parent is not None else device.handle
        try:
            support = nvml.nvmlGpmQueryDeviceSupport(target)
            supported = bool(support.isSupportedDevice)
            if supported and device.parent is not None:
                state.mig_instance = int(nvml.nvmlDeviceGetGpuInstanceId(device.handle))
            if supported:
                state.samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
                self._take(device, state.samples[0])
                state.gpm_baseline.advance(self._clock(), 0)
                state.previous = 0
        except Exception as exc:
            supported = False
            reason = describe(exc)
            self.free(device)
        else:
            reason = "the GPU does not support it (GPM needs Hopper or later)"
        skip_history(nvml, device, self._const("NVML_MEMORY_UTILIZATION_SAMPLES", 1))
        if not supported:
            self._log(
                f"gpm:{device.uuid}",
                logging.INFO,
                "GPU %s: NVML GPM unavailable (%s); SM activity, SM occupancy and tensor "
                "activity omitted, DRAM/PCIe/NVLink from classic NVML counters",
                device.uuid,
                reason,
            )
            return
        state.gpm = True
        state.gpm_keys = {m.key for m in GPM_METRICS}

    def free(self, device: GpuDevice) -> None:
        for sample in device.perf.samples:
            with contextlib.suppress(Exception):
                self._nvml.nvmlGpmSampleFree(sample)
        device.perf.samples = []
        device.perf.gpm = False

    def _take(self, device: GpuDevice, sample: Any) -> None:
        state = device.perf
        if state.mig_instance is not None:
            self._nvml.nvmlGpmMigSampleGet(device.parent, state.mig_instance, sample)
        else:
            self._nvml.nvmlGpmSampleGet(device.handle, sample)

    # -- sampling ------------------------------------------------------------------------

    def sample(self, device: GpuDevice, out: list[Reading]) -> None:
        state = device.perf
        if state.gpm:
            self._sample_gpm(device, out)
        fallback = [f for f in COUNTER_FIELDS if f.key not in state.gpm_keys]
        if fallback:
            self._sample_counters(device, fallback, out)
        if "dram" not in state.gpm_keys:
            self._sample_dram(device, out)

    def _sample_gpm(self, device: GpuDevice, out: list[Reading]) -> None:
        state = device.perf
        nvml = self._nvml
        current = state.samples[1 - state.previous]
        now = self._clock()
        try:
            self._take(device, current)
        except Exception as exc:
            self._queries.transient(device, "GPM sample", exc)
            return
        window = state.gpm_baseline.advance(now, 0)
        if window is None:
            return  # shorter than MIN_WINDOW_S: the next sample covers it
        _, _, start = window
        previous = state.samples[state.previous]
        state.previous = 1 - state.previous
        wanted = [m for m in GPM_METRICS if m.key in state.gpm_keys]
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = self._const("NVML_GPM_METRICS_GET_VERSION", 1)
        request.numMetrics = len(wanted)
        request.sample1 = previous
        request.sample2 = current
        for i, metric in enumerate(wanted):
            request.metrics[i].metricId = self._const(metric.constant, metric.default_id)
        try:
            nvml.nvmlGpmMetricsGet(request)
        except Exception as exc:
            self._queries.transient(device, "GPM metrics", exc)
            return
        success = self._const("NVML_SUCCESS", 0)
        for i, metric in enumerate(wanted):
            result = request.metrics[i]
            code = int(result.nvmlReturn)
            if code != success:
                # INVALID_ARGUMENT for one metric (e.g. samples too close) is not a refusal
                if code in permanent_codes(nvml) - {self._const("NVML_ERROR_INVALID_ARGUMENT", 2)}:
                    state.gpm_keys.discard(metric.key)
                    self._log(
                        f"gpm-refused:{device.uuid}:{metric.key}",
                        logging.INFO,
                        "GPU %s: GPM refuses %s (NVML error %d); classic NVML used where it "
                        "has the quantity",
                        device.uuid,
                        metric.constant,
                        code,
                    )
                continue
            attrs = _attributes(device, SOURCE_GPM, metric)
            value = float(result.value) * metric.scale
            out.append(Reading(metric.instrument.name, value, attrs, now, start))

    def _sample_counters(
        self, device: GpuDevice, fields: list[CounterField], out: list[Reading]
    ) -> None:
        state = device.perf
        live = [f for f in fields if f.key not in state.refused_fields]
        if not live:
            return
        ids = [
            self._const(f.constant, f.default_id)
            if f.scope is None
            else (self._const(f.constant, f.default_id), f.scope)
            for f in live
        ]
        now = self._clock()
        values = self._queries.query(
            device, "counters", lambda: self._nvml.nvmlDeviceGetFieldValues(device.handle, ids)
        )
        if values is None:
            return
        success = self._const("NVML_SUCCESS", 0)
        refused: list[str] = []
        for spec, value in zip(live, values, strict=False):
            code = int(value.nvmlReturn)
            if code != success:
                if code in permanent_codes(self._nvml):
                    state.refused_fields.add(spec.key)
                    refused.append(f"{spec.constant} (error {code})")
                continue
            value_type = int(value.valueType)
            total = float(getattr(value.value, _VALUE_FIELDS.get(value_type, "ullVal")))
            baseline = state.counters.setdefault(spec.key, Baseline())
            window = baseline.advance(now, total)
            if window is None:
                continue
            previous, dt, start = window
            delta = total - previous
            if delta < 0:
                if value_type != _UINT32:
                    continue  # counter reset (driver reload): the next window is clean
                delta += 2**32  # a 32-bit counter wrapped (once: see the module docstring)
            series = _GPM_BY_KEY[spec.key]
            attrs = _attributes(device, SOURCE_NVML, series)
            rate = delta * spec.scale / dt
            out.append(Reading(series.instrument.name, rate, attrs, now, start))
        if refused:
            self._log(
                f"field-refused:{device.uuid}:{','.join(refused)}",
                logging.INFO,
                "GPU %s: NVML refuses %s; those series are omitted",
                device.uuid,
                ", ".join(refused),
            )

    def _sample_dram(self, device: GpuDevice, out: list[Reading]) -> None:
        nvml = self._nvml
        kind = self._const("NVML_MEMORY_UTILIZATION_SAMPLES", 1)
        now = self._clock()
        state = device.perf
        baseline = state.counters.setdefault("dram-window", Baseline())
        mean = self._queries.query(device, "memory-samples", lambda: fresh_mean(nvml, device, kind))
        window = baseline.advance(now, 0.0)
        start = window[2] if window is not None else None
        if mean is None:
            return
        attrs = {**device.attributes, names.GPU_SOURCE: SOURCE_NVML}
        out.append(Reading(names.GPU_DRAM_BANDWIDTH.name, mean / 100.0, attrs, now, start))


def _attributes(device: GpuDevice, source: str, series: GpmMetric) -> Attributes:
    attrs: Attributes = {**device.attributes, names.GPU_SOURCE: source}
    if series.direction is not None:
        attrs[names.NETWORK_DIRECTION] = series.direction
    return attrs


def permanent_codes(nvml: Any) -> set[int]:
    """NVML errors that will not go away by asking again."""
    return {
        int(getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3)),
        int(getattr(nvml, "NVML_ERROR_NO_PERMISSION", 4)),
        int(getattr(nvml, "NVML_ERROR_INVALID_ARGUMENT", 2)),
        int(getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)),
    }


def skip_history(nvml: Any, device: GpuDevice, kind: int) -> None:
    """Skip the driver's history of samples of `kind`, so the first mean covers only our
    interval (refused or failing: the first sample() finds out and says so)."""
    with contextlib.suppress(Exception):
        fresh_mean(nvml, device, kind)


def fresh_mean(nvml: Any, device: GpuDevice, kind: int) -> float | None:
    """Mean of the driver's samples of `kind` newer than the last ones used; None if none.

    NVML answers NOT_FOUND when nothing is newer: then this interval has no value (the
    memory controller's own sampling period is longer than the interval).
    """
    last = device.last_samples_us.get(kind, 0)
    try:
        value_type, samples = nvml.nvmlDeviceGetSamples(device.handle, kind, last)
    except nvml.NVMLError as exc:
        if getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_NOT_FOUND", 6):
            return None
        raise
    fresh = [s for s in samples if int(s.timeStamp) > last]
    if not fresh:
        return None
    device.last_samples_us[kind] = max(int(s.timeStamp) for s in fresh)
    values = [float(getattr(s.sampleValue, _VALUE_FIELDS.get(value_type, "uiVal"))) for s in fresh]
    return sum(values) / len(values)
