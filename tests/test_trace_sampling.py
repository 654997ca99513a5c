"""Aggregate every step, keep the traces that matter: histograms, head/tail sampling, anomalies."""

from __future__ import annotations

import bisect
import math
import random
import time
from array import array
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof._timings import _sampling
from otelprof._timings._sampling import SpanFields, TraceSampler
from otelprof._timings._trace_ids import RunTraces
from tests.otlp_files import read_spans, timing_histograms


class _Ctx:
    """Stands for a recorder StepContext: the sampler reads its phase and number (head
    sampling) and reads and writes `kept`."""

    def __init__(self, number: int = -1, phase: str = "train") -> None:
        self.kept: bool | None = None
        self.number = number
        self.phase = phase


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run_steps(
    sampler: TraceSampler,
    durations: list[float],
    clock: _Clock,
    errors: frozenset[int] = frozenset(),
) -> list[int]:
    """Feed one child span + the step span per duration; return step numbers in order."""
    t = 1_000_000_000
    for number, seconds in enumerate(durations):
        ctx = _Ctx(number)
        end = t + int(seconds * 1e9)
        error = ("builtins.ValueError", "x", "") if number in errors else None
        child = SpanFields(
            "train_batch", number + 1, 2 * number + 10, 2 * number + 11, t, end, {}, error
        )
        sampler.span(ctx, child, False, seconds, error is not None)
        step = SpanFields(
            "step", number + 1, 2 * number + 11, 0, t, end, {"otelprof.step": number}, None
        )
        sampler.span(ctx, step, True, seconds, False, "step")
        t = end
        clock.now += seconds
    sampler.finish()
    return list(range(len(durations)))


def _sampler(budget: float = 0.0, **kw: Any) -> tuple[TraceSampler, list[SpanFields], _Clock]:
    out: list[SpanFields] = []
    clock = _Clock()
    kw.setdefault("head_burst", 0.0)
    return TraceSampler(budget, out.append, clock=clock, **kw), out, clock


def _kept_steps(out: list[SpanFields]) -> dict[int, SpanFields]:
    return {f.attributes["otelprof.step"]: f for f in out if f.name == "step"}


