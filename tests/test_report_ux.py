"""`otelprof report` as a user meets it: latest run, --json, --steps, notes, problems first.

Runs are recorded for real (otelprof.instrument() in detached mode); the CLI runs in-process
(`otelprof.cli.main`) or as a subprocess where the working directory matters.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof.analysis import sections as sections_module
from otelprof.analysis.sections import Section
from otelprof.cli import main as cli_main
from tests.otlp_files import read_spans

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_profiler_left_running() -> Iterator[None]:
    yield
    otelprof.uninstrument()


def record_run(
    output_dir: Path, steps: int = 6, step0_s: float = 0.0, call_step: bool = True
) -> Path:
    """A real detached run: each step one dataloader_next and one train_batch span."""
    with otelprof.instrument(output_dir=output_dir, interval=0.2, host_metrics=False) as prof:
        for i in range(steps):
            with otelprof.timing("dataloader_next"):
                time.sleep(0.002)
            with otelprof.timing("train_batch"):
                time.sleep(0.004 + (step0_s if i == 0 else 0.0))
            if call_step:
                otelprof.step()
    assert prof.run_dir is not None
    return prof.run_dir


def report(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert cli_main(["report", *args]) == 0
    return capsys.readouterr().out


def report_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(report(capsys, "--json", *args))
    return doc


def test_report_without_argument_takes_the_latest_run_under_otelprof_runs(tmp_path: Path) -> None:
    first = record_run(tmp_path / "otelprof-runs", steps=2)
    time.sleep(0.01)
    latest = record_run(tmp_path / "otelprof-runs", steps=3)
    assert first != latest
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OTELPROF_OUTPUT_DIR", None)
    result = subprocess.run(
        [sys.executable, "-m", "otelprof", "report", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"latest run {Path('otelprof-runs') / latest.name}" in result.stderr
    doc = json.loads(result.stdout)
    assert doc["run"]["run_ids"] == [latest.name]
    assert doc["steps"]["count"] == 3


def test_report_without_argument_and_no_runs_explains_what_to_pass(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OTELPROF_OUTPUT_DIR", None)
    result = subprocess.run(
        [sys.executable, "-m", "otelprof", "report"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "otelprof-runs does not exist; pass RUN_DIR" in result.stderr


def test_json_report_figures_equal_those_computed_from_the_spans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = record_run(tmp_path, steps=6)
    doc = report_json(capsys, str(run))
    spans = read_spans(run / "traces.jsonl")
    steps = [s.duration_s for s in spans if s.name == "step"]
    assert doc["steps"]["count"] == len(steps) == 6
    assert doc["steps"]["mean_s"] == pytest.approx(statistics.mean(steps), rel=1e-9)
    assert doc["steps"]["p50_s"] == pytest.approx(statistics.median(steps), rel=1e-9)
    rows = {r["name"]: r for r in doc["timings"]}
    batches = [s.duration_s for s in spans if s.name == "train_batch"]
    assert rows["train_batch"]["count"] == 6
    assert rows["train_batch"]["mean_s"] == pytest.approx(statistics.mean(batches), rel=1e-9)
    assert rows["train_batch"]["share"] == pytest.approx(sum(batches) / sum(steps), rel=1e-9)
    assert doc["problems"] == [] and doc["notes"] == []
    assert doc["verdict"]["kind"]
    assert doc["run"]["ends"][0]["status"] == "clean"
    # The text report shows the same figures.
    text = report(capsys, str(run))
    assert f"{100 * rows['train_batch']['share']:.1f}%" in text


def test_step0_outlier_is_noted_and_steps_range_excludes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = record_run(tmp_path, steps=6, step0_s=0.15)
    text = report(capsys, str(run))
    assert "note: step 0 took" in text and "--steps 1:" in text
    doc = report_json(capsys, "--steps", "1:", str(run))
    spans = read_spans(run / "traces.jsonl")
    later = [s.duration_s for s in spans if s.name == "step" and s.attributes["otelprof.step"] >= 1]
    assert doc["steps"]["count"] == 5
    assert doc["steps"]["mean_s"] == pytest.approx(statistics.mean(later), rel=1e-9)
    assert {r["name"]: r["count"] for r in doc["timings"]}["train_batch"] == 5
    assert not any("step 0 took" in n for n in doc["notes"])
    assert any("only steps 1:" in n for n in doc["notes"])
    middle = report_json(capsys, "--steps", "2:4", str(run))
    assert middle["steps"]["count"] == 2


def test_bad_steps_range_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        cli_main(["report", "--steps", "5:2", str(tmp_path)])
    assert "need 0 <= A < B" in capsys.readouterr().err


def test_step_never_called_gives_a_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = record_run(tmp_path, steps=8, call_step=False)
    text = report(capsys, str(run))
    assert "the whole run is one step" in text
    assert "otelprof.step()" in text


def test_crash_and_failed_spans_are_at_the_top_of_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with (
        pytest.raises(RuntimeError),
        otelprof.instrument(output_dir=tmp_path, interval=0.2, host_metrics=False) as prof,
    ):
        for _ in range(3):
            with otelprof.timing("train_batch"):
                time.sleep(0.002)
            otelprof.step()
        with otelprof.timing("train_batch"):
            raise RuntimeError("CUDA error: device-side assert triggered")
    text = report(capsys, str(prof.run_dir))
    problems_at = text.index("problems")
    assert problems_at < text.index("Timings")
    assert "training died of RuntimeError: CUDA error: device-side assert triggered" in text
    assert "1 span(s) ended with an error: train_batch (1)" in text
    assert problems_at < text.index("verdict")
    doc = report_json(capsys, str(prof.run_dir))
    assert [p["kind"] for p in doc["problems"]] == ["crashed", "failed spans"]
    assert doc["failed_spans"] == {"train_batch": 1}


def test_ctrl_c_is_reported_as_interrupted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with (
        pytest.raises(KeyboardInterrupt),
        otelprof.instrument(output_dir=tmp_path, interval=0.2, host_metrics=False) as prof,
    ):
        otelprof.step()
        raise KeyboardInterrupt
    doc = report_json(capsys, str(prof.run_dir))
    assert [p["kind"] for p in doc["problems"]] == ["interrupted"]


def test_killed_process_shows_as_unfinalized(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = (
        "import os, signal, time, otelprof\n"
        "otelprof.instrument(interval=0.2)\n"
        "for i in range(5):\n"
        "    with otelprof.timing('train_batch'):\n"
        "        time.sleep(0.002)\n"
        "    otelprof.step()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), OTELPROF_OUTPUT_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], env=env, timeout=120)
    assert result.returncode == -9
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    text = report(capsys, str(run))
    assert text.index("unfinalized") < text.index("verdict")
    assert "run not finalized: no end was recorded (the process was killed" in text


def test_registered_section_shows_in_text_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def slowest(summary: Any) -> Section:
        rows = [{"name": n, "count": a.stats.count} for n, a in sorted(summary.timings.items())]
        return Section("span_counts", "Span counts", rows, notes=["from a test section"])

    sections_module.section(slowest)
    try:
        run = record_run(tmp_path / "runs", steps=3)
        text = report(capsys, str(run))
        doc = report_json(capsys, str(run))
    finally:
        sections_module._BUILDERS.remove(slowest)
    assert "Span counts" in text and "from a test section" in text
    assert doc["sections"]["span_counts"]["rows"] == [
        {"name": "dataloader_next", "count": 3},
        {"name": "train_batch", "count": 3},
    ]


@pytest.mark.parametrize("command", [["report"], ["compare", "a", "b"]])
def test_html_was_removed_and_says_what_to_use_instead(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    page = tmp_path / "report.html"
    for flag in (["--html", str(page)], ["--html"]):
        with pytest.raises(SystemExit) as exited:
            cli_main([*command, *flag])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "--html was removed: use --json" in err and "`otelprof trace`" in err
    assert not page.exists()


def test_counters_report_their_totals_and_nothing_reads_as_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with otelprof.instrument(output_dir=tmp_path, interval=0.2, host_metrics=False) as prof:
        for _ in range(5):
            with otelprof.timing("train_batch"):
                otelprof.step_work(samples=32)
                time.sleep(0.002)
            otelprof.step()
    assert prof.run_dir is not None
    doc = report_json(capsys, str(prof.run_dir))
    # the counters' values at the end, not how many points each exported
    assert doc["counters"]["otelprof.train.samples"] == 160
    assert doc["counters"]["otelprof.telemetry.dropped"] == 0
    text = report(capsys, str(prof.run_dir))
    assert "otelprof.train.samples 160" in text
    assert "otelprof.telemetry.dropped 0" in text
    assert "points)" not in text


def test_verdict_weighs_the_processs_own_cpu_and_names_the_hosts_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with otelprof.instrument(output_dir=tmp_path, interval=0.2) as prof:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            with otelprof.timing("train_batch"):
                sum(i * i for i in range(20_000))  # CPU work of the training process
            otelprof.step()
    assert prof.run_dir is not None
    doc = report_json(capsys, str(prof.run_dir))
    verdict = doc["verdict"]
    assert "the training process uses" in verdict["headline"], verdict
    assert "the host's CPUs are" in verdict["headline"] and "all processes" in verdict["headline"]
    evidence = " | ".join(verdict["evidence"])
    assert "the training process's own CPU utilization averages" in evidence
    assert "host CPU utilization (all processes) averages" in evidence


def test_a_timing_under_two_parents_gets_one_row_per_parent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with otelprof.instrument(output_dir=tmp_path, interval=0.2, host_metrics=False) as prof:
        for _ in range(10):
            with otelprof.timing("forward"), otelprof.timing("matmul"):
                time.sleep(0.001)
            with otelprof.timing("backward"), otelprof.timing("matmul"):
                time.sleep(0.002)
            otelprof.step()
    assert prof.run_dir is not None
    rows = report_json(capsys, str(prof.run_dir))["timings"]
    matmul = {r["level"]: r for r in rows if r["name"] == "matmul"}
    assert set(matmul) == {"in forward", "in backward"}, rows
    totals = {r["name"]: r["total_s"] for r in rows if r["level"] == "in step"}
    for parent in ("forward", "backward"):
        assert matmul[f"in {parent}"]["count"] == 10
        assert matmul[f"in {parent}"]["total_s"] <= totals[parent]
    text = report(capsys, str(prof.run_dir))
    assert "in forward" in text and "in backward" in text


def test_a_drop_message_names_every_kind_of_loss_it_sums(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = record_run(tmp_path, steps=3)
    (info_path,) = run.glob("run*.json")
    info = json.loads(info_path.read_text())
    # losses a collector outage counts: failed exports of spans, dropped metric points
    info["stats"].update({"otlp.spans_failed": 7, "otlp.points_dropped": 2, "dropped_total": 9})
    info_path.write_text(json.dumps(info))
    doc = report_json(capsys, str(run))
    (message,) = [p["message"] for p in doc["problems"] if p["kind"] == "dropped"]
    assert message.endswith(
        "9 telemetry item(s) dropped (otlp.points_dropped 2, otlp.spans_failed 7)"
    )
