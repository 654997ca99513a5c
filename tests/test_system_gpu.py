"""GPU gauges over a fake NVML driver: job-visible selection, interval averages, refusals.

The SDK, the reader and pynvml's error classes and structures are real; only the driver
calls are scripted (tests/fake_nvml.py), since this machine has no GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint

from otelprof.system import (
    SystemMetricsHandle,
    SystemMetricsSettings,
    names,
    parse_visible_devices,
    register_system_metrics,
)
from tests.fake_nvml import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_GPU_UTILIZATION_SAMPLES,
    NVML_VALUE_TYPE_DOUBLE,
    FakeGpu,
    FakeNvml,
    four_gpus,
)

Points = dict[str, list[tuple[float, dict[str, Any]]]]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class GpuRig:
    """A MeterProvider + in-memory reader with only GPU gauges, over a fake driver."""

    def __init__(self, nvml: FakeNvml, env: dict[str, str], gpus: str = "visible") -> None:
        self.nvml = nvml
        self.clock = Clock()
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        self.handle: SystemMetricsHandle = register_system_metrics(
            self.provider.get_meter("test"),
            SystemMetricsSettings(
                interval_s=1.0,
                host_metrics=False,
                gpus=gpus,
                process_metrics=False,
                torch_cuda_memory=False,
            ),
            nvml=nvml,
            env=env,
            clock=self.clock,
        )

    def collect(self, advance_s: float = 1.0) -> Points:
        self.clock.now += advance_s
        out: Points = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else []:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    for p in metric.data.data_points:
                        assert isinstance(p, NumberDataPoint)
                        point = (p.value, dict(p.attributes or {}))
                        out.setdefault(metric.name, []).append(point)
        return out

    def close(self) -> None:
        self.handle.close()
        self.provider.shutdown()


@pytest.fixture
def rigs() -> Iterator[list[GpuRig]]:
    made: list[GpuRig] = []
    yield made
    for rig in made:
        rig.close()


def rig_for(rigs: list[GpuRig], nvml: FakeNvml, env: dict[str, str], gpus: str = "visible"):
    rig = GpuRig(nvml, env, gpus)
    rigs.append(rig)
    return rig


def by_index(points: Points, name: str) -> dict[int, float]:
    return {attrs["gpu.index"]: value for value, attrs in points.get(name, [])}


# -- CUDA_VISIBLE_DEVICES ----------------------------------------------------------------


def test_visible_devices_parse_like_cuda_up_to_the_first_invalid_entry() -> None:
    assert parse_visible_devices(None) is None
    assert parse_visible_devices("") == []
    assert parse_visible_devices("-1") == []
    assert parse_visible_devices("2, 0") == ["2", "0"]
    assert parse_visible_devices("1,-1,0") == ["1"]
    assert parse_visible_devices("GPU-abc,MIG-def,3") == ["GPU-abc", "MIG-def", "3"]
    assert parse_visible_devices("0,cuda:1,2") == ["0"]


def test_only_the_gpus_this_job_sees_are_reported_in_cuda_order(rigs: list[GpuRig]) -> None:
    nvml = FakeNvml(four_gpus())
    rig = rig_for(rigs, nvml, {"CUDA_VISIBLE_DEVICES": "2,0"})
    assert rig.handle.gpus == [(2, nvml.gpus[2].uuid), (0, nvml.gpus[0].uuid)]
    points = rig.collect()
    free = points[names.GPU_MEMORY_FREE.name]
    assert [attrs for _, attrs in free] == [
        {"hw.id": nvml.gpus[2].uuid, "gpu.index": 2},
        {"hw.id": nvml.gpus[0].uuid, "gpu.index": 0},
    ]


def test_gpu_uuid_prefixes_select_by_uuid_and_an_ambiguous_one_stops_the_list(
    rigs: list[GpuRig],
) -> None:
    nvml = FakeNvml(four_gpus())
    rig = rig_for(rigs, nvml, {"CUDA_VISIBLE_DEVICES": "GPU-3333,GPU-1111aaaa,GPU-,0"})
    assert [index for index, _ in rig.handle.gpus] == [3, 1]  # "GPU-" matches all: stop


def test_unset_visible_devices_means_every_gpu_and_all_ignores_it(rigs: list[GpuRig]) -> None:
    assert len(rig_for(rigs, FakeNvml(four_gpus()), {}).handle.gpus) == 4
    rig = rig_for(rigs, FakeNvml(four_gpus()), {"CUDA_VISIBLE_DEVICES": "1"}, gpus="all")
    assert [index for index, _ in rig.handle.gpus] == [0, 1, 2, 3]


def test_mig_slice_is_mapped_to_its_parent_index_and_refused_series_are_omitted(
    rigs: list[GpuRig], caplog: pytest.LogCaptureFixture
) -> None:
    gpus = four_gpus()
    mig = FakeGpu(
        uuid="MIG-5d3e1b2c-0000-0000-0000-000000000001",
        parent=gpus[1],
        memory_total=10 * 2**30,
        memory_used=2**30,
        errors={
            "nvmlDeviceGetSamples": NVML_ERROR_NOT_SUPPORTED,
            "nvmlDeviceGetUtilizationRates": NVML_ERROR_NOT_SUPPORTED,
            "nvmlDeviceGetPowerUsage": NVML_ERROR_NOT_SUPPORTED,
            "nvmlDeviceGetTemperature": NVML_ERROR_NOT_SUPPORTED,
            "nvmlDeviceGetTotalEnergyConsumption": NVML_ERROR_NOT_SUPPORTED,
        },
    )
    nvml = FakeNvml(gpus, migs=[mig])
    with caplog.at_level(logging.INFO, logger="otelprof.system"):
        rig = rig_for(rigs, nvml, {"CUDA_VISIBLE_DEVICES": mig.uuid})
        for _ in range(3):
            points = rig.collect()
            assert set(points) == {
                names.GPU_MEMORY_FREE.name,
                names.GPU_MEMORY_USAGE.name,
                names.GPU_MEMORY_LIMIT.name,
            }, "refused series must be absent, never 0"
            assert points[names.GPU_MEMORY_FREE.name] == [
                (9 * 2**30, {"hw.id": mig.uuid, "gpu.index": 1})
            ]
    refusals = [r.getMessage() for r in caplog.records if "refuses" in r.getMessage()]
    refused = {m.split("refuses ")[1].split(" (")[0] for m in refusals}
    assert {"utilization", "power", "temperature", "energy", "memory-samples"} <= refused
    assert len(refusals) == len(set(refusals)), "each refusal is logged once"
    assert any("PCIE_COUNT_TX_BYTES" in m for m in refusals)  # PCIe/NVLink counters: one line
    assert all(mig.uuid in m for m in refusals)
    assert nvml.calls["nvmlDeviceGetPowerUsage"] == 1  # not asked again once refused


def test_empty_selection_leaves_no_gpu_gauges_and_says_so_once(
    rigs: list[GpuRig], caplog: pytest.LogCaptureFixture
) -> None:
    nvml = FakeNvml(four_gpus())
    with caplog.at_level(logging.INFO, logger="otelprof.system"):
        rig = rig_for(rigs, nvml, {"CUDA_VISIBLE_DEVICES": "-1"})
    assert rig.handle.gpus == [] and rig.handle.instruments == ()
    assert rig.collect() == {}
    assert [r.getMessage() for r in caplog.records] == [
        "GPU metrics off: CUDA_VISIBLE_DEVICES='-1' selects no GPU"
    ]
    assert nvml.init_count == 0  # NVML shut down again


# -- utilization as an interval average -----------------------------------------------------


def test_utilization_is_the_mean_of_the_driver_samples_in_the_interval(
    rigs: list[GpuRig],
) -> None:
    gpu = FakeGpu(uuid="GPU-1", utilization_rate=99)
    gpu.add_sample(1_000, 100)  # history before registration: skipped
    rig = rig_for(rigs, FakeNvml([gpu]), {})
    for t, pct in ((2_000, 20), (3_000, 40), (4_000, 90)):
        gpu.add_sample(t, pct)
    assert by_index(rig.collect(), names.GPU_UTILIZATION.name) == {0: pytest.approx(0.5)}
    gpu.add_sample(5_000, 10)
    assert by_index(rig.collect(), names.GPU_UTILIZATION.name) == {0: pytest.approx(0.1)}


def test_no_new_driver_sample_falls_back_to_the_running_utilization_rate(
    rigs: list[GpuRig],
) -> None:
    gpu = FakeGpu(uuid="GPU-1", utilization_rate=37)
    rig = rig_for(rigs, FakeNvml([gpu]), {})
    assert by_index(rig.collect(), names.GPU_UTILIZATION.name) == {0: pytest.approx(0.37)}


def test_double_valued_samples_are_read_from_the_right_union_field(rigs: list[GpuRig]) -> None:
    gpu = FakeGpu(uuid="GPU-1", sample_type=NVML_VALUE_TYPE_DOUBLE)
    rig = rig_for(rigs, FakeNvml([gpu]), {})
    gpu.add_sample(10, 12.5)
    gpu.add_sample(20, 37.5)
    assert by_index(rig.collect(), names.GPU_UTILIZATION.name) == {0: pytest.approx(0.25)}


def test_unsupported_samples_switch_to_utilization_rates_for_good_with_one_log_line(
    rigs: list[GpuRig], caplog: pytest.LogCaptureFixture
) -> None:
    gpu = FakeGpu(
        uuid="GPU-1",
        utilization_rate=64,
        errors={"nvmlDeviceGetSamples": NVML_ERROR_NOT_SUPPORTED},
    )
    nvml = FakeNvml([gpu])
    with caplog.at_level(logging.INFO, logger="otelprof.system"):
        rig = rig_for(rigs, nvml, {})
        for _ in range(3):
            assert by_index(rig.collect(), names.GPU_UTILIZATION.name) == {0: 0.64}
    assert sum("utilization samples unavailable" in r.getMessage() for r in caplog.records) == 1
    # utilization samples: priming + first collection only (memory samples: the same)
    assert nvml.sample_calls[NVML_GPU_UTILIZATION_SAMPLES] == 2


# -- the other GPU series ------------------------------------------------------------------


def test_memory_power_temperature_and_energy_in_their_units(rigs: list[GpuRig]) -> None:
    gpu = FakeGpu(
        uuid="GPU-1",
        memory_total=80 * 10**9,
        memory_used=30 * 10**9,
        power_mw=312_500,
        temperature_c=61,
        energy_mj=5_000_000,
    )
    rig = rig_for(rigs, FakeNvml([gpu]), {})
    points = rig.collect()
    assert by_index(points, names.GPU_MEMORY_FREE.name) == {0: 50 * 10**9}
    assert by_index(points, names.GPU_MEMORY_USAGE.name) == {0: 30 * 10**9}
    assert by_index(points, names.GPU_MEMORY_LIMIT.name) == {0: 80 * 10**9}
    assert by_index(points, names.GPU_POWER.name) == {0: 312.5}
    assert by_index(points, names.GPU_TEMPERATURE.name) == {0: 61}
    assert by_index(points, names.GPU_ENERGY.name) == {0: 5_000}
    ((_, attrs),) = points[names.GPU_POWER.name]
    assert attrs == {"hw.id": "GPU-1", "gpu.index": 0, "hw.type": "gpu"}
    gpu.energy_mj = 5_250_000
    assert by_index(rig.collect(), names.GPU_ENERGY.name) == {0: 5_250}  # cumulative counter


def test_memory_used_leaves_out_what_the_driver_reserves_as_nvidia_smi_does(
    rigs: list[GpuRig],
) -> None:
    # an H200 (driver 580) reserves 615 MiB: NVML v1's `used` counted it, nvidia-smi does not
    reserved, held = 615 * 2**20, 8 * 2**30
    gpu = FakeGpu(uuid="GPU-1", memory_total=140 * 2**30, memory_used=held)
    gpu.memory_reserved = reserved
    points = rig_for(rigs, FakeNvml([gpu]), {}).collect()
    assert by_index(points, names.GPU_MEMORY_USAGE.name) == {0: held}
    assert by_index(points, names.GPU_MEMORY_FREE.name) == {0: 140 * 2**30 - held - reserved}
    assert by_index(points, names.GPU_MEMORY_LIMIT.name) == {0: 140 * 2**30}


def test_a_driver_without_memory_v2_falls_back_to_v1(rigs: list[GpuRig]) -> None:
    gpu = FakeGpu(uuid="GPU-1", memory_used=2**30)
    gpu.memory_reserved, gpu.memory_v2 = 2**20, False
    rig = rig_for(rigs, FakeNvml([gpu]), {})
    for _ in range(2):  # v2 is asked once, then v1 every time
        assert by_index(rig.collect(), names.GPU_MEMORY_USAGE.name) == {0: 2**30 + 2**20}


def test_a_transient_driver_error_omits_one_sample_and_is_logged_once(
    rigs: list[GpuRig], caplog: pytest.LogCaptureFixture
) -> None:
    gpu = FakeGpu(uuid="GPU-1", temperature_c=50)
    rig = rig_for(rigs, FakeNvml([gpu]), {})
    gpu.errors["nvmlDeviceGetTemperature"] = NVML_ERROR_GPU_IS_LOST
    with caplog.at_level(logging.WARNING, logger="otelprof.system"):
        for _ in range(2):
            points = rig.collect()
            assert names.GPU_TEMPERATURE.name not in points
            assert names.GPU_MEMORY_FREE.name in points
    assert len(caplog.records) == 1 and "temperature" in caplog.records[0].getMessage()
    del gpu.errors["nvmlDeviceGetTemperature"]
    assert by_index(rig.collect(), names.GPU_TEMPERATURE.name) == {0: 50}


def test_no_nvml_means_no_gpu_gauges_one_log_line_and_host_metrics_unchanged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    with caplog.at_level(logging.INFO, logger="otelprof.system"):
        handle = register_system_metrics(
            provider.get_meter("test"),
            SystemMetricsSettings(interval_s=1.0, torch_cuda_memory=False),
            nvml=FakeNvml([], init_error=NVML_ERROR_LIBRARY_NOT_FOUND),
        )
    try:
        assert handle.gpus == []
        assert not any(n.startswith("hw.") for n in handle.instruments)
        assert set(handle.instruments) == {i.name for i in names.HOST + names.PROCESS}
        assert len(caplog.records) == 1
        assert "GPU metrics off: NVML is not available" in caplog.records[0].getMessage()
    finally:
        handle.close()
        provider.shutdown()


def test_real_pynvml_without_a_driver_turns_gpu_metrics_off_quietly() -> None:
    """On this GPU-less machine the real binding must fail soft, not raise."""
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    handle = register_system_metrics(
        provider.get_meter("test"),
        SystemMetricsSettings(host_metrics=False, process_metrics=False, gpus="all"),
    )
    try:
        if handle.gpus:
            pytest.skip("this machine has an NVIDIA driver and GPU")
        assert handle.instruments == (
            names.TORCH_CUDA_ALLOCATED.name,
            names.TORCH_CUDA_RESERVED.name,
        )
    finally:
        handle.close()
        provider.shutdown()


def test_close_shuts_nvml_down_and_stops_observations(rigs: list[GpuRig]) -> None:
    nvml = FakeNvml(four_gpus())
    rig = rig_for(rigs, nvml, {})
    assert nvml.init_count == 1
    assert rig.collect()
    rig.handle.close()
    assert nvml.init_count == 0
    assert rig.collect() == {}
