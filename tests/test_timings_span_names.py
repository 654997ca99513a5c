"""Span-name cardinality is bounded: numbered names normalised, names past the limit folded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import otelprof
from otelprof._schema import ATTR_NAME_NUMBER, ATTR_NAME_ORIGINAL, TIMING_OVERFLOW
from otelprof._timings._names import MAX_SPAN_NAMES, SpanNames
from otelprof.analysis.problems import notes
from otelprof.analysis.reader import WarningLog, open_run
from otelprof.analysis.summary import summarize
from tests.otlp_files import read_spans


@pytest.fixture(autouse=True)
def _no_profiler_left_running() -> Iterator[None]:
    yield
    otelprof.uninstrument()


def test_profiler_step_numbers_become_an_attribute_not_a_name_per_step(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 8)
    with (
        otelprof.instrument(output_dir=tmp_path, host_metrics=False, process_metrics=False) as prof,
        torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=100, warmup=1, active=1)
        ) as user,
    ):
        for _ in range(30):
            with otelprof.timing("train_batch"):
                model(torch.randn(4, 8)).sum().backward()
            user.step()  # records a ProfilerStep#N range each step
            otelprof.step()
    assert prof.run_dir is not None
    spans = read_spans(prof.run_dir / "traces.jsonl")
    numbered = [s for s in spans if s.name.startswith("ProfilerStep")]
    assert len(numbered) >= 29
    assert {s.name for s in numbered} == {"ProfilerStep"}
    assert sorted(s.attributes[ATTR_NAME_NUMBER] for s in numbered) == list(
        range(31 - len(numbered), 31)
    )
    summary = summarize(open_run([prof.run_dir]), WarningLog(sink=lambda _m: None))
    assert len(summary.timings) < 10  # report rows: not one per step
    assert prof.stats()["timings.span_names_folded"] == 0


def test_new_names_past_the_limit_fold_into_one_overflow_name_counted(tmp_path: Path) -> None:
    extra = 40
    with otelprof.instrument(
        output_dir=tmp_path, host_metrics=False, process_metrics=False
    ) as prof:
        for i in range(MAX_SPAN_NAMES + extra):
            with otelprof.timing(f"request {i:05d}"):  # a name per item: a cardinality bug
                pass
        otelprof.step()
    stats = prof.stats()
    assert prof.run_dir is not None
    spans = read_spans(prof.run_dir / "traces.jsonl")
    names = {s.name for s in spans}
    assert len(names) == MAX_SPAN_NAMES + 2  # the limit, the overflow name and "step"
    assert "step" in names
    folded = [s for s in spans if s.name == TIMING_OVERFLOW]
    assert len(folded) == stats["timings.span_names_folded"] == extra
    assert {s.attributes[ATTR_NAME_ORIGINAL] for s in folded} == {
        f"request {i:05d}" for i in range(MAX_SPAN_NAMES, MAX_SPAN_NAMES + extra)
    }
    assert stats["dropped_total"] == 0  # folded spans are kept, not lost
    summary = summarize(open_run([prof.run_dir]), WarningLog(sink=lambda _m: None))
    assert any(f"{extra} span(s) exported as otelprof.other" in n for n in notes(summary))


def test_known_names_keep_working_after_the_limit() -> None:
    names = SpanNames(limit=2)
    attrs: dict[str, object] = {}
    assert names.name("a", attrs) == "a" and attrs == {}
    assert names.name("b#7", attrs) == "b" and attrs == {ATTR_NAME_NUMBER: 7}
    late: dict[str, object] = {}
    assert names.name("c", late) == TIMING_OVERFLOW and late == {ATTR_NAME_ORIGINAL: "c"}
    assert names.name("b#8", {}) == "b"  # an existing name with another number
    assert names.name("a", {}) == "a"
    assert names.name("train_batch", {}) == "train_batch"  # reserved names never fold
    assert names.name("Optimizer.step#SGD.step", {}) == TIMING_OVERFLOW  # not a number: a name
    assert names.folded == 2
