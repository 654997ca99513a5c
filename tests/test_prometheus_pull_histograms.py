"""The Prometheus pull endpoint (`prometheus_port`) serves the timing histograms.

`otelprof.timing.duration` is aggregated in process, not through an SDK instrument, so the
SDK's Prometheus reader alone would never show it. These tests scrape the real endpoint over
HTTP and check it against what was recorded (every span kept), against the run's detached
files, against the real collector's `prometheus` exporter (same names and labels, so a
dashboard works against either source), and point a real Prometheus at it to run the
training dashboard's own `histogram_quantile(...)` queries.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

import otelprof
from otelprof._timings._sampling import BOUNDS
from otelprof.analysis.aggregates import parse_point
from tests.dashboard_queries import label_values, load, queries, substitute, variable_query
from tests.otlp_files import read_lines, read_spans
from tests.services import REPO, Collector, Prometheus, wait_for

HIST = "otelprof_timing_duration_seconds"
# Sleeps that land in different buckets (0.5 ms ... 8 ms), so bucket placement is checked.
SLEEPS = {"dataloader_next": 0.0005, "train_batch": 0.002, "forward": 0.008}
OPENMETRICS = {"Accept": "application/openmetrics-text; version=1.0.0"}


def _train(prof: Any, steps: int, slow_every: int = 4) -> None:
    for i in range(steps):
        with otelprof.timing("dataloader_next"):
            time.sleep(SLEEPS["dataloader_next"])
        with otelprof.timing("train_batch"):
            time.sleep(SLEEPS["train_batch"])
            if i % slow_every == 0:
                with otelprof.timing("forward"):
                    time.sleep(SLEEPS["forward"])
        otelprof.step()


def _scrape(port: int, headers: dict[str, str] | None = None) -> str:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0, headers=headers)
    assert response.status_code == 200, response.text
    return response.text


def _histograms(text: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(timing, phase) -> labels, cumulative buckets [(le, n)], sum, count of the scrape."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != HIST:
            continue
        assert family.type == "histogram"
        for sample in family.samples:
            labels = dict(sample.labels)
            le = labels.pop("le", None)
            key = (labels["otelprof_timing"], labels["otelprof_phase"])
            hist = out.setdefault(key, {"labels": labels, "buckets": []})
            if sample.name.endswith("_bucket"):
                hist["buckets"].append((float(le or "nan"), sample.value))
            elif sample.name.endswith("_sum"):
                hist["sum"] = sample.value
            elif sample.name.endswith("_count"):
                hist["count"] = sample.value
    return out


def _file_histograms(metrics_file: Path) -> dict[tuple[str, str], Any]:
    """The last (cumulative, final) histogram point per (timing, phase) in the run's file."""
    last: dict[tuple[str, str], Any] = {}
    for request in read_lines(metrics_file):
        for rm in request["resourceMetrics"]:
            for sm in rm.get("scopeMetrics", []):
                for metric in sm.get("metrics", []):
                    if metric["name"] != "otelprof.timing.duration":
                        continue
                    for dp in metric["histogram"]["dataPoints"]:
                        attrs = {a["key"]: a["value"]["stringValue"] for a in dp["attributes"]}
                        rec = parse_point(dp, attrs, None)
                        key = (rec.timing, rec.phase)
                        if key not in last or rec.time_ns >= last[key].time_ns:
                            last[key] = rec
    return last


def _cumulative(counts: list[int] | tuple[int, ...]) -> list[int]:
    out, running = [], 0
    for n in counts:
        running += n
        out.append(running)
    return out


