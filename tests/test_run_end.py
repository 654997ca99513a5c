"""A run's end is always recorded in run.json, and nested instrument() never tears down the outer.

Real child processes are signalled for real (SIGTERM, SIGKILL); each child runs a short
training-like loop under a real profiler in detached mode.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof import _profiler
from tests.otlp_files import read_spans

REPO = Path(__file__).resolve().parents[1]

LOOP = """
import os, sys, time
import otelprof
ready = sys.argv[1]
def loop(n=10**9):
    for i in range(n):
        with otelprof.timing("train_batch"):
            time.sleep(0.005)
        otelprof.step()
        if i == 3 and not os.path.exists(ready):
            open(ready, "w").close()
"""


def _child(tmp_path: Path, body: str) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(LOOP + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=str(REPO), OTELPROF_OUTPUT_DIR=str(tmp_path / "runs"))
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ready")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_ready(tmp_path: Path, child: subprocess.Popen[str], name: str = "ready") -> None:
    # a generous bound: starting Python and PyTorch takes minutes on a busy machine
    deadline = time.monotonic() + 300
    while not (tmp_path / name).exists():
        if child.poll() is not None:
            pytest.fail(f"child exited early ({child.returncode}): {child.stderr.read()}")  # type: ignore[union-attr]
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail("child never reached its training loop")
        time.sleep(0.05)


def _finish(child: subprocess.Popen[str]) -> tuple[int, str]:
    _, stderr = child.communicate(timeout=300)
    return child.returncode, stderr


def _run_json(tmp_path: Path) -> dict[str, Any]:
    (run,) = list((tmp_path / "runs").iterdir())
    info: dict[str, Any] = json.loads((run / "run.json").read_text())
    return info


def test_sigterm_with_default_handler_finalizes_run_json_then_dies_of_sigterm(
    tmp_path: Path,
) -> None:
    child = _child(tmp_path, "otelprof.instrument(interval=0.2)\nloop()\n")
    _wait_ready(tmp_path, child)
    child.send_signal(signal.SIGTERM)
    code, stderr = _finish(child)
    assert code == -signal.SIGTERM, stderr  # dies as it would have without otelprof
    info = _run_json(tmp_path)
    assert "finished_unix_nano" in info, info
    assert info["end"]["status"] == "signal"
    assert info["end"]["signal"] == "SIGTERM"
    assert info["end"]["exit_code"] == 128 + signal.SIGTERM
    assert info["stats"]["timings.steps"] >= 4  # the flush ran: spans were counted


def test_sigterm_chains_the_handler_the_program_installed(tmp_path: Path) -> None:
    body = """
    import signal
    def graceful(signum, frame):
        open(ready + ".handled", "w").close()
        sys.exit(3)
    signal.signal(signal.SIGTERM, graceful)
    with otelprof.instrument(interval=0.2):
        loop()
    """
    child = _child(tmp_path, body)
    _wait_ready(tmp_path, child)
    child.send_signal(signal.SIGTERM)
    code, stderr = _finish(child)
    assert (tmp_path / "ready.handled").exists(), stderr
    assert code == 3, stderr
    info = _run_json(tmp_path)
    assert "finished_unix_nano" in info
    assert info["end"]["status"] == "signal"
    assert info["end"]["signal"] == "SIGTERM"
    assert info["end"]["exit_code"] == 3


def test_uncaught_exception_outside_any_span_is_recorded_with_type_and_message(
    tmp_path: Path,
) -> None:
    body = """
    otelprof.instrument(interval=0.2)
    loop(5)
    open(ready, "w").close()
    raise ValueError("loss is NaN at step 5")
    """
    code, stderr = _finish(_child(tmp_path, body))
    assert code == 1
    assert "ValueError: loss is NaN at step 5" in stderr  # the program's excepthook still ran
    info = _run_json(tmp_path)
    assert info["end"]["status"] == "exception"
    assert info["end"]["exception"] == {"type": "ValueError", "message": "loss is NaN at step 5"}
    assert info["end"]["recorded_by"] == "atexit"
    assert "finished_unix_nano" in info


def test_missing_shutdown_is_finalized_at_interpreter_exit(tmp_path: Path) -> None:
    code, stderr = _finish(_child(tmp_path, "otelprof.instrument(interval=0.2)\nloop(5)\n"))
    assert code == 0, stderr
    info = _run_json(tmp_path)
    assert info["end"]["status"] == "exited"
    assert info["stats"]["timings.steps"] == 5


def test_sigterm_in_a_forked_child_is_not_the_runs_end(tmp_path: Path) -> None:
    body = """
    import signal
    with otelprof.instrument(interval=0.2):
        loop(3)
        pid = os.fork()
        if pid == 0:  # like a DataLoader worker terminated at shutdown
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
        import json
        runs = os.environ["OTELPROF_OUTPUT_DIR"]
        run = os.path.join(runs, os.listdir(runs)[0])
        assert "end" not in json.load(open(os.path.join(run, "run.json")))
        loop(2)
    """
    code, stderr = _finish(_child(tmp_path, body))
    assert code == 0, stderr
    info = _run_json(tmp_path)
    assert info["end"]["status"] == "clean" and info["end"]["signal"] is None
    assert info["stats"]["timings.steps"] == 5


def test_a_sigterm_during_the_final_flush_waits_for_it_then_ends_the_process(
    tmp_path: Path,
) -> None:
    # an elastic launcher's SIGTERM reaches a rank while its exception is being flushed
    # (its peer's failure broke its collective): the exception is already in run.json, the
    # flush goes on and writes the spans the trace file still held, then the signal acts
    child = _child(
        tmp_path,
        """
        prof = otelprof.instrument(interval=0.2)
        flush = prof.tracer_provider.shutdown
        def slow_flush():
            open(ready + ".flushing", "w").close()
            # a slow collector (the export timeout bounds a real one), slow until the
            # test has sent its signal, however long a busy machine makes it take
            deadline = time.monotonic() + 300
            while not os.path.exists(ready + ".signalled") and time.monotonic() < deadline:
                time.sleep(0.01)
            flush()
            open(ready + ".flushed", "w").close()
        prof.tracer_provider.shutdown = slow_flush
        with prof:
            loop(5)
            raise RuntimeError("peer vanished")
        """,
    )
    _wait_ready(tmp_path, child, "ready.flushing")
    child.send_signal(signal.SIGTERM)
    (tmp_path / "ready.signalled").touch()
    code, stderr = _finish(child)
    assert code == -signal.SIGTERM, stderr  # delivered once the flush was done
    assert (tmp_path / "ready.flushed").exists()
    end = _run_json(tmp_path)["end"]
    assert end["status"] == "exception", end
    assert end["exception"] == {"type": "RuntimeError", "message": "peer vanished"}
    (run,) = list((tmp_path / "runs").iterdir())
    names = [span.name for span in read_spans(run / "traces.jsonl")]
    assert names.count("step") == 5 and names.count("train_batch") == 5


def test_sigkill_leaves_the_run_unfinalized_and_the_report_says_so_with_the_drops_counted(
    tmp_path: Path,
) -> None:
    # a trace file cap that drops spans: counted, and each metrics line carries the count
    child = _child(tmp_path, "otelprof.instrument(interval=0.2, max_trace_bytes=20000)\nloop()\n")
    _wait_ready(tmp_path, child)
    deadline = time.monotonic() + 120
    metrics = tmp_path / "runs"
    while not any(b"spans_dropped_size_cap" in p.read_bytes() for p in metrics.glob("*/metrics*")):
        assert time.monotonic() < deadline, "no metrics line counted the dropped spans"
        time.sleep(0.1)
    child.send_signal(signal.SIGKILL)
    code, _ = _finish(child)
    assert code == -signal.SIGKILL
    info = _run_json(tmp_path)
    assert "finished_unix_nano" not in info and "end" not in info
    (run,) = list((tmp_path / "runs").iterdir())
    report = subprocess.run(
        [sys.executable, "-m", "otelprof", "report", "--width", "400", str(run)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    # no guess at the cause: what is known (no end recorded), and what it had lost
    assert "run not finalized: no end was recorded" in report.stdout, report.stdout
    assert "counted as dropped by its last export (files.spans_dropped_size_cap" in report.stdout


def test_exception_leaving_the_with_block_is_recorded_and_propagates(tmp_path: Path) -> None:
    with pytest.raises(KeyError), otelprof.instrument(output_dir=tmp_path, interval=0.2) as prof:
        raise KeyError("labels")
    info = json.loads((prof.settings.run_dir / "run.json").read_text())
    assert info["end"]["status"] == "exception"
    assert info["end"]["exception"] == {"type": "KeyError", "message": "'labels'"}
    assert info["end"]["recorded_by"] == "context exit"


def test_clean_shutdown_is_recorded_as_clean(tmp_path: Path) -> None:
    with otelprof.instrument(output_dir=tmp_path, interval=0.2) as prof:
        otelprof.step()
    info = json.loads((prof.settings.run_dir / "run.json").read_text())
    assert info["end"]["status"] == "clean"
    assert info["end"]["exception"] is None


def test_shutdown_restores_the_sigterm_handler_and_excepthook(tmp_path: Path) -> None:
    def mine(signum: int, frame: Any) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    hook = sys.excepthook
    try:
        prof = otelprof.instrument(output_dir=tmp_path, interval=0.2)
        assert signal.getsignal(signal.SIGTERM) is not mine
        assert sys.excepthook is not hook
        prof.shutdown()
        assert signal.getsignal(signal.SIGTERM) is mine
        assert sys.excepthook is hook
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_nested_instrument_exit_does_not_shut_down_the_outer_profiler(tmp_path: Path) -> None:
    with otelprof.instrument(output_dir=tmp_path, interval=0.2) as outer:
        with otelprof.instrument() as inner:  # a callback or library doing its own
            assert inner.run_dir == outer.run_dir
            otelprof.step()
        assert _profiler.active_profiler() is outer
        inner.shutdown()
        assert _profiler.active_profiler() is outer
        with otelprof.timing("train_batch"):
            time.sleep(0.001)
        otelprof.step()
        assert outer.stats()["timings.steps"] == 2
    assert _profiler.active_profiler() is None
    info = json.loads((outer.settings.run_dir / "run.json").read_text())
    assert info["end"]["recorded_by"] == "context exit"


def test_repeated_instrument_after_shutdown_starts_a_fresh_profiler(tmp_path: Path) -> None:
    with otelprof.instrument(output_dir=tmp_path, interval=0.2) as first:
        pass
    with otelprof.instrument(output_dir=tmp_path, interval=0.2) as second:
        assert _profiler.active_profiler() is second
    assert first.settings.run_id != second.settings.run_id
    assert _profiler.active_profiler() is None


@pytest.fixture(autouse=True)
def _no_profiler_left_running() -> Any:
    yield
    otelprof.uninstrument()
