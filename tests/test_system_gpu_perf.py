"""What the GPU's units do (GPM or classic NVML), per-process GPU memory, read timestamps.

Over the fake driver (tests/fake_nvml.py): pynvml's own structures, error classes and
per-metric return codes; GPM samples snapshot the driver's integrals like the real ones.
Every code path: GPM supported, unsupported, refusing one metric, MIG slices with and
without GPM, a GPU that falls off the bus.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint

from otelprof.system import SystemMetricsSettings, names, register_system_metrics
from otelprof.system._stamps import Clock, apply_read_times
from tests.fake_nvml import (
    FI_NVLINK_RX,
    FI_NVLINK_TX,
    FI_PCIE_RX,
    FI_PCIE_TX,
    GPM_DRAM,
    GPM_NVLINK_RX,
    GPM_NVLINK_TX,
    GPM_OCCUPANCY,
    GPM_PCIE_RX,
    GPM_PCIE_TX,
    GPM_SM,
    GPM_TENSOR,
    NVML_ERROR_NOT_SUPPORTED,
    FakeGpu,
    FakeNvml,
)

MIB = 2**20
PERF = {
    names.GPU_SM_ACTIVITY.name,
    names.GPU_SM_OCCUPANCY.name,
    names.GPU_TENSOR_ACTIVITY.name,
    names.GPU_DRAM_BANDWIDTH.name,
    names.GPU_PCIE_IO.name,
    names.GPU_NVLINK_IO.name,
}


class StepClock:
    """Monotonic time that a test moves; each read also ticks 1 µs (reads are distinct)."""

    def __init__(self) -> None:
        self.ns = 10**12

    def __call__(self) -> int:
        self.ns += 1_000
        return self.ns


class Rig:
    def __init__(
        self, nvml: FakeNvml, env: dict[str, str] | None = None, training: Any = None
    ) -> None:
        self.nvml = nvml
        self.time = StepClock()
        self.clock = Clock(monotonic_ns=self.time, wall_ns=lambda: 1_800_000_000 * 10**9)
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        self.handle = register_system_metrics(
            self.provider.get_meter("test"),
            SystemMetricsSettings(
                interval_s=1.0, host_metrics=False, process_metrics=False, torch_cuda_memory=False
            ),
            nvml=nvml,
            env=env or {},
            clock=self.clock,
            training=training,
        )

    def advance(self, seconds: float, *gpus: FakeGpu, **gpm: float) -> None:
        """Let time pass on the host clock and on the GPUs (with these GPM averages)."""
        self.time.ns += int(seconds * 1e9)
        for gpu in gpus:
            gpu.run(seconds, **gpm)

    def collect(self) -> list[tuple[str, NumberDataPoint]]:
        data = self.reader.get_metrics_data()
        out = []
        if data is None:
            return out
        for rm in apply_read_times(data).resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    for point in metric.data.data_points:
                        assert isinstance(point, NumberDataPoint)
                        out.append((metric.name, point))
        return out

    def values(self) -> dict[tuple[str, tuple[tuple[str, Any], ...]], float]:
        return {
            (
                name,
                tuple(sorted((k, v) for k, v in (p.attributes or {}).items() if k != "hw.id")),
            ): (p.value)
            for name, p in self.collect()
        }

    def close(self) -> None:
        self.handle.close()
        self.provider.shutdown()


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.close()


def make(rigs: list[Rig], nvml: FakeNvml, env: dict[str, str] | None = None) -> Rig:
    rig = Rig(nvml, env)
    rigs.append(rig)
    return rig


def hopper(uuid: str = "GPU-h100") -> FakeGpu:
    return FakeGpu(uuid=uuid, gpm_supported=True)


def busy(**extra: float) -> dict[str, float]:
    """GPM averages of a busy training step (percent; MiB/s for traffic)."""
    return {
        f"m{GPM_SM}": 80.0,
        f"m{GPM_OCCUPANCY}": 40.0,
        f"m{GPM_TENSOR}": 60.0,
        f"m{GPM_DRAM}": 50.0,
        f"m{GPM_PCIE_TX}": 100.0,
        f"m{GPM_PCIE_RX}": 300.0,
        f"m{GPM_NVLINK_TX}": 1000.0,
        f"m{GPM_NVLINK_RX}": 2000.0,
        **{f"m{k}": v for k, v in extra.items()},
    }


def gpm(source: str = "gpm", index: int = 0, direction: str | None = None) -> tuple:
    attrs = [("gpu.index", index), ("otelprof.gpu.source", source)]
    if direction:
        attrs.append(("network.io.direction", direction))
    return tuple(sorted(attrs))


def test_gpm_metrics_are_the_averages_over_the_collection_interval(rigs: list[Rig]) -> None:
    gpu = hopper()
    rig = make(rigs, FakeNvml([gpu]))
    rig.advance(0.5, gpu, **busy())
    rig.advance(0.5, gpu, **{f"m{GPM_SM}": 20.0, f"m{GPM_TENSOR}": 0.0})  # a slow second half
    values = rig.values()
    assert values[(names.GPU_SM_ACTIVITY.name, gpm())] == pytest.approx(0.5)  # (80+20)/2 %
    assert values[(names.GPU_TENSOR_ACTIVITY.name, gpm())] == pytest.approx(0.3)
    assert values[(names.GPU_SM_OCCUPANCY.name, gpm())] == pytest.approx(0.2)
    assert values[(names.GPU_DRAM_BANDWIDTH.name, gpm())] == pytest.approx(0.25)
    assert values[(names.GPU_PCIE_IO.name, gpm(direction="transmit"))] == pytest.approx(50 * MIB)
    assert values[(names.GPU_PCIE_IO.name, gpm(direction="receive"))] == pytest.approx(150 * MIB)
    assert values[(names.GPU_NVLINK_IO.name, gpm(direction="receive"))] == pytest.approx(1000 * MIB)
    # the next interval covers only what happened since
    rig.advance(1.0, gpu, **busy())
    values = rig.values()
    assert values[(names.GPU_SM_ACTIVITY.name, gpm())] == pytest.approx(0.8)
    assert all(
        name not in PERF or dict(key)["otelprof.gpu.source"] == "gpm" for name, key in values
    )


def test_each_gpu_point_carries_its_own_read_time_and_rates_their_window(
    rigs: list[Rig],
) -> None:
    gpu = hopper()
    gpu.fields = {FI_PCIE_TX: 0}
    rig = make(rigs, FakeNvml([gpu]))
    rig.advance(1.0, gpu, **busy())
    points = rig.collect()
    times = {name: p.time_unix_nano for name, p in points}
    # every NVML call was stamped right before it: different instants, in call order
    assert times[names.GPU_UTILIZATION.name] < times[names.GPU_MEMORY_FREE.name]
    assert times[names.GPU_MEMORY_FREE.name] < times[names.GPU_POWER.name]
    assert times[names.GPU_POWER.name] < times[names.GPU_SM_ACTIVITY.name]
    sm = next(p for name, p in points if name == names.GPU_SM_ACTIVITY.name)
    window = (sm.time_unix_nano - sm.start_time_unix_nano) / 1e9
    assert window == pytest.approx(1.0, abs=1e-3)  # the GPM samples' own interval
    level = next(p for name, p in points if name == names.GPU_MEMORY_FREE.name)
    assert level.time_unix_nano != sm.time_unix_nano


def test_without_gpm_pcie_nvlink_and_dram_come_from_classic_nvml_and_say_so(
    rigs: list[Rig], caplog: pytest.LogCaptureFixture
) -> None:
    gpu = FakeGpu(uuid="GPU-a100", gpm_supported=False)  # Ampere: no GPM
    gpu.fields = {FI_PCIE_TX: 10**9, FI_PCIE_RX: 0, FI_NVLINK_TX: 0, FI_NVLINK_RX: 0}
    with caplog.at_level(logging.INFO, logger="otelprof.system"):
        rig = make(rigs, FakeNvml([gpu]))
        assert names.GPU_PCIE_IO.name not in {n for n, _ in rig.collect()}  # baseline only
        rig.advance(2.0)
        gpu.fields[FI_PCIE_TX] += 4 * 10**9
        gpu.fields[FI_PCIE_RX] += 10**9
        gpu.fields[FI_NVLINK_TX] += 2**20  # KiB: 1 GiB
        gpu.memory_samples = [(1, 30.0), (2, 50.0)]
        values = rig.values()
    assert values[(names.GPU_PCIE_IO.name, gpm("nvml", direction="transmit"))] == pytest.approx(
        2e9, rel=1e-4
    )
    assert values[(names.GPU_PCIE_IO.name, gpm("nvml", direction="receive"))] == pytest.approx(
        0.5e9, rel=1e-4
    )
    assert values[(names.GPU_NVLINK_IO.name, gpm("nvml", direction="transmit"))] == pytest.approx(
        2**30 / 2, rel=1e-4
    )
    assert values[(names.GPU_NVLINK_IO.name, gpm("nvml", direction="receive"))] == 0.0  # idle
    assert values[(names.GPU_DRAM_BANDWIDTH.name, gpm("nvml"))] == pytest.approx(0.4)
    present = {name for name, _ in values}
    # GPM-only quantities are absent, never 0
    assert not present & {
        names.GPU_SM_ACTIVITY.name,
        names.GPU_SM_OCCUPANCY.name,
        names.GPU_TENSOR_ACTIVITY.name,
    }
    assert sum("GPM unavailable" in r.getMessage() for r in caplog.records) == 1


def test_a_gpm_metric_the_gpu_refuses_falls_back_to_classic_nvml_for_that_quantity(
    rigs: list[Rig],
) -> None:
    gpu = hopper("GPU-h100-pcie")
    gpu.gpm_errors = {
        GPM_NVLINK_TX: NVML_ERROR_NOT_SUPPORTED,
        GPM_NVLINK_RX: NVML_ERROR_NOT_SUPPORTED,
    }
    gpu.fields = {FI_NVLINK_TX: 0, FI_NVLINK_RX: 0}
    rig = make(rigs, FakeNvml([gpu]))
    rig.advance(1.0, gpu, **busy())
    first = rig.values()
    assert (names.GPU_SM_ACTIVITY.name, gpm()) in first
    assert not any(name == names.GPU_NVLINK_IO.name for name, _ in first)  # baseline only
    rig.advance(1.0, gpu, **busy())
    gpu.fields[FI_NVLINK_RX] += 1024  # 1 MiB in 1 s
    values = rig.values()
    assert values[(names.GPU_NVLINK_IO.name, gpm("nvml", direction="receive"))] == pytest.approx(
        MIB, rel=1e-3
    )
    assert values[(names.GPU_PCIE_IO.name, gpm(direction="receive"))] == pytest.approx(300 * MIB)


def test_mig_slice_gets_gpm_through_its_gpu_instance(rigs: list[Rig]) -> None:
    parent = hopper("GPU-parent")
    mig = FakeGpu(uuid="MIG-aaaa", parent=parent, gpu_instance_id=7)
    other = FakeGpu(uuid="MIG-bbbb", parent=parent, gpu_instance_id=8)
    nvml = FakeNvml([parent], migs=[mig, other])
    rig = make(rigs, nvml, {"CUDA_VISIBLE_DEVICES": mig.uuid})
    rig.advance(1.0, mig, **busy())
    rig.advance(0.0, other, **{f"m{GPM_SM}": 1e6})  # another tenant's slice: not ours
    values = rig.values()
    assert values[(names.GPU_SM_ACTIVITY.name, gpm())] == pytest.approx(0.8)
    assert nvml.calls["nvmlGpmMigSampleGet"] >= 2 and "nvmlGpmSampleGet" not in nvml.calls


def test_mig_slice_without_gpm_reports_what_classic_nvml_allows_and_nothing_else(
    rigs: list[Rig],
) -> None:
    parent = FakeGpu(uuid="GPU-a100", gpm_supported=False)
    mig = FakeGpu(
        uuid="MIG-cccc",
        parent=parent,
        errors={
            "nvmlDeviceGetSamples": NVML_ERROR_NOT_SUPPORTED,
            "nvmlDeviceGetFieldValues": NVML_ERROR_NOT_SUPPORTED,
        },
    )
    rig = make(rigs, FakeNvml([parent], migs=[mig]), {"CUDA_VISIBLE_DEVICES": mig.uuid})
    for _ in range(2):
        rig.advance(1.0)
        assert not PERF & {name for name, _ in rig.values()}


def test_a_gpu_that_falls_off_the_bus_loses_its_series_and_the_others_continue(
    rigs: list[Rig], caplog: pytest.LogCaptureFixture
) -> None:
    gpus = [hopper("GPU-0"), hopper("GPU-1")]
    rig = make(rigs, FakeNvml(gpus))
    rig.advance(1.0, *gpus, **busy())
    assert {dict(k)["gpu.index"] for n, k in rig.values() if n == names.GPU_SM_ACTIVITY.name} == {
        0,
        1,
    }
    gpus[1].lost = True
    with caplog.at_level(logging.WARNING, logger="otelprof.system"):
        for _ in range(3):
            rig.advance(1.0, *gpus, **busy())
            values = rig.values()
            assert {dict(k)["gpu.index"] for n, k in values} == {0}, "lost GPU: absent, not 0"
            assert values[(names.GPU_SM_ACTIVITY.name, gpm())] == pytest.approx(0.8)
    messages = [r.getMessage() for r in caplog.records]
    assert messages and all("GPU-1" in m for m in messages)
    assert len(messages) == len(set(messages)), "each failure is logged once"


def test_close_frees_the_gpm_samples_before_shutting_nvml_down(rigs: list[Rig]) -> None:
    nvml = FakeNvml([hopper()])
    rig = make(rigs, nvml)
    assert nvml.calls["nvmlGpmSampleAlloc"] == 2
    rig.handle.close()
    assert nvml.calls["nvmlGpmSampleFree"] == 2 and nvml.init_count == 0


def test_process_gpu_memory_counts_this_process_and_its_children_only(rigs: list[Rig]) -> None:
    me = os.getpid()
    gpu = hopper()
    gpu.processes = [(me, 3 * 2**30), (999_999_1, 50 * 2**30)]  # a stranger on a shared GPU
    gpu.graphics_processes = [(me, 3 * 2**30)]  # the same process in both lists: once
    gpu.memory_used = 53 * 2**30
    rig = make(rigs, FakeNvml([gpu]))
    values = rig.values()
    assert values[(names.GPU_PROCESS_MEMORY.name, (("gpu.index", 0),))] == 3 * 2**30
    assert values[(names.GPU_MEMORY_USAGE.name, (("gpu.index", 0),))] == 53 * 2**30


def test_process_gpu_memory_is_absent_when_unknown_or_when_none_of_ours_is_listed(
    rigs: list[Rig],
) -> None:
    me = os.getpid()
    unknown, elsewhere = hopper("GPU-0"), hopper("GPU-1")
    unknown.processes = [(me, None)]  # no permission to see the figure
    elsewhere.processes = [(12345678, 2**30)]
    rig = make(rigs, FakeNvml([unknown, elsewhere]))
    assert not any(name == names.GPU_PROCESS_MEMORY.name for name, _ in rig.values())


class Training:
    """The training loop's step counter and phase, as the sampler reads them."""

    def __init__(self) -> None:
        self.steps = 0
        self.phase = "train"

    def __call__(self) -> tuple[int, str]:
        return self.steps, self.phase


