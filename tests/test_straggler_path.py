"""The collector's straggler path: a small pipeline and endpoint for the straggler panel.

collector-config/otelcol.yaml runs a second metrics pipeline (metrics/straggler) that keeps
only the per-rank collective waiting counter and serves it on its own endpoint
(prometheus/straggler, Prometheus job otelcol-straggler), so that the dashboards' straggler
panel names the slow rank from a few series per rank, whatever the full endpoint's size
(hundreds of ranks x ~780 series take longer to render than a scrape timeout). These tests
send what otelprof's distributed hooks send (the observable counter
otelprof.collective.duration per collective, plus other metrics that must not take the
path) from several synthetic ranks into the real collector and real Prometheus.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from otelprof._schema import (
    ATTR_COLLECTIVE,
    ATTR_LOCAL_RANK,
    ATTR_PHASE,
    ATTR_RANK,
    ATTR_TIMING,
    COLLECTIVE_DURATION,
    DDP_COLLECTIVE,
    TIMING_HISTOGRAM,
)
from tests.dashboard_queries import panel_expr
from tests.services import Collector, Prometheus, wait_for

pytestmark = pytest.mark.e2e

RANKS = 4
SLOW_RANK = 2  # waits least in collectives: the others wait for it
OPS = (DDP_COLLECTIVE, "all_reduce")
SMALL_NAME = "straggler_otelprof_collective_duration_seconds_total"
SMALL_NAMES = {SMALL_NAME, "straggler_target_info"}  # and the exporter's one per process
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", re.MULTILINE)


@contextmanager
def _ranks(endpoint: str, service: str, run_id: str) -> Iterator[None]:
    """RANKS synthetic processes' metrics (two nodes of two ranks), exported every 0.5 s."""
    began = time.monotonic()
    providers = []
    for rank in range(RANKS):
        resource = Resource.create(
            {
                "service.name": service,
                "host.name": f"node{rank // 2}",
                "otelprof.run_id": run_id,
                ATTR_RANK: rank,
                ATTR_LOCAL_RANK: rank % 2,
            }
        )
        exporter = OTLPMetricExporter(endpoint=endpoint, insecure=True)
        reader = PeriodicExportingMetricReader(exporter, export_interval_millis=500)
        provider = MeterProvider(metric_readers=[reader], resource=resource)
        meter = provider.get_meter("otelprof")
        share = 0.2 if rank == SLOW_RANK else 0.8 + 0.02 * rank  # of each second, waiting

        def observe(_options: CallbackOptions, share: float = share) -> Iterable[Observation]:
            waited = share * (time.monotonic() - began)
            for op in OPS:
                yield Observation(waited / len(OPS), {ATTR_COLLECTIVE: op})

        meter.create_observable_counter(COLLECTIVE_DURATION, callbacks=[observe], unit="s")
        # what must not take the straggler path: a timing histogram and a gauge
        step = meter.create_histogram(TIMING_HISTOGRAM, unit="s")
        step.record(0.01, {ATTR_TIMING: "step", ATTR_PHASE: "train"})
        meter.create_observable_gauge(
            "system.cpu.utilization", callbacks=[lambda _o: [Observation(0.5)]], unit="1"
        )
        providers.append(provider)
    try:
        yield
    finally:
        for provider in providers:
            provider.shutdown(timeout_millis=5_000)


def _names(metrics_text: str) -> set[str]:
    return set(SAMPLE.findall(metrics_text))


def _names_the_straggler(prometheus: Prometheus, service: str) -> dict[str, Any]:
    """Wait until the straggler panel's rows cover every rank and its top row is one rank;
    return that row's labels."""
    from dashboards.build import STRAGGLER_PANEL

    expr = panel_expr(STRAGGLER_PANEL, service)

    def top() -> dict[str, Any] | None:
        rows = prometheus.query(expr)
        if len(rows) < RANKS:
            return None
        best = max(rows, key=lambda row: float(row["value"][1]))
        return dict(best["metric"]) if best["metric"]["otelprof_rank"] == str(SLOW_RANK) else None

    return dict(wait_for(top, timeout_s=90, what=f"the straggler panel to name rank {SLOW_RANK}"))


def test_the_straggler_panel_names_the_slow_rank_from_the_small_endpoint_alone(
    collector: Collector, prometheus_factory: Callable[..., Prometheus]
) -> None:
    service = f"strag-{uuid.uuid4().hex[:8]}"
    # one Prometheus scrapes only the straggler path, one only the full endpoint (as a
    # Prometheus without the straggler job would)
    small_only = prometheus_factory(
        scrape_targets={"otelcol-straggler": collector.straggler_target}
    )
    full_only = prometheus_factory(scrape_targets={"otelcol": collector.prometheus_target})
    with _ranks(collector.otlp_endpoint, service, run_id=service):
        row = _names_the_straggler(small_only, service)
        assert row["host_name"] == f"node{SLOW_RANK // 2}", row
        # the small endpoint serves the collective counter of every rank, and nothing else
        text = collector.scrape_straggler()
        assert SMALL_NAME in _names(text) <= SMALL_NAMES, sorted(_names(text))
        ranks_ops = set(
            re.findall(rf'^{SMALL_NAME}{{[^}}]*otelprof_collective="(\w+)"[^}}]*'
                       rf'otelprof_rank="(\d+)"', text, re.MULTILINE)
        )  # fmt: skip
        assert ranks_ops == {(op, str(r)) for op in OPS for r in range(RANKS)}, text[:2000]
        # while the full endpoint keeps everything, the counter included (nothing lost)
        full = _names(collector.scrape())
        assert {
            "otelprof_collective_duration_seconds_total",
            "otelprof_timing_duration_seconds_bucket",
            "system_cpu_utilization_ratio",
        } <= full, sorted(full)
        assert not any(name.startswith("straggler_") for name in full)
        # the Prometheus scraping only the small endpoint holds nothing else of the job
        held = {s["__name__"] for s in small_only.series(f'{{service_name="{service}"}}')}
        assert SMALL_NAME in held <= SMALL_NAMES, held
        # the same panel falls back to the full endpoint's copy where the path is not scraped
        row = _names_the_straggler(full_only, service)
        assert row["host_name"] == f"node{SLOW_RANK // 2}", row


def test_the_straggler_path_pushed_with_remote_write_names_the_slow_rank(
    collector_factory: Callable[..., Collector], prometheus_factory: Callable[..., Prometheus]
) -> None:
    service = f"strag-rw-{uuid.uuid4().hex[:8]}"
    collector = collector_factory(
        metrics_exporters=["prometheus_remote_write"],
        straggler_exporters=["prometheus_remote_write/straggler"],
        wait=False,
    )
    prometheus = prometheus_factory(scrape_targets={})
    collector.env["OTELCOL_REMOTE_WRITE_URL"] = prometheus.remote_write_url
    collector.start()
    with _ranks(collector.otlp_endpoint, service, run_id=service):
        row = _names_the_straggler(prometheus, service)
        assert row["host_name"] == f"node{SLOW_RANK // 2}", row
        held = {s["__name__"] for s in prometheus.series(f'{{service_name="{service}"}}')}
        # both pushes arrived, each copy under its own name
        assert {SMALL_NAME, "otelprof_collective_duration_seconds_total"} <= held, held
