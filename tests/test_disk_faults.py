"""Run files under disk faults: every byte readable or counted, the run's end always told.

Real faults, made by the test: a small tmpfs filled up and freed, remounted read-only, a run
directory deleted mid-run or bind-remounted read-only, a run.json whose rewrite fails, an
ext4 image frozen (`fsfreeze`) while shutdown() runs. Needs root (CI runs as root) for the
mounts; without it the tests fail saying so (the frozen image is skipped, with the reason,
only where loop devices cannot be mounted at all).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof.analysis.problems import _end_finding
from otelprof.analysis.reader import open_run
from otelprof.export._metriclines import MetricLineStream
from otelprof.export._spanlines import SpanLineWriter, encode_span
from otelprof.export.counters import ExportCounters
from tests.otlp_files import read_lines, read_spans

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_profiler_left() -> Iterator[None]:
    yield
    otelprof.uninstrument()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs of the test's own, unmounted afterwards."""
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs (these tests need root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(mount: Path) -> Path:
    """Fill the file system up (ENOSPC); returns the ballast file to delete to free it."""
    ballast = mount / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
    chunk = b"\0" * (64 << 10)
    try:
        while True:
            os.write(fd, chunk)
    except OSError as error:
        assert error.errno == errno.ENOSPC, error
    try:  # the last partial page too
        while True:
            os.write(fd, b"\0" * 512)
    except OSError:
        pass
    finally:
        os.close(fd)
    return ballast


def train(prof: Any, steps: int) -> None:
    for _ in range(steps):
        with otelprof.timing("train_batch"):
            time.sleep(0.002)
        otelprof.step()


def report_tells_a_clean_end(run_dir: Path) -> None:
    """`otelprof report` on the run names no kill and no unfinalized process."""
    report = subprocess.run(
        [sys.executable, "-m", "otelprof", "report", str(run_dir)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    assert "SIGKILL" not in report.stdout and "not finalized" not in report.stdout


def spans_in(path: Path) -> int:
    return len(read_spans(path))


def _span(i: int, size: int) -> str:
    return encode_span("work", 1, i + 1, 0, 1_000, 2_000, {"blob": "x" * size, "i": i})


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_a_full_disk_leaves_only_whole_lines_and_writing_resumes_when_space_returns(
    small_fs: Path, compress: bool
) -> None:
    counters = ExportCounters()
    name = "traces.jsonl.gz" if compress else "traces.jsonl"
    writer = SpanLineWriter(small_fs / name, counters, compress=compress, line_spans=16)
    metrics_name = "metrics.jsonl.gz" if compress else "metrics.jsonl"
    metrics = MetricLineStream(small_fs / metrics_name, compress=compress)
    size = 20_000 if not compress else 60_000  # lines that cannot fit in what is left

    def write(first: int, count: int) -> None:
        for i in range(first, first + count):
            writer.write(None, None, [_span(i, size)])
        writer.flush()
        metrics.write(json.dumps({"resourceMetrics": [], "n": os.urandom(size).hex()}) + "\n")
        metrics.flush()

    write(0, 16)
    ballast = fill(small_fs)
    (small_fs / "gap").unlink(missing_ok=True)
    write(16, 48)  # each line fails part-way: the disk is full
    failed = counters.snapshot().get("files.spans_failed", 0)
    assert failed > 0
    assert metrics.lost == "write_error"
    ballast.unlink()  # space comes back
    write(64, 32)
    writer.close()
    metrics.close()
    stats = counters.snapshot()
    written = spans_in(small_fs / name)  # raises on any partial line or gzip member
    assert written == stats["files.spans_exported"]
    assert written + stats["files.spans_failed"] == 96
    assert {int(s.attributes["i"]) for s in read_spans(small_fs / name)} >= set(range(64, 96))
    assert len(read_lines(small_fs / metrics_name)) >= 2  # the line after space returned


def test_metric_exports_on_a_full_disk_warn_once_without_a_traceback_and_are_counted(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    prof = otelprof.instrument(output_dir=small_fs, interval=0.1, trace_budget=float("inf"))
    run_dir = prof.run_dir
    assert run_dir is not None

    def train_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with otelprof.timing("train_batch", note="x" * 500):
                time.sleep(0.002)
            otelprof.step()

    train_for(0.5)
    ballast = fill(small_fs)
    train_for(2.5)
    ballast.unlink()
    train_for(1.5)
    prof.shutdown()
    stats = prof.stats()
    assert stats["files.metric_points_dropped_write_error"] > 0, stats
    assert stats["dropped_total"] > 0
    traces, metrics = run_dir / "traces.jsonl", run_dir / "metrics.jsonl"
    assert spans_in(traces) == stats["files.spans_exported"]  # whole lines only
    read_lines(metrics)
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert not tracebacks, [r.getMessage() for r in tracebacks]
    failures = [r.getMessage() for r in caplog.records if "failed (" in r.getMessage()]
    assert len([m for m in failures if "metrics.jsonl" in m]) == 1, failures
    info = json.loads((run_dir / "run.json").read_text())
    assert info["end"]["status"] == "clean" and "finished_unix_nano" in info


def test_a_deleted_run_directory_is_noticed_logged_once_and_its_losses_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    prof = otelprof.instrument(output_dir=tmp_path, interval=0.1, trace_budget=float("inf"))
    run_dir = prof.run_dir
    assert run_dir is not None
    train(prof, 50)
    time.sleep(0.3)
    shutil.rmtree(run_dir)
    train(prof, 200)
    prof.shutdown()
    stats = prof.stats()
    assert stats["files.spans_dropped_run_dir_gone"] > 0, stats
    assert stats["files.metric_points_dropped_run_dir_gone"] > 0, stats
    messages = [r.getMessage() for r in caplog.records]
    gone = [m for m in messages if "deleted or replaced" in m]
    assert len(gone) == 2, gone  # once per file
    assert len([m for m in messages if "cannot write" in m and "run.json" in m]) == 1, messages
    assert not run_dir.exists()  # not silently recreated


def test_a_read_only_run_directory_is_logged_with_the_reason_and_losses_are_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    prof = otelprof.instrument(output_dir=tmp_path, interval=0.1, trace_budget=float("inf"))
    run_dir = prof.run_dir
    assert run_dir is not None
    train(prof, 30)
    # Linux refuses to remount a file system read-only while files on it are open for
    # writing; a read-only file system mounted over the run directory is what the process
    # then sees at that path (as after an errors=remount-ro), its open files left behind.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(run_dir)], check=True)
    try:
        train(prof, 200)
        prof.shutdown()
    finally:
        subprocess.run(["umount", "-l", str(run_dir)], capture_output=True)
    stats = prof.stats()
    assert stats["dropped_total"] > 0, stats
    messages = [r.getMessage() for r in caplog.records]
    run_json = [m for m in messages if "cannot write" in m and "run.json" in m]
    assert len(run_json) == 1 and "Read-only file system" in run_json[0], messages
    assert not [r for r in caplog.records if r.exc_info]


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_a_run_directory_remounted_read_only_mid_run_keeps_every_line_and_tells_its_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, compress: bool
) -> None:
    caplog.set_level(logging.WARNING)
    prof = otelprof.instrument(
        output_dir=tmp_path, interval=0.1, trace_budget=float("inf"), compress=compress
    )
    run_dir = prof.run_dir
    assert run_dir is not None
    train(prof, 30)
    # the run directory read-only from now on (its files open for writing stay writable, as
    # after `mount -o remount,ro` of a bind mount): nothing can be created or renamed there
    mounted = subprocess.run(["mount", "--bind", str(run_dir), str(run_dir)], capture_output=True)
    if mounted.returncode != 0:
        pytest.fail(f"cannot bind-mount (these tests need root): {mounted.stderr!r}")
    try:
        remount = ["mount", "-o", "remount,ro,bind", str(run_dir)]
        subprocess.run(remount, check=True, capture_output=True)
        with pytest.raises(OSError, match="Read-only file system"):
            (run_dir / "probe").touch()
        train(prof, 200)
        prof.shutdown()
    finally:
        subprocess.run(["umount", str(run_dir)], capture_output=True)
    stats = prof.stats()
    gz = ".gz" if compress else ""
    spans = read_spans(run_dir / f"traces.jsonl{gz}")
    assert [s.name for s in spans].count("step") == 230  # every line survived
    assert len(spans) == stats["files.spans_exported"]
    messages = [r.getMessage() for r in caplog.records]
    run_json = [m for m in messages if "cannot write" in m and "run.json" in m]
    assert len(run_json) == 1 and "Read-only file system" in run_json[0], messages
    assert "finished_unix_nano" not in json.loads((run_dir / "run.json").read_text())
    # ... but the closing record went through the metrics file's own descriptor
    (info,) = open_run([run_dir]).run_info
    assert info["end"]["status"] == "clean", info
    assert info["stats"]["dropped_total"] == stats["dropped_total"]
    assert info["stats"]["timings.steps"] == 230
    assert _end_finding(info) is None
    report_tells_a_clean_end(run_dir)


def test_a_run_json_that_cannot_be_rewritten_leaves_the_end_and_drops_to_the_closing_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    prof = otelprof.instrument(output_dir=tmp_path, interval=0.1)
    run_dir = prof.run_dir
    assert run_dir is not None
    train(prof, 20)
    (run_dir / f"run.tmp{os.getpid()}").mkdir()  # where run.json is rewritten: EISDIR
    prof.shutdown()
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "cannot write" in m and "run.json" in m]) == 1, messages
    on_disk = json.loads((run_dir / "run.json").read_text())
    assert "finished_unix_nano" not in on_disk  # the rewrite did fail
    read_lines(run_dir / "metrics.jsonl")  # the closing record is ordinary OTLP JSON
    (info,) = open_run([run_dir]).run_info
    assert info["end"]["status"] == "clean", info
    assert info["stats"]["timings.steps"] == 20
    assert "dropped_total" in info["stats"]
    assert _end_finding(info) is None  # not "killed (SIGKILL, out of memory)"
    report_tells_a_clean_end(run_dir)


def _child_stats(script: str, tmp_path: Path, timeout: float) -> dict[str, Any]:
    path = tmp_path / "child.py"
    path.write_text(CHILD_PRELUDE + script)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    done = subprocess.run(
        [sys.executable, str(path), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


CHILD_PRELUDE = """
import json, socket, sys, threading, time
import otelprof

def train(prof, steps):
    for _ in range(steps):
        with otelprof.timing("train_batch"):
            time.sleep(0.002)
        otelprof.step()

def report_shutdown(prof):
    start = time.monotonic()
    prof.shutdown()
    took = time.monotonic() - start
    print(json.dumps({"took": took, **prof.stats()}))
"""

HUNG_WRITE = """
from otelprof.export import _spanlines

prof = otelprof.instrument(output_dir=sys.argv[1], interval=0.2, export_timeout=2,
                           trace_budget=float("inf"))
train(prof, 50)
frozen = threading.Event()
def hung_write(self, header, spans):  # a write into a frozen file system: never returns
    frozen.wait()
_spanlines.SpanLineWriter._write_line = hung_write
train(prof, 50)
report_shutdown(prof)
"""


def test_shutdown_returns_within_its_bound_when_file_writes_hang(tmp_path: Path) -> None:
    from otelprof._run.bounded import SHUTDOWN_MARGIN_S

    result = _child_stats(HUNG_WRITE, tmp_path, timeout=60)
    # the documented bound, plus slack for a loaded machine (correctness, not speed)
    assert result["took"] < 2 + SHUTDOWN_MARGIN_S + 3, result
    assert result["shutdown.flush_timeouts"] == 1, result
    assert result["files.spans_dropped_shutdown_timeout"] > 0, result
    assert result["dropped_total"] > 0


@pytest.fixture
def ext4_image(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB ext4 image of the test's own, loop-mounted (tmpfs cannot be frozen); thawed
    and unmounted afterwards whatever happens."""
    image, mount = tmp_path / "fs.img", tmp_path / "ext4"
    mount.mkdir()
    with image.open("wb") as out:
        out.truncate(64 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.fail(f"cannot make an ext4 image (mkfs.ext4, e2fsprogs): {made.stderr.strip()}")
    done = subprocess.run(
        ["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot loop-mount an ext4 image here (no loop devices?): {done.stderr}")
    try:
        yield mount
    finally:
        subprocess.run(["fsfreeze", "-u", str(mount)], capture_output=True)
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


FROZEN = """
prof = otelprof.instrument(output_dir=sys.argv[1], interval=0.2, export_timeout=3,
                           trace_budget=float("inf"), host_metrics=False)
train(prof, 200)
print("trained", prof.run_dir, flush=True)
sys.stdin.readline()  # the test froze the file system of the run directory
report_shutdown(prof)
sys.stdin.readline()  # the test thawed it, and saw the end recorded
"""


def _line(child: subprocess.Popen[str], timeout: float) -> str:
    import select

    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    assert ready, f"no line from the child within {timeout} s"
    return child.stdout.readline().strip()


def _say(child: subprocess.Popen[str], line: str) -> None:
    assert child.stdin is not None
    child.stdin.write(line + "\n")
    child.stdin.flush()


def test_shutdown_returns_within_its_bound_on_a_frozen_file_system_and_the_end_follows_the_thaw(
    tmp_path: Path, ext4_image: Path
) -> None:
    from otelprof._run.bounded import SHUTDOWN_MARGIN_S

    script = tmp_path / "child.py"
    script.write_text(CHILD_PRELUDE + FROZEN)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    child = subprocess.Popen(
        [sys.executable, str(script), str(ext4_image)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        said, run_dir = _line(child, 180).split()
        assert said == "trained"
        subprocess.run(["fsfreeze", "-f", str(ext4_image)], check=True)
        try:
            _say(child, "shut down")
            result = json.loads(_line(child, 60))
        finally:
            subprocess.run(["fsfreeze", "-u", str(ext4_image)], check=True)
        # the end, written in the background once the file system is back (the process lives)
        deadline = time.monotonic() + 60
        while True:  # run.json as a reader finds it: none readable yet counts as not yet
            infos = open_run([Path(run_dir)]).run_info
            if (infos and "finished_unix_nano" in infos[0]) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        (info,) = infos
        _say(child, "exit")
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
        assert child.stderr is not None
        stderr = child.stderr.read()
    # the documented bound, plus slack for a loaded machine (correctness, not speed)
    assert result["took"] < 3 + SHUTDOWN_MARGIN_S + 3, (result, stderr)
    assert result["shutdown.flush_timeouts"] == 1, result
    assert "abandoned" in stderr
    assert info["end"]["status"] == "clean" and info["end"]["flush_timed_out"] is True, info
    assert info["stats"]["dropped_total"] == result["dropped_total"], (info, result)
    finding = _end_finding(info)
    assert finding is not None and "did not finish within its bound" in finding.message


HUNG_COLLECTOR = """
silent = socket.socket()  # accepts connections and never answers: a hung collector
silent.bind(("127.0.0.1", 0))
silent.listen(64)
port = silent.getsockname()[1]
prof = otelprof.instrument(endpoint=f"http://127.0.0.1:{port}", insecure=True, interval=0.2,
                           export_timeout=2, trace_budget=float("inf"), detached=False)
train(prof, 300)
report_shutdown(prof)
"""


def test_shutdown_returns_within_its_bound_when_the_collector_hangs(tmp_path: Path) -> None:
    from otelprof._run.bounded import SHUTDOWN_MARGIN_S

    result = _child_stats(HUNG_COLLECTOR, tmp_path, timeout=90)
    assert result["took"] < 2 + SHUTDOWN_MARGIN_S + 3, result
    assert result["dropped_total"] > 0, result


def test_a_compressed_runs_closing_record_tells_its_end_when_run_json_cannot_be_rewritten(
    tmp_path: Path,
) -> None:
    prof = otelprof.instrument(output_dir=tmp_path, interval=0.1, compress=True)
    run_dir = prof.run_dir
    assert run_dir is not None
    train(prof, 10)
    (run_dir / f"run.tmp{os.getpid()}").mkdir()
    prof.shutdown()
    read_lines(run_dir / "metrics.jsonl.gz")  # whole gzip members, closing record included
    (info,) = open_run([run_dir]).run_info
    assert info["end"]["status"] == "clean" and info["stats"]["timings.steps"] == 10, info
