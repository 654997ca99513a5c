"""The one policy the GPU sampler follows when it asks NVML for a metric of one device.

A metric NVML refuses for good (not supported, no permission: MIG slices, consumer
boards) is omitted for that device from then on and logged once at INFO; any other error
omits that one sample and is logged once per kind of error at WARNING. Nothing is ever
reported as 0 in place of an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

from ._common import LogOnce

T = TypeVar("T")


class Device(Protocol):
    """What the policy reads and keeps of a device (`_gpu_perf.GpuDevice`)."""

    uuid: str
    refused: set[str]


class QueryPolicy:
    """Asks through `call`, and turns an NVML error into an omitted sample (see above)."""

    def __init__(self, log: LogOnce, refusal: Callable[[Exception], str | None]) -> None:
        """`refusal(exc)`: why NVML refuses the metric for good, or None for an error that
        may pass."""
        self._log = log
        self._refusal = refusal

    def query(self, device: Device, metric: str, call: Callable[[], T]) -> T | None:
        if metric in device.refused:
            return None
        try:
            return call()
        except Exception as exc:
            reason = self._refusal(exc)
            if reason is not None:
                device.refused.add(metric)
                self._log(
                    f"refused:{device.uuid}:{metric}",
                    logging.INFO,
                    "GPU %s: NVML refuses %s (%s); that series is omitted",
                    device.uuid,
                    metric,
                    reason,
                )
            else:
                self.transient(device, metric, exc)
            return None

    def transient(self, device: Device, metric: str, exc: Exception) -> None:
        """An error that may pass: this sample is omitted, the kind of error logged once."""
        doing = f"GPU {device.uuid}: reading {metric} failed"
        self._log.error(f"failed:{device.uuid}:{metric}", exc, doing, "omitted while it fails")