def test_pull_endpoint_serves_every_recorded_range_as_the_run_files_histograms(
    tmp_path: Path,
) -> None:
    steps = 24
    prof = otelprof.instrument(
        output_dir=str(tmp_path), run_id="pull", prometheus_port=0, trace_budget=float("inf"),
        host_metrics=False, process_metrics=False, interval=0.5,
    )  # fmt: skip
    try:
        assert prof.prometheus_port
        port = prof.prometheus_port
        _train(prof, steps)
        # the span builder aggregates off the training thread: wait until it caught up
        scraped = wait_for(
            lambda: (
                h
                if (h := _histograms(_scrape(port))).get(("step", "train"), {}).get("count")
                == steps
                and h.get(("forward", "train"), {}).get("count") == steps / 4
                else None
            ),
            timeout_s=20,
            what="the pull endpoint to show every step",
        )
        exposition = _scrape(port, OPENMETRICS)
    finally:
        prof.shutdown()

    # what was recorded: every span kept (trace_budget=inf), durations from the trace file
    spans = read_spans(prof.files["traces"])
    for name in SLEEPS:
        durations = [s.duration_s for s in spans if s.name == name]
        hist = scraped[(name, "train")]
        assert hist["count"] == len(durations) == (steps / 4 if name == "forward" else steps)
        assert hist["sum"] == pytest.approx(math.fsum(durations), rel=1e-9)
        expected = [0] * (len(BOUNDS) + 1)
        for d in durations:
            expected[bisect.bisect_left(BOUNDS, d)] += 1
        assert [n for _, n in hist["buckets"]] == _cumulative(expected), name

    # every histogram: the `le` bounds are BOUNDS (seconds) then +Inf, cumulative, +Inf = count
    for key, hist in scraped.items():
        les = [le for le, _ in hist["buckets"]]
        assert les[:-1] == list(BOUNDS) and math.isinf(les[-1]), key
        counts = [n for _, n in hist["buckets"]]
        assert counts == sorted(counts) and counts[-1] == hist["count"], key
        assert hist["labels"]["service_name"] == "otelprof"
        assert hist["labels"]["otelprof_rank"] == "0"
        assert "telemetry_sdk_language" not in hist["labels"]

    # the same histograms as the detached file's final export of this run, exactly
    from_file = _file_histograms(prof.files["metrics"])
    assert set(from_file) == set(scraped)
    for key, rec in from_file.items():
        hist = scraped[key]
        assert hist["count"] == rec.count, key
        assert hist["sum"] == rec.sum, key
        assert [n for _, n in hist["buckets"]] == _cumulative(rec.bucket_counts), key
        assert [le for le, _ in hist["buckets"]][:-1] == list(rec.bounds), key

    # OpenMetrics (what Prometheus asks for) carries an exemplar pointing at a kept trace
    trace_ids = {s.trace_id for s in spans}
    exemplars = [
        sample.exemplar
        for family in openmetrics_families(exposition)
        if family.name == HIST
        for sample in family.samples
        if sample.exemplar is not None
    ]
    assert exemplars, "no exemplar on the timing histograms"
    assert all(e.labels["trace_id"] in trace_ids for e in exemplars)


def test_pull_endpoint_histograms_have_the_collectors_names_and_labels(
    collector_factory: Callable[..., Collector],
) -> None:
    collector = collector_factory()
    steps = 8
    with otelprof.instrument(
        endpoint=collector.otlp_endpoint, detached=False, prometheus_port=0, interval=0.3,
        host_metrics=False, process_metrics=False,
    ) as prof:  # fmt: skip
        assert prof.prometheus_port
        port = prof.prometheus_port
        _train(prof, steps)

        def both() -> tuple[dict[Any, Any], dict[Any, Any]] | None:
            ours, theirs = _histograms(_scrape(port)), _histograms(collector.scrape())
            done = all(h.get(("step", "train"), {}).get("count") == steps for h in (ours, theirs))
            return (ours, theirs) if done else None

        ours, theirs = wait_for(both, timeout_s=30, what="both endpoints to show every step")

    assert set(ours) == set(theirs)
    for key, hist in ours.items():
        collector_labels = dict(theirs[key]["labels"])
        # the collector's exporter sets job/instance itself; the scraping Prometheus sets
        # them for the pull endpoint
        collector_labels.pop("job")
        collector_labels.pop("instance")
        assert hist["labels"] == collector_labels, key
        assert hist["buckets"] == theirs[key]["buckets"], key
        assert hist["count"] == theirs[key]["count"]


