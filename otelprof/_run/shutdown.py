"""The end of a run, bounded: flush, give up on what hangs (counted), write how it ended.

Why: `shutdown()` must return within `export_timeout` + `SHUTDOWN_MARGIN_S` whatever hangs,
count what it could not flush, and leave the run's end readable even when run.json cannot
be rewritten. `finish_run`: the flush runs on a helper thread for `export_timeout` +
`FLUSH_GRACE_S`; past it, it is abandoned (flags and counts only, `*_dropped_shutdown_timeout`
and `flush_timed_out`: nothing the stuck flush holds is waited for); the end names a signal
that came meanwhile, and is recorded (closing record, run.json, claim released) on a helper
thread waited for `FINALIZE_S`, finishing in the background if the file system comes back.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import Any

from otelprof._run.bounded import FINALIZE_S, FLUSH_GRACE_S, run_within
from otelprof._run.end import DeferredSignals, EndRecord, signal_name

_log = logging.getLogger("otelprof")


def finish_run(
    session: Any, end: EndRecord, deferred: DeferredSignals, *, final: bool = True
) -> dict[str, int]:
    """Flush `session` (a `_Session`) within its bound, then record `end`; returns the
    final stats. Not `final`: the session ends for a new one of the same run; no end is
    recorded and its losses go on with the next session."""
    timeout = session.settings.export_timeout_s
    if not run_within(partial(session.flush_all, end, final), timeout + FLUSH_GRACE_S, "shutdown"):
        abandon_flush(session, end)
    if deferred.received is not None:
        end["signal_during_shutdown"] = signal_name(deferred.received)
    stats: dict[str, int] = session.stats()
    if not run_within(partial(session.record_end, end, stats, final), FINALIZE_S, "end") and final:
        _log.warning(
            "otelprof: writing the run's end to %s did not finish in %.1f s "
            "(a hung file system?); it goes on in the background",
            session.settings.run_dir,
            FINALIZE_S,
        )
    if stats["dropped_total"] and final:  # (before a deferred signal acts)
        lost = {k: v for k, v in session.losses().items() if v}
        _log.warning("otelprof: telemetry was dropped during this run: %s", lost)
    return stats


def abandon_flush(session: Any, end: EndRecord) -> None:
    """The flush outlived its bound (a hung write, an export that ignores its timeout):
    give it up, counting what the writers held, so shutdown() returns. Waits for nothing
    the stuck flush may hold."""
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
