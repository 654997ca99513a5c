"""Memory by training phase, for `otelprof report` and `otelprof compare`.

`PhaseMemory`: the process's RSS again, labelled with the phase current at the read.
`PhasePeaks` (the `memory_peaks` option): the CUDA allocator's peaks, read and reset on the
sampler's thread at each snapshot and, on the thread that changes phase, at each change of
phase, so every interval and phase block has its own peak; nothing per step (cost:
BENCHMARKS.md, "Per-module times and memory peaks by phase"). Opt-in because the reset
changes what the program's own `torch.cuda.max_memory_allocated()` means.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

from otelprof._schema import ATTR_PHASE, PHASE_TRAIN

from . import names
from ._common import Attributes, LogOnce, Reading
from ._gpu_steps import Training
from .torch_memory import device_attributes

DevicePeak = tuple[Attributes, float, float]
"""(device attributes, peak allocated bytes, peak reserved bytes) since the last reset."""


class CudaPeaks(Protocol):
    def read_and_reset(self) -> list[DevicePeak]:
        """Each device's allocator peaks since the last call, then reset them; [] while
        this process has not initialized CUDA."""


class TorchCudaPeaks:
    """The allocator's peaks of every CUDA device this process has memory on (not the
    current device: that is per thread, and the sampler's thread reads too). Never imports
    torch nor initializes CUDA."""

    def __init__(self, modules: Any = None) -> None:
        self._modules = sys.modules if modules is None else modules
        self._attributes: dict[int, Attributes] = {}

    def read_and_reset(self) -> list[DevicePeak]:
        torch = self._modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_initialized():
            return []
        out = []
        for device in range(cuda.device_count()):
            stats = cuda.memory_stats_as_nested_dict(device)
            reserved = stats.get("reserved_bytes", {}).get("all", {}).get("peak", 0)
            if not reserved:
                continue  # no memory of this process on that device
            cuda.reset_peak_memory_stats(device)
            attrs = device_attributes(cuda, device, self._attributes)
            allocated = stats["allocated_bytes"]["all"]["peak"]
            out.append((attrs, float(allocated), float(reserved)))
        return out


class PhasePeaks:
    """The CUDA allocator's peaks by phase (a window never spans two phases): `attach(engine)`
    listens to the engine's phase changes; the sampler reads `source(clock, training)`."""

    def __init__(self, peaks: CudaPeaks | None = None, log: LogOnce | None = None) -> None:
        self._peaks = peaks or TorchCudaPeaks()
        self._log = log or LogOnce()
        self._lock = threading.Lock()
        # (phase, device attributes) -> [peak allocated, peak reserved, attributes]
        self._window: dict[tuple[str, tuple[tuple[str, Any], ...]], list[Any]] = {}
        self._window_start: int | None = None
        self._phase = PHASE_TRAIN  # the last phase seen (the sampler's, or a change's)
        self._removers: list[Callable[[], None]] = []
        self.failed = False

    def attach(self, engine: Any) -> None:
        """Listen to `engine`'s changes of phase (on the thread that changes it)."""
        self._removers = [engine.add_phase_listener(self.on_phase)]

    def close(self) -> None:
        for remove in self._removers:
            remove()
        self._removers = []

    def on_phase(self, previous: str, phase: str) -> None:
        """A change of phase: the peak so far belongs to the phase that ends."""
        self._take(previous)
        self._phase = phase

    def _take(self, phase: str) -> None:
        """Read and reset the allocator's peaks; keep the window's highest for `phase`."""
        if self.failed:
            return
        with self._lock:  # one reader at a time: a peak is read and reset once
            try:
                read = self._peaks.read_and_reset()
            except Exception as error:  # telemetry never breaks training
                self.failed = True
                doing = "cannot read the CUDA allocator's peaks"
                self._log.error("memory-peaks", error, doing, "memory peaks off")
                return
            window = self._window
            for attrs, allocated, reserved in read:
                key = (phase, tuple(attrs.items()))
                have = window.setdefault(key, [allocated, reserved, attrs])
                have[0] = max(have[0], allocated)
                have[1] = max(have[1], reserved)

    def source(
        self, clock: Callable[[], int], training: Training | None = None
    ) -> Callable[[], list[Reading]]:
        """A source for the system sampler (one call per snapshot, shared by every reader),
        its readings stamped by `clock`, the sampler's; `training` gives the phase now."""

        def sample() -> list[Reading]:
            state = training() if training is not None else None
            return self.sample(clock(), state[1] if state is not None else None)

        return sample

    def sample(self, now: int | None = None, phase: str | None = None) -> list[Reading]:
        """The highest peaks per phase and device since the previous sample; the peak since
        the last read is the current phase's (`phase`, else the last one seen)."""
        if phase is not None:
            self._phase = phase
        self._take(self._phase)
        with self._lock:
            window, self._window = self._window, {}
        start, self._window_start = self._window_start, now
        out = []
        for (phase_of, _), (allocated, reserved, attrs) in window.items():
            labelled = {**attrs, ATTR_PHASE: phase_of}
            out.append(
                Reading(names.TORCH_CUDA_PEAK_ALLOCATED.name, allocated, labelled, now, start)
            )
            out.append(Reading(names.TORCH_CUDA_PEAK_RESERVED.name, reserved, labelled, now, start))
        return out


class PhaseMemory:
    """Wraps the process sampler: its RSS reading again, labelled with the phase current
    at the read (`training` returns (steps, phase), or None without a running loop: the
    final sample, after the loop stopped, keeps the last phase seen)."""

    def __init__(self, sample: Callable[[], list[Reading]], training: Training) -> None:
        self._sample = sample
        self._training = training
        self._phase: str | None = None

    def sample(self) -> list[Reading]:
        readings = self._sample()
        try:
            state = self._training()
        except Exception:  # the derived figure must never cost the process readings
            return readings
        if state is not None:
            self._phase = state[1]
        phase = self._phase
        if phase is None:
            return readings
        for r in list(readings):
            if r.name == names.PROCESS_MEMORY_USAGE.name:
                readings.append(
                    Reading(
                        names.PROCESS_MEMORY_BY_PHASE.name,
                        r.value,
                        {**r.attributes, ATTR_PHASE: phase},
                        r.time_ns,
                    )
                )
        return readings
