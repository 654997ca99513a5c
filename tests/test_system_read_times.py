"""Exported system-metric points say when they were read and which window they average."""

from __future__ import annotations

import ctypes
import itertools
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
    NumberDataPoint,
    PeriodicExportingMetricReader,
)

from otelprof.system import SystemMetricsSettings, names, register_system_metrics
from otelprof.system._procfs import ProcFile
from otelprof.system._stamps import Clock, StampedValue, apply_read_times, timed
from otelprof.system.gauges import Snapshots
from otelprof.system.host import HostSampler


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


def scripted(*values: int) -> Callable[[], int]:
    """A clock (or a counter) that returns the given readings in turn."""
    readings = iter(values)
    return lambda: next(readings)


def test_a_read_is_stamped_at_the_middle_of_the_clock_readings_around_it() -> None:
    events: list[str] = []
    readings = iter((100, 140))

    def clock() -> int:
        events.append("clock")
        return next(readings)

    def read() -> str:
        events.append("read")
        return "value"

    stamped = timed(read, clock)
    assert (stamped.value, stamped.time_ns, stamped.width_ns) == ("value", 120, 40)
    assert events == ["clock", "read", "clock"]


def test_a_read_with_a_thread_switch_inside_its_bracket_is_read_again() -> None:
    # 6 ms between the first clock reading and the end of the read: the thread was switched
    # out before or after the read, which happened somewhere in those 6 ms; read it again
    clock = scripted(0, 6_000_000, 6_000_100, 6_000_150)
    stamped = timed(scripted(1, 2), clock)
    assert (stamped.value, stamped.time_ns, stamped.width_ns) == (2, 6_000_125, 50)


def test_a_read_interrupted_every_time_keeps_its_narrowest_bracket() -> None:
    clock = scripted(0, 5_000_000, 6_000_000, 9_000_000, 10_000_000, 14_000_000)
    stamped = timed(scripted(1, 2, 3), clock)
    assert (stamped.value, stamped.time_ns, stamped.width_ns) == (2, 7_500_000, 3_000_000)


def test_the_unix_offset_is_not_read_across_a_thread_switch() -> None:
    """Monotonic clock read, a 35 ms switch, then the wall clock: that offset would stamp
    every read of a snapshot 35 ms late. The bracket shows the switch; it is read again."""
    w = 1_700_000_000_000_000_000  # wall minus monotonic, the true offset
    monotonic = scripted(0, 20, 1_000, 35_001_050, 35_001_100, 35_001_200)
    wall = scripted(w + 10, w + 35_001_000, w + 35_001_150)
    clock = Clock(monotonic_ns=monotonic, wall_ns=wall)
    assert clock.to_unix_ns(0) == w
    clock.resync()  # mono 1,000 ... wall at 35,001,000 ... mono 35,001,050; then again
    assert clock.to_unix_ns(0) == w


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


# --- a disk whose counters are known at every instant, read beside a busy thread ----------

MEAN_READS_PER_S = 200_000.0
SWING_PERIOD_S = 0.06  # the read rate swings between 0 and twice the mean with this period


def reads_at(t_ns: int) -> float:
    """Reads completed by the stand-in disk at monotonic instant `t_ns`: the integral of a
    rate of MEAN × (1 + sin(2πt/P)), so a window placed a few ms off gets a different mean."""
    t = t_ns / 1e9
    w = 2 * math.pi / SWING_PERIOD_S
    return MEAN_READS_PER_S * (t + (1 - math.cos(w * t)) / w)


class StandInDiskstats:
    """A kernel stand-in for /proc/diskstats (one disk, `sdz`, 4 KiB per read): its counters
    are those of `reads_at` at the instant its pread runs, as the kernel's are."""

    def pread(self, fd: int, address: int, count: int, offset: int) -> int:
        reads = int(reads_at(time.monotonic_ns()))
        # fixed width, so a second call at the end offset finds the end of the same text
        line = f"   8 0 sdz {reads:020d} 0 {8 * reads:020d} 0 0 0 0 0 0 0 0\n".encode()
        chunk = line[offset : offset + count]
        ctypes.memmove(address, chunk, len(chunk))
        return len(chunk)


