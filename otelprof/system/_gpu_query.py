"""What both GPU samplers (NVML, AMD SMI) share: a device's identity, the choice of the
visible devices, and the one policy they follow when they ask the driver for a metric of
one device.

A metric the driver refuses for good (not supported, no permission: MIG slices, consumer
boards) is omitted for that device from then on and logged once at INFO; any other error
omits that one sample and is logged once per kind of error at WARNING. Nothing is ever
reported as 0 in place of an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import names
from ._common import Attributes, LogOnce

T = TypeVar("T")
D = TypeVar("D", bound="GpuIdentity")


@dataclass
class GpuIdentity:
    """A sampled GPU's driver handle, the attributes every series of it carries (the same
    for NVML and AMD SMI devices) and the metrics its driver has refused."""

    handle: Any
    uuid: str
    index: int
    refused: set[str] = field(default_factory=set)

    @property
    def attributes(self) -> Attributes:
        return {names.HW_ID: self.uuid, names.GPU_INDEX: self.index}

    @property
    def hw_attributes(self) -> Attributes:
        return {**self.attributes, names.HW_TYPE: "gpu"}


def select_visible(
    entries: list[str], every: list[D], lookup_mig: Callable[[str], D | None] | None = None
) -> list[D]:
    """The devices a visibility variable's `entries` name, the way CUDA reads them: an index
    or a unique `GPU-` UUID prefix; a `MIG-` UUID through `lookup_mig` (skipped when not
    found); everything after an entry that names no device is ignored."""
    chosen: list[D] = []
    for entry in entries:
        device: D | None
        if entry.isdigit():
            device = every[int(entry)] if int(entry) < len(every) else None
        elif entry.startswith("MIG-") and lookup_mig is not None:
            device = lookup_mig(entry)
            if device is None:
                continue
        else:
            matches = [d for d in every if d.uuid.startswith(entry)]
            device = matches[0] if len(matches) == 1 else None
        if device is None:
            break
        if all(device.uuid != d.uuid for d in chosen):
            chosen.append(device)
    return chosen


class QueryPolicy:
    """Asks through `call`, and turns a driver error into an omitted sample (see above)."""

    def __init__(
        self,
        driver: str,
        log: LogOnce,
        refusal: Callable[[Exception], str | None],
        key_prefix: str = "",
    ) -> None:
        """`driver`: its name in messages; `refusal(exc)`: why the driver refuses the metric
        for good, or None for an error that may pass; `key_prefix`: keeps two drivers'
        log-once keys apart."""
        self._driver = driver
        self._log = log
        self._refusal = refusal
        self._prefix = key_prefix

    def query(self, device: GpuIdentity, metric: str, call: Callable[[], T]) -> T | None:
        if metric in device.refused:
            return None
        try:
            return call()
        except Exception as exc:
            reason = self._refusal(exc)
            if reason is not None:
                device.refused.add(metric)
                self._log(
                    f"{self._prefix}refused:{device.uuid}:{metric}",
                    logging.INFO,
                    "GPU %s: %s refuses %s (%s); that series is omitted",
                    device.uuid,
                    self._driver,
                    metric,
                    reason,
                )
            else:
                self.transient(device, metric, exc)
            return None

    def transient(self, device: GpuIdentity, metric: str, exc: Exception) -> None:
        """An error that may pass: this sample is omitted, the kind of error logged once."""
        doing = f"GPU {device.uuid}: reading {metric} failed"
        key = f"{self._prefix}failed:{device.uuid}:{metric}"
        self._log.error(key, exc, doing, "omitted while it fails")
