"""`report` and `trace` stay bounded in time and memory on any input, each case injected:

- many files: the report's cost per file does not grow with the number of files (5,000
  one-span files cost about five times 1,000; a quadratic step made it 12 times);
- a line longer than `--max-line` is skipped with a warning naming file and line, read past
  in bounded chunks (a child process's peak RSS grows by far less than the line);
- files whose lines are larger than their share of the read budget still yield whole
  lines, counted (they gave an empty report);
- a file of one long line read in parts is read past once, not once a window.

A worker process that is stopped, not dead, is in tests/test_report_parallel.py.

The 100,000-file figure is measured in bench/scale_report.py (BENCHMARKS.md).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from otelprof.analysis import reader
from otelprof.analysis.reader import ReadPlan, ReadStats, WarningLog, iter_lines, open_run
from otelprof.analysis.summary import summarize
from otelprof.cli import main as cli_main
from tests.run_generators import step_spans_line, write_one_span_files

REPO = Path(__file__).resolve().parents[1]

_CPU_OF_REPORTS = """
import contextlib, io, json, sys, time
from otelprof.cli import main
seconds, doc = [], {}
for run in sys.argv[1:]:  # the first run also imports what the report imports when it runs
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        start = time.process_time()
        assert main(["report", "--json", run]) == 0
        seconds.append(time.process_time() - start)
    doc = json.loads(report.getvalue())["run"]
print(json.dumps({"seconds": seconds, "run": doc}))
"""


def test_a_report_over_many_files_costs_the_same_per_file_at_5000_as_at_1000(
    tmp_path: Path,
) -> None:
    small = str(write_one_span_files(tmp_path / "small", 1_000))
    large = str(write_one_span_files(tmp_path / "large", 5_000))
    done = subprocess.run(
        [sys.executable, "-c", _CPU_OF_REPORTS, small, small, small, large, large],
        capture_output=True, text=True, timeout=300, check=True, cwd=REPO,
    )  # fmt: skip
    out = json.loads(done.stdout)
    _warm, small_1, small_2, large_1, large_2 = out["seconds"]
    # CPU time, not wall time (other processes on the machine do not count), best of two
    ratio = min(large_1, large_2) / min(small_1, small_2)
    # linear: 5 to 6.5; with the quadratic straggler check it was 12 to 14
    assert ratio < 8, out["seconds"]
    assert min(large_1, large_2) < 30, out["seconds"]  # 1 s here (2 vCPUs, loaded)
    assert out["run"]["files"] == out["run"]["spans"] == out["run"]["processes"] == 5_000


_PEAK_RSS = """
import contextlib, io, json, resource, sys
from otelprof.cli import main
run, out = sys.argv[1], sys.argv[2]
report = io.StringIO()
with contextlib.redirect_stdout(report):
    assert main(["report", "--json", run, "--max-line", "2M"]) == 0
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["trace", run, "-o", out, "--max-line", "2M"]) == 0
peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_kib": peak_kib, "run": json.loads(report.getvalue())["run"]}))
"""

LONG = 24 << 20


def _report_and_trace(run: Path, tmp_path: Path) -> tuple[int, dict[str, Any], str]:
    """Peak RSS (KiB) of a child process that ran `report --json` and `trace` on `run`, the
    report's "run" figures, and the warnings both gave."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, str(run), str(tmp_path / f"{run.name}.trace.json")],
        capture_output=True, text=True, timeout=300, check=True, cwd=REPO,
    )  # fmt: skip
    out = json.loads(done.stdout)
    return out["peak_kib"], out["run"], done.stderr