def test_energy_per_step_and_gpu_idle_by_phase_are_live_metrics(rigs: list[Rig]) -> None:
    gpu = FakeGpu(uuid="GPU-e", utilization_rate=75, energy_mj=1_000_000)
    training = Training()
    rig = Rig(FakeNvml([gpu]), training=training)
    rigs.append(rig)
    rig.values()  # baseline: energy and utilization windows start here
    rig.advance(2.0)
    training.steps = 10
    gpu.energy_mj += 400_000  # 400 J over 10 steps
    values = rig.values()
    assert values[(names.GPU_ENERGY_PER_STEP.name, ())] == pytest.approx(40.0)
    idle_key = (names.GPU_IDLE.name, (("gpu.index", 0), ("otelprof.phase", "train")))
    assert values[idle_key] == pytest.approx(0.25 * 2.0, rel=1e-3)  # 75 % busy for 2 s
    # validation: no training steps; idle time goes to the validation phase
    training.phase = "validation"
    rig.advance(2.0)
    gpu.energy_mj += 100_000
    values = rig.values()
    assert (names.GPU_ENERGY_PER_STEP.name, ()) not in values
    val_key = (names.GPU_IDLE.name, (("gpu.index", 0), ("otelprof.phase", "validation")))
    assert values[val_key] == pytest.approx(0.25 * 2.0, rel=1e-3)
    assert values[idle_key] == pytest.approx(0.5, rel=1e-3)  # train's total unchanged


