"""The observable instruments on a real SDK MeterProvider with real psutil readings."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint

from otelprof.system import SystemMetricsSettings, names, register_system_metrics
from otelprof.system._common import Reading
from otelprof.system._stamps import Clock
from otelprof.system.gauges import Snapshots

Collected = dict[str, dict[str, Any]]


def collect(reader: InMemoryMetricReader) -> Collected:
    """name -> {"unit", "kind", "points": [(value, attrs)]}"""
    out: Collected = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = {
                    "unit": m.unit,
                    "kind": type(m.data).__name__,
                    "points": [
                        (p.value, dict(p.attributes or {}))
                        for p in m.data.data_points
                        if isinstance(p, NumberDataPoint)
                    ],
                }
    return out


@pytest.fixture
def provider() -> Iterator[tuple[MeterProvider, InMemoryMetricReader]]:
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    yield mp, reader
    mp.shutdown()


def burn_cpu(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_host_and_process_gauges_have_the_design_names_units_and_attributes(
    provider: tuple[MeterProvider, InMemoryMetricReader],
) -> None:
    mp, reader = provider
    handle = register_system_metrics(mp.get_meter("t"), SystemMetricsSettings(interval_s=0.2))
    try:
        time.sleep(0.25)
        got = collect(reader)
    finally:
        handle.close()
    expected = {
        "system.cpu.utilization": ("1", [{}]),
        "system.memory.linux.available": ("By", [{}]),
        "system.network.throughput": (
            "By/s",
            [{"network.io.direction": "transmit"}, {"network.io.direction": "receive"}],
        ),
        "system.disk.iops": (
            "{operation}/s",
            [{"disk.io.direction": "read"}, {"disk.io.direction": "write"}],
        ),
        "system.disk.throughput": (
            "By/s",
            [{"disk.io.direction": "read"}, {"disk.io.direction": "write"}],
        ),
        "process.cpu.utilization": ("1", [{}]),
        "process.memory.usage": ("By", [{}]),
    }
    assert set(got) == set(expected)  # no GPU here; torch CUDA not initialized
    for name, (unit, attribute_sets) in expected.items():
        assert got[name]["unit"] == unit, name
        assert got[name]["kind"] == "Gauge", name
        assert [attrs for _, attrs in got[name]["points"]] == attribute_sets, name
        for value, _ in got[name]["points"]:
            assert value >= 0, name
    for name in ("system.cpu.utilization", "process.cpu.utilization"):
        assert 0 <= got[name]["points"][0][0] <= 1


def test_first_cpu_value_is_a_real_measurement_not_a_fake_zero(
    provider: tuple[MeterProvider, InMemoryMetricReader],
) -> None:
    import os

    from otelprof.system.process import usable_cpus

    mp, reader = provider
    cpu0, wall0 = time.process_time(), time.monotonic()
    handle = register_system_metrics(mp.get_meter("t"), SystemMetricsSettings(interval_s=1.0))
    try:
        # 0.4 s of CPU time, not of wall time: on a busy machine this process gets a small
        # share of a core, and a wall-time burn could leave it nearly idle
        while time.process_time() - cpu0 < 0.4:
            pass
        used, wall = time.process_time() - cpu0, time.monotonic() - wall0
        got = collect(reader)
    finally:
        handle.close()
    process = got["process.cpu.utilization"]["points"][0][0]
    system = got["system.cpu.utilization"]["points"][0][0]
    # what this process measured for itself, as a share of its usable / of all cores
    own_share = used / (wall * usable_cpus())
    assert used >= 0.4 and own_share > 0  # so a fake zero cannot pass the comparison below
    assert process == pytest.approx(own_share, rel=0.35)
    assert system >= 0.7 * used / (wall * (os.cpu_count() or 1))


def test_one_sample_serves_every_instrument_and_every_reader_within_half_an_interval() -> None:
    first, second = InMemoryMetricReader(), InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[first, second])
    # scripted time: how long a busy machine takes between the two collections is no part
    # of what is checked
    now = [time.monotonic()]
    handle = register_system_metrics(
        mp.get_meter("t"), SystemMetricsSettings(interval_s=1.0), clock=lambda: now[0]
    )
    try:
        now[0] += 0.1
        a = collect(first)
        b = collect(second)  # e.g. a Prometheus scrape right after the periodic export
        assert handle.samples_taken == 1
        assert a["system.network.throughput"]["points"] == b["system.network.throughput"]["points"]
        now[0] += 0.55  # older than interval/2: the next collection samples again
        collect(second)
        assert handle.samples_taken == 2
    finally:
        handle.close()
        mp.shutdown()


def test_snapshots_resample_only_after_half_the_interval() -> None:
    now = [0.0]
    calls: list[float] = []

    def source() -> list[Any]:
        calls.append(now[0])
        return []

    clock = Clock(monotonic_ns=lambda: round(now[0] * 1e9))
    snaps = Snapshots([("s", source)], max_age_s=0.5, clock=clock)
    for t in (0.0, 0.1, 0.49, 0.5, 0.6, 1.0):
        now[0] = t
        snaps.observations("x")
    assert calls == [0.0, 0.5, 1.0]


def test_one_sample_serves_a_whole_collection_however_far_apart_its_callbacks_are() -> None:
    """Busy threads can put the callbacks of one collection further apart than max_age:
    they still share one sample (a second one would advance every baseline, and the windows
    the first instruments exported would never be followed by the next ones)."""
    now = [0.0]
    calls: list[float] = []

    def source() -> list[Any]:
        calls.append(now[0])
        return []

    clock = Clock(monotonic_ns=lambda: round(now[0] * 1e9))
    snaps = Snapshots([("s", source)], max_age_s=0.5, clock=clock)
    for collection_start in (0.0, 1.0):
        now[0] = collection_start
        snaps.observations("system.disk.iops")
        now[0] += 0.7  # the next callback comes 0.7 s later
        snaps.observations("system.disk.throughput")
    assert calls == [0.0, 1.0]


def test_final_collection_reads_again_instead_of_re_serving_the_last_snapshot() -> None:
    now = [0.0]
    value = [1.0]

    def source() -> list[Reading]:
        t = round(now[0] * 1e9)
        return [Reading("x", value[0], {}, t, t - 10**9)]

    clock = Clock(monotonic_ns=lambda: round(now[0] * 1e9))
    snaps = Snapshots([("s", source)], max_age_s=0.5, clock=clock)
    first = snaps.observations("x")
    now[0], value[0] = 0.2, 2.0  # shutdown 0.2 s after the last export
    assert snaps.observations("x") == first  # another reader in the same round shares it
    snaps.final_sample()
    final = snaps.observations("x")
    assert [o.value for o in final] == [2.0]
    assert final[0].value.time_ns == clock.to_unix_ns(round(0.2e9))  # type: ignore[attr-defined]
    assert snaps.observations("x") == final  # the other readers' final collections share it
    assert snaps.samples_taken == 2


def test_host_metrics_off_leaves_only_process_series(
    provider: tuple[MeterProvider, InMemoryMetricReader],
) -> None:
    mp, reader = provider
    handle = register_system_metrics(
        mp.get_meter("t"),
        SystemMetricsSettings(host_metrics=False, gpus="none", torch_cuda_memory=False),
    )
    try:
        time.sleep(0.1)
        assert set(collect(reader)) == {"process.cpu.utilization", "process.memory.usage"}
    finally:
        handle.close()


def test_a_broken_source_never_raises_into_the_sdk_and_costs_only_its_own_series(
    provider: tuple[MeterProvider, InMemoryMetricReader], caplog: pytest.LogCaptureFixture
) -> None:
    import psutil

    class BrokenVirtualMemory:
        """Real psutil, except that one call raises something unexpected."""

        def __getattr__(self, name: str) -> Any:
            return getattr(psutil, name)

        def virtual_memory(self) -> Any:
            raise RuntimeError("meminfo vanished")

    mp, reader = provider
    with caplog.at_level(logging.WARNING, logger="otelprof.system"):
        handle = register_system_metrics(
            mp.get_meter("t"),
            SystemMetricsSettings(gpus="none", torch_cuda_memory=False),
            psutil_module=BrokenVirtualMemory(),
        )
        try:
            time.sleep(0.1)
            for _ in range(2):
                got = collect(reader)
                assert "system.memory.linux.available" not in got
                assert {"system.cpu.utilization", "process.memory.usage"} <= set(got)
                time.sleep(0.55)
        finally:
            handle.close()
    assert sum("meminfo vanished" in r.getMessage() for r in caplog.records) == 1


def test_close_stops_every_series(provider: tuple[MeterProvider, InMemoryMetricReader]) -> None:
    mp, reader = provider
    handle = register_system_metrics(mp.get_meter("t"), SystemMetricsSettings(gpus="none"))
    time.sleep(0.1)
    assert collect(reader)
    handle.close()
    assert collect(reader) == {}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"interval_s": 0.05}, "interval_s must be a number >= 0.1"),
        ({"interval_s": 0}, "interval_s"),
        ({"gpus": "some"}, "gpus must be one of visible, all, none"),
    ],
)
def test_bad_settings_are_rejected_with_the_option_named(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SystemMetricsSettings(**options)


def test_every_documented_instrument_name_is_unique_and_listed_in_the_package_docstring() -> None:
    import otelprof.system

    all_names = [i.name for i in names.ALL]
    assert len(all_names) == len(set(all_names))
    for name in all_names:
        assert f"`{name}`" in (otelprof.system.__doc__ or ""), name
