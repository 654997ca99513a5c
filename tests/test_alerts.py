"""otelprof's alerting rules (prometheus/otelprof-alerts.yml and its PrometheusRule form).

- both shipped files are prometheus/alerts.py's output with the default thresholds, and hold
  the same rule groups;
- `promtool check rules` accepts them and `promtool test rules` runs, for every alert,
  series that fire it and series that must not (tests/alerts/*.test.yml);
- every metric the rules read is one a real run exports through the collector, and the
  rules' expressions, run on that run, select its rank (or nothing, for a healthy run);
- live: the rules, rendered with short windows (thresholds are parameters, the expressions
  the shipped ones), loaded into a real Prometheus scraping the real collector that real
  jobs send to: a job that stops stepping fires OtelprofJobStalled, a healthy one fires
  nothing; a rank killed with SIGKILL fires OtelprofRankLost, one whose run ended does not.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.alert_rules import ALERTS_SCRIPT, RULES_FILE, alerts_module
from tests.pipeline_run import PipelineRun
from tests.services import REPO, Collector, Prometheus, wait_for

PROMETHEUS_RULE = REPO / "deploy" / "kubernetes" / "monitoring" / "otelprof-alerts.yaml"
UNIT_TESTS = sorted((REPO / "tests" / "alerts").glob("*.test.yml"))
ALERT_NAMES = {
    "OtelprofJobStalled",
    "OtelprofGpuIdle",
    "OtelprofDataBound",
    "OtelprofStraggler",
    "OtelprofTelemetryDropped",
    "OtelprofRankLost",
}


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool") or "/usr/bin/promtool"
    if not os.access(found, os.X_OK):
        pytest.fail("promtool is not installed; run `make prometheus` (Debian's package)")
    return found


def _rules(path: Path = RULES_FILE) -> list[dict[str, Any]]:
    (group,) = yaml.safe_load(path.read_text())["groups"]
    return list(group["rules"])


def _promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120)


# -- the shipped files --------------------------------------------------------------------------


def test_shipped_rules_are_what_alerts_py_renders_with_its_defaults() -> None:
    for path, text in alerts_module().outputs().items():
        assert path.read_text() == text, (
            f"{path.relative_to(REPO)} differs from prometheus/alerts.py's output: "
            "run python3 prometheus/alerts.py"
        )


def test_prometheus_rule_holds_exactly_the_rule_files_groups() -> None:
    manifest = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["metadata"]["namespace"] == "otelprof"
    assert manifest["spec"] == yaml.safe_load(RULES_FILE.read_text())


def test_promtool_accepts_the_rule_file_and_the_prometheus_rules_groups(
    promtool: str, tmp_path: Path
) -> None:
    spec = tmp_path / "from-prometheus-rule.yml"
    spec.write_text(yaml.safe_dump(yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]))
    for path in (RULES_FILE, spec):
        result = _promtool(promtool, "check", "rules", str(path))
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"SUCCESS: {len(ALERT_NAMES)} rules found" in result.stdout, result.stdout


def test_the_shipped_prometheus_config_loads_the_rules(promtool: str) -> None:
    config = REPO / "prometheus" / "prometheus.yml"
    assert yaml.safe_load(config.read_text())["rule_files"] == ["otelprof-alerts.yml"]
    result = _promtool(promtool, "check", "config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout, result.stdout


def test_every_alert_names_service_job_rank_and_host_and_has_a_runbook() -> None:
    rules = _rules()
    assert {rule["alert"] for rule in rules} == ALERT_NAMES
    for rule in rules:
        notes = rule["annotations"]
        assert set(notes) == {"summary", "description", "runbook"}, rule["alert"]
        for label in ("otelprof_run_id", "otelprof_rank", "host_name"):
            assert f"$labels.{label}" in notes["summary"], (rule["alert"], label)
        for label in ("service_name", "otelprof_run_id", "otelprof_rank", "host_name"):
            assert f"$labels.{label}" in notes["description"], (rule["alert"], label)
            assert label in rule["expr"], (rule["alert"], label)  # kept by the aggregation
        assert len(notes["runbook"]) > 80, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]


def test_a_threshold_is_changed_by_rendering_again_and_bad_values_are_refused(
    tmp_path: Path, promtool: str
) -> None:
    out = tmp_path / "mine.yml"
    script = [sys.executable, str(ALERTS_SCRIPT)]
    done = subprocess.run(
        [*script, "--set", "stall_window=30m", "--set", "gpu_idle_ratio=0.05", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    mine = {rule["alert"]: rule for rule in _rules(out)}
    stalled, idle = mine["OtelprofJobStalled"], mine["OtelprofGpuIdle"]
    assert "[30m]" in stalled["expr"] and "offset 30m" in stalled["expr"]
    assert "< 0.05" in idle["expr"] and "[15m]" in idle["expr"]  # the others keep their default
    assert _promtool(promtool, "check", "rules", str(out)).returncode == 0
    for bad, why in (
        ("stall_window=15", "expected a Prometheus duration"),
        ("gpu_idle_ratio=5", "at most 1"),
        ("stall_minutes=3", "unknown parameter"),
    ):
        refused = subprocess.run(
            [*script, "--set", bad, "--out", str(out)], capture_output=True, text=True
        )
        assert refused.returncode == 2 and why in refused.stderr, (bad, refused.stderr)


# -- promtool's unit tests ------------------------------------------------------------------------


def test_promtool_unit_tests_pass(promtool: str) -> None:
    assert UNIT_TESTS
    for path in UNIT_TESTS:
        result = _promtool(promtool, "test", "rules", str(path))
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_that_fires_it_and_one_where_it_must_not() -> None:
    fired: set[str] = set()
    quiet: set[str] = set()
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fired == ALERT_NAMES and quiet == ALERT_NAMES, (fired, quiet)


# -- the rules against what a real run exports ---------------------------------------------------

_NOT_METRICS = {"and", "or", "unless", "offset", "by", "on", "bool", "group_right", "group_left"}


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads: identifiers that are neither functions, keywords,
    labels (in `by (...)`, `on (...)`, `{...}`) nor durations."""
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    text = re.sub(r"\b(by|on|group_right|group_left)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\boffset\s+\S+", " ", text)
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", text))
    return names - _NOT_METRICS