def test_determined_profiler_gpu_group_keeps_exactly_its_keys_with_the_new_gpu_metrics(
    rigs: list[Rig],
) -> None:
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

    from otelprof.determined.mapping import PROFILING_KEYS, Route, extract_metrics

    gpu = hopper()
    gpu.processes = [(os.getpid(), 2**30)]
    gpu.fields = {FI_PCIE_TX: 0}
    training = Training()
    rig = Rig(FakeNvml([gpu]), training=training)
    rigs.append(rig)
    rig.reader.get_metrics_data()
    rig.advance(1.0, gpu, **busy())
    training.steps = 5
    gpu.energy_mj += 1_000_000
    data = rig.reader.get_metrics_data()
    assert data is not None
    names_sent = {
        m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    assert {names.GPU_SM_ACTIVITY.name, names.GPU_ENERGY_PER_STEP.name} <= names_sent
    extracted = extract_metrics(
        encode_metrics(apply_read_times(data)), Route(trial_id=7, run_id=1, agent="a")
    )
    assert extracted.rejected == 0, extracted.errors
    groups = {(g.group, g.key) for g in extracted.gauges}
    profiler = {(g, k) for g, k in groups if g in PROFILING_KEYS}
    assert profiler == {("gpu", key) for key in PROFILING_KEYS["gpu"]}
    assert groups - profiler == {("timings", "gpu_energy_per_step_j")}  # the Metrics tab


def test_energy_per_step_joins_determined_timings_report_not_a_profiler_group() -> None:
    from otelprof.determined.aggregate import WindowAggregator
    from otelprof.determined.mapping import GaugeSample, TimingSample

    agg = WindowAggregator()
    t = 1_800_000_000 * 10**9
    agg.add_gauges(
        [
            GaugeSample(7, 1, "agent", "timings", "", "gpu_energy_per_step_j", 40.0, t),
            GaugeSample(7, 1, "agent", "timings", "", "gpu_energy_per_step_j", 60.0, t + 1),
        ]
    )
    agg.add_timings([TimingSample(7, 1, "dataloader_next", 0.5, 10, 9, t)])
    reports = agg.drain()
    assert [r.group for r in reports] == ["timings"]
    avg = reports[0].body["metrics"]["metrics"]["avgMetrics"]
    assert avg["gpu_energy_per_step_j"] == pytest.approx(50.0)  # the window's mean
    assert avg["dataloader_next_s"] == pytest.approx(0.05)


def test_a_32_bit_pcie_counter_that_wraps_once_still_gives_the_right_rate(rigs: list[Rig]) -> None:
    gpu = FakeGpu(uuid="GPU-v100")  # no GPM
    gpu.fields = {FI_PCIE_RX: 2**32 - 1000}
    gpu.uint32_fields = {FI_PCIE_RX}
    rig = make(rigs, FakeNvml([gpu]))
    rig.values()
    rig.advance(1.0)
    gpu.fields[FI_PCIE_RX] += 3_000_000_000  # wraps past 2**32 inside the interval
    values = rig.values()
    assert values[(names.GPU_PCIE_IO.name, gpm("nvml", direction="receive"))] == pytest.approx(
        3e9,
        rel=1e-4,  # the test clock ticks 1 µs per read
    )


def test_a_bug_in_the_performance_part_costs_only_those_series(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = hopper()
    rig = make(rigs, FakeNvml([gpu]))
    perf = rig.handle._gpu._perf  # type: ignore[union-attr]

    def broken(device: Any, out: list[Any]) -> None:
        raise KeyError("a bug")

    monkeypatch.setattr(perf, "sample", broken)
    with caplog.at_level(logging.WARNING, logger="otelprof.system"):
        for _ in range(2):
            rig.advance(1.0, gpu, **busy())
            present = {name for name, _ in rig.values()}
            assert names.GPU_MEMORY_USAGE.name in present and not present & PERF
    assert len([r for r in caplog.records if "performance" in r.getMessage()]) == 1
