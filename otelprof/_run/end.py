"""How a profiled process ended, recorded in run.json however it ends.

A run that is never finalized looks like one still going, so `RunEndWatcher` watches the
ways a process ends without `shutdown()`: `atexit` (status `exited`, or `exception` seen
through a chained `sys.excepthook`) and SIGTERM. A program's own SIGTERM handler (Lightning,
Determined) decides: the end is recorded while it runs and cleared if training goes on.
With none, the end is written, the run flushed (bounded, on a helper thread so a lock the
interrupted code holds cannot hang it), and the process dies of SIGTERM as it would have.
SIGKILL leaves no `finished_unix_nano`. A SIGTERM/SIGINT during `shutdown()`'s flush waits until the
end is written (`DeferredSignals`) and is named in `signal_during_shutdown`. The `end`
object's fields: DEVELOPING.md, "Run directory (detached mode)". Everything is restored on
uninstall.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from otelprof._run.bounded import SHUTDOWN_MARGIN_S

_log = logging.getLogger("otelprof")

EndRecord = dict[str, Any]


DEFERRED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class DeferredSignals:
    """`with DeferredSignals():` a SIGTERM or SIGINT that arrives inside the block (a launcher
    stopping the ranks while the profiler's final flush runs, a Ctrl-C) waits for the block
    to end, then goes to the handler that was there before (SIGINT: KeyboardInterrupt): the
    flush, bounded by the export timeout, writes the lines the exporters still hold and the
    run's end instead of dying with them. `received` names the first one, so the run's end
    can say that a signal came during shutdown. Main thread only (elsewhere Python cannot
    set handlers, and a no-op). A signal the program ignores (SIG_IGN) stays ignored."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._pending: list[int] = []
        self._previous: dict[int, Any] = {}

    def _defer(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if signum not in self._pending:
            self._pending.append(signum)

    def __enter__(self) -> DeferredSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in DEFERRED_SIGNALS:
            try:
                previous = signal.getsignal(signum)
                if previous is signal.SIG_IGN or previous is None:
                    continue  # ignored, or set outside Python: left alone
                signal.signal(signum, self._defer)
                self._previous[signum] = previous
            except Exception as error:  # e.g. embedded interpreters without signals
                _log.debug("otelprof: cannot defer signal %s: %r", signum, error)
        return self

    def __exit__(self, *_exc: object) -> None:
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            try:
                signal.signal(signum, handler)
            except Exception as error:
                _log.debug("otelprof: cannot restore the handler of signal %s: %r", signum, error)
        for signum in self._pending:
            if signum in previous:
                signal.raise_signal(signum)  # now, to whoever handled it before

    def replace_previous(self, handler: Any, replacement: Any) -> None:
        """The handler to restore was `handler`, which is being uninstalled meanwhile:
        restore `replacement` instead (RunEndWatcher.uninstall inside the block)."""
        for signum, previous in self._previous.items():
            if previous == handler:
                self._previous[signum] = replacement


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except Exception:
        return str(signum)


def exception_info(error: BaseException) -> dict[str, str]:
    """`{"type", "message"}` of an exception, the message bounded so run.json stays small."""
    kind = type(error)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    try:
        message = str(error)
    except Exception:
        message = "<unprintable>"
    return {"type": name, "message": message[:2000]}


class RunEndWatcher:
    """Chains atexit, SIGTERM and sys.excepthook to finalize one profiler's run.json.

    `finish(end)` finalizes the run (the profiler's shutdown) and `mark(end)` writes the end
    to run.json before the flush (so a kill during the flush still leaves it recorded);
    `mark(None)` takes it back (a SIGTERM the program's handler survived).
    """

    def __init__(
        self,
        finish: Callable[[EndRecord], None],
        mark: Callable[[EndRecord | None], None],
        flush_timeout_s: float,
    ) -> None:
        self._finish = finish
        self._mark = mark
        self._flush_timeout_s = flush_timeout_s
        self._exception: dict[str, str] | None = None
        self._signal: str | None = None
        self._installed = False
        self._previous_sigterm: Any = None
        self._sigterm_installed = False
        self._previous_excepthook: Any = None
        self._pid = os.getpid()  # a forked child (DataLoader worker) inherits the hooks

    # -- lifecycle ----------------------------------------------------------------------

    def install(self) -> None:
        """Register the atexit hook, chain sys.excepthook and (main thread only) SIGTERM."""
        self._installed = True
        atexit.register(self._at_exit)
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        try:
            previous = signal.getsignal(signal.SIGTERM)
            if previous is signal.SIG_IGN or previous is None:
                # Ignored by the program (so by otelprof too), or a handler installed
                # outside Python that could be neither chained nor restored.
                return
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._previous_sigterm = previous
            self._sigterm_installed = True
        except Exception as error:  # e.g. embedded interpreters without signals
            _log.debug("otelprof: cannot watch SIGTERM: %r", error)

    def uninstall(self, deferred: DeferredSignals | None = None) -> None:
        """Undo install(): each hook is restored only if nobody replaced it since (or, with
        `deferred`, only `deferred` did: it then restores the program's handler)."""
        if not self._installed:
            return
        self._installed = False
        atexit.unregister(self._at_exit)
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook
        if self._sigterm_installed:
            self._sigterm_installed = False
            try:
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, self._previous_sigterm)
                elif deferred is not None:
                    deferred.replace_previous(self._on_sigterm, self._previous_sigterm)
            except Exception as error:
                _log.debug("otelprof: cannot restore the SIGTERM handler: %r", error)

    # -- the end record -----------------------------------------------------------------

    def end_record(
        self, recorded_by: str, error: BaseException | None = None, *, at_exit: bool = False
    ) -> EndRecord:
        """The end as known now; `error` is an exception that is ending the `with` block."""
        exit_code: int | None = None
        if isinstance(error, SystemExit):
            code = error.code
            exit_code = code if isinstance(code, int) else (0 if code is None else 1)
        elif error is not None and self._exception is None:
            self._exception = exception_info(error)
        if self._exception is not None:
            status = "exception"
            exit_code = 1 if at_exit else exit_code
        elif self._signal is not None:
            status = "signal"
        elif exit_code:
            status = "exit"
        elif at_exit:
            status = "exited"
        else:
            status = "clean"
        return {
            "status": status,
            "exit_code": exit_code,
            "signal": self._signal,
            "exception": self._exception,
            "recorded_by": recorded_by,
        }

    # -- hooks --------------------------------------------------------------------------

    def _excepthook(
        self, kind: type[BaseException], error: BaseException, tb: TracebackType | None
    ) -> None:
        try:
            if (
                os.getpid() == self._pid
                and not issubclass(kind, SystemExit)
                and self._exception is None
            ):
                self._exception = exception_info(error)
        except Exception:
            pass
        previous = self._previous_excepthook or sys.__excepthook__
        previous(kind, error, tb)

    def _at_exit(self) -> None:
        if os.getpid() != self._pid:
            return  # a forked child's exit is not the run's end
        try:
            self._finish(self.end_record("atexit", at_exit=True))
        except Exception as error:
            _log.debug("otelprof: finalizing at exit failed: %r", error)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous_sigterm
        if os.getpid() != self._pid:
            # A forked child (a DataLoader worker being terminated): not this run's end;
            # behave exactly as the child would have without otelprof.
            if callable(previous):
                previous(signum, frame)
                return
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._signal = signal_name(signum)
        if callable(previous):
            # The program handles SIGTERM itself (checkpoint, graceful stop): the signal is
            # recorded while its handler runs (a kill meanwhile keeps it), and if the handler
            # ends the process (sys.exit) the end says SIGTERM; if training goes on, the
            # signal was not the run's end and is forgotten again.
            self._mark_quietly(self.end_record("signal (program handler runs)"))
            previous(signum, frame)
            self._signal = None  # survived: not the run's end
            self._mark_quietly(None)
            return
        # Default action: the process dies. Record, flush within bounds, then die the same way.
        end = self.end_record("signal")
        end["exit_code"] = 128 + signum
        self._mark_quietly(end)
        flusher = threading.Thread(
            target=self._finish_quietly, args=(end,), name="otelprof-sigterm", daemon=True
        )
        flusher.start()
        flusher.join(self._flush_timeout_s + SHUTDOWN_MARGIN_S + 0.5)
        self.uninstall()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _mark_quietly(self, end: EndRecord | None) -> None:
        try:
            self._mark(end)
        except Exception as error:
            doing = "recording" if end is not None else "clearing the record of"
            _log.debug("otelprof: %s SIGTERM failed: %r", doing, error)

    def _finish_quietly(self, end: EndRecord) -> None:
        try:
            self._finish(end)
        except Exception as error:
            _log.debug("otelprof: flushing after SIGTERM failed: %r", error)