def test_a_line_over_the_limit_is_skipped_naming_file_and_line_in_bounded_memory(
    tmp_path: Path,
) -> None:
    reference = tmp_path / "reference"
    long = tmp_path / "long"
    good = step_spans_line(0, 0, 3)
    near_limit = step_spans_line(0, 3, 1).replace(  # a span of 1.5 MiB: under the limit
        '"name":"step"', '"name":"' + "n" * (3 << 19) + '"'
    )
    junk = '{"resourceSpans":[{"resource":{"attributes":[{"key":"x","value":{"stringValue":"'
    body = [good, near_limit, junk + "a" * LONG + '"}}]}}]}\n', step_spans_line(0, 4, 2)]
    for run, text in (
        (reference, good + near_limit + step_spans_line(0, 4, 2)),
        (long, "".join(body) + junk + "b" * LONG),  # the last line: no newline at its end
    ):
        run.mkdir()
        (run / "traces.jsonl").write_text(text)
        (run / "run.json").write_text(json.dumps({"run_id": run.name}))

    base_kib, base_run, said = _report_and_trace(reference, tmp_path)
    assert "warning" not in said and base_run["spans"] == 6
    started = time.monotonic()
    long_kib, long_run, said = _report_and_trace(long, tmp_path)
    elapsed = time.monotonic() - started
    path = long / "traces.jsonl"
    for number, size in ((3, len(body[2])), (5, len(junk) + LONG)):
        message = (
            f"{path}:{number}: line of {size:,} bytes skipped: longer than the line limit "
            "(2,097,152 bytes, --max-line)"
        )
        assert said.count(message) == 2, said  # once by the report, once by the trace
    assert long_run["spans"] == 3 + 1 + 2  # every line under the limit, the long span too
    assert long_run["bad_lines"] == 2
    assert long_run["bytes"] == path.stat().st_size
    # two lines of 24 MiB read past: the peak grows by what the limit allows, not by the
    # lines (holding one took twice its size: its bytes and its text)
    assert (long_kib - base_kib) << 10 < LONG // 2, (base_kib, long_kib)
    assert elapsed < 60, elapsed


def test_files_whose_lines_outgrow_their_share_of_the_budget_still_yield_whole_lines(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    files, per_line = 40, 250  # two lines of ~80 KiB a file, longer than the tail window
    last_lines = 0
    for rank in range(files):
        last = step_spans_line(rank, per_line, per_line)
        (run / f"traces.rank{rank}.jsonl").write_text(step_spans_line(rank, 0, per_line) + last)
        last_lines += len(last)
    (run / "run.json").write_text(json.dumps({"run_id": "big-lines"}))
    budget = files * (16 << 10)  # a share of 16 KiB a file: less than a line
    warn = WarningLog(sink=lambda _m: None)
    summary = summarize(open_run([run]), warn, read_budget=budget)
    assert summary.plan.partial and warn.count == 0
    assert summary.read.partial_files == files
    assert summary.read.spans == files * per_line  # each file's last line, whole (was 0)
    assert summary.read.bytes == last_lines
    assert len(summary.ranks) == files
    assert summary.step.count == files * per_line
    assert summary.read.bytes <= budget + files * len(last)  # over by at most a line a file


class _CountedFile(io.FileIO):
    """A file that counts the bytes read from it (all instances together)."""

    read_bytes = 0

    def readinto(self, buffer: Any) -> int | None:
        n = super().readinto(buffer)
        _CountedFile.read_bytes += n or 0
        return n


def test_a_file_of_one_long_line_read_in_parts_is_read_past_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "traces.jsonl"
    path.write_bytes(b'{"resourceSpans":[' + b"7" * (16 << 20) + b"]}\n")
    size = path.stat().st_size
    monkeypatch.setattr(
        reader, "open_lines", lambda p: io.BufferedReader(_CountedFile(p, "rb"), 64 << 10)
    )
    plan = ReadPlan.for_files([path], 1 << 20, max_line=1 << 20)
    assert len(plan.windows[path]) > 40  # windows in the line, and the file's tail
    said: list[str] = []
    stats = ReadStats()
    assert list(iter_lines([path], said.append, stats, plan)) == []
    assert said == [
        f"{path}:1: line of {size:,} bytes skipped: longer than the line limit "
        "(1,048,576 bytes, --max-line)"
    ]
    assert stats.bad_lines == 1 and stats.bytes == size
    assert _CountedFile.read_bytes < 2 * size  # once, not once a window (~25 times)


def test_the_line_limit_is_a_size_option_of_report_and_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_one_span_files(tmp_path / "run", 2)
    assert cli_main(["report", str(run), "--max-line", "512"]) == 0
    assert "longer than the line limit (512 bytes" in capsys.readouterr().err
    assert cli_main(["trace", str(run), "-o", str(tmp_path / "t.json"), "--max-line", "64K"]) == 0
    assert "line limit" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["report", str(run), "--max-line", "0"])
