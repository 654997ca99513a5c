"""Grafana dashboards and provisioning: structure, and every query proven on real data.

The data tests run every PromQL expression of every panel and variable, with the variables
set to the values of one real attached-mode run (tests/pipeline_run.py: CPU PyTorch →
collector → Prometheus), and fail with the panel's title when one returns nothing. GPU
panels are fed by otelprof's GPU gauges over a scripted NVML driver: SYNTHETIC data, since
this machine has no GPU (labelled otelprof_synthetic="fake-nvml" in Prometheus).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import grafana_provisioning
from tests.dashboard_queries import (
    DASHBOARD_DIR,
    DASHBOARD_FILES,
    label_values,
    load,
    panels,
    queries,
    references,
    run_range,
    substitute,
    variable_query,
)
from tests.pipeline_run import RANK_ENV, PipelineRun
from tests.services import REPO, Collector, Prometheus, wait_for

PROVISIONING = DASHBOARD_DIR / "provisioning"
DATASOURCES = PROVISIONING / "datasources" / "datasources.yaml"
PROVIDERS = PROVISIONING / "dashboards" / "dashboards.yaml"
IDS = [p.name for p in DASHBOARD_FILES]


def _build_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "otelprof_dashboards_build", DASHBOARD_DIR / "build.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _datasources() -> dict[str, dict[str, Any]]:
    return {d["uid"]: d for d in yaml.safe_load(DATASOURCES.read_text())["datasources"]}


# -- structure -------------------------------------------------------------------------------


def test_both_dashboards_are_shipped() -> None:
    assert IDS == ["otelprof-system.json", "otelprof-training.json"]


def test_committed_dashboards_are_what_build_py_generates() -> None:
    build = _build_module()
    for path in DASHBOARD_FILES:
        assert path.read_text() == build.render(path.name), (
            f"{path.name} differs from dashboards/build.py's output: run python dashboards/build.py"
        )


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=IDS)
def test_dashboard_is_valid_grafana_json(path: Path) -> None:
    dashboard = load(path)
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] == path.stem and dashboard["title"]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert all(isinstance(i, int) and i > 0 for i in ids)
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], f"{panel['title']} has no query"
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=IDS)
def test_panels_do_not_overlap(path: Path) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in panels(load(path)):
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=IDS)
def test_every_datasource_uid_is_provisioned(path: Path) -> None:
    provisioned = _datasources()
    dashboard = load(path)
    used = []
    for panel in panels(dashboard):
        if "datasource" in panel:
            used.append((panel["title"], panel["datasource"]))
        used += [(panel["title"], t["datasource"]) for t in panel.get("targets", [])]
    used += [(v["name"], v["datasource"]) for v in _query_variables(dashboard)]
    assert used
    for where, ds in used:
        assert ds["uid"] in provisioned, f"{where}: datasource uid {ds['uid']} not provisioned"
        assert ds["type"] == provisioned[ds["uid"]]["type"], where


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=IDS)
def test_every_variable_used_is_defined_and_every_defined_one_is_used(path: Path) -> None:
    dashboard = load(path)
    defined = [v["name"] for v in dashboard["templating"]["list"]]
    assert len(defined) == len(set(defined))
    used: set[str] = set()
    for query in queries(dashboard):
        undefined = references(query.expr) - set(defined)
        assert not undefined, f"{query.panel}: uses undefined variables {undefined}"
        used |= references(query.expr)
    for position, var in enumerate(dashboard["templating"]["list"]):
        refs = references(variable_query(var))
        earlier = set(defined[:position])
        assert refs <= earlier, f"variable {var['name']} uses {refs - earlier} before definition"
        used |= refs
    for link in dashboard["links"]:
        refs = references(link["title"] + link.get("url", ""))
        assert refs <= set(defined), f"link {link['title']} uses undefined {refs - set(defined)}"
        used |= refs
    assert used == set(defined), f"defined but unused: {set(defined) - used}"


def _query_variables(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """The Prometheus query variables (the Determined URL is a text box)."""
    return [v for v in dashboard["templating"]["list"] if v["type"] == "query"]


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=IDS)
def test_the_dashboard_links_back_to_the_determined_trial(path: Path) -> None:
    """Opened from a trial's link in Determined (otelprof/determined/links.py sets `trial`
    and `determined`), the dashboard links back to that trial's page of the Web UI."""
    dashboard = load(path)
    (link,) = [link for link in dashboard["links"] if link["type"] == "link"]
    assert link["url"] == "${determined}/det/trials/${trial}" and link["targetBlank"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["determined"]["type"] == "textbox"
    assert variables["trial"]["type"] == "query"
    assert "${trial}" in link["title"]


def test_datasources_have_fixed_uids_and_link_exemplars_and_traces_both_ways() -> None:
    sources = _datasources()
    assert set(sources) == {"otelprof-prometheus", "otelprof-tempo"}
    prometheus, tempo = sources["otelprof-prometheus"], sources["otelprof-tempo"]
    (link,) = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert link == {"name": "trace_id", "datasourceUid": "otelprof-tempo"}  # collector label
    to_metrics = tempo["jsonData"]["tracesToMetrics"]
    assert to_metrics["datasourceUid"] == "otelprof-prometheus"
    assert {t["key"]: t["value"] for t in to_metrics["tags"]} == {
        "service.name": "service_name",
        "host.name": "host_name",
        "otelprof.rank": "otelprof_rank",
    }
    for query in to_metrics["queries"]:
        # Grafana expands $VAR in provisioning files: its own variables must be $$-escaped.
        assert "$$__tags" in query["query"] and "$${__span.name}" in query["query"]


def test_dashboard_provider_reads_the_directory_compose_mounts_the_dashboards_in() -> None:
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    path = grafana_provisioning.dashboards_path(compose["services"]["grafana"]["environment"])
    assert path == "/var/lib/grafana/dashboards"
    mounts = compose["services"]["grafana"]["volumes"]
    for dashboard in DASHBOARD_FILES:
        assert f"./dashboards/{dashboard.name}:{path}/{dashboard.name}:ro" in mounts


# -- every query on real data ---------------------------------------------------------------


def _values_of_the_run(run: PipelineRun) -> dict[str, str]:
    return {
        "service": run.service_name,
        "run": run.run_id,
        "host": run.host_name,
        "rank": run.rank,
        "trial": RANK_ENV["DET_TRIAL_ID"],
        "gpu": "0",
    }


@pytest.mark.e2e
@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=IDS)
def test_every_variable_query_lists_the_runs_value(pipeline_run: PipelineRun, path: Path) -> None:
    values = _values_of_the_run(pipeline_run)
    for var in _query_variables(load(path)):
        query = substitute(variable_query(var), values)
        found = label_values(pipeline_run.prometheus, query, pipeline_run.started - 5)
        assert values[var["name"]] in found, (
            f"variable {var['name']} ({query}) lists {found}, not {values[var['name']]}"
        )


