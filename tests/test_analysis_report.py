"""`otelprof report`: figures equal independent computations; the verdict finds the bottleneck."""

from __future__ import annotations

import json
import math
import random
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from otelprof.analysis.quantiles import DurationStats
from otelprof.analysis.reader import WarningLog, open_run
from otelprof.analysis.summary import RunSummary, summarize
from otelprof.analysis.tables import timing_rows
from otelprof.analysis.verdict import judge
from otelprof.cli import main as cli_main
from tests.otlp_files import read_points, read_spans
from tests.run_generators import RunSpec, write_sdk_run


def _summary(run_dir: Path, **kw: Any) -> tuple[RunSummary, WarningLog]:
    warn = WarningLog(sink=lambda _m: None)
    return summarize(open_run([run_dir], warn), warn, **kw), warn


def _q(values: list[float], pct: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[pct - 1]


def oracle_timings(run_dir: Path) -> tuple[dict[str, dict[str, Any]], float]:
    """Per-name figures computed from the test reader's spans, independently of otelprof."""
    spans = [s for f in sorted(run_dir.glob("traces*.jsonl")) for s in read_spans(f)]
    steps = {s.span_id: s for s in spans if s.name == "step"}
    step_total = sum(s.duration_s for s in steps.values())
    durations: dict[str, list[float]] = defaultdict(list)
    direct: dict[str, float] = defaultdict(float)
    for s in spans:
        if s.name == "step":
            continue
        durations[s.name].append(s.duration_s)
        if s.parent_span_id in steps:
            direct[s.name] += s.duration_s
    expected = {
        name: {
            "count": len(v),
            "mean": statistics.fmean(v),
            "p50": _q(v, 50),
            "p95": _q(v, 95),
            "total": math.fsum(v),
            "share": direct[name] / step_total if name in direct else None,
        }
        for name, v in durations.items()
    }
    step_durs = [s.duration_s for s in steps.values()]
    expected["step"] = {
        "count": len(step_durs),
        "mean": statistics.fmean(step_durs),
        "p50": _q(step_durs, 50),
        "p95": _q(step_durs, 95),
        "total": step_total,
        "share": 1.0,
    }
    return expected, step_total


def assert_report_matches_oracle(run_dir: Path, summary: RunSummary) -> None:
    expected, _ = oracle_timings(run_dir)
    rows = {r.name: r for r in timing_rows(summary)}
    assert set(expected) <= set(rows)
    for name, exp in expected.items():
        row = rows[name]
        assert row.count == exp["count"], name
        assert row.mean_s == pytest.approx(exp["mean"], rel=1e-9), name
        assert row.p50_s == pytest.approx(exp["p50"], rel=1e-9), name
        assert row.p95_s == pytest.approx(exp["p95"], rel=1e-9), name
        assert row.total_s == pytest.approx(exp["total"], rel=1e-9), name
        if exp["share"] is None:
            assert row.share is None, name
        else:
            assert row.share == pytest.approx(exp["share"], rel=1e-9), name


def test_report_figures_equal_those_computed_independently_from_the_spans(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(ranks=2, steps=60, epochs=3))
    summary, warn = _summary(run)
    assert warn.count == 0
    assert_report_matches_oracle(run, summary)
    rows = {r.name: r for r in timing_rows(summary)}
    # nested spans are listed with their parent, outside the step breakdown
    assert rows["forward"].level == "in train_batch" and rows["forward"].share is None
    assert rows["validation"].level == "top level"
    assert summary.unresolved_children == 0


def test_hardware_min_mean_max_per_host_and_gpu_match_the_points(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(ranks=2, gpus=2, steps=30))
    summary, _ = _summary(run)
    points = [p for f in sorted(run.glob("metrics*.jsonl")) for p in read_points(f)]
    groups: dict[tuple, list[float]] = defaultdict(list)
    for p in points:
        if p.name.startswith(("hw.", "system.")):
            key = (p.resource["host.name"], p.name, tuple(sorted(p.attributes.items())))
            groups[key].append(p.value)
    got = {
        (s.host, s.name, tuple(sorted(s.attrs))): s
        for s in summary.series.values()
        if s.scope == ""
    }
    assert set(got) == set(groups)
    gpu_keys = [k for k in groups if k[1] == "hw.gpu.utilization"]
    assert len(gpu_keys) == 2  # one series per GPU
    for key, values in groups.items():
        s = got[key]
        assert s.count == len(values)
        assert s.min == min(values) and s.max == max(values)
        assert s.mean == pytest.approx(statistics.fmean(values), rel=1e-12)
    # per-process gauges stay per process
    per_process = [s for s in summary.series.values() if s.name == "process.memory.usage"]
    assert len(per_process) == 2


def test_slow_dataloader_gives_a_data_loader_bound_verdict_with_evidence(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(slow_dataloader_s=0.08, steps=40))
    summary, _ = _summary(run)
    verdict = judge(summary)
    share = summary.share("dataloader_next")
    gpu = summary.gauge_mean("hw.gpu.utilization")
    assert share is not None and share > 0.5
    assert gpu is not None and gpu < 0.5
    assert verdict.kind == "data-loader bound"
    assert verdict.headline == (
        f"data-loader bound: dataloader_next takes {100 * share:.0f}% of step time "
        f"while GPU utilization averages {100 * gpu:.0f}%"
    )


def test_dominant_train_batch_with_a_busy_gpu_is_gpu_compute_bound(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(train_batch_s=0.1, gpu_busy_util=0.97))
    verdict = judge(_summary(run)[0])
    assert verdict.kind == "GPU compute bound"
    assert "train_batch" in verdict.headline


def test_dominant_train_batch_with_an_idle_gpu_points_at_cpu_overhead(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(train_batch_s=0.1, gpu_busy_util=0.3))
    verdict = judge(_summary(run)[0])
    assert verdict.kind == "train_batch bound, GPU under-used"


def test_untimed_work_dominating_the_step_is_called_out(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(untimed_s=0.2))
    summary, _ = _summary(run)
    verdict = judge(summary)
    assert verdict.kind == "untimed work"
    assert summary.untimed_share is not None and summary.untimed_share > 0.7


def test_a_straggler_rank_is_named_in_the_evidence(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(ranks=4, straggler_rank=2, steps=20))
    verdict = judge(_summary(run)[0])
    stragglers = [e for e in verdict.evidence if e.startswith("straggler")]
    assert len(stragglers) == 1 and "rank 2 " in stragglers[0]


def _steps_first(traces: Path) -> None:
    """Rewrite a traces file so every step span comes before all the other spans."""
    steps, others = [], []
    template = None
    for line in traces.read_text().splitlines():
        body = json.loads(line)
        for rs in body["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                template = (rs["resource"], ss["scope"])
                for span in ss["spans"]:
                    (steps if span["name"] == "step" else others).append(span)
    assert template is not None and steps and others
    resource, scope = template
    lines = [
        json.dumps(
            {
                "resourceSpans": [
                    {"resource": resource, "scopeSpans": [{"scope": scope, "spans": chunk}]}
                ]
            }
        )
        for chunk in (steps, others)
    ]
    traces.write_text("\n".join(lines) + "\n")


def test_children_written_after_their_step_still_count_as_direct_children(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=30))
    expected, _ = oracle_timings(run)
    _steps_first(run / "traces.jsonl")
    summary, _ = _summary(run)
    assert summary.unresolved_children == 0
    for name in ("dataloader_next", "train_batch", "to_device"):
        assert summary.share(name) == pytest.approx(expected[name]["share"], rel=1e-9)


def test_a_small_link_window_degrades_to_counting_unresolved_spans(tmp_path: Path) -> None:
    """Beyond the window a child is counted as unresolved, never guessed into the breakdown."""
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=30))
    expected, _ = oracle_timings(run)
    _steps_first(run / "traces.jsonl")
    summary, _ = _summary(run, window=3)
    assert summary.unresolved_children > 0
    got = summary.share("dataloader_next") or 0.0
    assert got < expected["dataloader_next"]["share"]
    assert "never found" in " ".join(judge(summary).evidence)


