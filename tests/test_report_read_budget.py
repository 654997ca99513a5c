"""The report reads a run once, and a run over its read budget in evenly spaced parts.

A run within the budget (every run of a few ranks and hours) gives the very report it gave
when each section read the files on its own; a larger one keeps its timing figures exact
(the cumulative histograms are at the end of every metrics file) and says it was read in
parts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof.analysis.reader import (
    DEFAULT_READ_BUDGET,
    ReadPlan,
    ReadStats,
    WarningLog,
    iter_lines,
    iter_records,
    open_run,
)
from otelprof.analysis.report_json import build_json
from otelprof.analysis.sections import build_sections
from otelprof.analysis.summary import RunSummary, summarize
from otelprof.analysis.throughput_pass import PhaseThroughput, ThroughputPass
from otelprof.analysis.verdict import judge

STEPS = 2500


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run whose traces were sampled, with work per step (throughput) and a phase."""
    out = tmp_path_factory.mktemp("runs")
    prof = otelprof.instrument(
        output_dir=str(out), run_id="budget", trace_budget=5, interval=0.2,
        host_metrics=False,
    )  # fmt: skip
    try:
        for i in range(STEPS):
            with otelprof.timing("dataloader_next"):
                pass
            with otelprof.timing("train_batch"), otelprof.timing("forward"):
                time.sleep(0.0002 if i % 7 else 0.0006)
            otelprof.step_work(samples=8, tokens=64, flops=1e6)
            otelprof.step()
    finally:
        prof.shutdown()
    assert prof.run_dir is not None
    return prof.run_dir


def _report(run: Path, **options: Any) -> tuple[RunSummary, dict[str, Any], WarningLog]:
    warn = WarningLog(sink=lambda _m: None)
    summary = summarize(open_run([run]), warn, **options)
    doc = build_json(summary, judge(summary), build_sections(summary, warn))
    return summary, json.loads(json.dumps(doc)), warn


def test_a_run_within_the_budget_gives_the_report_of_a_full_read(sampled_run: Path) -> None:
    whole, whole_doc, whole_warn = _report(sampled_run, read_budget=None)
    default, default_doc, default_warn = _report(sampled_run, read_budget=DEFAULT_READ_BUDGET)
    assert not default.plan.partial
    assert default_doc == whole_doc
    assert whole_warn.count == default_warn.count == 0
    assert whole.read.bytes == whole.read.total_bytes == open_run([sampled_run]).total_bytes


def throughput_pass(run: Path, steps: tuple[int, int] | None = None) -> list[PhaseThroughput]:
    """The throughput figures from a pass over the run of their own."""
    work = ThroughputPass(steps)
    for rec in iter_records(open_run([run]).jsonl, lambda _m: None, histograms=True):
        work.feed(rec)
    return work.result()


def test_the_throughput_of_the_single_pass_equals_a_pass_of_its_own(sampled_run: Path) -> None:
    summary, doc, _warn = _report(sampled_run)
    alone = throughput_pass(sampled_run)
    assert alone and summary.throughput == alone
    assert alone[0].from_aggregates  # sampled: the counters over every step
    assert doc["sections"]["throughput"]["rows"][0]["steps"] == alone[0].steps
    ranged, _doc, _warn = _report(sampled_run, steps=(100, 900))
    alone = throughput_pass(sampled_run, (100, 900))
    assert ranged.throughput == alone and alone[0].steps > 0


def test_a_run_over_the_budget_keeps_exact_timings_and_says_it_was_read_in_parts(
    sampled_run: Path,
) -> None:
    whole, whole_doc, _ = _report(sampled_run, read_budget=None)
    budget = whole.read.total_bytes // 4
    part, part_doc, warn = _report(sampled_run, read_budget=budget)
    assert part.plan.partial and warn.count == 0  # only whole lines were read
    assert part.read.bytes < whole.read.bytes
    assert part.read.spans < whole.read.spans
    assert part.timings_from_histograms
    # counts, totals and means come from the last histograms, at the end of the file
    assert part.step.count == whole.step.count == STEPS
    assert part.step.total == pytest.approx(whole.step.total, rel=1e-12)
    assert set(part.timings) == set(whole.timings)
    for name, agg in whole.timings.items():
        assert part.timings[name].stats.count == agg.stats.count, name
        assert part.timings[name].stats.total == pytest.approx(agg.stats.total, rel=1e-12)
    assert part.throughput[0].samples_per_s == pytest.approx(
        whole.throughput[0].samples_per_s, rel=1e-9
    )
    assert any("read budget" in note for note in part_doc["notes"])
    assert not any("read budget" in note for note in whole_doc["notes"])


def test_read_plan_windows_yield_whole_lines_in_order_from_start_to_end(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    lines = [json.dumps({"resourceSpans": [{"n": i, "pad": "x" * (i % 500)}]}) for i in range(6000)]
    path.write_text("\n".join(lines) + "\n")
    size = path.stat().st_size
    plan = ReadPlan.for_files([path], size // 3)
    windows = plan.windows[path]
    assert len(windows) > 1 and windows[0][0] == 0 and windows[-1][1] == size
    read = [
        json.loads(raw)["resourceSpans"][0]["n"]
        for raw in (line.raw for line in iter_lines([path], lambda _m: None, ReadStats(), plan))
    ]
    assert read == sorted(set(read))  # no line twice, in file order
    assert read[0] == 0 and read[-1] == 5999  # the file's start and its end
    assert len(read) < len(lines)
    assert ReadPlan.for_files([path], size).windows == {}  # within the budget: whole


def test_the_tail_window_reads_a_final_line_longer_than_the_window(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    body = [json.dumps({"resourceMetrics": [{"n": i, "pad": "y" * 300}]}) for i in range(20000)]
    final = json.dumps({"resourceMetrics": [{"n": "final", "pad": "z" * (300 << 10)}]})
    path.write_text("\n".join([*body, final]) + "\n")
    plan = ReadPlan.for_files([path], path.stat().st_size // 10)
    assert plan.windows[path][-1][1] - plan.windows[path][-1][0] < len(final)
    read = [
        line.body["resourceMetrics"][0]["n"]
        for line in iter_lines([path], print, ReadStats(), plan)
    ]
    assert read[-1] == "final" and read[0] == 0
