"""The timing histograms (`otelprof.timing.duration`) added to every metrics export.

Why ours, not an SDK Histogram instrument: recording each range through one cost more than
the range itself (docs/benchmarks-history.md). The builder thread aggregates them
(`_timings._sampling.Aggregates`); each counting metric exporter (files, OTLP, Determined)
gets them merged into what it sends, as cumulative histograms with an exemplar pointing at
a kept trace (files every `EXPORT_EVERY_S`, others with every export, all once more at
shutdown: the report reads the last point).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from opentelemetry.sdk.metrics import Exemplar
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otelprof._schema import ATTR_PHASE, ATTR_TIMING, TIMINGS_SCOPE
from otelprof._schema import TIMING_HISTOGRAM as METRIC_NAME
from otelprof._timings._sampling import BOUNDS

DESCRIPTION = (
    "Durations of every recorded timing range, per timing name and phase "
    "(exact count/sum/min/max; traces are sampled, these are not)"
)
EXPORT_EVERY_S = 30.0
"""Seconds between the histograms in the detached metrics file: a point set (61 bucket bounds
per timing name) is too big for every export, and a replayed run's dashboards still get a
point this often."""


class AggregateMetrics:
    """Turns a live `Aggregates` into histogram points for each exporter, rate-limited."""

    def __init__(self, aggregates: Any, resource: Any, version: str = "0") -> None:
        self._aggregates = aggregates
        self._resource = resource
        self._scope = InstrumentationScope(TIMINGS_SCOPE, version)
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self.final = False
        """Set once the span builder has drained for good: the next export of every
        exporter carries the final histograms."""

    def _due(self, exporter: str) -> bool:
        """Files get the histograms every EXPORT_EVERY_S (disk volume); other exporters
        (OTLP, Determined) with every export, so dashboards' rate() windows see them move."""
        if exporter != "files" and not self.final:
            return True
        now = time.monotonic()
        with self._lock:
            last = self._last.get(exporter)
            if last == -1.0 or (
                not self.final and last is not None and now - last < EXPORT_EVERY_S
            ):
                return False  # (-1.0: the final histograms went out)
            self._last[exporter] = -1.0 if self.final else now
            return True

    def scope_metrics(self) -> ScopeMetrics | None:
        now = time.time_ns()
        points = []
        for name, phase, hist in self._aggregates.snapshot():
            if not hist.count:
                continue
            exemplars = []
            if hist.exemplar is not None:
                value, at, trace_id, span_id = hist.exemplar
                exemplars.append(Exemplar({}, value, at, span_id, trace_id))
            points.append(
                HistogramDataPoint(
                    attributes={ATTR_TIMING: name, ATTR_PHASE: phase},
                    start_time_unix_nano=self._aggregates.start_ns,
                    time_unix_nano=now,
                    count=hist.count,
                    sum=hist.sum,
                    bucket_counts=hist.buckets,
                    explicit_bounds=BOUNDS,
                    min=hist.min,
                    max=hist.max,
                    exemplars=exemplars,
                )
            )
        if not points:
            return None
        metric = Metric(
            name=METRIC_NAME,
            description=DESCRIPTION,
            unit="s",
            data=Histogram(
                data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE
            ),
        )
        return ScopeMetrics(scope=self._scope, metrics=[metric], schema_url="")

    def merge(self, exporter: str, data: MetricsData) -> MetricsData:
        """`data` plus the histograms when this exporter is due for them."""
        if not self._due(exporter):
            return data
        scope = self.scope_metrics()
        if scope is None:
            return data
        resource_metrics = list(data.resource_metrics)
        for i, rm in enumerate(resource_metrics):
            if rm.resource is self._resource or rm.resource == self._resource:
                resource_metrics[i] = ResourceMetrics(
                    resource=rm.resource,
                    scope_metrics=[*rm.scope_metrics, scope],
                    schema_url=rm.schema_url,
                )
                break
        else:
            resource_metrics.append(
                ResourceMetrics(resource=self._resource, scope_metrics=[scope], schema_url="")
            )
        return MetricsData(resource_metrics=resource_metrics)
