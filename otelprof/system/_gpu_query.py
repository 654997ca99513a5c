"""The one policy both GPU samplers (NVML, AMD SMI) follow when they ask the driver for a
metric of one device.

A metric the driver refuses for good (not supported, no permission: MIG slices, consumer
boards) is omitted for that device from then on and logged once at INFO; any other error
omits that one sample and is logged once per kind of error at WARNING. Nothing is ever
reported as 0 in place of an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class QueriedDevice(Protocol):
    uuid: str
    refused: set[str]


class QueryPolicy:
    """Asks through `call`, and turns a driver error into an omitted sample (see above)."""

    def __init__(
        self,
        driver: str,
        log: Callable[..., Any],
        refusal: Callable[[Exception], str | None],
        describe: Callable[[Exception], str],
        key_prefix: str = "",
    ) -> None:
        """`driver`: its name in messages; `refusal(exc)`: why the driver refuses the metric
        for good, or None for an error that may pass; `describe(exc)`: a transient error in
        words; `key_prefix`: keeps two drivers' log-once keys apart."""
        self._driver = driver
        self._log = log
        self._refusal = refusal
        self._describe = describe
        self._prefix = key_prefix

    def query(self, device: QueriedDevice, metric: str, call: Callable[[], T]) -> T | None:
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

    def transient(self, device: QueriedDevice, metric: str, exc: Exception) -> None:
        """An error that may pass: this sample is omitted, the kind of error logged once."""
        self._log(
            f"{self._prefix}failed:{device.uuid}:{metric}:{type(exc).__name__}",
            logging.WARNING,
            "GPU %s: reading %s failed (%s); omitted while it fails",
            device.uuid,
            metric,
            self._describe(exc),
        )
