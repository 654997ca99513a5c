"""Attached mode end to end: training → OTLP gRPC → collector → Prometheus / trace exporters.

One real run (tests/pipeline_run.py, session fixture `pipeline_run`): the built collector
with collector-config/otelcol.yaml, Debian's Prometheus scraping it, and a CPU PyTorch loop
under `otelprof.instrument(endpoint=...)`. GPU gauges come from otelprof's own GPU sampler
over a scripted NVML driver (no GPU here) and are labelled `otelprof_synthetic="fake-nvml"`.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.pipeline_run import STEP_SPAN, PipelineRun
from tests.services import Collector, Prometheus
from tests.spec import DETERMINED_TIMINGS

pytestmark = pytest.mark.e2e


def _selector(run: PipelineRun, **extra: str) -> str:
    labels = {"service_name": run.service_name, **extra}
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _samples(
    prom: Prometheus, query: str, at: float | None = None
) -> list[tuple[dict[str, str], float]]:
    return [(s["metric"], float(s["value"][1])) for s in prom.query(query, at=at)]


def _run_samples(run: PipelineRun, query: str) -> list[tuple[dict[str, str], float]]:
    """The query at a time Prometheus held the whole run: its series stay until the
    collector expires them (5 min), however long the suite runs before this test asks."""
    return _samples(run.prometheus, query, at=run.complete_at)


# -- hardware gauges ----------------------------------------------------------------------

# Prometheus name, the label that splits it, its values, and the plausible range.
HOST_METRICS = [
    ("system_cpu_utilization_ratio", None, (), (0.0, 1.0)),
    ("system_memory_linux_available_bytes", None, (), (1.0, float(psutil.virtual_memory().total))),
    (
        "system_network_throughput_bytes_per_second",
        "network_io_direction",
        ("transmit", "receive"),
        (0.0, 1e11),
    ),
    ("system_disk_iops_per_second", "disk_io_direction", ("read", "write"), (0.0, 1e7)),
    (
        "system_disk_throughput_bytes_per_second",
        "disk_io_direction",
        ("read", "write"),
        (0.0, 1e11),
    ),
]


@pytest.mark.parametrize(("name", "split", "values", "bounds"), HOST_METRICS)
def test_seed_host_metric_reaches_prometheus_with_plausible_values_and_host_rank_labels(
    pipeline_run: PipelineRun,
    name: str,
    split: str | None,
    values: tuple[str, ...],
    bounds: tuple[float, float],
) -> None:
    run = pipeline_run
    window = f"[{int(time.time() - run.started) + 5}s]"
    query = f"max_over_time({name}{_selector(run)}{window})"
    samples = _samples(run.prometheus, query)
    assert samples, f"no {name} series for {run.service_name} in Prometheus"
    for labels, value in samples:
        assert labels["host_name"] == run.host_name
        assert labels["otelprof_rank"] == "2"
        assert labels["otelprof_world_size"] == "4"
        assert labels.get("job") == run.service_name  # honor_labels kept the exporter's job
        assert bounds[0] <= value <= bounds[1], f"{name}{labels} = {value} outside {bounds}"
    if split:
        assert {labels[split] for labels, _ in samples} == set(values)


def test_cpu_and_network_gauges_move_during_training(pipeline_run: PipelineRun) -> None:
    run = pipeline_run
    window = f"[{int(time.time() - run.started) + 5}s]"
    cpu = _samples(
        run.prometheus, f"max_over_time(system_cpu_utilization_ratio{_selector(run)}{window})"
    )
    assert cpu and cpu[0][1] > 0.0, "a training CPU never busy is not plausible"
    # OTLP exports to the collector cross loopback, which the network gauge includes.
    sent = _samples(
        run.prometheus,
        "max_over_time(system_network_throughput_bytes_per_second"
        f"{_selector(run, network_io_direction='transmit')}{window})",
    )
    assert sent and sent[0][1] > 0.0
    points = run.prometheus.query_range(
        f"system_cpu_utilization_ratio{_selector(run)}", run.started, run.finished, 0.5
    )
    assert points and len(points[0]["values"]) >= 3, "expected a time series, not one point"


GPU_METRICS = [
    ("hw_gpu_utilization_ratio", (0.35, 0.95)),
    ("hw_gpu_memory_free_bytes", (1.0, 80 * 2**30)),
    ("hw_gpu_memory_usage_bytes", (1.0, 80 * 2**30)),
    ("hw_gpu_memory_limit_bytes", (80 * 2**30, 80 * 2**30)),
    ("hw_power_watts", (150.0, 400.0)),
    ("hw_temperature_celsius", (45.0, 70.0)),
]


@pytest.mark.parametrize(("name", "bounds"), GPU_METRICS)
def test_synthetic_gpu_gauges_reach_prometheus_per_gpu_with_host_rank_labels(
    pipeline_run: PipelineRun, name: str, bounds: tuple[float, float]
) -> None:
    """SYNTHETIC: otelprof's GPU sampler over a scripted NVML driver (no GPU on this machine)."""
    run = pipeline_run
    samples = _run_samples(run, f"{name}{_selector(run, otelprof_synthetic='fake-nvml')}")
    assert {labels.get("hw_id") for labels, _ in samples} == set(run.gpu_uuids), name
    assert {labels.get("gpu_index") for labels, _ in samples} == {"0", "1"}
    for labels, value in samples:
        assert labels["host_name"] == run.host_name
        assert labels["otelprof_rank"] == "2"
        assert bounds[0] <= value <= bounds[1], f"{name}{labels} = {value} outside {bounds}"


