"""Detached span files written without SDK objects: same wire format, one writer, whole lines."""

from __future__ import annotations

import json
from pathlib import Path

from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource

import otelprof
from otelprof._timings._builder import Clock, SpanBuilder
from otelprof._timings._targets import SpanTargets
from otelprof.export._spanlines import SpanLineWriter, encode_span
from otelprof.export.counters import ExportCounters
from tests.otlp_files import read_lines, read_spans


def _sdk_span_dict(builder: SpanBuilder, fields: tuple) -> dict:  # type: ignore[type-arg]
    span = builder.make_span(*fields)
    data = encode_spans([span]).to_dict()
    return data["resourceSpans"][0]["scopeSpans"][0]["spans"][0]


def test_the_span_encoder_caches_short_attribute_values_but_not_stack_traces() -> None:
    """Phases and thread names repeat on every span; each error's stack trace is new, and
    a cache of them would hold one copy of every error the run ever had."""
    from otelprof.export import _spanlines

    stack = "Traceback (most recent call last):\n" + "  frame\n" * 20
    encoded = encode_span(
        "bad", 1, 2, 0, 10, 20, {"otelprof.phase": "train"}, ("ValueError", "boom", stack)
    )
    event = json.loads(encoded)["events"][0]
    assert {a["key"]: a["value"]["stringValue"] for a in event["attributes"]}[
        "exception.stacktrace"
    ] == stack
    assert "train" in _spanlines._text_cache
    assert stack not in _spanlines._text_cache


def test_encoded_spans_equal_the_sdk_exporters_json_for_every_field_kind() -> None:
    builder = SpanBuilder(SpanTargets(), Resource({"service.name": "t"}), Clock())
    cases = [
        ("step", 1 << 100, 0xABC, 0, 10, 20, {"otelprof.step": 3}, None),
        (
            'x "quoted" é',
            5,
            6,
            7,
            1_795_000_000_000_000_000,
            1_795_000_000_000_001_000,
            {
                "otelprof.step": 0,
                "thread.id": 1 << 60,
                "s": 'v\n "é"',
                "f": 1.25,
                "b": True,
                "ints": (1, 2),
                "strs": ("a", "b"),
                "neg": -4,
            },
            None,
        ),
        (
            "bad",
            9,
            10,
            11,
            100,
            200,
            {"otelprof.step": 1},
            ("builtins.ValueError", 'boom "x"', "Traceback...\n"),
        ),
    ]
    for fields in cases:
        ours = json.loads(encode_span(*fields))
        assert ours == _sdk_span_dict(builder, fields), fields[0]


def test_recorded_ranges_and_user_sdk_spans_share_one_file_of_whole_lines(tmp_path: Path) -> None:
    prof = otelprof.instrument(
        output_dir=str(tmp_path), run_id="r", host_metrics=False, process_metrics=False
    )
    tracer = prof.tracer_provider.get_tracer("user-code")
    try:
        for _ in range(3):
            with otelprof.timing("train_batch", kind="t"), tracer.start_as_current_span("mine"):
                pass
            otelprof.step()
    finally:
        prof.shutdown()
    path = prof.files["traces"]
    requests = read_lines(path)
    assert all(set(r) == {"resourceSpans"} for r in requests)
    spans = read_spans(path)
    names = sorted(s.name for s in spans)
    assert names == ["mine"] * 3 + ["step"] * 3 + ["train_batch"] * 3
    steps = {s.span_id: s for s in spans if s.name == "step"}
    for span in spans:
        if span.name == "train_batch":
            parent = steps[span.parent_span_id]
            assert parent.trace_id == span.trace_id
            assert span.attributes["otelprof.step"] == parent.attributes["otelprof.step"]
            assert span.attributes["kind"] == "t"
    stats = prof.stats()
    assert stats["files.spans_exported"] == 9 and stats["dropped_total"] == 0


def test_a_size_cap_drops_whole_lines_and_counts_their_spans(tmp_path: Path) -> None:
    counters = ExportCounters()
    writer = SpanLineWriter(tmp_path / "t.jsonl", counters, max_bytes=3000, line_spans=5)
    resource = Resource({"service.name": "t"})
    span = encode_span("x", 1, 2, 0, 1, 2, {"otelprof.step": 0})
    for _ in range(40):
        assert writer.write(resource, None, [span] * 5)  # taken; the cap decides per line
    writer.close()
    counts = counters.snapshot()
    written = counts["files.spans_exported"]
    assert 0 < written < 200 and written % 5 == 0
    assert counts["files.spans_dropped_size_cap"] == 200 - written
    assert (tmp_path / "t.jsonl").stat().st_size <= 3000
    assert len(read_spans(tmp_path / "t.jsonl")) == written
    assert not writer.write(resource, None, [span])  # closed: refused and counted
    assert counters.snapshot()["files.spans_failed"] == 1
