"""The timing histograms (`otelprof.timing.duration`) on the Prometheus pull endpoint.

Why: they are aggregated in process, not through an SDK instrument, so the SDK's
PrometheusMetricReader never sees them. This prometheus_client collector, on the endpoint's
own registry, reads a consistent snapshot at every scrape and exposes it with the names and
labels the collector's `prometheus` exporter gives the same OTLP histogram
(collector-config/otelcol.yaml), so the dashboards' queries work against either source.
`job`/`instance` are left to the scraping Prometheus.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.samples import Exemplar
from prometheus_client.utils import floatToGoString

from otelprof._schema import TIMING_HISTOGRAM_PROMETHEUS as PROM_NAME
from otelprof._schema import TIMINGS_SCOPE as SCOPE_NAME
from otelprof._timings._sampling import BOUNDS
from otelprof.export._aggregates import DESCRIPTION

_log = logging.getLogger("otelprof.export")

_LE = [floatToGoString(bound) for bound in BOUNDS] + ["+Inf"]
_INVALID = re.compile(r"[^a-zA-Z0-9_]")
DROPPED_RESOURCE_KEYS = frozenset(
    {
        "telemetry.sdk.name",
        "telemetry.sdk.language",
        "telemetry.sdk.version",
        "telemetry.auto.version",
    }
)
"""What collector-config/otelcol.yaml's `resource` processor deletes before its exporters."""


def label_name(key: str) -> str:
    """An OTel attribute key as a Prometheus label name, as the collector's translator does
    (invalid characters to `_`, a leading digit gets `key_`, a leading `_` gets `key`)."""
    name = _INVALID.sub("_", key)
    if name[:1].isdigit():
        name = "key_" + name
    elif name.startswith("_") and not name.startswith("__"):
        name = "key" + name
    return name


def _label_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_label_value(v) for v in value) + "]"
    return str(value)


class TimingHistogramCollector:
    """Yields `otelprof_timing_duration_seconds` from a live `Aggregates` at each scrape."""

    def __init__(
        self, aggregates: Any, resource_attributes: Mapping[str, Any], version: str
    ) -> None:
        self._aggregates = aggregates
        labels = {
            label_name(str(key)): _label_value(value)
            for key, value in resource_attributes.items()
            if key not in DROPPED_RESOURCE_KEYS
        }
        labels.update(
            otel_scope_name=SCOPE_NAME, otel_scope_schema_url="", otel_scope_version=version
        )
        self._base = labels
        self._failed = False

    def describe(self) -> list[Metric]:
        """Nothing at registration: keeps `register()` from calling `collect()` early."""
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            family = self._family()
        except Exception as error:  # a scrape must never take the endpoint down
            if not self._failed:
                self._failed = True
                _log.warning("otelprof: timing histograms left out of a scrape: %r", error)
            return
        if family is not None:
            yield family

    def _family(self) -> HistogramMetricFamily | None:
        family: HistogramMetricFamily | None = None
        for name, phase, hist in self._aggregates.snapshot():
            if not hist.count:
                continue
            if family is None:
                labels = [*self._base, "otelprof_timing", "otelprof_phase"]
                family = HistogramMetricFamily(PROM_NAME, DESCRIPTION, labels=labels)
            exemplar_bucket, exemplar = _exemplar(hist.exemplar)
            buckets: list[Any] = list(zip(_LE, itertools.accumulate(hist.buckets), strict=True))
            if exemplar is not None:
                buckets[exemplar_bucket] += (exemplar,)
            # _count is the +Inf bucket, so a scrape racing the builder's update of one
            # histogram still exposes a self-consistent one (the next scrape catches up).
            family.add_metric([*self._base.values(), name, phase], buckets, hist.sum)
        return family


def _exemplar(raw: tuple[float, int, int, int] | None) -> tuple[int, Exemplar | None]:
    """(bucket index, exemplar) for the kept trace a histogram points at, as the collector
    exposes it (OpenMetrics only): labels trace_id/span_id in hex, time in seconds."""
    if raw is None:
        return -1, None
    value, at_ns, trace_id, span_id = raw
    labels = {"trace_id": format(trace_id, "032x"), "span_id": format(span_id, "016x")}
    return bisect.bisect_left(BOUNDS, value), Exemplar(labels, value, at_ns / 1e9)
