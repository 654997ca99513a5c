"""Live GPU figures tied to training: energy per step and GPU-idle time by phase.

The report joins GPU samples with spans after the run; these give the same answers live,
from the sampler's readings plus the loop's (steps, phase), read off the training thread,
never written. Energy per step: Δ`hw.energy` / steps over a window that starts and ends in
"train" with at least one step (validation inside would be charged to training). GPU idle:
(1 - utilization) × window, added to the phase current at the window's end, so a window
across a phase change goes to the later phase (the report's figures are exact).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from otelprof._schema import ATTR_PHASE
from otelprof._schema import PHASE_TRAIN as TRAIN

from . import names
from ._common import Reading

Training = Callable[[], "tuple[int, str] | None"]
"""(training steps completed, current phase), or None when no profiler is running."""


class GpuStepMetrics:
    """Derives the two metrics from each GPU sample (wraps the GPU sampler's `sample`)."""

    def __init__(self, sample: Callable[[], list[Reading]], training: Training | None) -> None:
        self._sample = sample
        self._training = training  # None without a training loop: no per-step figures
        self._energy: dict[tuple[Any, ...], float] = {}  # GPU -> last hw.energy (J)
        self._window: tuple[int, int, str] | None = None  # (time ns, steps, phase)
        self._idle: dict[tuple[Any, ...], float] = {}  # (GPU attrs, phase) -> idle seconds
        self._util_time: dict[tuple[Any, ...], int] = {}  # GPU -> last utilization read

    def sample(self) -> list[Reading]:
        readings = self._sample()
        try:
            return readings + self._derive(readings)
        except Exception:  # derived figures must never cost the GPU readings
            return readings

    def _derive(self, readings: list[Reading]) -> list[Reading]:
        state = self._training() if self._training is not None else None
        out: list[Reading] = []
        energy_delta = 0.0
        energy_time: int | None = None
        complete = True
        for r in readings:
            if r.name == names.GPU_ENERGY.name:
                key = tuple(sorted(r.attributes.items()))
                previous = self._energy.get(key)
                self._energy[key] = r.value
                if previous is None or r.value < previous:
                    complete = False  # first read, or counter reset: no delta this window
                else:
                    energy_delta += r.value - previous
                energy_time = r.time_ns if energy_time is None else max(energy_time, r.time_ns or 0)
        if state is not None:
            steps, phase = state
            for r in readings:
                if r.name != names.GPU_UTILIZATION.name or r.time_ns is None:
                    continue
                gpu = (r.attributes.get(names.HW_ID), r.attributes.get(names.GPU_INDEX))
                previous_read = self._util_time.get(gpu)
                self._util_time[gpu] = r.time_ns
                if previous_read is None:
                    continue
                seconds = (r.time_ns - previous_read) / 1e9
                if seconds <= 0:
                    continue
                attrs = {
                    names.HW_ID: r.attributes.get(names.HW_ID, ""),
                    names.GPU_INDEX: r.attributes.get(names.GPU_INDEX, -1),
                    ATTR_PHASE: phase,
                }
                key = tuple(sorted(attrs.items()))
                idle = (1.0 - min(1.0, max(0.0, r.value))) * seconds
                self._idle[key] = self._idle.get(key, 0.0) + idle
            for key, total in self._idle.items():
                out.append(Reading(names.GPU_IDLE.name, total, dict(key), energy_time))
            previous_window = self._window
            if energy_time is not None:
                self._window = (energy_time, steps, phase)
            if (
                previous_window is not None
                and energy_time is not None
                and complete
                and previous_window[2] == TRAIN
                and phase == TRAIN
                and steps > previous_window[1]
            ):
                per_step = energy_delta / (steps - previous_window[1])
                name = names.GPU_ENERGY_PER_STEP.name
                out.append(Reading(name, per_step, {}, energy_time, previous_window[0]))
        return out
