"""Robust reading of run directories: bad lines skipped with file:line warnings, bounded memory."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from otelprof.analysis.reader import (
    ReadStats,
    RunDirError,
    SpanRec,
    WarningLog,
    iter_records,
    open_run,
)
from otelprof.analysis.summary import summarize
from otelprof.cli import main as cli_main
from tests.otlp_files import read_spans
from tests.run_generators import RunSpec, write_big_run, write_sdk_run


def _collect(run_dir: Path) -> tuple[list[SpanRec], list[str], ReadStats]:
    messages: list[str] = []
    warn = WarningLog(limit=1000, sink=messages.append)
    stats = ReadStats()
    spans = [
        r for r in iter_records(open_run([run_dir]).jsonl, warn, stats) if isinstance(r, SpanRec)
    ]
    return spans, messages, stats


def test_a_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="no such directory"):
        open_run([tmp_path / "nope"])


def test_a_file_is_not_a_run_directory(tmp_path: Path) -> None:
    f = tmp_path / "traces.jsonl"
    f.write_text("")
    with pytest.raises(RunDirError, match="not a directory"):
        open_run([f])


def test_a_directory_without_telemetry_files_is_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(RunDirError, match=r"is not an otelprof run directory: no \*\.jsonl"):
        open_run([tmp_path])


def test_the_output_directory_above_runs_names_the_runs_inside(tmp_path: Path) -> None:
    write_sdk_run(tmp_path / "20260101-run-a", RunSpec(steps=2))
    with pytest.raises(RunDirError, match="contains run directories \\(20260101-run-a\\)"):
        open_run([tmp_path])


@pytest.mark.parametrize("command", ["report", "trace", "replay"])
def test_every_command_rejects_a_non_run_with_exit_code_2(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ["--endpoint", "127.0.0.1:1"] if command == "replay" else []
    if command == "trace":
        extra = ["-o", str(tmp_path / "t.json")]
    assert cli_main([command, str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert f"otelprof {command}: error: {tmp_path} is not an otelprof run directory" in err


def test_a_truncated_last_line_is_skipped_with_a_warning_and_the_rest_is_read(
    tmp_path: Path,
) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=80))  # several lines of spans
    traces = run / "traces.jsonl"
    intact = read_spans(traces)
    lines = traces.read_text().splitlines(keepends=True)
    assert len(lines) >= 2
    with traces.open("a") as f:
        f.write(lines[0][: len(lines[0]) // 2])  # a crash mid-write: half a line, no newline
    spans, messages, stats = _collect(run)
    assert len(spans) == len(intact)
    n = len(lines) + 1
    assert any(m.startswith(f"{traces}:{n}: truncated last line skipped") for m in messages)
    assert stats.bad_lines == 1


def test_a_corrupt_line_is_skipped_with_a_warning_naming_file_and_line(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=80))
    traces = run / "traces.jsonl"
    lines = traces.read_text().splitlines(keepends=True)
    assert len(lines) >= 3
    lost = len(json.loads(lines[1])["resourceSpans"][0]["scopeSpans"][0]["spans"])
    lines[1] = '{"resourceSpans": [{"resource": \x00garbage\n'
    traces.write_text("".join(lines))
    total = sum(
        len(ss["spans"])
        for i, line in enumerate(lines)
        if i != 1
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
    )
    spans, messages, _ = _collect(run)
    assert len(spans) == total and lost > 0
    assert any(m.startswith(f"{traces}:2: corrupt line skipped") for m in messages)
    # and the report still runs to the end on it
    warn = WarningLog(sink=lambda _m: None)
    summary = summarize(open_run([run]), warn)
    assert summary.read.spans == total and summary.read.bad_lines == 1


def test_valid_json_that_is_not_an_otlp_request_is_skipped_with_a_warning(
    tmp_path: Path,
) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=5))
    traces = run / "traces.jsonl"
    intact = read_spans(traces)
    n = len(traces.read_text().splitlines())
    with traces.open("a") as f:
        f.write('{"hello": "world"}\n[1, 2]\n')
    spans, messages, stats = _collect(run)
    assert len(spans) == len(intact) and stats.bad_lines == 2
    assert any(m.startswith(f"{traces}:{n + 1}: not an OTLP request line") for m in messages)
    assert any(m.startswith(f"{traces}:{n + 2}: not an OTLP request line") for m in messages)


def test_malformed_spans_inside_a_good_line_are_skipped_one_by_one(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=5))
    traces = run / "traces.jsonl"
    body = json.loads(traces.read_text().splitlines()[0])
    spans = body["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans[0]["traceId"] = "not-hex"
    del spans[1]["endTimeUnixNano"]
    traces.write_text(json.dumps(body) + "\n")
    got, messages, stats = _collect(run)
    assert len(got) == len(spans) - 2
    assert stats.skipped_items == 2
    assert sum("malformed span skipped" in m and f"{traces}:1" in m for m in messages) == 2


def test_any_jsonl_name_is_read_and_lines_are_told_apart_by_content(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=5), run_json=False)
    (run / "traces.jsonl").rename(run / "a.jsonl")
    (run / "metrics.jsonl").rename(run / "b.jsonl")
    (run / "c.jsonl").write_text('{"resourceLogs": []}\n')  # a logs file: ignored, no warning
    spans, messages, stats = _collect(run)
    assert len(spans) == len(read_spans(run / "a.jsonl"))
    assert stats.points > 0 and stats.other_lines == 1
    assert messages == []


def test_a_run_with_only_run_json_reports_that_it_holds_no_telemetry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "r1"}))
    assert cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no timing spans in this run" in out and "verdict: no timings" in out


def _peak_bytes(run_dir: Path) -> int:
    warn = WarningLog(sink=lambda _m: None)
    files = open_run([run_dir])
    tracemalloc.start()
    try:
        summary = summarize(files, warn, window=2_000, exact_cap=5_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert summary.read.spans > 0 and warn.count == 0
    return peak


def test_reading_memory_stays_flat_as_the_run_grows(tmp_path: Path) -> None:
    small = write_big_run(tmp_path / "small", 3_000_000, ranks=2)
    big = write_big_run(tmp_path / "big", 12_000_000, ranks=2)
    assert big > 3.5 * small
    peak_small = _peak_bytes(tmp_path / "small")
    peak_big = _peak_bytes(tmp_path / "big")
    # 4x the data, about the same memory (the caps, not the run, set it)
    assert peak_big < 1.3 * peak_small + 1_000_000, (peak_small, peak_big)
