"""The report reads the in-process histograms when a run has them: exact over every step."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof._timings._sampling import BOUNDS
from otelprof.analysis.aggregates import HistRec
from otelprof.analysis.aggregates import apply as apply_aggregates
from otelprof.analysis.quantiles import DurationStats
from otelprof.analysis.reader import WarningLog, iter_records, open_run
from otelprof.analysis.summary import TimingAgg, summarize, timing_key
from otelprof.cli import main as cli_main


def _train(prof: Any, steps: int) -> None:
    for i in range(steps):
        with otelprof.timing("dataloader_next"):
            pass
        with otelprof.timing("train_batch"), otelprof.timing("forward"):
            time.sleep(0.0003 if i % 5 else 0.0008)
        otelprof.step()


def _run(tmp_path: Path, run_id: str, steps: int, budget: float) -> Path:
    prof = otelprof.instrument(
        output_dir=str(tmp_path), run_id=run_id, trace_budget=budget,
        host_metrics=False, process_metrics=False,
    )  # fmt: skip
    try:
        _train(prof, steps)
    finally:
        prof.shutdown()
    assert prof.run_dir is not None
    return prof.run_dir


def test_histogram_figures_equal_the_span_figures_of_a_fully_traced_run(tmp_path: Path) -> None:
    run = _run(tmp_path, "full", 300, float("inf"))
    warn = WarningLog(sink=lambda _m: None)
    from_spans = summarize(open_run([run]), warn, steps=(None, None))  # spans only
    hists = [
        rec
        for rec in iter_records(open_run([run]).jsonl, warn, histograms=True)
        if isinstance(rec, HistRec)
    ]
    from_hists = summarize(open_run([run]), warn, steps=(None, None))
    from_hists.timings = {}  # as if every span had been sampled out
    from_hists.step = DurationStats()
    assert apply_aggregates(
        from_hists, hists, timing_key, lambda name, stats: TimingAgg(name, stats)
    )
    assert warn.count == 0
    assert from_hists.step.count == from_spans.step.count == 300
    assert from_hists.step.total == pytest.approx(from_spans.step.total, rel=1e-9)
    assert set(from_hists.timings) == set(from_spans.timings)
    for name, agg in from_spans.timings.items():
        hist = from_hists.timings[name]
        assert hist.stats.count == agg.stats.count, name
        assert hist.stats.total == pytest.approx(agg.stats.total, rel=1e-9), name
        assert hist.stats.min == pytest.approx(agg.stats.min, abs=1e-9)
        assert hist.stats.max == pytest.approx(agg.stats.max, abs=1e-9)
        for q in (50, 95):  # within a bucket (a factor of sqrt(2)) ...
            exact, estimate = agg.stats.percentile(q), hist.stats.percentile(q)
            if exact > BOUNDS[0]:
                assert estimate == pytest.approx(exact, rel=0.42), (name, q)
            else:  # ... or in the first one, below 1 µs (an empty range takes less)
                assert hist.stats.min <= estimate <= BOUNDS[0], (name, q)
    # a fully traced run keeps the spans' exact figures
    assert not summarize(open_run([run]), warn).timings_from_histograms


def test_a_sampled_run_reports_every_step_and_says_traces_were_sampled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path, "sampled", 3000, 0.0)
    warn = WarningLog(sink=lambda _m: None)
    summary = summarize(open_run([run]), warn)
    assert summary.read.spans < 4 * 3000  # most traces were sampled out...
    assert summary.step.count == 3000  # ...yet every step is counted
    for name in ("dataloader_next", "train_batch", "forward"):
        assert summary.timings[name].stats.count == 3000
    # direct children's share = their exact time over the exact step time
    share = summary.share("train_batch")
    expected = summary.timings["train_batch"].stats.total / summary.step.total
    assert share == pytest.approx(expected, rel=0.02)
    assert cli_main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "timings cover every step" in out and "3,000" in out
