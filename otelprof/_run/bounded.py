"""Run shutdown's work on a helper thread and wait for it only so long.

Why: a flush can hang where no timeout reaches it (a write into a frozen file system, an
exporter retrying a collector that is down), and a `shutdown()` that never returns gets the
job killed, losing the run's end too. The work runs on a daemon thread; the caller waits at
most its bound, then goes on and counts what the thread still held (the thread stays
blocked, but does not keep the process alive).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

_log = logging.getLogger("otelprof")

FLUSH_GRACE_S = 1.0
"""After the export timeout (when exports still retrying are abandoned), how long the
flush may take to finish what remains (metrics, closing files) before it is abandoned."""
FINALIZE_S = 1.0
"""How long writing the run's end (closing record, run.json) may take."""
SHUTDOWN_MARGIN_S = FLUSH_GRACE_S + FINALIZE_S
"""`shutdown()` returns within `export_timeout` plus this, whatever hangs (docs/guide/faults.md)."""


def run_within(work: Callable[[], None], seconds: float, name: str) -> bool:
    """Run `work` on a daemon thread; True if it finished within `seconds`. Exceptions
    are logged, never raised (the caller is shutting down; nothing may reach training)."""
    done = threading.Event()

    def run() -> None:
        try:
            work()
        except Exception as error:
            _log.warning("otelprof: %s raised %r", name, error)
        finally:
            done.set()

    thread = threading.Thread(target=run, name=f"otelprof-{name}", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no new threads at interpreter exit (Python 3.12+ atexit): inline
        run()
        return True
    return done.wait(seconds)
