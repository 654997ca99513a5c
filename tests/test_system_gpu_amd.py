"""AMD GPUs through AMD SMI, over a fake driver (tests/fake_amdsmi.py): the NVIDIA names."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint

from otelprof.system import SystemMetricsSettings, names, register_system_metrics
from tests.fake_amdsmi import (
    AMDSMI_STATUS_DRM_ERROR,
    AMDSMI_STATUS_NOT_SUPPORTED,
    FakeAmdGpu,
    FakeAmdSmi,
)
from tests.fake_nvml import NVML_ERROR_LIBRARY_NOT_FOUND, FakeNvml

Values = dict[tuple[str, int], tuple[float, dict[str, Any]]]


class AmdRig:
    def __init__(self, smi: FakeAmdSmi, env: dict[str, str] | None = None) -> None:
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        self.handle = register_system_metrics(
            self.provider.get_meter("test"),
            SystemMetricsSettings(
                host_metrics=False, process_metrics=False, torch_cuda_memory=False
            ),
            nvml=FakeNvml([], init_error=NVML_ERROR_LIBRARY_NOT_FOUND),  # no NVIDIA driver
            amdsmi=smi,
            env=env or {},
        )

    def values(self) -> Values:
        out: Values = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else []:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    for p in metric.data.data_points:
                        assert isinstance(p, NumberDataPoint)
                        attrs = dict(p.attributes or {})
                        out[(metric.name, int(attrs["gpu.index"]))] = (p.value, attrs)
        return out


@pytest.fixture
def rigs() -> Iterator[list[AmdRig]]:
    made: list[AmdRig] = []
    yield made
    for rig in made:
        rig.handle.close()
        rig.provider.shutdown()


def make(rigs: list[AmdRig], smi: FakeAmdSmi, env: dict[str, str] | None = None) -> AmdRig:
    rig = AmdRig(smi, env)
    rigs.append(rig)
    return rig


def mi300(i: int = 0, **kw: Any) -> FakeAmdGpu:
    return FakeAmdGpu(uuid=f"GPU-a{i}00-0000-0000-0000", **kw)


def test_amd_gpu_metrics_use_the_nvidia_names_and_units(rigs: list[AmdRig]) -> None:
    gpu = mi300(
        gfx_activity=87,
        umc_activity=41,
        vram_used_mib=1024,
        energy_accumulator=1_000_000,
        processes=[(os.getpid(), 3 * 2**30), (424242, 2**30)],
    )
    rig = make(rigs, FakeAmdSmi([gpu]))
    assert rig.handle.gpus == [(0, gpu.uuid)]
    v = rig.values()
    ids = {"hw.id": gpu.uuid, "gpu.index": 0}
    assert v[(names.GPU_UTILIZATION.name, 0)] == (0.87, ids)
    assert v[(names.GPU_DRAM_BANDWIDTH.name, 0)] == (0.41, {**ids, "otelprof.gpu.source": "amdsmi"})
    assert v[(names.GPU_MEMORY_USAGE.name, 0)][0] == 2**30
    assert v[(names.GPU_MEMORY_LIMIT.name, 0)][0] == 192 * 2**30
    assert v[(names.GPU_MEMORY_FREE.name, 0)][0] == 191 * 2**30
    assert v[(names.GPU_POWER.name, 0)] == (300.0, {**ids, "hw.type": "gpu"})  # the average
    assert v[(names.GPU_TEMPERATURE.name, 0)][0] == 60.0  # MI300: hotspot, no edge sensor
    assert v[(names.GPU_ENERGY.name, 0)][0] == pytest.approx(15.3)  # 1e6 × 15.3 µJ
    assert v[(names.GPU_PROCESS_MEMORY.name, 0)][0] == 3 * 2**30  # ours, not the stranger's


def test_values_amd_smi_lacks_are_absent_never_zero_and_refusals_logged_once(
    rigs: list[AmdRig], caplog: pytest.LogCaptureFixture
) -> None:
    gpu = mi300(
        gfx_activity="N/A",
        umc_activity="N/A",
        average_socket_power="N/A",
        errors={"amdsmi_get_energy_count": AMDSMI_STATUS_NOT_SUPPORTED},
    )
    smi = FakeAmdSmi([gpu])
    with caplog.at_level(logging.INFO, logger="otelprof.system"):
        rig = make(rigs, smi)
        for _ in range(2):
            present = {name for name, _ in rig.values()}
            assert not present & {
                names.GPU_UTILIZATION.name,
                names.GPU_DRAM_BANDWIDTH.name,
                names.GPU_POWER.name,
                names.GPU_ENERGY.name,
                names.GPU_PROCESS_MEMORY.name,  # none of our processes on it
            }
            assert names.GPU_MEMORY_USAGE.name in present
            rig.handle.final_sample()
    refusals = [r.getMessage() for r in caplog.records if "refuses" in r.getMessage()]
    assert len([m for m in refusals if "energy" in m]) == 1
    assert smi.calls["amdsmi_get_energy_count"] == 1  # not asked again
    assert any("temperature-edge" in m for m in refusals)


def test_visible_devices_select_amd_gpus_like_hip_does(rigs: list[AmdRig]) -> None:
    gpus = [mi300(i) for i in range(4)]
    rig = make(rigs, FakeAmdSmi(gpus), {"HIP_VISIBLE_DEVICES": "2,0", "CUDA_VISIBLE_DEVICES": "3"})
    assert rig.handle.gpus == [(2, gpus[2].uuid), (0, gpus[0].uuid)]
    rig2 = make(rigs, FakeAmdSmi(gpus), {"ROCR_VISIBLE_DEVICES": "GPU-a300"})
    assert rig2.handle.gpus == [(3, gpus[3].uuid)]


def test_an_amd_gpu_that_disappears_loses_its_series_and_the_other_continues(
    rigs: list[AmdRig], caplog: pytest.LogCaptureFixture
) -> None:
    gpus = [mi300(0, gfx_activity=50), mi300(1, gfx_activity=60)]
    rig = make(rigs, FakeAmdSmi(gpus))
    assert {i for _, i in rig.values()} == {0, 1}
    gpus[0].lost = True
    gpus[1].errors = {"amdsmi_get_power_info": AMDSMI_STATUS_DRM_ERROR}  # transient
    with caplog.at_level(logging.WARNING, logger="otelprof.system"):
        for _ in range(2):
            rig.handle.final_sample()
            v = rig.values()
            assert {i for _, i in v} == {1}
            assert v[(names.GPU_UTILIZATION.name, 1)][0] == 0.6
            assert (names.GPU_POWER.name, 1) not in v
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == len(set(messages))
    gpus[1].errors = {}
    rig.handle.final_sample()
    assert (names.GPU_POWER.name, 1) in rig.values()  # back once the error clears


def test_no_amd_smi_library_means_no_gpu_metrics_without_an_error(rigs: list[AmdRig]) -> None:
    rig = make(rigs, FakeAmdSmi([], init_error=AMDSMI_STATUS_INIT_ERROR_DRIVER))
    assert rig.handle.gpus == [] and rig.values() == {}


AMDSMI_STATUS_INIT_ERROR_DRIVER = 18
