"""OTLP requests in, Determined reports out: map → journal → window → spool → deliver.

Shared by the bridge service and the in-process exporter, so both window, spool and retry
the same way. `ingest_*` never blocks on the network: it maps, journals and aggregates in
memory; a timer thread closes windows and a delivery thread posts.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otelprof.determined.aggregate import WindowAggregator
from otelprof.determined.client import DeterminedClient
from otelprof.determined.delivery import Deliverer
from otelprof.determined.mapping import (
    Cancelled,
    Extracted,
    Route,
    Stop,
    extract_metrics,
    extract_spans,
    never,
)
from otelprof.determined.spool import DiskSpool, MemorySpool

log = logging.getLogger("otelprof.determined")

_MAX_LOGGED = 1000
_MAX_LOOKUPS = 32  # trials asked about per window: a flood of new trials waits its turn


class Pipeline:
    """Owns the aggregator, the spool and the delivery thread for one master."""

    def __init__(
        self,
        client: DeterminedClient,
        spool: DiskSpool | MemorySpool,
        window_s: float = 10.0,
        route: Route | None = None,
        timings_group: str = "timings",
        retry_initial_s: float = 0.5,
        retry_max_s: float = 30.0,
        max_unknown_attempts: int = 5,
        skip_direct: bool = False,
        max_steps_per_s: float = 10_000.0,
        trust_offsets: bool = False,
    ) -> None:
        """`skip_direct`: the bridge's setting; leave out data of processes that post to
        Determined themselves (resource attribute otelprof.determined.direct).
        `trust_offsets`: the in-process exporter's; the producer's DET_STEPS_COMPLETED is
        its own environment, not a sender's claim the master must vouch for."""
        if window_s <= 0:
            raise ValueError(f"report window must be > 0 s, got {window_s}")
        self.client = client
        self.spool = spool
        self.window_s = window_s
        self.route = route or Route()
        self.aggregator = WindowAggregator(
            timings_group=timings_group,
            max_steps_per_s=max_steps_per_s,
            window_s=window_s,
            trust_offsets=trust_offsets,
        )
        self.deliverer = Deliverer(
            spool, client, retry_initial_s, retry_max_s, max_unknown_attempts
        )
        self.rejected_points = 0
        self.rejected_by_reason: dict[str, int] = {}
        self.baseline_lookups = 0
        self.skip_direct = skip_direct
        self.skipped_direct = 0
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self._logged: set[str] = set()
        self._started = False
        self._abandoned = threading.Event()
        self.undelivered_at_shutdown = 0  # never sent (or refused) when shutdown's time was up
        self.unconfirmed_at_shutdown = 0  # posted, answer not back: the master may hold them

    def start(self) -> None:
        """Recover the spool (replaying journaled samples), then start the threads."""
        recovered = self.spool.recover()
        with self._lock:
            self.aggregator.window = recovered.window
            for (trial, run), steps in recovered.last_steps.items():
                self.aggregator.remember_steps(trial, run, steps)
            self.aggregator.add_gauges(recovered.gauges)
            self.aggregator.add_timings(recovered.timings)
        if recovered.pending_reports or recovered.gauges or recovered.timings:
            log.info(
                "Determined spool recovered: %d reports to deliver, %d samples replayed",
                recovered.pending_reports,
                len(recovered.gauges) + len(recovered.timings),
            )
        self.deliverer.start()
        self._timer = threading.Thread(
            target=self._tick, name="otelprof-determined-window", daemon=True
        )
        self._timer.start()
        self._started = True

    def _tick(self) -> None:
        while not self._stop.wait(self.window_s):
            try:
                self.flush()
            except Exception:  # keep closing windows whatever one window did
                log.exception("closing a Determined report window failed")

    # -- ingest --------------------------------------------------------------------------------
    def ingest_metrics(self, request: ExportMetricsServiceRequest, stop: Stop = never) -> Extracted:
        """Map, aggregate and journal one request; `stop()` true (its caller went away)
        raises `Cancelled` before anything of it is taken."""
        return self._ingest(extract_metrics(request, self.route, self.skip_direct, stop), stop)

    def ingest_traces(self, request: ExportTraceServiceRequest, stop: Stop = never) -> Extracted:
        return self._ingest(extract_spans(request, self.route, self.skip_direct, stop), stop)

    def _ingest(self, extracted: Extracted, stop: Stop) -> Extracted:
        if stop():
            raise Cancelled
        with self._lock:
            timings = extracted.timings
            if extracted.histograms:  # exact timings; journaled as deltas like span sums
                timings = timings + self.aggregator.histogram_deltas(extracted.histograms)
            # Journaled before the request is answered (both under this lock), and only
            # what the window took: a flood over the per-trial limits costs no disk.
            gauges = self.aggregator.add_gauges(extracted.gauges)
            self.aggregator.add_timings(timings)
            self.spool.journal(self.aggregator.window, gauges, timings)
            self.rejected_points += extracted.rejected
            for reason, count in extracted.by_reason.items():
                self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + count
            self.skipped_direct += extracted.skipped_direct
        for message in extracted.errors:
            self._log_once(message)
        return extracted

    def _log_once(self, message: str, what: str = "refused OTLP data: ") -> None:
        if message in self._logged:
            return
        if len(self._logged) < _MAX_LOGGED:
            self._logged.add(message)
        log.error("%s%s", what, message)

    # -- windows -------------------------------------------------------------------------------
    def _ask_baselines(self, deadline: float) -> None:
        """Ask the master what it holds for trials whose first timings report waits on it
        (`WindowAggregator.baselines_wanted`), before the lock; a master that cannot answer
        is asked again at the next window (the timings wait, nothing is dropped)."""
        with self._lock:
            wanted = sorted(self.aggregator.baselines_wanted)[:_MAX_LOOKUPS]
        for trial in wanted:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                batches = self.client.trial_batches(trial, timeout_s=left)
            except Exception as exc:
                self._log_once(f"cannot ask the master what trial {trial} holds: {exc}; its "
                               "first timings report waits", "Determined: ")  # fmt: skip
                return
            self.baseline_lookups += 1
            with self._lock:
                self.aggregator.set_baseline(trial, batches)

    def flush(self, lookup_s: float | None = None) -> int:
        """Close the current window now; returns the number of reports it produced.
        `lookup_s`: the most time asking the master for step baselines may take (default:
        the client's own timeout)."""
        self._ask_baselines(time.monotonic() + (self.window_s if lookup_s is None else lookup_s))
        with self._flush_lock:
            with self._lock:
                window = self.aggregator.window
                reports = self.aggregator.drain()
                last_steps = dict(self.aggregator.last_steps)
                incomplete = list(self.aggregator.incomplete)
                unsafe = list(self.aggregator.unsafe)
            self.spool.commit_window(window, reports, last_steps)
        for what in unsafe:
            self._log_once(what, "not reporting timings: ")
        for what in incomplete[:5]:
            log.debug("not reported this window (a key has no recent value): %s", what)
        if reports:
            self.deliverer.wake()
        return len(reports)

    def wait_delivered(self, timeout_s: float) -> bool:
        """Block until everything spooled has been answered by the master (True), the
        timeout passes or delivery is abandoned (False)."""
        deadline = time.monotonic() + timeout_s
        self.deliverer.wake()
        while not self._abandoned.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.deliverer.wait_idle(min(left, 0.05)):
                return True
        return False

    def abandon(self) -> None:
        """Stop waiting for the master now (the caller's time is up); shutdown returns at
        once and counts what was not answered."""
        self._abandoned.set()

    def shutdown(self, drain_timeout_s: float = 5.0) -> None:
        """Close the last window and give delivery `drain_timeout_s` to empty the spool;
        returns within that time (plus closing files) whatever the master does.

        What is not delivered by then stays in a disk spool for the next start; in a memory
        spool it is counted: as unconfirmed when it was posted and its answer did not come
        back (the master may hold it), as dropped otherwise.
        """
        deadline = time.monotonic() + max(0.0, drain_timeout_s)
        if self._started:
            self._started = False
            self._stop.set()
            if self._timer is not None:
                self._timer.join(max(0.0, deadline - time.monotonic()))
            self.flush(lookup_s=max(0.0, deadline - time.monotonic()) / 2)
            if not self.wait_delivered(max(0.0, deadline - time.monotonic())):
                pending = self.spool.pending()
                self.unconfirmed_at_shutdown = min(self.deliverer.unconfirmed(), pending)
                self.undelivered_at_shutdown = pending - self.unconfirmed_at_shutdown
                log.warning(
                    "Determined: %d reports not delivered at shutdown, %d more posted without "
                    "an answer (%s)",
                    self.undelivered_at_shutdown,
                    self.unconfirmed_at_shutdown,
                    "kept in the spool for the next start"
                    if isinstance(self.spool, DiskSpool)
                    else "lost: the spool is in memory",
                )
            self.deliverer.stop(max(0.0, deadline - time.monotonic()))
        self.spool.close()
        self.client.close()

    def stats(self) -> dict[str, Any]:
        a, s, d = self.aggregator.stats, self.spool.stats, self.deliverer.stats
        return {
            **asdict(a),
            "rejected_points": self.rejected_points,
            **{f"rejected_points_{r}": n for r, n in sorted(self.rejected_by_reason.items())},
            "baseline_lookups": self.baseline_lookups,
            "skipped_direct": self.skipped_direct,
            "spool_damaged_files": s.damaged_files,
            "spool_damaged_lines": s.damaged_lines,
            "spooled": s.reports_spooled,
            "spool_dropped": s.reports_dropped,
            "journal_overflow": s.journal_overflow,
            "pending": self.spool.pending(),
            "delivered": d.delivered,
            "refused_by_master": d.rejected,
            "refused_kept": s.reports_refused - s.refused_not_kept,
            "refused_not_kept": s.refused_not_kept,
            "gave_up_unknown_error": d.gave_up,
            "retries": d.retries,
            "found_stored_after_restart": d.found_stored,
            "found_stored_after_lost_response": d.found_stored_after_lost_response,
        }

    def delivery_counts(self) -> dict[str, int]:
        """What reached the master and what did not, for `Profiler.stats()`.

        Keys with "dropped"/"failed" count as lost telemetry there: reports the master
        refused (they never show in the Web UI), dropped because the spool was full, still
        unsent when a memory spool shut down, timing windows withheld because a restarted
        trial's step offset is unknown, samples over the per-trial limits.
        """
        s, d = self.spool.stats, self.deliverer.stats
        on_disk = isinstance(self.spool, DiskSpool)
        a = self.aggregator.stats
        return {
            "determined.reports_delivered": d.delivered + d.found_stored
            + d.found_stored_after_lost_response,
            "determined.reports_failed_refused_by_master": d.rejected,
            "determined.reports_dropped_spool_full": s.reports_dropped,
            "determined.reports_dropped_at_shutdown": 0 if on_disk
            else self.undelivered_at_shutdown,
            "determined.reports_unconfirmed_at_shutdown": 0 if on_disk
            else self.unconfirmed_at_shutdown,
            "determined.timing_windows_dropped_unknown_steps": a.timings_unsafe_steps,
            "determined.samples_dropped_over_limits": a.dropped_agents + a.dropped_series
            + a.dropped_trials + a.dropped_timing_names,
            "determined.timing_reports_steps_clamped": a.steps_clamped,
            "determined.reports_pending": self.spool.pending(),
            "determined.report_retries": d.retries,
        }  # fmt: skip

    def refused_reports(self) -> list[dict[str, Any]]:
        """Reports the master refused for good, with its status and message, oldest first."""
        return self.spool.refused_reports()
