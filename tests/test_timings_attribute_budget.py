"""Attributes of `timing()` ranges are bounded in bytes, not only in count (issue #22).

A range's attributes live from `timing(name, **attributes)` until the span builder has
written the range; a builder that falls behind (a slow disk, a loaded machine) used to
let them pile up to `max_queued_spans` x the value length limit. The budget
(`max_attribute_bytes`) bounds what is alive at once; what passes it is counted.
"""

from __future__ import annotations

import gc
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof import _limits
from otelprof._schema import ATTR_ATTRIBUTES_DROPPED
from otelprof._timings._builder import SpanBuilder
from tests.otlp_files import read_spans

STEPS = 3000
BUDGET = 1 << 20
VALUE = 4096  # the default value length limit: kept whole


def test_attribute_bytes_are_charged_while_alive_and_handed_back_when_freed() -> None:
    before = _limits.budget.held_bytes()
    timing = otelprof.timing("load_batch", batch="x" * 10_000, size=3)
    attributes = timing.attributes
    assert attributes is not None
    charged = attributes.nbytes  # type: ignore[attr-defined]
    assert charged > VALUE  # the value, cut to the limit, and the dict
    assert _limits.budget.held_bytes() == before + charged
    del timing, attributes
    gc.collect()
    assert _limits.budget.held_bytes() == before


def test_attributes_past_the_byte_budget_are_dropped_counted_and_memory_stays_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The span builder holds off until released: everything recorded waits in the queue, as
    # it does behind a builder that cannot keep up.
    release = threading.Event()
    run = SpanBuilder._run

    def held_run(self: SpanBuilder) -> None:
        release.wait(600)
        run(self)

    monkeypatch.setattr(SpanBuilder, "_run", held_run)
    prof = otelprof.instrument(
        output_dir=tmp_path,
        interval=60,
        trace_budget=float("inf"),
        max_attribute_bytes=BUDGET,
        host_metrics=False,
        gpus="none",
    )
    try:
        tracemalloc.start()
        start = tracemalloc.get_traced_memory()[0]
        for i in range(STEPS):  # two distinct 4 KB values per step: 24 MB in all
            text = f"{i:08d}" * (VALUE // 8)
            with otelprof.timing("load_batch", batch=text, labels=text[::-1]):
                pass
            otelprof.step()
        growth = tracemalloc.get_traced_memory()[0] - start
        tracemalloc.stop()
        held = _limits.budget.held_bytes()
    finally:
        release.set()
        prof.shutdown()
    stats: dict[str, Any] = prof.stats()
    # what stays alive is the budget plus a few hundred bytes of frame per range; without
    # the budget every step's 8 KB stayed (about 27 MB here)
    assert held <= BUDGET
    assert growth < BUDGET + STEPS * 1500, (growth, stats)
    spans = [s for s in read_spans(prof.run_dir / "traces.jsonl") if s.name == "load_batch"]
    assert len(spans) == STEPS  # every range kept its timing
    over = [s for s in spans if ATTR_ATTRIBUTES_DROPPED in s.attributes]
    kept = [s for s in spans if "batch" in s.attributes]
    assert len(over) + len(kept) == STEPS
    assert over and kept
    assert all(len(s.attributes["batch"]) == VALUE for s in kept)
    assert stats["timings.attributes_dropped_over_budget"] == len(over)
    assert stats["dropped_total"] >= len(over)


def test_the_charge_moves_with_the_values_into_the_built_span() -> None:
    # A span built for an exporter's queue (OTLP, while the collector is down) holds the
    # attribute values after the range's frame is gone: the budget still counts them.
    from opentelemetry.sdk.resources import Resource

    from otelprof._timings import _recorder as rec
    from otelprof._timings._builder import Clock
    from otelprof._timings._frames import timing_frame
    from otelprof._timings._targets import SpanTargets

    before = _limits.budget.held_bytes()
    timing = otelprof.timing("load_batch", batch="y" * VALUE)
    charged = _limits.budget.held_bytes() - before
    assert charged > VALUE
    builder = SpanBuilder(SpanTargets(), Resource({"service.name": "t"}), Clock())
    ctx = rec.StepContext(1, None, 0)
    frame = timing_frame("load_batch", None, ctx, rec.thread_state(), timing.attributes, None)
    frame[7] = 10  # F_END
    span = builder.make_span(*builder.fields(frame))
    del timing, frame
    gc.collect()
    assert span.attributes is not None and span.attributes["batch"] == "y" * VALUE
    assert _limits.budget.held_bytes() == before + charged  # held by the span now
    del span
    gc.collect()
    assert _limits.budget.held_bytes() == before
