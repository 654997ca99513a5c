"""The detached metrics file in fewer, bigger lines: several exports' points per OTLP line.

Why: each SDK export line repeats the resource, the scope and every metric's name,
description and unit, over half the file. `MetricLineBatcher` holds the exports of
`LINE_SECONDS` and writes them as one request whose metrics carry every held export's
points in order (what `replay` sends the collector; valid OTLP). Nothing is re-aggregated,
so every reader sees the same points. Bounded (`exports_per_line` held; a flush or shutdown
writes them, only SIGKILL loses them). Counting stays exact: a held export counts as
exported when handed over, and a refused or failed line moves its points to dropped or
failed; when the cap refuses a line of several exports, the newest goes alone (so the final
histograms make it in), and from then on one export per line (DEVELOPING.md, "export/ and
determined/").
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import (
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)

from otelprof.export.counters import ExportCounters, ExportDropped, count_points, preferences_of

_log = logging.getLogger("otelprof.export")

LINE_SECONDS = 5.0
"""A metrics line holds this many seconds of exports (one export per line from an `interval`
of this or longer). Most of the saving comes by 5 exports per line (the per-line overhead
is then a fifth); longer lines would mostly lengthen what a SIGKILL can lose."""
MAX_EXPORTS_PER_LINE = 10
"""At a short `interval` (0.1 s), lines hold at most this many exports, so a line stays
small next to a size cap."""


def exports_per_line(interval_s: float) -> int:
    """How many exports of `interval_s` one line holds: LINE_SECONDS' worth, 1 to MAX."""
    return max(1, min(MAX_EXPORTS_PER_LINE, round(LINE_SECONDS / interval_s)))


def _metric_key(metric: Metric) -> tuple[Any, ...]:
    data = metric.data
    return (
        metric.name,
        metric.description,
        metric.unit,
        type(data),
        getattr(data, "aggregation_temporality", None),
        getattr(data, "is_monotonic", None),
    )


def merge_exports(exports: Sequence[MetricsData]) -> MetricsData:
    """One MetricsData holding every data point of `exports`, in order: one ResourceMetrics
    per resource, one ScopeMetrics per scope, one Metric per (name, description, unit, kind,
    temporality, monotonicity), whose points are those of each export in turn."""
    if len(exports) == 1:
        return exports[0]
    # [(ResourceMetrics seen first, {(scope, schema): {metric key: [Metric, ...]}})]
    groups: list[tuple[ResourceMetrics, dict[Any, dict[Any, list[Metric]]]]] = []
    for data in exports:
        for rm in data.resource_metrics:
            res = rm.resource  # the group of an equal resource (one at most: they merge)
            scopes = next((s for f, s in groups if f.resource is res or f.resource == res), None)
            if scopes is None:
                scopes = {}
                groups.append((rm, scopes))
            for sm in rm.scope_metrics:
                metrics = scopes.setdefault((sm.scope, sm.schema_url), {})
                for metric in sm.metrics:
                    metrics.setdefault(_metric_key(metric), []).append(metric)
    out = []
    for first, scopes in groups:
        scope_metrics = []
        for (scope, schema_url), metrics in scopes.items():
            merged = []
            for same in metrics.values():
                if len(same) == 1:
                    merged.append(same[0])
                    continue
                points = [p for m in same for p in m.data.data_points]
                kind_data: Any = dataclasses.replace(same[0].data, data_points=points)  # type: ignore[arg-type]
                merged.append(dataclasses.replace(same[0], data=kind_data))
            scope_metrics.append(ScopeMetrics(scope=scope, metrics=merged, schema_url=schema_url))
        out.append(
            ResourceMetrics(
                resource=first.resource, scope_metrics=scope_metrics, schema_url=first.schema_url
            )
        )
    return MetricsData(resource_metrics=out)


