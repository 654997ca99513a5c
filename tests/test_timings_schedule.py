"""otelprof.schedule matches torch.profiler.schedule; cyclic_schedule matches Composer's table."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from otelprof._timings._schedule import ScheduleAction, as_action, cyclic_schedule, schedule

PARAMETER_SETS = [
    dict(zip(("skip_first", "wait", "warmup", "active", "repeat"), values, strict=True))
    for values in itertools.product((0, 1, 3), (0, 1, 2), (0, 1, 2), (1, 2, 3), (0, 1, 2))
]


@pytest.mark.parametrize("skip_first_wait", [0, 1])
def test_schedule_matches_torch_profiler_schedule_over_many_parameter_sets(
    skip_first_wait: int,
) -> None:
    assert len(PARAMETER_SETS) == 243
    for params in PARAMETER_SETS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about warmup=0
            oracle = torch.profiler.schedule(**params, skip_first_wait=skip_first_wait)
        ours = schedule(**params, skip_first_wait=skip_first_wait)
        for step in range(60):
            expected = oracle(step)
            got = ours(step)
            assert got.name == expected.name and got.value == expected.value, (
                f"{params} step {step}: torch says {expected}, otelprof says {got}"
            )


def test_schedule_actions_have_torch_profiler_action_names_and_values() -> None:
    for action in ScheduleAction:
        assert torch.profiler.ProfilerAction[action.name].value == action.value
        assert as_action(torch.profiler.ProfilerAction[action.name]) is action


# Seed 003 (Composer profiler tutorial): skip_first=1, wait=1, warmup=1, active=2, repeat=1
# batch -> (state, action) for each epoch; "Record" rows are the active (recorded) ones.
COMPOSER_TABLE = [
    (0, "skip_first", ScheduleAction.NONE),
    (1, "wait", ScheduleAction.NONE),
    (2, "warmup", ScheduleAction.WARMUP),
    (3, "active", ScheduleAction.RECORD),
    (4, "active", ScheduleAction.RECORD_AND_SAVE),
    (5, "wait", ScheduleAction.NONE),
    (6, "warmup", ScheduleAction.WARMUP),
    (7, "active", ScheduleAction.RECORD),
    (8, "active", ScheduleAction.RECORD_AND_SAVE),
    (9, "disabled", ScheduleAction.NONE),
]


def test_cyclic_schedule_reproduces_the_composer_tutorial_table() -> None:
    fn = cyclic_schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=1)
    for batch, state, action in COMPOSER_TABLE:
        assert fn(batch) is action, f"batch {batch} ({state})"
    for batch in range(10, 40):
        assert fn(batch) is ScheduleAction.NONE


def test_cyclic_schedule_tutorial_example_records_ten_batches_per_epoch() -> None:
    # "Since prof_warmup=1, prof_active=4, prof_repeat=1 ... record profiling data for 10
    # batches each epoch" (warmup + active over two windows).
    fn = cyclic_schedule(wait=0, warmup=1, active=4, repeat=1)
    actions = [fn(batch) for batch in range(16)]
    assert sum(a is not ScheduleAction.NONE for a in actions) == 10
    assert sum(a.records for a in actions) == 8


def test_cyclic_schedule_with_repeat_zero_cycles_for_the_whole_epoch() -> None:
    fn = cyclic_schedule(skip_first=0, wait=1, warmup=0, active=1, repeat=0)
    assert [fn(b) for b in range(6)] == [
        ScheduleAction.NONE,
        ScheduleAction.RECORD_AND_SAVE,
    ] * 3


def test_cyclic_schedule_counts_repeat_differently_from_torch() -> None:
    torch_like = schedule(wait=1, warmup=1, active=2, repeat=1, skip_first=1)
    composer = cyclic_schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=1)
    assert [torch_like(b).records for b in range(10)].count(True) == 2
    assert [composer(b).records for b in range(10)].count(True) == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"wait": -1, "warmup": 0, "active": 1}, "wait must be >= 0"),
        ({"wait": 0, "warmup": 0, "active": 0}, "active must be >= 1"),
        ({"wait": 0, "warmup": 0, "active": 1, "repeat": -2}, "repeat must be >= 0"),
        ({"wait": 0, "warmup": 0, "active": 1, "skip_first": -1}, "skip_first must be >= 0"),
    ],
)
def test_schedule_rejects_bad_counts_naming_the_parameter(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        schedule(**kwargs)


def test_schedule_rejects_non_integer_counts() -> None:
    with pytest.raises(TypeError, match="active must be an int"):
        schedule(wait=0, warmup=0, active=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="active must be >= 1"):
        cyclic_schedule(active=0)


def test_a_schedule_returning_something_else_is_reported() -> None:
    with pytest.raises(TypeError, match="expected a ScheduleAction"):
        as_action("sometimes")
