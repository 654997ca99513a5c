"""Rate arithmetic on made-up counters: exact values, and the edge cases stay defined."""

from __future__ import annotations

from collections import namedtuple

import pytest

from otelprof.system.rates import (
    busy_fraction,
    counter_delta,
    rate,
    share_of_cpus,
    summed_delta,
    summed_rate,
)

CpuTimes = namedtuple(
    "CpuTimes",
    "user nice system idle iowait irq softirq steal guest guest_nice",
)


def test_counter_delta_is_the_plain_difference_when_the_counter_grew() -> None:
    assert counter_delta(1_000, 1_500) == 500
    assert counter_delta(7, 7) == 0


def test_a_32_bit_counter_that_wrapped_counts_across_the_wrap() -> None:
    assert counter_delta(2**32 - 100, 900) == 1_000


def test_a_counter_that_went_down_by_more_than_a_plausible_wrap_is_a_restart() -> None:
    # 32-bit value that dropped to a value implying >2 GiB in one interval: a reset.
    assert counter_delta(3_000_000_000, 2_999_000_000) is None
    # 64-bit sized counter going down: a restart (a 64-bit wrap never happens in practice).
    assert counter_delta(10 * 2**32, 5) is None


def test_summed_delta_counts_only_devices_in_both_readings() -> None:
    before = {"eth0": 100, "eth1": 1_000, "lo": 10}
    after = {"eth0": 300, "lo": 60, "eth2": 5_000_000}  # eth1 gone, eth2 new
    assert summed_delta(before, after) == (250, 2)


def test_summed_delta_skips_a_restarted_device_but_keeps_the_others() -> None:
    before = {"sda": 10 * 2**32, "sdb": 1_000}
    after = {"sda": 12, "sdb": 4_000}
    assert summed_delta(before, after) == (3_000, 1)


def test_no_device_in_common_is_unknown_not_zero() -> None:
    assert summed_delta({"eth0": 5}, {"eth1": 7}) is None
    assert summed_delta({}, {}) is None
    assert summed_rate({"eth0": 5}, {"eth1": 7}, 10.0) is None


def test_idle_devices_measure_a_true_zero() -> None:
    assert summed_rate({"eth0": 5}, {"eth0": 5}, 1.0) == 0.0


def test_ten_second_interval_reports_the_exact_ten_second_average() -> None:
    assert summed_rate({"eth0": 0, "lo": 0}, {"eth0": 7_000_000, "lo": 3_000_000}, 10.0) == 1e6


@pytest.mark.parametrize("dt", [0.0, -1.0, float("nan")])
def test_zero_or_negative_interval_gives_no_rate(dt: float) -> None:
    assert rate(100, dt) is None
    assert summed_rate({"a": 0}, {"a": 10}, dt) is None


def cpu(user: float, system: float, idle: float, iowait: float = 0.0, guest: float = 0.0):
    return CpuTimes(user, 0.0, system, idle, iowait, 0.0, 0.0, 0.0, guest, 0.0)


def test_cpu_busy_fraction_is_busy_time_over_total_time() -> None:
    before = cpu(user=100, system=50, idle=850)
    after = cpu(user=130, system=60, idle=910)  # +40 busy, +60 idle
    assert busy_fraction(before, after) == pytest.approx(0.4)


def test_iowait_counts_as_idle_and_guest_time_is_not_counted_twice() -> None:
    before = cpu(user=0, system=0, idle=0)
    after = cpu(user=20, system=0, idle=50, iowait=30, guest=10)  # guest is inside user
    assert busy_fraction(before, after) == pytest.approx(0.2)


def test_cpu_readings_within_one_tick_give_no_value_and_backward_iowait_clamps() -> None:
    same = cpu(user=1, system=1, idle=1)
    assert busy_fraction(same, same) is None
    before = cpu(user=10, system=0, idle=10, iowait=5)
    after = cpu(user=12, system=0, idle=10, iowait=4)  # iowait stepped back: total +1, busy +2
    assert busy_fraction(before, after) == 1.0


def test_process_share_of_cpus_is_normalised_by_usable_cores() -> None:
    assert share_of_cpus(1.0, 1.0, 4) == pytest.approx(0.25)
    assert share_of_cpus(3.0, 1.0, 2) == 1.0
    assert share_of_cpus(1.0, 0.0, 2) is None
    assert share_of_cpus(-0.01, 1.0, 2) is None
