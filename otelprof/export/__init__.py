"""Exporter wiring: where telemetry goes (OTLP gRPC, JSON Lines files, Determined)."""

from otelprof.export.counters import ExportCounters
from otelprof.export.wiring import ExportPipelines, build_pipelines

__all__ = ["ExportCounters", "ExportPipelines", "build_pipelines"]