def _panel_queries() -> list[Any]:
    # panels that need collectives of several ranks are proven on a real multi-process job
    # in tests/test_distributed.py; this run is one process
    multi_rank = set(_build_module().MULTI_RANK_PANELS)
    return [q for path in DASHBOARD_FILES for q in queries(load(path)) if q.panel not in multi_rank]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "query", _panel_queries(), ids=lambda q: f"{q.dashboard}|{q.panel}|{q.ref}"
)
def test_every_panel_query_returns_data_from_the_run(pipeline_run: PipelineRun, query: Any) -> None:
    run = pipeline_run
    expr = substitute(query.expr, _values_of_the_run(run))
    series = run_range(run.prometheus, expr, run.started, run.finished + 3.0)
    points = sum(len(values) for _, _, values in series)
    assert points, (
        f"panel {query.panel!r} ({query.dashboard}, {query.ref}) returned no data: {expr}"
    )


@pytest.mark.e2e
def test_trace_to_metrics_links_answer_from_the_exact_timing_histograms(
    pipeline_run: PipelineRun,
) -> None:
    """Tempo's span -> metrics links, expanded as Grafana does for a `train_batch` span of
    the run, return data from otelprof's histograms (every range, even when traces are
    sampled), not from the collector's span_metrics (kept spans only)."""
    run = pipeline_run
    to_metrics = _datasources()["otelprof-tempo"]["jsonData"]["tracesToMetrics"]
    tags = ", ".join(
        f'{tag["value"]}="{value}"'
        for tag, value in zip(
            to_metrics["tags"], (run.service_name, run.host_name, run.rank), strict=True
        )
    )
    for query in to_metrics["queries"]:
        assert "otelprof_timing_duration_seconds" in query["query"], query["name"]
        expr = query["query"].replace("$$__tags", tags).replace("$${__span.name}", "train_batch")
        series = run_range(run.prometheus, expr, run.started, run.finished + 3.0)
        assert sum(len(values) for _, _, values in series), f"{query['name']}: no data: {expr}"


@pytest.mark.e2e
def test_step_spans_carry_what_tempo_search_needs(pipeline_run: PipelineRun) -> None:
    """TraceQL `{ name = "step" && resource.service.name = ... && resource.otelprof.rank = ... }`
    with `span.otelprof.step` to pick a step: all three must be on the exported spans."""
    requests = pipeline_run.tempo.trace_requests
    steps = set()
    for request in requests:
        for rs in request.resource_spans:
            resource = {kv.key: kv.value for kv in rs.resource.attributes}
            assert resource["service.name"].string_value == pipeline_run.service_name
            assert resource["otelprof.rank"].int_value == int(pipeline_run.rank)
            for ss in rs.scope_spans:
                for span in ss.spans:
                    if span.name == "step":
                        attrs = {kv.key: kv.value for kv in span.attributes}
                        steps.add(attrs["otelprof.step"].int_value)
    assert steps == set(range(pipeline_run.steps))


@pytest.mark.e2e
def test_render_script_draws_every_dashboard_from_the_run(
    pipeline_run: PipelineRun, tmp_path: Path
) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import render_dashboards
    finally:
        sys.path.remove(str(REPO / "scripts"))
    written = render_dashboards.render(pipeline_run, tmp_path)
    assert sorted(p.name for p in written) == ["otelprof-system.png", "otelprof-training.png"]
    for png in written:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert all(panel["points"] > 0 for panel in summary["panels"]), summary


