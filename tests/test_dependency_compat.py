"""The private parts of OpenTelemetry and torch that otelprof uses are all still there in the
pinned versions (an upgrade that removes one fails here, not silently in a run)."""

from __future__ import annotations

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


def test_the_gauge_encoders_otelprof_wraps_exist() -> None:
    import importlib

    for module_name, function in _otel_compat.GAUGE_ENCODERS:
        assert callable(getattr(importlib.import_module(module_name), function))


def test_torchs_profiler_internals_are_there_and_idle() -> None:
    assert _torch_compat.profiler_state(torch) is torch.autograd.profiler
    assert _torch_compat.record_function_ops(torch) is not None
    assert _torch_compat.profile_class(torch) is torch.autograd.profiler.profile
    assert _torch_compat.profiler_enabled(torch) is False
    with torch.profiler.profile():
        assert _torch_compat.profiler_enabled(torch) is True


def test_missing_torch_internals_degrade_to_none_or_a_safe_answer() -> None:
    assert _torch_compat.profiler_state(object()) is None
    assert _torch_compat.record_function_ops(object()) is None
    assert _torch_compat.profile_class(object()) is None
    assert _torch_compat.profiler_enabled(object()) is True  # cannot tell: assume one runs
    assert _torch_compat.default_store(dist) is None  # no process group here