def _steady(n: int, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [0.010 * rng.uniform(0.8, 1.2) for _ in range(n)]


def test_tail_kept_steps_are_exactly_the_steps_slower_than_every_recent_one() -> None:
    durations = _steady(600)
    for at in (150, 300, 450):
        durations[at] = 0.020  # slow, but under the anomaly rule's 3x
    sampler, out, clock = _sampler(tail_burst=1e9)
    _run_steps(sampler, durations, clock)
    kept = _kept_steps(out)
    window = _sampling.SLOW_WINDOW
    slowest = {
        i for i in range(1, len(durations)) if durations[i] > max(durations[max(0, i - window) : i])
    }
    assert {
        i for i, f in kept.items() if f.attributes["otelprof.sampled"] == "tail.slowest"
    } == slowest
    assert {150, 300, 450} <= slowest
    assert sampler.anomalies == 0
    # every kept step comes with its child; nothing else was written, the rest is counted
    assert sum(1 for f in out if f.name == "train_batch") == len(kept)
    assert sampler.sampled_out + len(out) == 2 * len(durations)


def test_the_anomaly_rule_fires_on_an_injected_slow_step_and_captures_the_next_ones() -> None:
    durations = _steady(400, seed=2)
    durations[250] = 0.050  # 5x the recent median
    sampler, out, clock = _sampler()
    _run_steps(sampler, durations, clock)
    assert sampler.anomalies == 1
    kept = _kept_steps(out)
    assert kept[250].attributes["otelprof.sampled"] == "anomaly"
    assert kept[250].attributes["otelprof.anomaly.ratio"] == pytest.approx(5.0, rel=0.25)
    captured = range(251, 251 + _sampling.CAPTURE_STEPS)
    assert all(kept[i].attributes["otelprof.sampled"] == "capture" for i in captured)
    # the slow step's span links to every captured step's span
    links = kept[250].links
    assert [span_id for _, span_id, _ in links] == [kept[i][2] for i in captured]
    assert all(trace == kept[i][1] for (trace, _, _), i in zip(links, captured, strict=True))


def test_anomalies_within_their_budget_are_all_kept_while_head_and_tail_are_spent() -> None:
    durations = _steady(600, seed=3)
    slow = list(range(150, 150 + 13 * 20, 20))  # 13 steps at 12x, 0.2 s apart: one cooldown
    assert len(slow) <= _sampling.ANOMALY_BURST  # within the anomaly budget's burst
    for at in slow:
        durations[at] = 0.120
    sampler, out, clock = _sampler(tail_burst=0.0)  # head and tail budgets spent
    _run_steps(sampler, durations, clock)
    kept = _kept_steps(out)
    assert set(slow) <= set(kept), sorted(set(slow) - set(kept))
    assert all(kept[i].attributes["otelprof.sampled"] == "anomaly" for i in slow)
    assert all(kept[i].attributes["otelprof.anomaly.ratio"] > 9 for i in slow)
    assert sampler.anomalies == len(slow)
    assert sampler.anomalies_refused == 0
    # only the first starts a capture (one per cooldown), and only it links to its steps
    captured = sorted(i for i, f in kept.items() if f.attributes["otelprof.sampled"] == "capture")
    assert captured == list(range(151, 151 + _sampling.CAPTURE_STEPS))
    assert len(kept[150].links) == _sampling.CAPTURE_STEPS
    assert all(not kept[i].links for i in slow[1:])  # no links
    assert set(kept) == set(slow) | set(captured)


def _flood(n: int, every: int, seed: int = 4) -> tuple[list[float], list[int]]:
    """10 ms steps with one in `every` at 12x (a machine that stalls all the time)."""
    durations = _steady(n, seed=seed)
    slow = list(range(100, n, every))
    for at in slow:
        durations[at] = 0.120
    return durations, slow


def test_a_flood_of_anomalies_is_bounded_by_the_anomaly_budget_and_the_rest_counted() -> None:
    durations, slow = _flood(3000, every=3)
    sampler, out, clock = _sampler(tail_burst=0.0, anomaly_budget=6.0)  # 6 per minute
    _run_steps(sampler, durations, clock)
    kept = _kept_steps(out)
    anomalies = sorted(i for i, f in kept.items() if f.attributes["otelprof.sampled"] == "anomaly")
    captured = [i for i, f in kept.items() if f.attributes["otelprof.sampled"] == "capture"]
    # the rule fired on every slow step outside a running capture
    assert sampler.anomalies == len(set(slow) - set(captured))
    # kept: the burst, what the bucket refilled in the run's (simulated) time, and at
    # most the one anomaly per cooldown that starts a capture; every other one counted
    minutes = clock.now / 60
    captures = math.floor(clock.now / _sampling.CAPTURE_COOLDOWN_S) + 1
    assert len(anomalies) <= _sampling.ANOMALY_BURST + 6.0 * minutes + captures
    assert len(anomalies) >= _sampling.ANOMALY_BURST + 6.0 * minutes - 1
    assert sampler.anomalies_refused == sampler.anomalies - len(anomalies) > 500
    assert len(captured) == captures * _sampling.CAPTURE_STEPS
    # nothing else was written: refused anomalies were sampled out like any step
    assert set(kept) == set(anomalies) | set(captured)
    assert sampler.sampled_out + len(out) == 2 * len(durations)


def test_the_anomaly_budget_can_keep_every_anomaly_or_none() -> None:
    durations, slow = _flood(1000, every=5)
    sampler, out, clock = _sampler(tail_burst=0.0, anomaly_budget=math.inf)
    _run_steps(sampler, durations, clock)
    kept = _kept_steps(out)
    assert sampler.anomalies_refused == 0
    assert (
        sum(f.attributes["otelprof.sampled"] == "anomaly" for f in kept.values())
        == sampler.anomalies
    )
    sampler, out, clock = _sampler(tail_burst=0.0, anomaly_budget=0.0)
    _run_steps(sampler, durations, clock)
    assert out == []  # no anomaly kept, so no capture either
    assert sampler.anomalies_refused == sampler.anomalies == len(slow)


def test_preemptions_of_fast_steps_are_not_anomalies_but_a_real_stall_is() -> None:
    """1 ms steps on a loaded machine: a quarter of them preempted for 2-15 ms (scheduler
    slices, GIL switch intervals) is noise, not an anomaly; a 60 ms stall is one."""
    rng = random.Random(5)
    durations = [0.001 * rng.uniform(0.8, 1.2) for _ in range(4000)]
    for at in rng.sample(range(4000), 1000):
        durations[at] += rng.uniform(0.002, 0.015)
    stalls = list(range(500, 500 + 13 * 200, 200))
    for at in stalls:
        durations[at] = 0.060
    sampler, out, clock = _sampler(tail_burst=0.0)
    _run_steps(sampler, durations, clock)
    kept = _kept_steps(out)
    anomalies = sorted(i for i, f in kept.items() if f.attributes["otelprof.sampled"] == "anomaly")
    assert anomalies == stalls
    assert sampler.anomalies == len(stalls) and sampler.anomalies_refused == 0


def test_injected_slow_steps_of_a_real_run_all_reach_the_trace_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long run's state: both budgets spent (bursts 0), so only the anomaly rule keeps a
    step, and fast steps are decided on the training thread. 13 injected steps 50x slower
    than the others, within one capture cooldown and the anomaly budget's burst: every one
    is in the trace file."""
    monkeypatch.setattr(_sampling, "HEAD_BURST", 0.0)
    monkeypatch.setattr(_sampling, "TAIL_BURST", 0.0)
    prof = otelprof.instrument(
        output_dir=str(tmp_path), run_id="slow", trace_budget=0,
        host_metrics=False, process_metrics=False,
    )  # fmt: skip
    slow = set(range(60, 60 + 13 * 15, 15))
    try:
        for i in range(300):
            with otelprof.timing("train_batch"):
                time.sleep(0.250 if i in slow else 0.005)  # 50x: clear of load noise
            otelprof.step()
    finally:
        prof.shutdown()
    steps = {
        s.attributes["otelprof.step"]: s
        for s in read_spans(prof.files["traces"])
        if s.name == "step"
    }
    assert slow <= set(steps), (  # (other anomalies took the burst's tokens? see stats)
        f"slow steps missing from the trace file: {sorted(slow - set(steps))}; "
        f"{ {k: v for k, v in prof.stats().items() if 'anomal' in k} }"
    )
    assert all(steps[i].attributes["otelprof.sampled"] in ("anomaly", "capture") for i in slow)
    stats = prof.stats()
    assert stats["timings.anomalies"] >= len(slow) - 1  # one may fall in the first capture
    kept_anomalies = stats["timings.steps_kept.anomaly"]
    assert kept_anomalies + stats["timings.anomalies_refused"] == stats["timings.anomalies"]
    assert stats["timings.steps_sampled_out_on_thread"] > 0  # the fast path was in play


def test_the_anomaly_rule_stays_quiet_on_a_steady_run() -> None:
    for seed in range(5):
        sampler, out, clock = _sampler(tail_burst=1e9)
        _run_steps(sampler, _steady(1000, seed=seed), clock)
        assert sampler.anomalies == 0
        assert not any(f.attributes.get("otelprof.sampled") in ("anomaly", "capture") for f in out)


def test_steps_with_an_error_are_kept_while_the_head_budget_is_spent() -> None:
    sampler, out, clock = _sampler(tail_burst=100)
    _run_steps(sampler, [0.010] * 200, clock, errors=frozenset({17, 123}))
    kept = _kept_steps(out)
    assert {i for i, f in kept.items() if f.attributes["otelprof.sampled"] == "tail.error"} == {
        17,
        123,
    }


def test_the_head_budget_bounds_the_spans_written_per_second() -> None:
    sampler, out, clock = _sampler(budget=40.0, head_burst=200.0, tail_burst=0.0)
    durations = [0.001] * 20_000  # 20 s of 1 ms steps, two spans each
    _run_steps(sampler, durations, clock)
    head = {i: f for i, f in _kept_steps(out).items() if f.attributes["otelprof.sampled"] == "head"}
    # head gets half the budget: at most 20 spans/s over 20 s plus the burst, and at least
    # half of that (one step in 2**level, the lowest level that fits)
    assert 100 <= len(head) and 2 * len(head) <= 20 * 20 + 200
    assert sampler.sampled_out + len(out) == 2 * len(durations)
    # after the first second (the burst), the head steps are exactly those every rank
    # selects at the level the load gives: 2,000 spans/s against 20 -> one step in 128
    assert sampler.head_level == 7
    traces = RunTraces("", 0)
    later = range(1000, len(durations))
    assert {i for i in head if i in later} == {
        i for i in later if traces.head_selected("train", i, 7)
    }
    assert sampler.head_refused == 0


def _train(prof: Any, steps: int) -> None:
    for i in range(steps):
        with otelprof.timing("dataloader_next"):
            pass
        with otelprof.timing("train_batch"), otelprof.timing("forward"):
            time.sleep(0.0002 if i % 7 else 0.001)
        otelprof.step()
        if i % 50 == 49:
            with otelprof.phase("validation"), otelprof.timing("eval_batch"):
                pass


@pytest.mark.parametrize("budget", [float("inf"), 10.0], ids=["keep-all", "sampling"])
def test_histograms_equal_what_full_traces_give_per_timing_and_phase(
    tmp_path: Path, budget: float
) -> None:
    # with a budget every span still fits the head burst, so all are written: the
    # sampling-mode builder (batched aggregation) must give the same histograms
    prof = otelprof.instrument(
        output_dir=str(tmp_path), run_id="full", trace_budget=budget,
        host_metrics=False, process_metrics=False,
    )  # fmt: skip
    try:
        _train(prof, 200)
    finally:
        prof.shutdown()
    spans = read_spans(prof.files["traces"])
    hists = timing_histograms(prof.files["metrics"])
    expected: dict[tuple[str, str], list[float]] = {}
    for span in spans:
        key = (span.name, span.attributes["otelprof.phase"])
        expected.setdefault(key, []).append(span.duration_s)
    assert ("eval_batch", "validation") in expected and ("forward", "train") in expected
    assert set(hists) == set(expected)
    ids = {(s.trace_id, s.span_id) for s in spans}
    for key, durations in expected.items():
        dp = hists[key]
        assert int(dp["count"]) == len(durations), key
        assert dp["sum"] == pytest.approx(sum(durations), rel=1e-9, abs=1e-9), key
        assert dp["min"] == pytest.approx(min(durations), abs=1e-9), key
        assert dp["max"] == pytest.approx(max(durations), abs=1e-9), key
        buckets = [0] * (len(_sampling.BOUNDS) + 1)
        for seconds in durations:
            buckets[bisect.bisect_left(_sampling.BOUNDS, seconds)] += 1
        assert [int(c) for c in dp["bucketCounts"]] == buckets, key
        (exemplar,) = dp["exemplars"]  # points at a span that was written
        assert (exemplar["traceId"], exemplar["spanId"]) in ids


def test_sampled_runs_keep_exact_histograms_and_account_for_every_span(tmp_path: Path) -> None:
    prof = otelprof.instrument(
        output_dir=str(tmp_path), run_id="sampled", trace_budget=0,
        host_metrics=False, process_metrics=False,
    )  # fmt: skip
    _sampling_burst = _sampling.HEAD_BURST
    try:
        _train(prof, 3000)
    finally:
        prof.shutdown()
    stats = prof.stats()
    hists = timing_histograms(prof.files["metrics"])
    assert int(hists[("forward", "train")]["count"]) == 3000
    assert int(hists[("step", "train")]["count"]) == 3000
    assert int(hists[("eval_batch", "validation")]["count"]) == 60
    recorded = sum(int(dp["count"]) for dp in hists.values())
    written = len(read_spans(prof.files["traces"]))
    assert stats["timings.spans_sampled_out"] > 0
    assert written + stats["timings.spans_sampled_out"] == recorded
    assert written <= _sampling_burst + _sampling.TAIL_BURST + 1000
    assert stats["dropped_total"] == 0  # sampling out is not a loss


def test_batched_durations_fill_the_same_buckets_as_one_at_a_time() -> None:
    # every bound's edge in integer ns, both sides, plus a spread of ordinary values
    values = [k + d for k in _sampling.BOUNDS_NS for d in (-1, 0, 1)]
    values += [random.randrange(1, 10**10) for _ in range(2000)] + [0, 10**13]
    one, batch = _sampling.DurationHistogram(), _sampling.DurationHistogram()
    for ns in values:
        one.add(ns / 1e9)
    batch.add_ns(values[:1000])
    batch.add_ns(values[1000:])
    # batches within one bucket, a single duration, and one spanning every bucket, unsorted
    for extra in ([5_000, 5_001, 5_002], [7], [10**13, 0, *_sampling.BOUNDS_NS[::-1]]):
        for ns in extra:
            one.add(ns / 1e9)
        batch.add_ns(list(extra))
    assert batch.buckets == one.buckets
    assert (batch.count, batch.min, batch.max) == (one.count, one.min, one.max)
    assert batch.sum == pytest.approx(one.sum, rel=1e-12)


def test_row_columns_fold_into_the_same_histogram_as_a_sorted_batch() -> None:
    # rows of 3 columns (two ranges, the step) as the on-thread sampler packs them, every bound's
    # edge on both sides in one column, ordinary values in the others
    edges = [k + d for k in _sampling.BOUNDS_NS for d in (-1, 0, 1)] + [0, 10**13]
    rows = [(ns, random.randrange(1, 10**10), random.randrange(10**6, 10**9)) for ns in edges]
    values = memoryview(array("q", [v for row in rows for v in row]).tobytes()).cast("q")
    for index in range(3):
        folded, batch = _sampling.DurationHistogram(), _sampling.DurationHistogram()
        folded.add_column(values, index, 3)
        batch.add_ns([row[index] for row in rows])
        assert folded.buckets == batch.buckets
        assert (folded.count, folded.sum, folded.min, folded.max) == (
            batch.count,
            batch.sum,
            batch.min,
            batch.max,
        )
    empty = _sampling.DurationHistogram()
    empty.add_column(values, 3 * len(rows), 3)
    assert (empty.count, sum(empty.buckets), empty.min) == (0, 0, math.inf)


def test_a_column_whose_total_overflows_int64_is_still_counted_exactly() -> None:
    huge = (1 << 62) + 5
    values = memoryview(array("q", [huge, 1, huge, 2, huge, 3]).tobytes()).cast("q")
    hist = _sampling.DurationHistogram()
    hist.add_column(values, 0, 2)
    assert (hist.count, hist.sum) == (3, 3 * huge / 1e9)
    assert hist.buckets[-1] == 3


def test_ranks_with_different_loads_keep_nested_head_steps_and_a_fixed_fraction_equal_ones() -> (
    None
):
    """Two ranks at the same step rate, one recording twice the spans per step: against the
    same budget the busier one picks a level one higher, so its head steps are a subset of
    the other's (every step it keeps, both keep). With `head_fraction` both pick the same."""

    def head_steps(
        spans_per_step: int, budget: float = 40.0, **kw: Any
    ) -> tuple[set[int], int | None]:
        sampler, out, clock = _sampler(budget=budget, head_burst=200.0, tail_burst=0.0, **kw)
        t = 1_000_000_000
        for number in range(20_000):  # 1 ms steps
            ctx = _Ctx(number)
            for child in range(spans_per_step - 1):
                item = SpanFields("x", 1, child + 10, 9, t, t + 1, {}, None)
                sampler.span(ctx, item, False, 0.001, False)
            step = SpanFields("step", 1, 9, 0, t, t + 1_000_000, {"otelprof.step": number}, None)
            sampler.span(ctx, step, True, 0.001, False, "step")
            t += 1_000_000
            clock.now += 0.001
        kept = _kept_steps(out)
        later = {
            i for i, f in kept.items() if f.attributes["otelprof.sampled"] == "head" and i >= 1000
        }
        return later, sampler.head_level

    light, light_level = head_steps(2)
    busy, busy_level = head_steps(4)
    assert (light_level, busy_level) == (7, 8)
    assert busy and busy < light
    # a fixed fraction: the same steps, while the budget's head half has room for them
    fixed = [head_steps(n, budget=100.0, head_fraction=0.01) for n in (2, 4)]
    assert fixed[0] == fixed[1] and fixed[0][1] == 7  # 0.01 -> one step in 128


def test_a_phase_of_one_batch_keeps_its_span_after_fast_steps_raised_the_head_level() -> None:
    """The report learns that a phase ran (and when) from its root spans: a one-batch
    validation after thousands of fast training steps must not be sampled out with them."""
    sampler, out, clock = _sampler(budget=40.0, head_burst=200.0, tail_burst=0.0)
    durations = [0.001] * 5_000
    t = 1_000_000_000
    for number, seconds in enumerate(durations):
        ctx = _Ctx(number)
        step = SpanFields("step", 1, 9, 0, t, t + 1_000_000, {"otelprof.step": number}, None)
        sampler.span(ctx, step, True, seconds, False, "step")
        t += 1_000_000
        clock.now += seconds
    assert sampler.head_level is not None and sampler.head_level >= 5
    assert len(_kept_steps(out)) < len(durations) // 8  # the training steps are sampled
    for phase in ("validation", "test", "sanity_check"):
        ctx = _Ctx(0, phase)
        root = SpanFields("validate", 1, 99, 0, t, t + 5_000_000, {"otelprof.phase": phase}, None)
        sampler.span(ctx, root, True, 0.005, False, "validate")
        assert ctx.kept, phase
        assert out[-1].name == "validate" and out[-1].attributes["otelprof.sampled"] == "head"
        t += 5_000_000
        clock.now += 0.005


def test_the_head_level_holds_while_sampled_out_steps_arrive_in_batches() -> None:
    """30 ms steps of 11 spans: the training thread samples out the steps head sampling does
    not select and hands them over 64 at a time (2 s apart), as the on-thread sampler does. The
    level follows the load averaged over seconds, not each second's share of a batch, so it
    settles once; each window of published numbers costs one hash per selected number."""
    windows: list[int] = []

    class CountedTraces(RunTraces):
        def head_numbers(self, phase: str, low: int, high: int, level: int | None) -> Any:
            found = super().head_numbers(phase, low, high, level)
            windows.append(len(found))
            return found

    sampler, out, clock = _sampler(
        budget=10.0, head_burst=50.0, tail_burst=0.0, traces=CountedTraces("", 0)
    )
    spans, step_s, levels = 11, 0.030, []
    batched, published, next_publish = 0, (-math.inf, frozenset[int]()), 0.0
    t = 1_000_000_000
    for number in range(4_000):  # two minutes
        if clock.now >= next_publish:  # the builder's drain, every 0.2 s
            published = sampler.head_window("train", number)
            next_publish = clock.now + 0.2
        unknown, selected = published
        if number >= unknown or number in selected:
            ctx = _Ctx(number)
            step = SpanFields("step", 1, 9, 0, t, t + 30_000_000, {"otelprof.step": number}, None)
            for child in range(spans - 1):
                sampler.span(
                    ctx, SpanFields("x", 1, child + 10, 9, t, t + 1, {}), False, step_s, False
                )
            sampler.span(ctx, step, True, step_s, False, "step")
        else:
            batched += 1
            if batched == 64:
                sampler.sampled_out += 64 * spans
                sampler.offered(64 * spans)
                batched = 0
        if sampler.head_level != (levels[-1] if levels else None):
            levels.append(sampler.head_level)
        t += 30_000_000
        clock.now += step_s
    # 366 spans/s offered against the head's 5: one step in 128, reached and kept
    assert levels[-1] == 7, levels
    assert len(levels) <= 3, levels  # (None,) 0 -> 7 at most, no swinging
    assert windows and max(windows) <= _sampling.HEAD_WINDOW_SELECTED
    traces = RunTraces("", 0)
    head = {n for n, f in _kept_steps(out).items() if f.attributes["otelprof.sampled"] == "head"}
    later = {n for n in head if n >= 1000}
    assert later and all(traces.head_selected("train", n, 7) for n in later)
