"""Exported system-metric points say when they were read and which window they average."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint

from otelprof.system import SystemMetricsSettings, register_system_metrics
from otelprof.system._stamps import Clock, StampedValue, apply_read_times, timed


def points(data: Any) -> dict[str, list[NumberDataPoint]]:
    out: dict[str, list[NumberDataPoint]] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
    return out


def test_rate_points_carry_their_window_and_level_points_their_read_time() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    settings = SystemMetricsSettings(interval_s=0.2, gpus="none", torch_cuda_memory=False)
    before = time.time_ns()
    handle = register_system_metrics(provider.get_meter("t"), settings)
    try:
        time.sleep(0.3)
        raw = reader.get_metrics_data()
        after = time.time_ns()
        first = points(apply_read_times(raw))
        time.sleep(0.3)
        second = points(apply_read_times(reader.get_metrics_data()))
    finally:
        handle.close()
        provider.shutdown()
    for name in (
        "system.cpu.utilization",
        "system.network.throughput",
        "system.disk.iops",
        "process.cpu.utilization",
    ):
        for point in first[name]:
            assert type(point.value) is float, name  # exporters get plain floats
            assert point.start_time_unix_nano is not None, name
            assert before <= point.start_time_unix_nano < point.time_unix_nano <= after, name
            assert point.time_unix_nano - point.start_time_unix_nano >= 0.25e9, name
        # the next window starts exactly where this one ended: no gap, no overlap
        assert {p.start_time_unix_nano for p in second[name]} == {
            p.time_unix_nano for p in first[name]
        }, name
    for name in ("system.memory.linux.available", "process.memory.usage"):
        (point,) = first[name]
        assert point.start_time_unix_nano is None
        assert before <= point.time_unix_nano <= after


def test_the_sdk_hands_the_stamped_value_through_to_the_point() -> None:
    """apply_read_times relies on this; an SDK that copied values would break it here."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    handle = register_system_metrics(
        provider.get_meter("t"), SystemMetricsSettings(gpus="none", torch_cuda_memory=False)
    )
    try:
        time.sleep(0.06)
        got = points(reader.get_metrics_data())
    finally:
        handle.close()
        provider.shutdown()
    assert all(isinstance(p.value, StampedValue) for p in got["process.cpu.utilization"])


def test_data_without_stamps_is_exported_unchanged() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    provider.get_meter("t").create_gauge("g").set(3.0)
    data = reader.get_metrics_data()
    provider.shutdown()
    assert apply_read_times(data) is data


def test_the_stamp_is_taken_before_the_read() -> None:
    events: list[str] = []

    def clock() -> int:
        events.append("clock")
        return 7

    def read() -> str:
        events.append("read")
        return "value"

    stamped = timed(read, clock)
    assert (stamped.value, stamped.time_ns, events) == ("value", 7, ["clock", "read"])


def test_clock_follows_a_stepped_wall_clock_but_not_the_jitter_of_reading_it() -> None:
    wall = [1_000_000_000]
    clock = Clock(monotonic_ns=lambda: 50, wall_ns=lambda: wall[0])
    assert clock.to_unix_ns(60) == 1_000_000_010
    wall[0] += 300  # two clock reads a few hundred ns apart: windows stay contiguous
    clock.resync()
    assert clock.to_unix_ns(60) == 1_000_000_010
    wall[0] = 5_000_000_000  # the wall clock was stepped
    clock.resync()
    assert clock.to_unix_ns(60) == 5_000_000_010


def test_gauge_start_times_reach_both_otlp_encodings_and_the_encoders_are_restored() -> None:
    from opentelemetry.exporter.otlp.json.common._internal import metrics_encoder as json_enc
    from opentelemetry.exporter.otlp.proto.common._internal import metrics_encoder as pb_enc
    from opentelemetry.sdk.metrics.export import Gauge, Metric

    from otelprof.system import _gauge_start

    originals = (json_enc._encode_gauge_data_point, pb_enc._encode_metric)
    point = NumberDataPoint({}, start_time_unix_nano=5, time_unix_nano=9, value=1.5)
    sdk_point = NumberDataPoint({}, start_time_unix_nano=None, time_unix_nano=9, value=2.0)
    metric = Metric("m", "", "", Gauge(data_points=[point, sdk_point]))
    _gauge_start.install()
    try:
        encoded = json_enc._encode_gauge_data_point(point)
        assert (encoded.start_time_unix_nano, encoded.time_unix_nano) == (5, 9)
        assert not json_enc._encode_gauge_data_point(sdk_point).start_time_unix_nano
        from opentelemetry.proto.metrics.v1 import metrics_pb2

        pb2_metric = metrics_pb2.Metric(name="m")
        pb_enc._encode_metric(metric, pb2_metric)
        starts = [p.start_time_unix_nano for p in pb2_metric.gauge.data_points]
        assert starts == [5, 0]  # the SDK's own gauge points encode as before
    finally:
        _gauge_start.uninstall()
    assert (json_enc._encode_gauge_data_point, pb_enc._encode_metric) == originals


def test_shutdown_reads_again_instead_of_re_exporting_the_last_snapshot(tmp_path: Any) -> None:
    """Shut down 0.15 s after a periodic export: the final points are a new, real sample."""
    import otelprof
    from tests.otlp_files import read_points

    prof = otelprof.instrument(output_dir=tmp_path, interval=1.0, timings=False, gpus="none")
    try:
        time.sleep(2.15)
    finally:
        before_shutdown = time.time_ns()
        prof.shutdown()
    by_series: dict[tuple[str, tuple[Any, ...]], list[Any]] = {}
    for point in read_points(prof.files["metrics"]):
        if point.name.startswith(("system.", "process.")):
            key = (point.name, tuple(sorted(point.attributes.items())))
            by_series.setdefault(key, []).append(point)
    assert by_series
    for key, series in by_series.items():
        times = [p.time_ns for p in series]
        assert len(set(times)) == len(times), f"{key} exported one reading twice: {times}"
        assert times[-1] >= before_shutdown, f"{key}: the final point is not a new read"
        if series[-1].start_ns is not None:  # rates: the last window joins the previous one
            assert series[-1].start_ns == series[-2].time_ns, key


def test_a_cumulative_counter_point_gets_the_read_time_of_its_value() -> None:
    """Sums lose the StampedValue in the SDK's arithmetic; the read is found by value."""
    from otelprof.system._common import Reading
    from otelprof.system.gauges import Snapshots

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    clock = Clock()
    read_at = clock() - 5_000_000

    def source() -> list[Reading]:
        return [Reading("t.energy", 1234.5, {"hw.id": "GPU-x"}, read_at)]

    snapshots = Snapshots([("s", source)], 0.5, clock=clock, counters=frozenset({"t.energy"}))
    provider.get_meter("t").create_observable_counter(
        "t.energy", callbacks=[lambda _options: snapshots.observations("t.energy")]
    )
    data = reader.get_metrics_data()
    provider.shutdown()
    (point,) = points(data)["t.energy"]
    assert not isinstance(point.value, StampedValue)  # the SDK's sum made a new float
    (stamped,) = points(apply_read_times(data))["t.energy"]
    assert stamped.time_unix_nano == clock.to_unix_ns(read_at)
    assert stamped.start_time_unix_nano == point.start_time_unix_nano  # the SDK's, kept