def test_percentiles_beyond_the_exact_cap_stay_within_half_a_percent() -> None:
    rng = random.Random(3)
    values = [rng.lognormvariate(-4, 1) for _ in range(50_000)]
    stats = DurationStats(exact_cap=1_000)
    for v in values:
        stats.add(v)
    assert not stats.exact
    for pct in (50, 95, 99):
        exact = _q(values, pct)
        assert stats.percentile(pct) == pytest.approx(exact, rel=0.006)
    assert stats.total == pytest.approx(math.fsum(values))
    assert (stats.min, stats.max) == (min(values), max(values))


def test_report_command_prints_tables_and_the_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(slow_dataloader_s=0.08, ranks=2))
    assert cli_main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    summary, _ = _summary(run)
    share = summary.share("dataloader_next")
    assert share is not None
    assert "verdict: data-loader bound" in out
    assert f"{100 * share:.1f}%" in out  # the share column
    for name in ("dataloader_next", "train_batch", "hw.gpu.utilization", "system.disk.throughput"):
        assert name in out
    assert "Steps per process" in out


def test_a_run_without_step_spans_says_so_and_names_the_biggest_timing(tmp_path: Path) -> None:
    run = write_sdk_run(tmp_path / "run", RunSpec(steps=10, validation=False))
    traces = run / "traces.jsonl"
    lines = []
    for line in traces.read_text().splitlines():
        body = json.loads(line)
        for rs in body["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                ss["spans"] = [s for s in ss["spans"] if s["name"] != "step"]
        lines.append(json.dumps(body))
    traces.write_text("\n".join(lines) + "\n")
    summary, _ = _summary(run)
    verdict = judge(summary)
    assert summary.step.count == 0
    assert verdict.kind == "no steps" and "the most time is in train_batch" in verdict.headline
    assert all(r.share is None for r in timing_rows(summary))


def test_section_figures_keep_their_significant_digits_and_flags_read_yes() -> None:
    from otelprof.analysis.format import cell, number

    assert number(399_600.0) == "399,600"  # not 399,600.000
    assert number(12.3456) == "12.35"
    assert number(0.034) == "0.034"
    # the text report's cell formatter for section tables (report_text)
    assert cell(3.4e-05) == "3.4e-05"  # a TFLOP/s beside MFU % 0.034, not 0.000
    assert cell(0.0) == "0"
    assert (cell(True), cell(False), cell(None)) == ("yes", "", "-")  # not True/False


def test_the_verdict_names_cpu_contention_from_the_process_and_host_cpu() -> None:
    from otelprof.analysis.verdict import _cpu_evidence, _hardware_clause

    clause = _hardware_clause(None, 1.0, 0.1)  # a shared machine: host busy, process not
    assert clause.startswith(
        "the training process uses 10% of the usable CPUs; the host's CPUs are 100% busy, "
        "all processes"
    ), clause
    assert "competing for CPU" in _cpu_evidence(1.0, 0.1)[-1]
    assert not any("competing" in e for e in _cpu_evidence(0.3, 0.25))
    assert _hardware_clause(0.5, 1.0, 0.1) == "GPU utilization averages 50%"


def test_the_run_end_marker_is_not_a_hardware_row_of_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`otelprof.run.ended` is a flag for Prometheus' alerts, exported by every real run; the
    report tells how a run ended from its closing record, not as a "min / mean / max" row."""
    import otelprof

    with otelprof.instrument(output_dir=tmp_path, run_id="ended", interval=0.2) as prof:
        for _ in range(3):
            with otelprof.timing("train_batch"):
                pass
            otelprof.step()
    run = prof.run_dir
    exported = {p.name for f in sorted(run.glob("metrics*.jsonl")) for p in read_points(f)}
    assert "otelprof.run.ended" in exported and "process.memory.usage" in exported
    assert cli_main(["report", "--json", str(run)]) == 0
    metrics = {row["metric"] for row in json.loads(capsys.readouterr().out)["hardware"]}
    assert "process.memory.usage" in metrics
    assert "otelprof.run.ended" not in metrics