def test_real_prometheus_scraping_the_endpoint_answers_the_dashboards_quantile_queries(
    tmp_path: Path,
    prometheus_factory: Callable[..., Prometheus],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a Determined trial's resource, so the dashboard's trial variable has a value
    monkeypatch.setenv("DET_TRIAL_ID", "42")
    monkeypatch.setenv("DET_EXPERIMENT_ID", "17")
    dashboard = load(REPO / "dashboards" / "otelprof-training.json")
    quantiles = [q for q in queries(dashboard) if "histogram_quantile(" in q.expr]
    assert quantiles, "the training dashboard has no histogram_quantile panels"
    started = time.time()
    with otelprof.instrument(
        service_name="pullrun", detached=False, prometheus_port=0,
        host_metrics=False, process_metrics=False,
    ) as prof:  # fmt: skip
        assert prof.prometheus_port
        # the shipped config's job, retargeted at the pull endpoint
        prom = prometheus_factory(scrape_targets={"otelcol": f"127.0.0.1:{prof.prometheus_port}"})
        wanted = {"service": "pullrun", "trial": "42", "rank": "0"}
        values: dict[str, str] = {}
        answers: dict[str, float] = {}
        deadline = time.monotonic() + 300  # a generous bound: scrapes every second
        while time.monotonic() < deadline:
            _train(prof, 20, slow_every=2)  # keeps the counters moving for rate()
            for var in dashboard["templating"]["list"]:
                if var["type"] != "query":  # the Determined URL text box
                    continue
                try:  # a variable's query names the ones before it
                    query = substitute(variable_query(var), values)
                except KeyError:
                    break
                found = label_values(prom, query, started - 5)
                if found:
                    values[var["name"]] = wanted.get(var["name"], found[0])
            if {"service", "host", "rank", "trial"} <= set(values):
                for q in quantiles:
                    result = prom.values(substitute(q.expr, values))
                    if result and all(math.isfinite(v) for v in result):
                        answers[f"{q.panel}|{q.ref}"] = max(result)
            if len(answers) == len(quantiles):
                break
        seen = _histograms(_scrape(prof.prometheus_port))
    assert {"service", "host", "rank", "trial"} <= set(values), values
    missing = [f"{q.panel}|{q.ref}" for q in quantiles if f"{q.panel}|{q.ref}" not in answers]
    assert not missing, f"no finite answer from {missing}; got {answers}"
    # every quantile lies within the buckets that saw the ranges (from the 0.5 ms sleep's
    # bucket up to the bucket of the slowest range: on a busy machine a step between two
    # rounds of training can take seconds)
    highest = max(
        le
        for hist in seen.values()
        for (le, n), (_, below) in zip(hist["buckets"], [(0.0, 0), *hist["buckets"]], strict=False)
        if n > below
    )
    for name, value in answers.items():
        assert 0.0002 < value <= highest, (name, value, highest)


def test_scrapes_during_training_are_each_consistent_and_never_go_back(tmp_path: Path) -> None:
    import threading

    with otelprof.instrument(
        detached=False, prometheus_port=0, host_metrics=False, process_metrics=False
    ) as prof:
        assert prof.prometheus_port
        port = prof.prometheus_port
        scrapes: list[dict[tuple[str, str], dict[str, Any]]] = []
        stop = threading.Event()

        def scrape_loop() -> None:
            while not stop.is_set():
                scrapes.append(_histograms(_scrape(port)))

        def scrapes_seeing_training() -> int:
            return sum(("train_batch", "train") in scrape for scrape in list(scrapes))

        scraper = threading.Thread(target=scrape_loop)
        scraper.start()
        try:
            # at least 40 rounds, and until 5 scrapes saw the training, however few scrapes
            # a busy machine fits into 40 rounds (a generous bound)
            deadline = time.monotonic() + 300
            rounds = 0
            while rounds < 40 or (scrapes_seeing_training() < 5 and time.monotonic() < deadline):
                for _ in range(25):
                    with otelprof.timing("train_batch"):
                        pass
                    otelprof.step()
                time.sleep(0.01)
                rounds += 1
        finally:
            stop.set()
            scraper.join(timeout=60)
    assert scrapes_seeing_training() >= 5, "too few scrapes to check"
    previous: dict[tuple[str, str], float] = {}
    for scrape in scrapes:
        for key, hist in scrape.items():
            counts = [n for _, n in hist["buckets"]]
            assert counts == sorted(counts), key
            assert counts[-1] == hist["count"], key
            assert hist["count"] >= previous.get(key, 0), key
            previous[key] = hist["count"]
    assert previous[("train_batch", "train")] > 0


def test_a_failing_histogram_read_leaves_the_rest_of_the_scrape_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with otelprof.instrument(
        detached=False, prometheus_port=0, host_metrics=True, process_metrics=False, interval=0.2
    ) as prof:
        assert prof.prometheus_port
        aggregates = prof._timings.aggregates

        def broken() -> list[Any]:
            raise RuntimeError("snapshot exploded")

        aggregates.snapshot = broken
        with otelprof.timing("train_batch"):
            pass
        otelprof.step()
        time.sleep(0.3)
        body = _scrape(prof.prometheus_port)
        _scrape(prof.prometheus_port)
    assert "system_cpu_utilization{" in body
    assert HIST not in body
    assert caplog.text.count("timing histograms left out of a scrape") == 1
