"""PyTorch caching-allocator memory per CUDA device, when this process has set up CUDA.

Never imports torch nor initializes CUDA (it reads `sys.modules` and asks only once
`torch.cuda.is_initialized()`), so a CPU-only or not-yet-started job pays nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from . import names
from ._common import Attributes, LogOnce, Reading


class TorchMemorySampler:
    def __init__(
        self,
        log: LogOnce | None = None,
        modules: Any = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._log = log or LogOnce()
        self._clock = clock
        self._modules = sys.modules if modules is None else modules
        self._attributes: dict[int, Attributes] = {}

    def sample(self) -> list[Reading]:
        cuda = getattr(self._modules.get("torch"), "cuda", None)
        if cuda is None:  # no torch, or torch still being imported by another thread
            return []
        try:
            if not cuda.is_initialized():
                return []
            out = []
            for ordinal in range(cuda.device_count()):
                attrs = device_attributes(cuda, ordinal, self._attributes)
                t = self._clock()  # both come from the allocator's counters, read together
                allocated = float(cuda.memory_allocated(ordinal))
                reserved = float(cuda.memory_reserved(ordinal))
                out.append(Reading(names.TORCH_CUDA_ALLOCATED.name, allocated, attrs, t))
                out.append(Reading(names.TORCH_CUDA_RESERVED.name, reserved, attrs, t))
            return out
        except Exception as exc:
            self._log.error("torch", exc, "cannot read torch.cuda allocator statistics")
            return []


def device_attributes(cuda: Any, ordinal: int, cache: dict[int, Attributes]) -> Attributes:
    """`otelprof.cuda.device` and, when torch knows it, `hw.id` (the GPU's UUID, as NVML
    names it, to join with the `hw.gpu.*` series); asked once per device, kept in `cache`."""
    if ordinal in cache:
        return cache[ordinal]
    attrs: Attributes = {names.CUDA_DEVICE: ordinal}
    try:
        uuid = str(cuda.get_device_properties(ordinal).uuid)
        if uuid and not uuid.startswith(("GPU-", "MIG-")):
            uuid = f"GPU-{uuid}"
        if uuid:
            attrs[names.HW_ID] = uuid
    except Exception:
        pass  # older torch: no uuid property
    cache[ordinal] = attrs
    return attrs
