"""The end of a run, bounded: flush, give up on what hangs (counted), write how it ended.

Why: `shutdown()` must return within `export_timeout` + `SHUTDOWN_MARGIN_S` whatever hangs
(a frozen file system, a collector that never answers, a huge backlog), must count what it
could not flush, and must leave the run's end readable even when run.json cannot be
rewritten. `finish_run` does that for the Profiler's running session (`_Session`, which
keeps only the list of what to flush, `_Session.flush_all`):

1. the flush runs on a helper thread, waited for `export_timeout` + `FLUSH_GRACE_S` (exports
   still retrying are abandoned at `export_timeout` by the flush's own watchdog);
2. if it is still running, it is abandoned: what the file writers held and the ranges the
   span builder never got to are counted as dropped (`*_dropped_shutdown_timeout`), and the
   end says `flush_timed_out`;
3. the end names a SIGTERM/SIGINT that arrived meanwhile (`signal_during_shutdown`);
4. detached runs: the closing record (otelprof/export/_closing.py), then run.json, on a
   helper thread waited for `FINALIZE_S`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from otelprof._run.bounded import FINALIZE_S, FLUSH_GRACE_S, run_within
from otelprof._run.end import DeferredSignals, EndRecord
from otelprof.export.counters import is_loss

_log = logging.getLogger("otelprof")


def finish_run(session: Any, end: EndRecord, deferred: DeferredSignals) -> dict[str, int]:
    """Flush `session` (a `_Session`) within its bound, then record `end`; returns the
    final stats."""
    timeout = session.settings.export_timeout_s
    if not run_within(lambda: session.flush_all(end), timeout + FLUSH_GRACE_S, "shutdown"):
        abandon_flush(session, end)
    if deferred.received is not None:
        end["signal_during_shutdown"] = deferred.received_name
    stats: dict[str, int] = session.stats()
    detached = session.settings.detached
    if detached and not run_within(lambda: write_run_end(session, end, stats), FINALIZE_S, "end"):
        _log.warning(
            "otelprof: writing the run's end to %s did not finish in %.1f s "
            "(a hung file system?); abandoned",
            session.settings.run_dir,
            FINALIZE_S,
        )
    if stats["dropped_total"]:  # (before a deferred signal acts)
        lost = {k: v for k, v in stats.items() if is_loss(k) and v}
        _log.warning("otelprof: telemetry was dropped during this run: %s", lost)
    return stats


def abandon_flush(session: Any, end: EndRecord) -> None:
    """The flush outlived its bound (a hung write, an export that ignores its timeout):
    give it up, counting what the writers held, so shutdown() returns."""
    _log.warning(
        "otelprof: flushing did not finish within export_timeout (%.1f s) + %.1f s; "
        "abandoned, what it still held is counted as dropped",
        session.settings.export_timeout_s,
        FLUSH_GRACE_S,
    )
    end["flush_timed_out"] = True
    counters = session.counters
    counters.add("shutdown.flush_timeouts")
    with contextlib.suppress(Exception):
        session.pipelines.abandon_exports()
    with contextlib.suppress(Exception):
        session.pipelines.abandon_files()
    if session.timings is not None:  # ranges the span builder never got to
        with contextlib.suppress(Exception):
            queued = int(session.timings.stats().get("spans_queued", 0))
            if queued:
                counters.add("timings.spans_dropped_shutdown_timeout", queued)


def write_run_end(session: Any, end: EndRecord, stats: dict[str, int]) -> None:
    """The run's end into the metrics file (closing record), then into run.json."""
    metrics = session.pipelines.files.get("metrics")
    if metrics is not None:
        from otelprof.export._closing import write_closing_record

        settings = session.settings
        write_closing_record(
            metrics,
            dict(session.resource.attributes),
            end,
            stats,
            compress=settings.compress,
            max_bytes=settings.max_metrics_bytes,
        )
    session.finalize_run_info(end, stats)