class MetricLineBatcher(MetricExporter):
    """Holds up to `per_line` exports and hands them to `inner` merged into one export.

    Sits between `CountingMetricExporter` (which has already merged the timing histograms
    and the read times into each export) and `CappedMetricExporter`. `on_export` callbacks
    run at every export (the periodic reader's tick: the trace file's due lines use it).
    """

    def __init__(
        self,
        inner: MetricExporter,
        per_line: int,
        counters: ExportCounters,
        name: str = "files",
    ) -> None:
        super().__init__(**preferences_of(inner))
        self._inner = inner
        self.per_line = max(1, per_line)
        self._counters = counters
        self._name = name
        self._lock = threading.Lock()
        self._held: list[MetricsData] = []
        self._held_points = 0
        self.capped = False
        """Set once the cap refused a line: from then on one export per line."""
        self.on_export: list[Callable[[], None]] = []

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        for tick in self.on_export:
            try:
                tick()
            except Exception as error:  # a hook must not cost the metrics
                _log.debug("otelprof: metrics export hook raised %r", error)
        with self._lock:
            points = count_points(metrics_data)
            self._held.append(metrics_data)
            self._held_points += points
            if len(self._held) < self.per_line and not self.capped:
                return MetricExportResult.SUCCESS
            return self._write(points, timeout_millis, from_export=True, **kwargs)

    def _move(self, points: int, to: str) -> None:
        """Points already counted as exported that were lost after all."""
        if points:
            self._counters.add(f"{self._name}.metric_points_exported", -points)
            self._counters.add(f"{self._name}.metric_points_{to}", points)

    def _write(
        self, current: int, timeout_millis: float, from_export: bool = False, **kwargs: Any
    ) -> MetricExportResult:
        """Write what is held as one line. From `export()`, `current` = the points of the
        export being made (the counting wrapper counts them and any error raised); the rest
        were counted as exported already and are moved here if the line is lost."""
        held, self._held = self._held, []
        points, self._held_points = self._held_points, 0
        if not held:
            return MetricExportResult.SUCCESS
        earlier = points - current
        try:
            result = self._inner.export(
                merge_exports(held), timeout_millis=timeout_millis, **kwargs
            )
        except ExportDropped as dropped:
            # the size cap, a failed write (disk full) or a deleted file: nothing of the line
            # is in the file (the counting wrapper warns with the same key)
            reason = dropped.reason
            self._counters.warn_once(f"{self._name}.{reason}", "%s", dropped.message)
            older = len(held) - 1  # the exports held before the newest: lost either way
            if reason == "size_cap":
                self.capped = True
                if older:
                    self._counters.add(f"{self._name}.metric_exports_{reason}", older)
                if older and self._alone(held[-1], timeout_millis, **kwargs):
                    self._move(points - count_points(held[-1]), f"dropped_{reason}")
                    return MetricExportResult.SUCCESS  # the newest made it in alone
            self._move(earlier, f"dropped_{reason}")
            if from_export:
                raise  # the counting wrapper counts the newest export and its points
            self._counters.add(f"{self._name}.metric_exports_{reason}")
            return MetricExportResult.FAILURE
        except Exception as error:
            self._move(earlier, "failed")
            if from_export:
                raise
            self._count_failure(error)
            return MetricExportResult.FAILURE
        if result is not MetricExportResult.SUCCESS:
            self._move(earlier, "failed")
            if not from_export:
                self._count_failure(None)
        return result

    def _alone(self, newest: MetricsData, timeout_millis: float, **kwargs: Any) -> bool:
        """Write the newest export as a line of its own after the cap refused the line
        holding it: True if written. If refused too, the file keeps it (the newest refused
        line) for its close, within the reserve: the final export, with the exact timing
        histograms, then still makes it in, however many exports its line would have held."""
        try:
            result = self._inner.export(newest, timeout_millis=timeout_millis, **kwargs)
        except Exception:
            return False
        return result is MetricExportResult.SUCCESS

    def _count_failure(self, error: Exception | None) -> None:
        self._counters.add(f"{self._name}.metric_exports_failed")
        self._counters.warn_once(
            f"{self._name}.metric_failure",
            "otelprof: %s metric export failed (%r); points are dropped and counted "
            "(see Profiler.stats()); further failures are not logged",
            self._name,
            error,
        )

    def flush(self, timeout_millis: float = 10_000) -> bool:
        """Write the held exports now (flush, shutdown, close)."""
        with self._lock:
            return self._write(0, timeout_millis) is MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        ok = self.flush(timeout_millis)
        return bool(self._inner.force_flush(timeout_millis=timeout_millis)) and ok

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.flush(timeout_millis)
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)

    def close(self) -> None:
        """Write what is still held, then close the inner exporter's file (if it has one)."""
        self.flush()
        close = getattr(self._inner, "close", None)
        if close is not None:
            close()
