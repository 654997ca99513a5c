"""Registration of the observable instruments, and the shared sample behind them.

Every instrument's callback reads the same snapshot. A snapshot is taken when a callback
finds the last one older than half the collection interval, so one collection (of any
number of instruments) costs one sample, and a second reader (a Prometheus scrape beside
the periodic exporter) shares it instead of sampling again. Rates in a snapshot cover the
time since the previous snapshot: with the periodic reader alone that is exactly one
collection interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from . import names
from ._common import LogOnce, Reading, logger
from .gpu import GpuSampler
from .host import HostSampler
from .process import ProcessSampler
from .torch_memory import TorchMemorySampler

MIN_INTERVAL_S = 0.1
GPU_SELECTIONS = ("visible", "all", "none")

Source = Callable[[float], list[Reading]]


@dataclass(frozen=True)
class SystemMetricsSettings:
    """What to sample. `interval_s` is the export interval the readers run at (>= 0.1 s)."""

    interval_s: float = 1.0
    host_metrics: bool = True
    gpus: str = "visible"
    process_metrics: bool = True
    torch_cuda_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.interval_s, (int, float)) or not self.interval_s >= MIN_INTERVAL_S:
            raise ValueError(
                f"interval_s must be a number >= {MIN_INTERVAL_S} s, got {self.interval_s!r}"
            )
        if self.gpus not in GPU_SELECTIONS:
            raise ValueError(f"gpus must be one of {', '.join(GPU_SELECTIONS)}, got {self.gpus!r}")


class Snapshots:
    """The latest sample of every source, refreshed at most once per `max_age_s`."""

    def __init__(
        self,
        sources: list[tuple[str, Source]],
        max_age_s: float,
        clock: Callable[[], float] = time.monotonic,
        log: LogOnce | None = None,
    ) -> None:
        self._sources = sources
        self._max_age_s = max_age_s
        self._clock = clock
        self._log = log or LogOnce()
        self._lock = threading.Lock()
        self._time: float | None = None
        self._observations: dict[str, list[Observation]] = {}
        self.samples_taken = 0
        self.closed = False

    def observations(self, name: str) -> list[Observation]:
        with self._lock:
            if self.closed:
                return []
            now = self._clock()
            if self._time is None or now - self._time >= self._max_age_s:
                self._observations = self._take(now)
                self._time = now
                self.samples_taken += 1
            return self._observations.get(name, [])

    def _take(self, now: float) -> dict[str, list[Observation]]:
        by_name: dict[str, list[Observation]] = {}
        for label, source in self._sources:
            try:
                readings = source(now)
            except Exception as exc:  # a sampler bug must not cost the other sources
                self._log(
                    f"source:{label}:{type(exc).__name__}",
                    logging.WARNING,
                    "%s metrics failed (%s: %s); omitted",
                    label,
                    type(exc).__name__,
                    exc,
                )
                continue
            for reading in readings:
                by_name.setdefault(reading.name, []).append(
                    Observation(reading.value, reading.attributes)
                )
        return by_name


class SystemMetricsHandle:
    """What `register_system_metrics` set up; `close()` stops sampling and releases NVML."""

    def __init__(
        self,
        snapshots: Snapshots,
        instruments: tuple[str, ...],
        gpu: GpuSampler | None,
    ) -> None:
        self._snapshots = snapshots
        self.instruments = instruments
        self._gpu = gpu

    @property
    def gpus(self) -> list[tuple[int, str]]:
        """(NVML index, UUID) of every GPU being sampled."""
        return [(d.index, d.uuid) for d in self._gpu.devices] if self._gpu else []

    @property
    def samples_taken(self) -> int:
        return self._snapshots.samples_taken

    def close(self) -> None:
        with self._snapshots._lock:
            self._snapshots.closed = True
        if self._gpu is not None:
            self._gpu.close()


def register_system_metrics(
    meter: Meter,
    settings: SystemMetricsSettings,
    *,
    psutil_module: Any = None,
    nvml: Any = None,
    env: Mapping[str, str] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SystemMetricsHandle:
    """Create the observable instruments on `meter`, primed so the first values are real.

    `psutil_module`, `nvml` and `env` replace the real psutil, pynvml and os.environ (tests
    use fakes for hardware this machine lacks).
    """
    log = LogOnce()
    sources: list[tuple[str, Source]] = []
    instruments: list[names.Instrument] = []
    now = clock()
    if settings.host_metrics:
        host = HostSampler(psutil_module, log=log)
        host.prime(now)
        sources.append(("host", host.sample))
        instruments.extend(names.HOST)
    gpu: GpuSampler | None = None
    if settings.gpus != "none":
        gpu = GpuSampler(settings.gpus, nvml=nvml, env=env, log=log)
        if gpu.start():
            sources.append(("gpu", _ignore_time(gpu.sample)))
            instruments.extend(names.GPU)
        else:
            gpu = None
    if settings.process_metrics:
        process = ProcessSampler(
            None if psutil_module is None else psutil_module.Process(), log=log
        )
        process.prime(now)
        sources.append(("process", process.sample))
        instruments.extend(names.PROCESS)
    if settings.torch_cuda_memory:
        sources.append(("torch", _ignore_time(TorchMemorySampler(log=log).sample)))
        instruments.extend(names.TORCH)

    snapshots = Snapshots(sources, max_age_s=settings.interval_s / 2, clock=clock, log=log)
    for instrument in instruments:
        create = (
            meter.create_observable_counter
            if instrument.kind == "counter"
            else meter.create_observable_gauge
        )
        create(
            instrument.name,
            callbacks=[_callback(snapshots, instrument.name, log)],
            unit=instrument.unit,
            description=instrument.description,
        )
    logger.debug("system metrics registered: %s", ", ".join(i.name for i in instruments))
    return SystemMetricsHandle(snapshots, tuple(i.name for i in instruments), gpu)


def _ignore_time(sample: Callable[[], list[Reading]]) -> Source:
    return lambda _now: sample()


def _callback(
    snapshots: Snapshots, name: str, log: LogOnce
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(_options: CallbackOptions) -> Iterable[Observation]:
        try:
            return snapshots.observations(name)
        except Exception as exc:  # never raise into the SDK's collection
            log(
                f"callback:{name}:{type(exc).__name__}",
                logging.WARNING,
                "collecting %s failed (%s: %s); omitted",
                name,
                type(exc).__name__,
                exc,
            )
            return []

    return observe