# -- concurrent jobs, and a job that ends ---------------------------------------------------


def _shipped_metric_expiration_s() -> float:
    config = (REPO / "collector-config" / "otelcol.yaml").read_text()
    match = re.search(r"metric_expiration: \$\{env:OTELCOL_METRIC_EXPIRATION:-(\d+)s\}", config)
    assert match, "the prometheus exporter's metric_expiration is not OTELCOL_METRIC_EXPIRATION"
    return float(match[1])


def _panel_now(prometheus: Prometheus, title: str, service: str) -> dict[str, float]:
    """{run id: value} of a training panel's series at this instant, every variable All
    except the service (Grafana's All: `.+`/`.*`)."""
    [query] = [
        q for q in queries(load(DASHBOARD_DIR / "otelprof-training.json")) if q.panel == title
    ]
    expr = query.expr.replace("$__rate_interval", "4s").replace('"$service"', f'"{service}"')
    expr = re.sub(r'"\$(run|rank|host|trial)"', '".*"', expr)
    out: dict[str, float] = {}
    for sample in prometheus.query(expr):
        run_id = sample["metric"]["otelprof_run_id"]
        assert run_id not in out, f"{title}: two series for job {run_id}"
        out[run_id] = float(sample["value"][1])
    return out


@pytest.mark.e2e
def test_two_jobs_on_one_host_stay_apart_and_a_finished_one_leaves_the_panels(
    collector: Collector, prometheus: Prometheus, tmp_path: Path
) -> None:
    """Two jobs of one service on one host, both rank 0, differ only by their run id: each
    per-rank panel shows each job on its own, never their sum; once one job ends, its
    series leave the collector's endpoint after the shipped metric_expiration, Prometheus
    marks them stale and the panels show only the job still running."""
    service = f"jobs-{uuid.uuid4().hex[:8]}"
    expiration_s = _shipped_metric_expiration_s()
    jobs: dict[str, subprocess.Popen[bytes]] = {}
    stops = {run_id: tmp_path / f"stop-{run_id}" for run_id in ("job-a", "job-b")}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTELPROF_", "OTEL_"))}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    try:
        for run_id, stop in stops.items():
            jobs[run_id] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.live_job",
                    collector.otlp_endpoint,
                    service,
                    str(stop),
                ],
                cwd=tmp_path,
                env={**env, "OTELPROF_RUN_ID": run_id, "OTELPROF_DETACHED": "false"},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        gauge = "otelprof_train_throughput_samples_per_second"
        for run_id in stops:
            prometheus.wait_for_series(
                f'{gauge}{{service_name="{service}", otelprof_run_id="{run_id}"}}', timeout_s=120
            )
        time.sleep(6)  # several scrapes and rate() windows with both running

        # both running: one series per job in every per-rank panel, each the job's own value
        own = {
            s["metric"]["otelprof_run_id"]: float(s["value"][1])
            for s in prometheus.query(f'{gauge}{{service_name="{service}"}}')
        }
        samples = _panel_now(prometheus, "Samples per second", service)
        assert set(samples) == set(stops), samples
        for run_id, value in samples.items():
            assert value == pytest.approx(own[run_id], rel=0.05), (samples, own)
        steps = _panel_now(prometheus, "Steps per second per rank", service)
        assert set(steps) == set(stops) and all(v > 0 for v in steps.values()), steps
        mean_step = _panel_now(prometheus, "Mean step time per rank (stragglers)", service)
        assert set(mean_step) == set(stops), mean_step
        skew = _panel_now(prometheus, "Rank skew over time", service)
        assert skew == {"job-a": pytest.approx(1.0), "job-b": pytest.approx(1.0)}, skew

        # job A ends; B runs on
        stops["job-a"].touch()
        assert jobs["job-a"].wait(timeout=60) == 0, jobs["job-a"].stderr
        ended = time.time()

        per_rank = (
            "Samples per second",
            "Steps per second per rank",
            "Mean step time per rank (stragglers)",
        )

        def only_b_shown() -> bool:
            # rate() panels: their 4 s windows must also have passed A's last sample
            return all(set(_panel_now(prometheus, t, service)) == {"job-b"} for t in per_rank)

        wait_for(only_b_shown, timeout_s=expiration_s + 40, what="job-a to leave the panels")
        gone_after = time.time() - ended
        # exported once more at shutdown, served for metric_expiration, one scrape, one window
        assert gone_after <= expiration_s + 15, gone_after
        assert jobs["job-b"].poll() is None, "job-b must still be running"
        # the mechanism: the collector's endpoint no longer serves A's series (but the
        # span_metrics connector's, which it re-emits for its own 2 m expiry; no panel
        # reads them, and target_info, which they keep alive)
        served = [
            line
            for line in collector.scrape().splitlines()
            if 'otelprof_run_id="job-a"' in line
            and not line.startswith(("traces_span_metrics_", "target_info"))
        ]
        assert not served, served[:5]
    finally:
        for stop in stops.values():
            stop.touch()
        for job in jobs.values():
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait()
