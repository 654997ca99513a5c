"""In-process Determined exporters: post straight to the master when there is no collector.

The SDK's data is encoded to the same OTLP protobuf the bridge receives and handed to the
same pipeline (`otelprof.determined.pipeline`): one mapping, one windowing, one retry and
spool policy for both paths. `export()` runs on the SDK's exporter thread, never on the
training thread, only maps and aggregates in memory, and never raises.

Ranks: Determined's profiler reports system metrics once per node and one timing series per
trial. So system metrics are taken only from local rank 0 and timings only from global
rank 0 (resource attributes `otelprof.local_rank` / `otelprof.rank`; absent means 0).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otelprof._schema import ATTR_LOCAL_RANK, ATTR_RANK
from otelprof.determined.client import ConfigError, Credentials, DeterminedClient
from otelprof.determined.mapping import Route
from otelprof.determined.pipeline import Pipeline
from otelprof.determined.settings import validate_group
from otelprof.determined.spool import DiskSpool, MemorySpool

_log = logging.getLogger("otelprof.determined")

REFUSED_FILE = "determined-refused.jsonl"  # in the run directory: reports the master refused


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    try:
        return int(raw) if raw else None
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


class _SharedPipeline:
    """One pipeline behind the metric and span exporters; shut down when both are."""

    def __init__(self, pipeline: Pipeline, users: int, export_timeout_s: float = 10.0) -> None:
        self.pipeline = pipeline
        self.export_timeout_s = export_timeout_s
        self._users = users
        self._lock = threading.Lock()

    def release(self, drain_timeout_s: float) -> None:
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self.pipeline.shutdown(drain_timeout_s)


def build_pipeline(
    master: str | None = None,
    *,
    credentials: Credentials | None = None,
    trial_id: int | None = None,
    run_id: int | None = None,
    agent_id: str | None = None,
    report_interval_s: float = 10.0,
    spool_dir: str | None = None,
    spool_max_bytes: int = 64 * 1024 * 1024,
    refused_path: str | None = None,
    ca_bundle: str | None = None,
    timeout_s: float = 10.0,
    timings_group: str = "timings",
    env: Mapping[str, str] | None = None,
) -> Pipeline:
    """A started pipeline from arguments, falling back to the Determined task environment
    (DET_MASTER, DET_USER_TOKEN / DET_SESSION_TOKEN, DET_TRIAL_ID, DET_TRIAL_RUN_ID,
    DET_AGENT_ID, DET_MASTER_CERT_FILE). Raises ConfigError naming what is missing.
    `refused_path`: where a memory spool also keeps the reports the master refused (the
    run directory's `determined-refused.jsonl`, shown by `otelprof report`)."""
    env = os.environ if env is None else env
    master = master or env.get("DET_MASTER")
    if not master:
        raise ConfigError("Determined exporter: no master (pass master= or set DET_MASTER)")
    credentials = credentials or Credentials.from_env(env)
    if not credentials.has_any():
        raise ConfigError(
            "Determined exporter: no credentials (DET_USER_TOKEN, DET_SESSION_TOKEN or "
            "DET_USER with DET_PASS, or credentials=Credentials(...))"
        )
    route = Route(
        trial_id=trial_id if trial_id is not None else _int_env(env, "DET_TRIAL_ID"),
        run_id=run_id if run_id is not None else _int_env(env, "DET_TRIAL_RUN_ID"),
        agent=agent_id or env.get("DET_AGENT_ID"),
        steps_offset=_int_env(env, "DET_STEPS_COMPLETED"),
        steps_per_batch=_int_env(env, "OTELPROF_DETERMINED_STEPS_PER_BATCH"),
    )
    client = DeterminedClient.in_task(master, credentials, env, ca_bundle, timeout_s)
    spool: DiskSpool | MemorySpool = (
        DiskSpool(spool_dir, spool_max_bytes)
        if spool_dir
        else MemorySpool(spool_max_bytes, refused_path=refused_path)
    )
    pipeline = Pipeline(
        client,
        spool,
        window_s=report_interval_s,
        route=route,
        timings_group=validate_group(timings_group),
        trust_offsets=True,  # DET_STEPS_COMPLETED is this process's own environment
    )
    pipeline.start()
    return pipeline


def _rank_is_zero(attributes: Mapping[str, Any], key: str) -> bool:
    value = attributes.get(key, 0)
    try:
        return int(value) == 0
    except (TypeError, ValueError):
        return True


class DeterminedMetricExporter(MetricExporter):
    """Hardware gauges → Determined profiling groups, posted from this process."""

    def __init__(
        self, pipeline: Pipeline | None = None, export_timeout_s: float = 10.0, **kwargs: Any
    ) -> None:
        """`pipeline` from `build_pipeline`, or the keyword arguments of `build_pipeline`;
        `export_timeout_s` bounds shutdown (Settings.export_timeout_s)."""
        super().__init__()
        self._shared = _SharedPipeline(
            pipeline or build_pipeline(**kwargs), users=1, export_timeout_s=export_timeout_s
        )
        self.pipeline = self._shared.pipeline
        self._failed_logged = False

    @classmethod
    def from_environment(
        cls, env: Mapping[str, str] | None = None, export_timeout_s: float = 10.0, **kwargs: Any
    ) -> DeterminedMetricExporter:
        """Everything from the Determined task environment (see `build_pipeline`)."""
        return cls(build_pipeline(env=env, **kwargs), export_timeout_s=export_timeout_s)

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        try:
            kept = [
                rm
                for rm in metrics_data.resource_metrics
                if _rank_is_zero(rm.resource.attributes, ATTR_LOCAL_RANK)
            ]
            if kept:
                self.pipeline.ingest_metrics(encode_metrics(MetricsData(resource_metrics=kept)))
            return MetricExportResult.SUCCESS
        except Exception as error:  # never into the SDK's thread, let alone training
            if not self._failed_logged:
                self._failed_logged = True
                _log.error("Determined metric export failed: %r", error)
            return MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Close the current report window and wait for the master to take it."""
        self.pipeline.flush()
        return self.pipeline.wait_delivered(timeout_millis / 1000)

    def shutdown(
        self, timeout_millis: float = 30_000, timeout: float | None = None, **kwargs: Any
    ) -> None:
        """Drain for what is left of the caller's time (the SDK's metric reader passes it
        as `timeout`, in ms), never longer than the export timeout."""
        millis = timeout if timeout is not None else timeout_millis
        self._shared.release(max(0.0, min(millis / 1000, self._shared.export_timeout_s)))

    def abandon(self) -> None:
        """Shutdown's time is up: stop waiting for the master; what is left is counted."""
        self.pipeline.abandon()

    def span_exporter(self) -> DeterminedSpanExporter:
        """A span exporter feeding the same pipeline (timings group)."""
        with self._shared._lock:
            self._shared._users += 1
        return DeterminedSpanExporter(self._shared)


class DeterminedSpanExporter(SpanExporter):
    """Timing spans → Determined's timings group; made by `DeterminedMetricExporter`."""

    def __init__(self, shared: _SharedPipeline) -> None:
        self._shared = shared
        self.pipeline = shared.pipeline
        self._failed_logged = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            kept = [
                s
                for s in spans
                if s.resource is None or _rank_is_zero(s.resource.attributes, ATTR_RANK)
            ]
            if kept:
                self.pipeline.ingest_traces(encode_spans(kept))
            return SpanExportResult.SUCCESS
        except Exception as error:
            if not self._failed_logged:
                self._failed_logged = True
                _log.error("Determined span export failed: %r", error)
            return SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True  # the metric exporter's flush closes the shared window

    def shutdown(self) -> None:
        self._shared.release(self._shared.export_timeout_s)