def test_synthetic_gpu_free_and_used_memory_add_up_to_the_limit(pipeline_run: PipelineRun) -> None:
    """SYNTHETIC (fake NVML): the three memory gauges of one collection agree."""
    run = pipeline_run
    sel = _selector(run, otelprof_synthetic="fake-nvml")
    diff = _run_samples(
        run,
        f"hw_gpu_memory_limit_bytes{sel} - hw_gpu_memory_free_bytes{sel}"
        f" - hw_gpu_memory_usage_bytes{sel}",
    )
    assert len(diff) == 2 and all(value == 0 for _, value in diff)


# -- timing histograms (span_metrics connector) -------------------------------------------


@pytest.mark.parametrize("span_name", [*DETERMINED_TIMINGS, STEP_SPAN])
def test_every_timing_has_a_duration_histogram_counting_each_step_once(
    pipeline_run: PipelineRun, span_name: str
) -> None:
    run = pipeline_run
    sel = _selector(run, span_name=span_name)
    calls = _run_samples(run, f"traces_span_metrics_calls_total{sel}")
    count = _run_samples(run, f"traces_span_metrics_duration_seconds_count{sel}")
    inf = _run_samples(run, f'traces_span_metrics_duration_seconds_bucket{sel[:-1]},le="+Inf"}}')
    total = _run_samples(run, f"traces_span_metrics_duration_seconds_sum{sel}")
    assert len(calls) == len(count) == len(inf) == len(total) == 1, "one series per timing"
    assert calls[0][1] == count[0][1] == inf[0][1] == run.steps
    labels = count[0][0]
    assert labels["host_name"] == run.host_name
    assert labels["otelprof_rank"] == "2"
    assert 0.0 < total[0][1] < 60.0 * run.steps
    p50 = _run_samples(
        run,
        f"histogram_quantile(0.5, sum by (le) (traces_span_metrics_duration_seconds_bucket{sel}))",
    )
    assert p50 and 0.0 < p50[0][1] <= 60.0, f"median of {span_name}: {p50}"


def test_step_time_covers_the_sum_of_its_phases(pipeline_run: PipelineRun) -> None:
    run = pipeline_run
    names = "|".join(DETERMINED_TIMINGS)
    phases = _run_samples(
        run,
        f'sum(traces_span_metrics_duration_seconds_sum{{service_name="{run.service_name}",'
        f'span_name=~"{names}"}})',
    )
    step = _run_samples(
        run,
        f"sum(traces_span_metrics_duration_seconds_sum{_selector(run, span_name=STEP_SPAN)})",
    )
    assert phases and step
    assert 0.0 < phases[0][1] <= step[0][1] * 1.001


def test_timing_histograms_carry_exemplars_of_exported_traces(pipeline_run: PipelineRun) -> None:
    run = pipeline_run
    exemplars = run.prometheus.exemplars(
        f"traces_span_metrics_duration_seconds_bucket{_selector(run)}",
        run.started - 5,
        time.time(),
    )
    found = [e for series in exemplars for e in series["exemplars"]]
    assert found, "no exemplars stored (enable_open_metrics + exemplar-storage)"
    trace_ids = {span.trace_id.hex() for span in run.tempo.spans()}
    linked = [e for e in found if e["labels"].get("trace_id") in trace_ids]
    assert linked, "exemplar trace ids do not match any exported trace"
    assert all(len(e["labels"].get("span_id", "")) == 16 for e in linked)


# -- traces ---------------------------------------------------------------------------------


def _attr(attributes: Any, key: str) -> Any:
    for kv in attributes:
        if kv.key == key:
            return getattr(kv.value, kv.value.WhichOneof("value"))
    return None


def _check_step_structure(spans: list[dict[str, Any]], steps: int) -> None:
    """Each step span is a root with otelprof.step; each timing is its child in its trace."""
    by_id = {(s["trace_id"], s["span_id"]): s for s in spans}
    step_spans = [s for s in spans if s["name"] == STEP_SPAN]
    assert sorted(s["step"] for s in step_spans) == list(range(steps))
    assert all(not s["parent"] for s in step_spans)
    counts = Counter(s["name"] for s in spans)
    for name in DETERMINED_TIMINGS:
        assert counts[name] == steps, f"{name}: {counts[name]} spans for {steps} steps"
    parents_per_step: dict[int, set[str]] = defaultdict(set)
    for span in spans:
        if span["name"] not in DETERMINED_TIMINGS:
            continue
        parent = by_id.get((span["trace_id"], span["parent"]))
        assert parent is not None, f"{span['name']} of step {span['step']} lost its parent"
        assert parent["name"] == STEP_SPAN
        assert parent["step"] == span["step"]
        assert parent["start"] <= span["start"] and span["end"] <= parent["end"]
        parents_per_step[span["step"]].add(span["name"])
    assert all(names == set(DETERMINED_TIMINGS) for names in parents_per_step.values())


