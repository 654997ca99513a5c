"""One log line when an exporter's destination goes away, one when it comes back.

Why: while the collector is down, the SDK's OTLP exporter logs every failed export and
retry for as long as the outage lasts, drowning the training log; otelprof counts the
losses anyway (`otlp.spans_failed`, `otlp.metric_points_failed`). So the first failure of
an outage logs the destination and the SDK's last reason, the first success after it how
long it lasted and what was lost. The SDK's records about this destination are filtered out
of its exporter logger (`_otel_compat.OTLP_EXPORTER_LOGGERS`) while the pipeline runs;
other destinations' records pass untouched.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from otelprof._otel_compat import OTLP_EXPORTER_LOGGERS

_log = logging.getLogger("otelprof.export")


class OutageLog:
    """The state of one destination (shared by its span and metric exporters)."""

    def __init__(self, name: str, destination: str) -> None:
        self.name = name
        self.destination = destination
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._lost: dict[str, int] = {}
        self._last_error = ""

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def noted(self, message: str) -> None:
        """The SDK's latest complaint about this destination (kept for the outage line)."""
        self._last_error = message

    def failed(self, what: str, count: int) -> None:
        """An export of `count` `what` (spans, metric points) failed: they are lost."""
        with self._lock:
            self._lost[what] = self._lost.get(what, 0) + count
            if self._down_since is not None:
                return
            self._down_since = time.monotonic()
            reason = self._last_error
        _log.warning(
            "otelprof: %s export to %s is failing%s; what cannot be sent is dropped and "
            "counted (Profiler.stats()), and one line will say when it recovers",
            self.name,
            self.destination,
            f" ({reason})" if reason else "",
        )

    def succeeded(self) -> None:
        if self._down_since is None:  # the common case, without the lock
            return
        with self._lock:
            if self._down_since is None:
                return
            lasted = time.monotonic() - self._down_since
            lost, self._lost = self._lost, {}
            self._down_since = None
        _log.warning(
            "otelprof: %s export to %s recovered after %.1f s; lost meanwhile: %s",
            self.name,
            self.destination,
            lasted,
            ", ".join(f"{n} {what}" for what, n in sorted(lost.items())) or "nothing",
        )


class SdkExportLogFilter(logging.Filter):
    """Drops the SDK exporter's records that name `destination` (and its argument-less
    retry warnings while the destination is down), handing the errors' text to the outage
    (its line quotes the last one)."""

    def __init__(self, destination: str, outage: OutageLog) -> None:
        super().__init__()
        self._destination = destination
        self._outage = outage

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if not args:  # "Shutdown in progress, aborting retry.": ours while it is down
            return not (self._outage.down and record.levelno == logging.WARNING)
        if not any(isinstance(a, str) and a == self._destination for a in args):
            return True
        if record.levelno >= logging.ERROR:
            with contextlib.suppress(Exception):  # one we cannot read is still filtered
                self._outage.noted(_reason(record))
        return False


def _reason(record: logging.LogRecord) -> str:
    """'UNAVAILABLE: failed to connect ...' from the SDK's 'Failed to export ...' record."""
    args = record.args if isinstance(record.args, tuple) else ()
    codes = [a for a in args if hasattr(a, "name") and hasattr(a, "value")]
    details = [a for a in args if isinstance(a, str)]
    if codes and details:
        return f"{codes[-1].name}: {details[-1][:200]}"
    return record.getMessage()[:200]


def quiet_sdk_logs(outage: OutageLog, destination: str) -> Callable[[], None]:
    """Filter the SDK exporter's records about `destination` into `outage`; returns the
    function that removes the filter again (at the pipeline's close)."""
    log_filter = SdkExportLogFilter(destination, outage)
    loggers = [logging.getLogger(name) for name in OTLP_EXPORTER_LOGGERS]
    for logger in loggers:
        logger.addFilter(log_filter)

    def remove() -> None:
        for logger in loggers:
            logger.removeFilter(log_filter)

    return remove