def test_metric_names_finds_every_name_an_expression_reads() -> None:
    assert metric_names(
        'sum by (a, b) (rate(x_total{c="d"}[5m])) / on (a) y_count offset 5m > 0.3 and z'
    ) == {"x_total", "y_count", "z"}


@pytest.mark.e2e
def test_every_metric_the_rules_read_is_exported_through_the_collector(
    pipeline_run: PipelineRun,
) -> None:
    """The real run (one process, synthetic GPUs) exports every name but the collective
    counters, which only a job of several processes has: those are the names the
    dashboards' straggler panels read, proven on a real 2-rank job in test_distributed."""
    from dashboards.build import COLLECTIVE, STRAGGLER_PATH

    run = pipeline_run
    exported = {
        s["metric"]["__name__"]
        for s in run.prometheus.query(f'{{service_name="{run.service_name}"}}', at=run.complete_at)
    }
    read = set().union(*(metric_names(rule["expr"]) for rule in _rules()))
    assert read - exported == {COLLECTIVE, STRAGGLER_PATH}, read - exported


def _instant(run: PipelineRun, expr: str) -> list[dict[str, str]]:
    return [s["metric"] for s in run.prometheus.query(expr, at=run.complete_at)]


@pytest.mark.e2e
def test_with_the_shipped_thresholds_no_rule_holds_for_a_healthy_run(
    pipeline_run: PipelineRun,
) -> None:
    for rule in _rules():
        assert not _instant(pipeline_run, rule["expr"]), rule["alert"]


@pytest.mark.e2e
def test_thresholds_every_training_passes_select_the_runs_rank_and_gpus(
    pipeline_run: PipelineRun, tmp_path: Path
) -> None:
    """The same expressions with thresholds any run passes (every GPU 'idle' under 100 %,
    'data-bound' over 0.01 %): the joins of GPU gauges, step counts and data-loader time
    carry the run's service, job, trial, host and rank through to the alert's labels."""
    run = pipeline_run
    out = tmp_path / "always.yml"
    out.write_text(
        alerts_module().rules_file({"gpu_idle_ratio": "1", "data_bound_share": "0.0001"})
    )
    rules = {rule["alert"]: rule for rule in _rules(out)}
    who = {
        "service_name": run.service_name,
        "otelprof_run_id": run.run_id,
        "determined_trial_id": "42",
        "host_name": run.host_name,
        "otelprof_rank": run.rank,
    }
    idle = _instant(run, rules["OtelprofGpuIdle"]["expr"])
    assert sorted(s["hw_id"] for s in idle) == sorted(run.gpu_uuids), idle
    assert all({k: s[k] for k in who} == who for s in idle), idle
    (bound,) = _instant(run, rules["OtelprofDataBound"]["expr"])
    assert bound == who


