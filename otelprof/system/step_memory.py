"""Memory by training phase and by step: what `otelprof report` shows per phase.

- `otelprof.process.memory.by_phase` (By, gauge, `otelprof.phase`): this process's resident
  memory as the sampler reads it for `process.memory.usage`, labelled with the training
  phase current at that read (`PhaseMemory`). Nothing runs on the training thread.
- `otelprof.torch.cuda.memory.peak.allocated` / `.peak.reserved` (By, gauge,
  `otelprof.phase`, `otelprof.cuda.device`, `hw.id`), with the `step_memory` option
  (`StepPeaks`): at each training step boundary and each change of phase, on the training
  thread, the caching allocator's peak since the previous boundary is read and reset, so
  each step (and each block of another phase, such as a validation pass) has a peak of its
  own. The thread does no I/O: it keeps, per phase and device, the highest peak since the
  last collection, which the sampler's thread exports (the point's start time is the
  previous collection's). Resetting the allocator's peak changes what the program's own
  `torch.cuda.max_memory_allocated()` means (the current step's peak), hence opt-in. The
  cost per step is in BENCHMARKS.md; without CUDA initialized a boundary costs one check.

The CUDA calls sit behind `CudaPeaks` (`TorchCudaPeaks` is the real one), so tests drive the
logic without a GPU.
"""

from __future__ import annotations

import logging
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
    """The allocator's peaks of the process's current CUDA device, from torch's public
    calls: `memory_stats_as_nested_dict` (one call for both peaks, no flattening) and
    `reset_peak_memory_stats`. Never imports torch nor initializes CUDA."""

    def __init__(self, modules: Any = None) -> None:
        self._modules = sys.modules if modules is None else modules
        self._attributes: dict[int, Attributes] = {}

    def read_and_reset(self) -> list[DevicePeak]:
        torch = self._modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_initialized():
            return []
        device = cuda.current_device()
        stats = cuda.memory_stats_as_nested_dict(device)
        cuda.reset_peak_memory_stats(device)
        attrs = self._attributes.get(device)
        if attrs is None:
            attrs = self._attributes[device] = device_attributes(cuda, device)
        return [
            (
                attrs,
                float(stats["allocated_bytes"]["all"]["peak"]),
                float(stats["reserved_bytes"]["all"]["peak"]),
            )
        ]


class StepPeaks:
    """Per-step CUDA peaks, read on the training thread, exported by the sampler's.

    `attach(engine)` listens to the timings engine's training steps and phase changes; the
    system sampler reads `source(clock)` once per snapshot."""

    def __init__(
        self,
        peaks: CudaPeaks | None = None,
        log: LogOnce | None = None,
    ) -> None:
        self._peaks = peaks or TorchCudaPeaks()
        self._log = log or LogOnce()
        self._lock = threading.Lock()
        # (phase, device attributes) -> [peak allocated, peak reserved, attributes]
        self._window: dict[tuple[str, tuple[tuple[str, Any], ...]], list[Any]] = {}
        self._window_start: int | None = None
        self._removers: list[Callable[[], None]] = []
        self.failed = False

    def attach(self, engine: Any) -> None:
        """Listen to `engine`'s step boundaries and phase changes (the training thread)."""
        self._removers = [
            engine.add_step_listener(self.on_step),
            engine.add_phase_listener(self.on_phase),
        ]

    def close(self) -> None:
        for remove in self._removers:
            remove()
        self._removers = []

    def on_step(self, _step: int, _train_ns: int, _first: bool) -> None:
        self._boundary(PHASE_TRAIN)

    def on_phase(self, previous: str, _phase: str) -> None:
        self._boundary(previous)

    def _boundary(self, phase: str) -> None:
        """The training thread's part: read and reset, keep the window's highest."""
        if self.failed:
            return
        try:
            read = self._peaks.read_and_reset()
        except Exception as error:  # telemetry never breaks training
            self.failed = True
            self._log(
                f"step-peaks:{type(error).__name__}",
                logging.WARNING,
                "cannot read the CUDA allocator's peaks (%s: %s); per-step memory off",
                type(error).__name__,
                error,
            )
            return
        if not read:
            return
        with self._lock:
            window = self._window
            for attrs, allocated, reserved in read:
                key = (phase, tuple(attrs.items()))
                have = window.get(key)
                if have is None:
                    window[key] = [allocated, reserved, attrs]
                else:
                    if allocated > have[0]:
                        have[0] = allocated
                    if reserved > have[1]:
                        have[1] = reserved

    def source(self, clock: Callable[[], int]) -> Callable[[], list[Reading]]:
        """A source for the system sampler (one call per snapshot, shared by every reader),
        its readings stamped by `clock`, the sampler's."""
        return lambda: self.sample(clock())

    def sample(self, now: int | None = None) -> list[Reading]:
        """The highest peaks per phase and device since the previous sample."""
        with self._lock:
            window, self._window = self._window, {}
        start, self._window_start = self._window_start, now
        out = []
        for (phase, _), (allocated, reserved, attrs) in window.items():
            labelled = {**attrs, ATTR_PHASE: phase}
            out.append(
                Reading(names.TORCH_CUDA_PEAK_ALLOCATED.name, allocated, labelled, now, start)
            )
            out.append(Reading(names.TORCH_CUDA_PEAK_RESERVED.name, reserved, labelled, now, start))
        return out


class PhaseMemory:
    """Wraps the process sampler: its RSS reading again, labelled with the phase current
    at the read (`training` returns (steps, phase), or None without a running loop)."""

    def __init__(self, sample: Callable[[], list[Reading]], training: Training) -> None:
        self._sample = sample
        self._training = training

    def sample(self) -> list[Reading]:
        readings = self._sample()
        try:
            state = self._training()
        except Exception:  # the derived figure must never cost the process readings
            return readings
        if state is None:
            return readings
        phase = state[1]
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
