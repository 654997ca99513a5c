"""Where built spans go: the tracer provider's span processors, and the frame sinks among them.

The Profiler makes one `SpanTargets`, gives it to the SDK as the provider's active span
processor (`TracerProvider(active_span_processor=...)`, a public parameter) and to the span
builder. SDK spans (users', Kineto's) reach every processor through it as usual. Recorded
ranges skip the SDK where they can: a processor added with a `frame_sink` (the detached trace
file) gets them already encoded from the builder, the others get ReadableSpans.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from opentelemetry.sdk.trace import SpanProcessor, SynchronousMultiSpanProcessor


class FrameSink(Protocol):
    """Takes spans the builder encoded with the sink's own `encode_span` (one string per
    span: OTLP JSON for the trace file), so the timings layer knows no file format."""

    encode_span: Callable[..., str]
    """(name, trace id, span id, parent id, start, end, attributes, error) -> one span."""

    def write(self, resource: Any, scope: Any, spans: Sequence[str]) -> bool: ...


class SpanTargets(SynchronousMultiSpanProcessor):
    """The provider's span processors, plus which of them take encoded spans.

    `add_span_processor` is what `TracerProvider.add_span_processor` calls, so a processor a
    user adds to `prof.tracer_provider` gets the built spans too. Both tuples are replaced,
    never mutated, so the builder's thread reads them without a lock.
    """

    def __init__(self) -> None:
        super().__init__()
        self.frame_sinks: tuple[FrameSink, ...] = ()
        self.encode_span: Callable[..., str] | None = None
        """The frame sinks' encoding (they share one; the builder encodes each span once)."""
        self.span_processors: tuple[SpanProcessor, ...] = ()
        """The processors the builder hands ReadableSpans (those without a frame sink)."""

    def add_span_processor(
        self, span_processor: SpanProcessor, frame_sink: FrameSink | None = None
    ) -> None:
        """Add a processor; with `frame_sink`, recorded ranges go to the sink instead of it."""
        super().add_span_processor(span_processor)
        with self._lock:
            if frame_sink is not None:
                if self.frame_sinks and frame_sink.encode_span is not self.encode_span:
                    raise ValueError("frame sinks of one provider must share their encoding")
                self.encode_span = frame_sink.encode_span
                self.frame_sinks += (frame_sink,)
            else:
                self.span_processors += (span_processor,)
