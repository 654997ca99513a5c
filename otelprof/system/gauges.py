"""Registration of the observable instruments, and the shared sample behind them.

Every callback reads one snapshot, taken afresh only when an instrument already served
from the last one finds it older than half the interval: one collection costs one sample
however far apart its callbacks are, and a second reader (files and OTLP at once) shares it.
Values reach the SDK as `StampedValue`s carrying their read time and window (`_stamps`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from . import _gauge_start, names
from ._common import LogOnce, Reading, logger
from ._gpu_steps import GpuStepMetrics, Training
from ._stamps import Clock, StampedValue, attr_key, recent_counters
from .gpu import GpuSampler
from .host import HostSampler
from .memory_peaks import PhaseMemory, PhasePeaks
from .process import ProcessSampler
from .torch_memory import TorchMemorySampler

MIN_INTERVAL_S = 0.1
GPU_SELECTIONS = ("visible", "all", "none")

Source = Callable[[], list[Reading]]


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
        clock: Clock | None = None,
        log: LogOnce | None = None,
        counters: frozenset[str] = frozenset(),
    ) -> None:
        self._sources = sources
        self._max_age_ns = int(max_age_s * 1e9)
        self._clock = clock or Clock()
        self._log = log or LogOnce()
        self._counters = counters
        self._lock = threading.Lock()
        self._time = 0
        self._served: set[str] = set()
        self._fresh_needed = True  # the first callback samples
        self._observations: dict[str, list[Observation]] = {}
        self.samples_taken = 0
        self.closed = False

    def observations(self, name: str) -> list[Observation]:
        with self._lock:
            if self.closed:
                return []
            now = self._clock()
            # an instrument not served yet from the latest sample gets it whatever its age:
            # with busy threads the callbacks of one collection can be further apart than
            # max_age, and a second sample in the middle of a collection would advance the
            # baselines past windows the first instruments already exported
            again = name in self._served and now - self._time >= self._max_age_ns
            if self._fresh_needed or again:
                self._observations = self._take()
                self._time = now
                self._served = set()
                self._fresh_needed = False
                self.samples_taken += 1
            self._served.add(name)
            return self._observations.get(name, [])

    def final_sample(self) -> None:
        """Make the next collection read every source again, however recent the last one
        (before the final collections at shutdown, which then share that last sample)."""
        with self._lock:
            self._fresh_needed = True

    def _take(self) -> dict[str, list[Observation]]:
        by_name: dict[str, list[Observation]] = {}
        self._clock.resync()
        to_unix = self._clock.to_unix_ns
        for label, source in self._sources:
            try:
                readings = source()
            except Exception as exc:  # a sampler bug must not cost the other sources
                self._log.error(f"source:{label}", exc, f"{label} metrics failed")
                continue
            for reading in readings:
                read = None if reading.time_ns is None else to_unix(reading.time_ns)
                start = None if reading.start_ns is None else to_unix(reading.start_ns)
                if read is not None and reading.name in self._counters:
                    recent_counters.remember(
                        reading.name, attr_key(reading.attributes), reading.value, read
                    )
                by_name.setdefault(reading.name, []).append(
                    Observation(StampedValue(reading.value, read, start), reading.attributes)
                )
        return by_name


class SystemMetricsHandle:
    """What `register_system_metrics` set up; `close()` stops sampling and releases NVML."""

    def __init__(
        self,
        snapshots: Snapshots,
        instruments: tuple[str, ...],
        gpu: GpuSampler | None,
        closers: tuple[Callable[[], None], ...] = (),
    ) -> None:
        self._snapshots = snapshots
        self.instruments = instruments
        self._gpu = gpu
        self._closers = closers

    @property
    def gpus(self) -> list[tuple[int, str]]:
        """(NVML index, UUID) of every GPU being sampled."""
        return [(d.index, d.uuid) for d in self._gpu.devices] if self._gpu else []

    @property
    def samples_taken(self) -> int:
        return self._snapshots.samples_taken

    def final_sample(self) -> None:
        """Before the final collection (shutdown): read the counters again, see Snapshots."""
        self._snapshots.final_sample()

    def close(self) -> None:
        with self._snapshots._lock:
            self._snapshots.closed = True
        if self._gpu is not None:
            self._gpu.close()
        for closer in self._closers:
            closer()


def register_system_metrics(
    meter: Meter,
    settings: SystemMetricsSettings,
    *,
    psutil_module: Any = None,
    nvml: Any = None,
    env: Mapping[str, str] | None = None,
    clock: Clock | Callable[[], float] | None = None,
    training: Training | None = None,
    memory_peaks: PhasePeaks | None = None,
) -> SystemMetricsHandle:
    """Create the observable instruments on `meter`, primed so the first values are real.

    `psutil_module`, `nvml`, `env`: stand-ins for tests. `training` returns
    (steps, phase) for energy per step, GPU idle by phase and RSS by phase; `memory_peaks`
    adds the allocator's peaks by phase. `clock`: a `_stamps.Clock`, or monotonic seconds.
    """
    log = LogOnce()
    clock = _as_clock(clock)
    sources: list[tuple[str, Source]] = []
    instruments: list[names.Instrument] = []
    _gauge_start.install()  # rate windows' start times survive OTLP encoding
    closers: list[Callable[[], None]] = [_gauge_start.uninstall]
    if settings.host_metrics:
        host = HostSampler(psutil_module, log=log, clock=clock)
        host.prime()
        sources.append(("host", host.sample))
        closers.append(host.close)
        instruments.extend(names.HOST)
    gpu: GpuSampler | None = None
    if settings.gpus != "none":
        gpu = GpuSampler(settings.gpus, nvml=nvml, env=env, log=log, clock=clock)
        if gpu.start():
            sources.append(("gpu", GpuStepMetrics(gpu.sample, training).sample))
            instruments.extend(names.GPU)
        else:
            gpu = None
    if settings.process_metrics:
        process = ProcessSampler(
            None if psutil_module is None else psutil_module.Process(), log=log, clock=clock
        )
        process.prime()
        if training is None:
            sources.append(("process", process.sample))
        else:
            sources.append(("process", PhaseMemory(process.sample, training).sample))
            instruments.extend(names.PHASE_MEMORY)
        closers.append(process.close)
        instruments.extend(names.PROCESS)
    if settings.torch_cuda_memory:
        sources.append(("torch", TorchMemorySampler(log=log, clock=clock).sample))
        instruments.extend(names.TORCH)
    if memory_peaks is not None:
        sources.append(("memory peaks", memory_peaks.source(clock, training)))
        instruments.extend(names.PEAK_MEMORY)

    counters = frozenset(i.name for i in instruments if i.kind == "counter")
    snapshots = Snapshots(
        sources, max_age_s=settings.interval_s / 2, clock=clock, log=log, counters=counters
    )
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
    return SystemMetricsHandle(snapshots, tuple(i.name for i in instruments), gpu, tuple(closers))


def _callback(
    snapshots: Snapshots, name: str, log: LogOnce
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(_options: CallbackOptions) -> Iterable[Observation]:
        try:
            return snapshots.observations(name)
        except Exception as exc:  # never raise into the SDK's collection
            log.error(f"callback:{name}", exc, f"collecting {name} failed")
            return []

    return observe


def _as_clock(clock: Clock | Callable[[], float] | None) -> Clock:
    if clock is None or isinstance(clock, Clock):
        return clock or Clock()
    seconds = clock
    return Clock(monotonic_ns=lambda: round(seconds() * 1e9))
