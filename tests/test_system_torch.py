"""Caching-allocator gauges: silent until this process has initialized CUDA, never init it.

This machine's torch has no CUDA, so the initialized case runs against a scripted
`torch.cuda` namespace (the one part of torch that cannot run here); the real CPU torch
checks that nothing is reported and CUDA is left alone.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from otelprof.system import names
from otelprof.system.torch_memory import TorchMemorySampler


class ScriptedCuda:
    def __init__(self, initialized: bool, uuids: list[str]) -> None:
        self.initialized = initialized
        self.uuids = uuids
        self.allocated = {i: (i + 1) * 1_000 for i in range(len(uuids))}
        self.reserved = {i: (i + 1) * 4_000 for i in range(len(uuids))}

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return len(self.uuids)

    def memory_allocated(self, device: int) -> int:
        return self.allocated[device]

    def memory_reserved(self, device: int) -> int:
        return self.reserved[device]

    def get_device_properties(self, device: int) -> Any:
        return SimpleNamespace(uuid=self.uuids[device])


def test_nothing_is_reported_before_cuda_is_initialized_or_without_torch() -> None:
    cuda = ScriptedCuda(initialized=False, uuids=["1234"])
    assert TorchMemorySampler(modules={"torch": SimpleNamespace(cuda=cuda)}).sample() == []
    assert TorchMemorySampler(modules={}).sample() == []


def test_allocated_and_reserved_bytes_per_device_joinable_to_gpu_series_by_uuid() -> None:
    cuda = ScriptedCuda(initialized=True, uuids=["5d3e1b2c-aaaa", "MIG-77"])
    readings = TorchMemorySampler(modules={"torch": SimpleNamespace(cuda=cuda)}).sample()
    got = {(r.name, r.attributes["otelprof.cuda.device"]): r for r in readings}
    assert got[(names.TORCH_CUDA_ALLOCATED.name, 0)].value == 1_000
    assert got[(names.TORCH_CUDA_RESERVED.name, 1)].value == 8_000
    assert got[(names.TORCH_CUDA_ALLOCATED.name, 0)].attributes["hw.id"] == "GPU-5d3e1b2c-aaaa"
    assert got[(names.TORCH_CUDA_RESERVED.name, 1)].attributes["hw.id"] == "MIG-77"


def test_a_failing_allocator_query_is_omitted_not_raised() -> None:
    cuda = ScriptedCuda(initialized=True, uuids=["1"])
    cuda.allocated = {}  # KeyError inside the "driver"
    assert TorchMemorySampler(modules={"torch": SimpleNamespace(cuda=cuda)}).sample() == []


def test_real_torch_is_never_made_to_initialize_cuda() -> None:
    import torch

    initialized_before = torch.cuda.is_initialized()
    readings = TorchMemorySampler().sample()
    assert torch.cuda.is_initialized() == initialized_before
    if not initialized_before:
        assert readings == []
