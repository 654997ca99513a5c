"""The one thread that talks to the master: oldest report first, retry what can succeed.

Connection errors, timeouts and 5xx are retried with exponential backoff and jitter, the
report staying at the head of the spool so order is kept. Any other 4xx (invalid run id,
permission, bad group) will never succeed: it is logged once with the master's message
and the report is dropped and counted.
"""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass

from otelprof.determined.client import DeterminedClient, Outcome
from otelprof.determined.spool import DiskSpool, MemorySpool

log = logging.getLogger("otelprof.determined")

_MAX_LOGGED = 1000  # distinct rejection messages remembered for "log once"


@dataclass
class DeliveryStats:
    delivered: int = 0
    rejected: int = 0
    retries: int = 0
    found_stored: int = 0  # in flight at a crash, found on the master after the restart


class Deliverer:
    """Drains a spool into a client on a daemon thread."""

    def __init__(
        self,
        spool: DiskSpool | MemorySpool,
        client: DeterminedClient,
        initial_delay_s: float = 0.5,
        max_delay_s: float = 30.0,
    ) -> None:
        self.spool = spool
        self.client = client
        self.initial_delay_s = initial_delay_s
        self.max_delay_s = max_delay_s
        self.stats = DeliveryStats()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._logged: set[tuple[int | None, str, str]] = set()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="otelprof-determined-delivery", daemon=True
        )
        self._thread.start()

    def wake(self) -> None:
        """New reports are in the spool."""
        self._idle.clear()
        self._wake.set()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until the spool is empty (True) or the timeout passes (False)."""
        self.wake()
        return self._idle.wait(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _run(self) -> None:
        delay = self.initial_delay_s
        failing_since_retry: int | None = None
        while not self._stop.is_set():
            item = self.spool.peek()
            if item is None:
                self._idle.set()
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            window, index, report = item
            if self.spool.maybe_delivered(window, index) and self.client.already_stored(report):
                # Posted just before a crash and taken by the master: do not store it twice.
                log.info("a %s report posted before the restart was already stored", report.group)
                self.spool.ack(window, index)
                self.stats.found_stored += 1
                continue
            self.spool.mark_inflight(window, index)
            try:
                result = self.client.report(report)
            except Exception as exc:  # a bad token file, a bug: keep the report, keep going
                log.error("Determined delivery failed: %s", self.client.redact(str(exc)))
                self.stats.retries += 1
                self._sleep(self._jitter(delay))
                delay = min(delay * 2, self.max_delay_s)
                continue
            if result.outcome is Outcome.OK:
                self.spool.ack(window, index)
                self.stats.delivered += 1
                if failing_since_retry is not None:
                    log.warning(
                        "Determined master reachable again after %d retries; delivering %d "
                        "spooled reports",
                        self.stats.retries - failing_since_retry,
                        self.spool.pending(),
                    )
                    failing_since_retry = None
                delay = self.initial_delay_s
            elif result.outcome is Outcome.REJECTED:
                self.spool.ack(window, index)
                self.stats.rejected += 1
                self._log_rejection(result.status, report.group, report.trial_id, result.message)
            else:
                if failing_since_retry is None:
                    failing_since_retry = self.stats.retries
                    log.warning(
                        "Determined master %s unavailable (%s); keeping reports in the spool "
                        "and retrying with backoff up to %g s",
                        self.client.master,
                        f"HTTP {result.status}: {result.message}"
                        if result.status
                        else result.message,
                        self.max_delay_s,
                    )
                self.stats.retries += 1
                self._sleep(self._jitter(delay))
                delay = min(delay * 2, self.max_delay_s)

    @staticmethod
    def _jitter(delay: float) -> float:
        """Equal jitter: half the delay fixed, half random, so restarts do not stampede."""
        return delay / 2 + random.uniform(0, delay / 2)

    def _log_rejection(self, status: int | None, group: str, trial_id: int, message: str) -> None:
        key = (status, group, message)
        if key in self._logged:
            log.debug("Determined refused another %s report for trial %d", group, trial_id)
            return
        if len(self._logged) < _MAX_LOGGED:
            self._logged.add(key)
        log.error(
            "Determined master refused a %s report for trial %d (HTTP %s): %s — dropping it; "
            "further reports refused with this message are dropped without logging",
            group,
            trial_id,
            status,
            message,
        )
