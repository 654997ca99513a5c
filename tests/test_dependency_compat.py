"""The private parts of OpenTelemetry and torch that otelprof uses are all still there in the
pinned versions (an upgrade that removes one fails here, not silently in a run)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otelprof import _otel_compat, _torch_compat
from otelprof.export.counters import CountingBatchSpanProcessor, ExportCounters


class _Discard(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def test_span_queue_drops_reach_the_counters_through_the_sdks_drop_hook() -> None:
    counters = ExportCounters()
    processor = CountingBatchSpanProcessor("otlp", _Discard(), counters)
    try:
        assert _otel_compat.count_span_queue_drops(processor, lambda *_: None)
        processor._batch_processor._metrics.drop_items(3, "queue_full")
        assert counters.snapshot()["otlp.spans_dropped_queue_full"] == 3
    finally:
        processor.shutdown()


def test_an_sdk_without_the_drop_hook_is_reported_not_fatal() -> None:
    assert not _otel_compat.count_span_queue_drops(object(), lambda *_: None)


def test_a_periodic_readers_thread_ends_on_the_event_otelprof_sets_in_forked_children() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        InMemoryMetricReader,
        MetricExporter,
        MetricExportResult,
        PeriodicExportingMetricReader,
    )

    exports = []

    class Recording(MetricExporter):
        def export(self, metrics_data: Any, timeout_millis: float = 0, **_: Any) -> Any:
            exports.append(metrics_data)
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 0) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 0, **_: Any) -> None:
            pass

    reader = PeriodicExportingMetricReader(Recording(), export_interval_millis=60_000)
    provider = MeterProvider(metric_readers=[reader])
    observed = []
    provider.get_meter("compat").create_observable_gauge(
        "compat.gauge", callbacks=[lambda options: observed.append(1) or []]
    )
    try:
        assert reader._daemon_thread.is_alive()
        assert _otel_compat.stop_reader_thread(reader)
        reader._daemon_thread.join(timeout=5)
        assert not reader._daemon_thread.is_alive()
        # stopped without the loop's last collection: no callback ran, nothing exported
        assert not observed and not exports
    finally:
        provider.shutdown()
    assert not _otel_compat.stop_reader_thread(InMemoryMetricReader())


def test_the_gauge_encoders_otelprof_wraps_exist() -> None:
    import importlib

    for module_name, function in _otel_compat.GAUGE_ENCODERS:
        assert callable(getattr(importlib.import_module(module_name), function))


def test_torchs_profiler_internals_are_there_and_idle() -> None:
    namespace, flag = _torch_compat.profiler_flag(torch)  # type: ignore[misc]
    assert namespace is vars(torch.autograd.profiler) and namespace[flag] is False
    assert _torch_compat.record_function_ops(torch) is not None
    assert _torch_compat.profile_class(torch) is torch.autograd.profiler.profile
    assert _torch_compat.profiler_enabled(torch) is False
    with torch.profiler.profile():
        assert _torch_compat.profiler_enabled(torch) is True
        assert namespace[flag] is True


def test_missing_torch_internals_degrade_to_none_or_a_safe_answer() -> None:
    assert _torch_compat.profiler_flag(object()) is None
    assert _torch_compat.record_function_ops(object()) is None
    assert _torch_compat.profile_class(object()) is None
    assert _torch_compat.profiler_enabled(object()) is True  # cannot tell: assume one runs
    assert _torch_compat.default_store(dist) is None  # no process group here


def test_the_otlp_exporters_log_records_name_the_destination_otelprof_filters_on() -> None:
    import logging

    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    exporter = OTLPMetricExporter(endpoint="http://127.0.0.1:1", insecure=True)
    try:
        assert _otel_compat.otlp_log_destination(exporter) == "127.0.0.1:1"
    finally:
        exporter.shutdown(timeout_millis=100)
    for name in _otel_compat.OTLP_EXPORTER_LOGGERS:
        assert name in logging.Logger.manager.loggerDict, name


SPEEDUPS = Path(__file__).resolve().parents[1] / "otelprof" / "_timings" / "_speedups.c"
PRIVATE_CPYTHON = re.compile(
    r"\b(_Py\w+|ma_version_tag|d_member|PyMemberDescr\w*|PyDictObject|PyThreadState_\w+|"
    r"T_OBJECT_EX|Py_T_\w+|PY_VERSION_HEX)\b|structmember\.h"
)


def test_the_c_hot_path_reaches_cpython_internals_only_through_its_compat_header() -> None:
    code = re.sub(r"/\*.*?\*/", "", SPEEDUPS.read_text(), flags=re.S)  # comments aside
    found = sorted({m.group(0) for m in PRIVATE_CPYTHON.finditer(code)})
    assert not found, f"_speedups.c uses {found}: move them to _cpython_compat.h"
    header = (SPEEDUPS.parent / "_cpython_compat.h").read_text()
    assert "ma_version_tag" in header and "PyMemberDescrObject" in header


def test_the_compiled_hot_path_was_built_with_the_compat_headers_guards() -> None:
    from otelprof._timings import _speedups as speedups  # built whatever the path in use

    assert speedups.CPYTHON_CHECKED
    # dict version tags exist (and are used) up to 3.13, not from 3.14 on
    assert speedups.VERSION_TAGS == (sys.version_info < (3, 14))


def test_the_timing_histograms_ride_on_the_exporters_only_while_the_sdk_lacks_producers() -> None:
    """The timing histograms are merged by the counting exporters and re-served on the pull
    endpoint because this SDK has no MetricProducer seam (ARCHITECTURE.md). An upgrade that
    adds `metric_producers=` to MetricReader fails here: move them onto it then."""
    import inspect

    import opentelemetry.sdk.metrics.export as export
    from opentelemetry.sdk.metrics.export import MetricReader

    assert not hasattr(export, "MetricProducer")
    assert "metric_producers" not in inspect.signature(MetricReader.__init__).parameters