class SwitchedOutAfterEveryThirdReading:
    """`time.monotonic_ns`, except that after every third reading the calling thread is
    switched out for one switch interval before it goes on, as the interpreter may do right
    there when another thread wants the GIL (rarely: here it is made frequent)."""

    def __init__(self) -> None:
        self.readings = 0

    def __call__(self) -> int:
        now = time.monotonic_ns()
        self.readings += 1
        if self.readings % 3 == 0:
            time.sleep(sys.getswitchinterval())  # the busy thread runs meanwhile
        return now


class KeepDiskReadWindows(MetricExporter):
    """What reaches an exporter: (start, end, value) of every read-IOPS point."""

    def __init__(self) -> None:
        super().__init__()
        self.windows: list[tuple[int, int, float]] = []

    def export(
        self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        for point in points(metrics_data).get(names.DISK_IOPS.name, []):
            if point.attributes[names.DISK_DIRECTION] == names.READ:
                start, end = point.start_time_unix_nano, point.time_unix_nano
                self.windows.append((start, end, point.value))
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


def unix_minus_monotonic() -> int:
    """This test's own reading of the offset: the narrowest of many brackets."""
    brackets = []
    for _ in range(200):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        brackets.append((after - before, wall - (before + after) // 2))
    return min(brackets)[1]


def test_disk_rates_cover_their_own_reads_while_a_python_thread_is_busy() -> None:
    """Every window's read IOPS is the stand-in disk's true mean over the window exported
    with it, within 5 %, though the sampler is switched out right after a third of its
    clock readings and a busy thread holds the GIL meanwhile (issue 49: a read stamped
    before a switch was stamped that long before the counters were read)."""
    from otelprof.export.counters import CountingMetricExporter, ExportCounters

    disk = StandInDiskstats()
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    busy = threading.Thread(target=spin, daemon=True)
    busy.start()
    clock = Clock(monotonic_ns=SwitchedOutAfterEveryThirdReading())

    def open_proc(path: str) -> ProcFile:
        return ProcFile(path, pread=disk.pread if path == "/proc/diskstats" else None)

    host = HostSampler(
        is_physical_disk=lambda name: name == "sdz", clock=clock, open_proc=open_proc
    )
    kept = KeepDiskReadWindows()
    reader = PeriodicExportingMetricReader(
        CountingMetricExporter("test", kept, ExportCounters()), export_interval_millis=100
    )
    provider = MeterProvider(metric_readers=[reader])
    try:
        host.prime()
        snapshots = Snapshots([("host", host.sample)], max_age_s=0.05, clock=clock)
        meter = provider.get_meter("t")
        for instrument in (names.DISK_IOPS, names.DISK_THROUGHPUT):
            meter.create_observable_gauge(
                instrument.name,
                callbacks=[lambda _o, name=instrument.name: snapshots.observations(name)],
            )
        deadline = time.monotonic() + 30
        while len(kept.windows) < 25 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.06)  # past MIN_WINDOW_S since that export's read: the final window
        shutdown_at = time.time_ns()
        snapshots.final_sample()  # what Profiler.shutdown() does before the last collection
        reader.force_flush(timeout_millis=10_000)  # which the SDK bounds by the interval
    finally:
        provider.shutdown()
        stop.set()
        busy.join()
        host.close()
    # a collection right after another shares its sample: the same window again
    windows = list(dict.fromkeys(kept.windows))
    offset = unix_minus_monotonic()
    first = windows[0][0] if windows else 0
    report, errors = [], []
    for start, end, value in windows:
        expected = (reads_at(end - offset) - reads_at(start - offset)) / ((end - start) / 1e9)
        errors.append(abs(value - expected) / expected)
        report.append(
            f"+{(start - first) / 1e6:6.0f} ms, {(end - start) / 1e6:5.1f} ms long: "
            f"{value:8.0f} reads/s, truly {expected:8.0f} ({errors[-1]:.2%})"
        )
    summary = "\n".join(report)
    assert len(windows) >= 25, f"only {len(windows)} windows:\n{summary}"
    assert windows[-1][1] > shutdown_at, f"no window from the final collection:\n{summary}"
    assert max(errors) <= 0.05, summary
    # each window starts where the previous one ended: the same read closes one, opens the next
    for i, ((_, end, _), (start, _, _)) in enumerate(itertools.pairwise(windows)):
        assert start == end, f"window {i + 1} starts {(start - end) / 1e6} ms off:\n{summary}"