# -- live: the rules evaluated by a real Prometheus on real jobs ----------------------------------

# Short windows so that the test takes seconds; the expressions are the shipped ones.
LIVE = {
    "evaluation_interval": "1s",
    "rate_window": "4s",
    "stall_window": "6s",
    "stall_for": "1s",
    "gpu_idle_window": "6s",
    "gpu_idle_for": "1s",
    "data_bound_for": "2s",
    "straggler_for": "2s",
    "dropped_window": "6s",
    "lost_window": "30s",
    "lost_for": "1s",
}


def _alerts_of(prometheus: Prometheus, run_id: str, name: str, state: str) -> list[Any]:
    return [
        a
        for a in prometheus.alerts()
        if a["labels"]["alertname"] == name
        and a["labels"].get("otelprof_run_id") == run_id
        and a["state"] == state
    ]


@pytest.mark.e2e
def test_live_a_stalled_job_fires_a_healthy_one_does_not_and_a_killed_rank_is_lost(
    collector_factory: Callable[..., Collector],
    prometheus_factory: Callable[..., Prometheus],
    tmp_path: Path,
) -> None:
    rules = tmp_path / "otelprof-alerts.yml"
    rules.write_text(alerts_module().rules_file(LIVE))
    # a killed rank's series leave the collector's endpoint after the expiry: 3 s here
    collector = collector_factory(extra_env={"OTELCOL_METRIC_EXPIRATION": "3s"})
    prometheus = prometheus_factory(collector=collector, rule_files=[rules])
    service = f"alerts-{uuid.uuid4().hex[:8]}"
    healthy, stalled = "job-healthy", "job-stalled"
    stops = {run_id: tmp_path / f"stop-{run_id}" for run_id in (healthy, stalled)}
    stall_file = tmp_path / "stall"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTELPROF_", "OTEL_", "DET_"))}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    jobs: dict[str, subprocess.Popen[bytes]] = {}
    started = time.time()
    try:
        for run_id, stop in stops.items():
            argv = [sys.executable, "-m", "tests.live_job", collector.otlp_endpoint, service]
            argv += [str(stop), *([str(stall_file)] if run_id == stalled else [])]
            jobs[run_id] = subprocess.Popen(
                argv,
                cwd=tmp_path,
                env={**env, "OTELPROF_RUN_ID": run_id, "OTELPROF_DETACHED": "false"},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        # both have stepped for longer than the stall window (JobStalled's `offset`)
        steps = f'otelprof_timing_duration_seconds_count{{service_name="{service}"}}'
        wait_for(
            lambda: {s["metric"]["otelprof_run_id"] for s in prometheus.query(
                f"sum by (otelprof_run_id) ({steps} offset 8s)")} == set(stops),
            timeout_s=180,
            what="both jobs to have stepped for 8 s",
        )  # fmt: skip
        stall_file.touch()
        wait_for(
            lambda: _alerts_of(prometheus, stalled, "OtelprofJobStalled", "firing"),
            timeout_s=60,
            what="OtelprofJobStalled to fire for the stalled job",
        )
        assert jobs[stalled].poll() is None, "the stalled job must still be alive"
        for group in prometheus.rule_groups():
            for rule in group["rules"]:
                assert rule["health"] == "ok", rule

        # the healthy job ends (its run end is exported); the stalled one is SIGKILLed
        stops[healthy].touch()
        assert jobs[healthy].wait(timeout=60) == 0, jobs[healthy].stderr
        jobs[stalled].send_signal(signal.SIGKILL)
        jobs[stalled].wait(timeout=30)
        (lost,) = wait_for(
            lambda: _alerts_of(prometheus, stalled, "OtelprofRankLost", "firing"),
            timeout_s=60,
            what="OtelprofRankLost to fire for the killed job",
        )
        assert lost["labels"]["service_name"] == service and lost["labels"]["otelprof_rank"] == "0"
        assert "without a run end" in lost["annotations"]["summary"]
        ended = prometheus.query(
            f'max_over_time(otelprof_run_ended{{otelprof_run_id="{healthy}"}}[1m])'
        )
        assert [float(s["value"][1]) for s in ended] == [1.0], ended

        # never any alert for the healthy job, from its start to its end and after
        history = prometheus.query_range(
            f'ALERTS{{otelprof_run_id="{healthy}"}}', started, time.time(), 1.0
        )
        assert history == [], [s["metric"] for s in history]
    finally:
        for stop in stops.values():
            stop.touch()
        for job in jobs.values():
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait()