def test_traces_reach_the_tempo_exporter_with_step_parent_structure(
    pipeline_run: PipelineRun,
) -> None:
    run = pipeline_run
    spans = [
        {
            "name": s.name,
            "trace_id": s.trace_id.hex(),
            "span_id": s.span_id.hex(),
            "parent": s.parent_span_id.hex(),
            "step": _attr(s.attributes, "otelprof.step"),
            "start": s.start_time_unix_nano,
            "end": s.end_time_unix_nano,
        }
        for s in run.tempo.spans()
    ]
    _check_step_structure(spans, run.steps)
    resources = [
        {kv.key: _attr([kv], kv.key) for kv in rs.resource.attributes}
        for request in run.tempo.trace_requests
        for rs in request.resource_spans
    ]
    assert all(r["service.name"] == run.service_name for r in resources)
    assert all(r["otelprof.rank"] == 2 and "host.name" in r for r in resources)


def _file_spans(path: Path) -> list[dict[str, Any]]:
    spans = []
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    attrs = {a["key"]: a["value"] for a in s.get("attributes", [])}
                    step = attrs.get("otelprof.step", {}).get("intValue")
                    spans.append(
                        {
                            "name": s["name"],
                            "trace_id": s["traceId"],
                            "span_id": s["spanId"],
                            "parent": s.get("parentSpanId", ""),
                            "step": None if step is None else int(step),
                            "start": int(s["startTimeUnixNano"]),
                            "end": int(s["endTimeUnixNano"]),
                        }
                    )
    return spans


def test_traces_reach_the_file_exporter_as_otlp_json_lines_with_step_structure(
    pipeline_run: PipelineRun,
) -> None:
    _check_step_structure(_file_spans(pipeline_run.traces_file), pipeline_run.steps)


# -- completeness ------------------------------------------------------------------------


def test_nothing_was_dropped_on_the_way(pipeline_run: PipelineRun) -> None:
    run = pipeline_run
    assert run.training.stats["dropped_total"] == 0, run.training.stats
    prom = run.prometheus
    # the collector's own metrics (job otelcol-self); v0.158 names carry no _total suffix
    refused = _samples(prom, '{__name__=~"otelcol_receiver_(refused|failed)_.*"}')
    assert refused, "the collector's own receiver metrics are missing"
    assert all(value == 0 for _, value in refused), refused
    failed = _samples(prom, '{__name__=~"otelcol_exporter_send_failed_.*"}')
    assert all(value == 0 for _, value in failed), failed
    accepted = _samples(prom, 'sum(otelcol_receiver_accepted_spans{receiver="otlp"})')
    assert accepted and accepted[0][1] >= run.steps * (len(DETERMINED_TIMINGS) + 1)


# -- the remote-write path ---------------------------------------------------------------


def test_remote_write_exporter_pushes_gauges_and_timings_into_prometheus(
    collector_factory: Any, prometheus_factory: Any
) -> None:
    """prometheus_remote_write → Prometheus 2.42's remote-write receiver, no scraping."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.metrics import Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    prom: Prometheus = prometheus_factory(scrape_targets={})
    collector: Collector = collector_factory(
        metrics_exporters=["prometheus_remote_write"],
        extra_env={"OTELCOL_REMOTE_WRITE_URL": prom.remote_write_url},
    )
    resource = Resource.create(
        {"service.name": "rw-test", "host.name": "node-7", "otelprof.rank": 5}
    )
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=collector.otlp_endpoint, insecure=True))
    )
    meter_provider = MeterProvider(
        resource=resource,
        metric_readers=[
            PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=collector.otlp_endpoint, insecure=True),
                export_interval_millis=500,
            )
        ],
    )
    meter_provider.get_meter("otelprof").create_observable_gauge(
        "system.cpu.utilization", [lambda _: [Observation(0.25)]], unit="1"
    )
    tracer = tracer_provider.get_tracer("otelprof")
    for step in range(5):
        with (
            tracer.start_as_current_span(STEP_SPAN, attributes={"otelprof.step": step}),
            tracer.start_as_current_span("train_batch"),
        ):
            time.sleep(0.002)
    tracer_provider.shutdown()
    meter_provider.shutdown()

    gauge = prom.wait_for_series('system_cpu_utilization_ratio{service_name="rw-test"}')
    assert gauge[0]["metric"]["host_name"] == "node-7"
    assert gauge[0]["metric"]["otelprof_rank"] == "5"
    assert float(gauge[0]["value"][1]) == 0.25
    calls = prom.wait_for_series(
        'traces_span_metrics_calls_total{service_name="rw-test",span_name="train_batch"} == 5'
    )
    assert calls[0]["metric"]["host_name"] == "node-7"
    prom.wait_for_series('target_info{job="rw-test"}')
