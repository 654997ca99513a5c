"""Which steps record timing spans: torch.profiler's schedule, and Composer's per-epoch cycle.

`schedule()` has exactly `torch.profiler.schedule`'s semantics (the tests use torch's own
function as the oracle), so a schedule users already wrote for torch means the same here.
`cyclic_schedule()` follows the Composer profiler tutorial's table (seed 003): the cycle
restarts at every epoch and `repeat` counts the repetitions *after* the first window.
"""

from __future__ import annotations

import dataclasses
import enum


class ScheduleAction(enum.Enum):
    """What a step does; the same members and values as `torch.profiler.ProfilerAction`.

    Timing spans (and step spans) are recorded on RECORD and RECORD_AND_SAVE steps only;
    WARMUP only matters to the optional Kineto session, which starts tracing there and
    discards it, like torch.profiler does.
    """

    NONE = 0
    WARMUP = 1
    RECORD = 2
    RECORD_AND_SAVE = 3

    @property
    def records(self) -> bool:
        return self is ScheduleAction.RECORD or self is ScheduleAction.RECORD_AND_SAVE


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"schedule: {name} must be an int, got {value!r}")
        minimum = 1 if name == "active" else 0
        if value < minimum:
            raise ValueError(f"schedule: {name} must be >= {minimum}, got {value}")


def _action_at(position: int, wait: int, warmup: int, cycle: int) -> ScheduleAction:
    """The action at `position` in a cycle of `wait`, `warmup`, then active steps."""
    if position < wait:
        return ScheduleAction.NONE
    if position < wait + warmup:
        return ScheduleAction.WARMUP
    if position < cycle - 1:
        return ScheduleAction.RECORD
    return ScheduleAction.RECORD_AND_SAVE


@dataclasses.dataclass(eq=False, repr=False)
class Schedule:
    """`torch.profiler.schedule` semantics: skip_first, then cycles of wait/warmup/active.

    `repeat=0` cycles until the end of training. Called with the global step number.
    """

    wait: int
    warmup: int
    active: int
    repeat: int = 0
    skip_first: int = 0
    skip_first_wait: int = 0
    restarts_each_epoch = False
    _name = "schedule"  # the factory, in repr

    def __post_init__(self) -> None:
        _check_counts(**vars(self))

    def __call__(self, step: int) -> ScheduleAction:
        if step < 0:
            raise ValueError(f"schedule: step must be >= 0, got {step}")
        if step < self.skip_first:
            return ScheduleAction.NONE
        step -= self.skip_first
        if self.skip_first_wait:
            step += self.wait
        cycle = self.wait + self.warmup + self.active
        if self.repeat > 0 and step >= self.repeat * cycle:
            return ScheduleAction.NONE
        return _action_at(step % cycle, self.wait, self.warmup, cycle)

    def __repr__(self) -> str:
        return (
            f"{self._name}(skip_first={self.skip_first}, wait={self.wait}, "
            f"warmup={self.warmup}, active={self.active}, repeat={self.repeat})"
        )


class CyclicSchedule(Schedule):
    """Composer's cyclic window, restarting every epoch; called with the batch-in-epoch index.

    Per the Composer profiler tutorial's table (seed 003): skip `skip_first` batches, then a
    window of `wait` + `warmup` + `active` batches, run once and then repeated `repeat` more
    times in the epoch (so `repeat=1` gives two windows), then nothing until the next epoch.
    `repeat=0` cycles for the whole epoch. (Composer's code at HEAD stops after `repeat`
    windows instead; we follow the documented table, and say so.)
    """

    restarts_each_epoch = True
    _name = "cyclic_schedule"

    def __call__(self, batch_in_epoch: int) -> ScheduleAction:
        if batch_in_epoch < 0:
            raise ValueError(f"cyclic_schedule: batch must be >= 0, got {batch_in_epoch}")
        if batch_in_epoch < self.skip_first:
            return ScheduleAction.NONE
        cycle = self.wait + self.warmup + self.active
        offset = batch_in_epoch - self.skip_first
        if self.repeat != 0 and offset >= cycle * (self.repeat + 1):
            return ScheduleAction.NONE
        return _action_at(offset % cycle, self.wait, self.warmup, cycle)


def schedule(
    *,
    wait: int,
    warmup: int,
    active: int,
    repeat: int = 0,
    skip_first: int = 0,
    skip_first_wait: int = 0,
) -> Schedule:
    """A step -> `ScheduleAction` function with `torch.profiler.schedule`'s exact semantics."""
    return Schedule(wait, warmup, active, repeat, skip_first, skip_first_wait)


def cyclic_schedule(
    skip_first: int = 0, wait: int = 0, warmup: int = 1, active: int = 4, repeat: int = 1
) -> CyclicSchedule:
    """Composer's per-epoch cyclic window (see `CyclicSchedule` for how `repeat` counts)."""
    return CyclicSchedule(wait, warmup, active, repeat, skip_first)


def as_action(value: object) -> ScheduleAction:
    """Accept our enum, torch's ProfilerAction, or Composer-style names from a user schedule."""
    if isinstance(value, ScheduleAction):
        return value
    name = getattr(value, "name", value)
    mapped = _ALIASES.get(str(name).upper()) if isinstance(name, str) else None
    if mapped is None:
        raise TypeError(f"schedule returned {value!r}; expected a ScheduleAction")
    return mapped


_ALIASES = {
    "NONE": ScheduleAction.NONE,
    "SKIP": ScheduleAction.NONE,
    "WARMUP": ScheduleAction.WARMUP,
    "RECORD": ScheduleAction.RECORD,
    "ACTIVE": ScheduleAction.RECORD,
    "RECORD_AND_SAVE": ScheduleAction.RECORD_AND_SAVE,
    "ACTIVE_AND_SAVE": ScheduleAction.RECORD_AND_SAVE,
}
