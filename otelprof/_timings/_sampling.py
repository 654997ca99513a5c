"""Aggregate every step, keep the traces that matter: duration histograms, trace sampling,
anomaly-triggered capture. Runs on the span builder thread, never on the training thread.

Why: full traces of every fast step are gigabytes per hour, yet the report, dashboards and
Determined need exact per-timing figures. So every range goes into a (name, phase)
`DurationHistogram` (`otelprof.timing.duration`), and only head-, tail- and anomaly-sampled
steps' traces are written, each bucket with its own token budget. The rules and their
constants are documented in docs/guide/timings.md ("Trace sampling", "Anomaly-triggered
deep capture") and ARCHITECTURE.md ("Step N of every rank in one trace"). Sampled-out
spans are counted (`spans_sampled_out`), never as dropped: their durations are in the
histograms.
"""

from __future__ import annotations

import bisect
import copy
import math
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from otelprof._schema import ATTR_ANOMALY_RATIO, ATTR_SAMPLED, PHASE_TRAIN
from otelprof._timings._trace_ids import RunTraces, level_for

BOUNDS: tuple[float, ...] = tuple(1e-6 * 2 ** (i / 2) for i in range(61))
"""Histogram bucket bounds in seconds: 1 µs to ~1 ks, a factor √2 apart (percentiles read
from them are within ±19 %; count, sum, min and max are exact)."""


def _ns_bound(bound: float) -> int:
    """The largest integer duration in ns whose seconds (ns / 1e9) are <= `bound`: bisecting
    integer ns over these puts every duration in the bucket `bisect_left(BOUNDS, ns / 1e9)`
    would, exactly."""
    k = math.floor(bound * 1e9)
    while (k + 1) / 1e9 <= bound:
        k += 1
    while k / 1e9 > bound:
        k -= 1
    return k


BOUNDS_NS: tuple[int, ...] = tuple(_ns_bound(b) for b in BOUNDS)

HEAD_BURST = 5000.0
TAIL_BURST = 500.0
SLOW_WINDOW = 100
ANOMALY_FACTOR = 3.0
ANOMALY_MIN_S = 0.020
"""The least excess over the recent median that is an anomaly: a floor above scheduler
slices and GIL switch intervals (docs/guide/timings.md)."""
ANOMALY_BUDGET = 10.0
"""Anomaly steps kept per minute (default of the `trace_anomaly_budget` option)."""
ANOMALY_BURST = 20.0
"""Anomaly steps the anomaly bucket holds when full (a burst of real stalls is kept)."""
CAPTURE_STEPS = 5
CAPTURE_COOLDOWN_S = 60.0
KINETO_WINDOW_STEPS = 3
"""With kineto=True an anomaly also runs a torch.profiler window: 1 warm-up step, then this
many recorded steps, kept in full and linked from the slow step's span."""
LEVEL_WINDOW_S = 1.0
"""How often the head level is re-read from the offered load."""
LEVEL_RATE_S = 8.0
"""The offered load the level follows is averaged over this long: steps sampled out on their
thread arrive in batches (`OnThreadSampler.rows_per_item`), so a one-second rate would swing,
and every level change recomputes the head window (a burst of the builder's GIL time)."""
HEAD_WINDOW = 1 << 14
"""Numbers ahead whose head selection is computed at once (and published to the on-thread
sampler)."""
HEAD_WINDOW_SELECTED = 256
"""At most this many selected numbers per computed window (one hash each, GIL time): at low
levels a window spans `HEAD_WINDOW_SELECTED << level` numbers."""
MAX_BUFFERED = 100_000
"""Spans held while their step is undecided; past it the oldest steps are decided early."""


def anomaly_threshold(median: float) -> float:
    """The duration in seconds at or above which a step is an anomaly, given the median of
    the recent steps: `ANOMALY_FACTOR` x it, and at least `ANOMALY_MIN_S` more than it."""
    return max(ANOMALY_FACTOR * median, median + ANOMALY_MIN_S)


class DurationHistogram:
    """count, sum, min, max and bucket counts of one (timing, phase); exact except buckets."""

    __slots__ = ("buckets", "count", "exemplar", "max", "min", "sum")

    def __init__(self) -> None:
        self.count = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.buckets = [0] * (len(BOUNDS) + 1)
        self.exemplar: tuple[float, int, int, int] | None = None  # value, time, trace, span

    def add(self, seconds: float) -> None:
        self.count += 1
        self.sum += seconds
        if seconds < self.min:
            self.min = seconds
        if seconds > self.max:
            self.max = seconds
        self.buckets[bisect.bisect_left(BOUNDS, seconds)] += 1

    def add_ns(self, durations: list[int]) -> None:
        """Add a batch of durations in integer ns; sorts `durations` in place. Each bucket's
        count is the distance between two bisections (the per-duration work is the sort's,
        in C); bucket i holds BOUNDS_NS[i-1] < ns <= BOUNDS_NS[i], where `add` puts ns / 1e9."""
        if not durations:
            return
        durations.sort()
        self.count += len(durations)
        self.sum += sum(durations) / 1e9
        low, high = durations[0] / 1e9, durations[-1] / 1e9
        if low < self.min:
            self.min = low
        if high > self.max:
            self.max = high
        bounds, buckets = BOUNDS_NS, self.buckets
        first = bisect.bisect_left(bounds, durations[0])
        last = bisect.bisect_left(bounds, durations[-1])
        below = 0  # durations counted so far: all <= bounds[i - 1]
        for i in range(first, last):
            upto = bisect.bisect_right(durations, bounds[i], below)
            buckets[i] += upto - below
            below = upto
        buckets[last] += len(durations) - below

    def add_column(self, values: Any, start: int, stride: int) -> None:
        """Add every `stride`-th duration of `values`, a buffer of native int64 ns (rows of
        steps sampled out on their thread), from `start`: one column of those rows."""
        self.add_ns(list(memoryview(values).cast("B").cast("q")[start::stride]))


class Aggregates:
    """Histograms per (timing name, phase) from every recorded range; thread-safe reads."""

    def __init__(self) -> None:
        self.start_ns = time.time_ns()
        self._lock = threading.Lock()
        self.histograms: dict[tuple[str, str], DurationHistogram] = {}

    def add(self, name: str, phase: str, seconds: float) -> DurationHistogram:
        hist = self.histograms.get((name, phase)) or self.add_histogram(name, phase)
        hist.add(seconds)
        return hist

    def add_histogram(self, name: str, phase: str) -> DurationHistogram:
        """The histogram of (name, phase), created if new."""
        key = (name, phase)
        hist = self.histograms.get(key)
        if hist is None:
            with self._lock:
                hist = self.histograms[key] = DurationHistogram()
        return hist

    def snapshot(self) -> list[tuple[str, str, DurationHistogram]]:
        """A consistent copy of every histogram (for export on another thread)."""
        with self._lock:
            items = list(self.histograms.items())
        out = []
        for (name, phase), hist in items:
            snapshot = copy.copy(hist)
            snapshot.buckets = list(hist.buckets)
            out.append((name, phase, snapshot))
        return out


class TokenBucket:
    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self._clock = clock
        self._last = clock()

    def available(self) -> float:
        """The largest `n` that `take(n)` would grant now (inf: any; -1: none)."""
        if self.burst <= 0:
            return -1.0
        tokens = min(self.burst, self.tokens + (self._clock() - self._last) * self.rate)
        return math.inf if tokens >= self.burst else tokens

    def could_take(self, n: float) -> bool:
        """Whether `take(n)` would succeed now (takes nothing)."""
        tokens = min(self.burst, self.tokens + (self._clock() - self._last) * self.rate)
        return self.burst > 0 and tokens >= min(n, self.burst)

    def take(self, n: float) -> bool:
        """Take `n` tokens if the bucket holds them (a step bigger than the burst needs a
        full bucket, and leaves it in debt)."""
        now = self._clock()
        self.tokens = min(self.burst, self.tokens + (now - self._last) * self.rate)
        self._last = now
        if self.burst > 0 and self.tokens >= min(n, self.burst):
            self.tokens -= n
            return True
        return False


class SpanFields(NamedTuple):
    """One span as the builder writes it (`_builder.SpanBuilder.fields`); times in Unix ns."""

    name: str
    trace_id: int
    span_id: int
    parent_id: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: tuple[str, str, str] | None = None
    links: tuple[tuple[int, int, dict[str, Any]], ...] = ()
    """(trace id, span id, attributes) of linked spans (an anomaly's captured steps)."""


class _Pending:
    __slots__ = ("error", "items")

    def __init__(self) -> None:
        self.items: list[Any] = []  # buffered items (frames), built only if kept
        self.error = False


class TraceSampler:
    """Buffers each step's spans until the step ends, then keeps or samples them out."""

    def __init__(
        self,
        budget: float,
        output: Callable[[SpanFields], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        head_burst: float = HEAD_BURST,
        tail_burst: float = TAIL_BURST,
        build: Callable[[Any], SpanFields | None] | None = None,
        traces: RunTraces | None = None,
        head_fraction: float | None = None,
        anomaly_budget: float = ANOMALY_BUDGET,
    ) -> None:
        """`build(item)` turns a buffered item into span fields (None: it could not be
        built), called only for kept steps, so a sampled-out range costs no span fields.
        `traces`: the run attempt's head selection (`_trace_ids`); `head_fraction`: a
        fixed share of steps for head sampling (None: follow the budget);
        `anomaly_budget`: anomaly steps kept per minute (inf: every one; 0: none)."""
        self._build = build or (lambda item: item)
        self.keep_all = math.isinf(budget)
        self._head = TokenBucket(budget / 2, head_burst, clock)
        self._tail = TokenBucket(budget / 2, tail_burst, clock)
        self._every_anomaly = math.isinf(anomaly_budget)
        self._anomaly = TokenBucket(
            0.0 if self._every_anomaly else anomaly_budget / 60,
            ANOMALY_BURST if anomaly_budget > 0 else 0.0,
            clock,
        )
        self._output = output
        self._clock = clock
        self._traces = traces if traces is not None else RunTraces("", 0)
        self._fixed_level = head_fraction is not None
        self.head_level: int | None = (
            level_for(head_fraction) if head_fraction is not None else (0 if budget > 0 else None)
        )
        self._bursting = not self._fixed_level  # level 0 until half the burst is spent
        self._head_spent = 0
        self._offered = 0  # spans of steps ended since `_offered_since` (kept or not)
        self._offered_since = clock()
        # (start, spans) of the last LEVEL_RATE_S of level windows, the current one excluded
        self._offered_windows: deque[tuple[float, int]] = deque()
        self._windows: dict[str, tuple[int | None, int, int, frozenset[int]]] = {}
        self.last_number: dict[str, int] = {}  # per phase, of the last step decided
        self.head_refused = 0  # head-selected steps the head bucket had no room for
        self._pending: dict[Any, _Pending] = {}
        self._buffered = 0
        # per root-span name (`step`, `validation`, ...): phases are not compared
        self._recent_by_root: dict[str, deque[float]] = {}
        self._median: dict[str, tuple[float, int]] = {}
        self._capture_left = 0
        self._held: SpanFields | None = None  # the anomalous step's span, until linked
        self._held_links: list[tuple[int, int, dict[str, Any]]] = []
        self._last_capture = -math.inf
        self.sampled_out = 0
        self.kept_steps: Counter[str] = Counter()  # kept steps by why they were kept
        self.anomalies = 0  # steps the rule fired on, kept or not
        self.anomalies_refused = 0  # ... that the anomaly budget had no room for
        self.on_anomaly: Callable[[Any, float], bool] | None = None
        self.on_sampled_out: Callable[[list[Any]], None] | None = None
        """Called with a sampled-out step's buffered items (e.g. to recycle their resources)."""
        self._awaiting_window = 0  # Kineto window steps the held span still waits for

    # ---- spans ----
    def span(
        self, ctx: Any, item: Any, is_step: bool, seconds: float, error: bool, name: str = ""
    ) -> None:
        """A finished span of step `ctx` (`item`, built into fields only if kept); the step
        span itself (`name` = the root's name) ends the step."""
        decided = getattr(ctx, "kept", None)
        if decided is not None:  # decided early (flush, a Kineto window): follow it
            if is_step:
                self._recent_of(name).append(seconds)
                if decided and getattr(ctx, "kineto_capture", False):
                    fields = self._build(item)
                    if fields is not None:
                        attributes = {**fields.attributes, ATTR_SAMPLED: "capture.kineto"}
                        self._output(fields._replace(attributes=attributes))
                        self.kept_steps["capture.kineto"] += 1
                        self.window_step(fields)
                    return
            if decided:
                self._emit(item)
            else:
                self.sampled_out += 1
            return
        if not is_step:
            self.buffer(ctx, [item], error)
            return
        pending = self._pending.pop(ctx, None) or _Pending()
        self._buffered -= len(pending.items)
        self._decide(ctx, pending, item, seconds, name)

    def buffer(self, ctx: Any, items: list[Any], error: bool = False) -> None:
        """Hold `items` of step `ctx` (not decided yet) until the step span comes; past
        MAX_BUFFERED items in all, the oldest steps are decided early (by the head budget)."""
        pending = self._pending.get(ctx)
        if pending is None:
            pending = self._pending[ctx] = _Pending()
        pending.items.extend(items)
        if error:
            pending.error = True
        self._buffered += len(items)
        if self._buffered > MAX_BUFFERED:
            oldest = next(iter(self._pending))
            self._decide_by_head(oldest, self._pending[oldest])

    def release_decided(self) -> None:
        """Items held for steps decided elsewhere as sampled out (`kept` False: on their own
        thread, see `_recorder.OnThreadSampler`) are counted as sampled out and dropped."""
        for ctx in [ctx for ctx in self._pending if getattr(ctx, "kept", None) is False]:
            items = self._pending.pop(ctx).items
            self._buffered -= len(items)
            self.sampled_out += len(items)

    def add_recent(self, root: str, seconds: Iterable[float]) -> None:
        """Durations of steps named `root` decided elsewhere, for the recent window (tail
        sampling's slowest, the anomaly median)."""
        self._recent_of(root).extend(seconds)

    def roots(self) -> list[str]:
        """The root span names seen so far (`step`, `validation`, ...)."""
        return list(self._recent_by_root)

    def _emit(self, item: Any) -> None:
        fields = self._build(item)
        if fields is not None:
            self._output(fields)

    def flush(self) -> None:
        """An explicit flush: steps still open that head sampling selects are written now
        if the head budget allows (their tail decision is lost), others stay buffered."""
        for ctx, pending in list(self._pending.items()):
            if self.keep_all or (
                self.head_selects(ctx) and self._head.take(len(pending.items) + 1)
            ):
                self._release(ctx, pending, "head")

    def finish(self) -> None:
        """Shutdown: steps whose step span never came (still open) go by the head budget."""
        self._release_held()
        for ctx, pending in list(self._pending.items()):
            self._decide_by_head(ctx, pending)

    def _release(self, ctx: Any, pending: _Pending, why: str) -> None:
        if self._pending.pop(ctx, None) is not None:  # (`_decide`'s step is out already)
            self._buffered -= len(pending.items)
        ctx.kept = True
        self.kept_steps[why] += 1
        for item in pending.items:
            self._emit(item)

    def _decide_by_head(self, ctx: Any, pending: _Pending) -> None:
        if self.keep_all or self._head.take(len(pending.items)):
            self._release(ctx, pending, "head")
        else:  # the head budget cannot take it: its items are counted, not exported
            del self._pending[ctx]
            self._buffered -= len(pending.items)
            ctx.kept = False
            self.sampled_out += len(pending.items)

    def _recent_of(self, root: str) -> deque[float]:
        recent = self._recent_by_root.get(root)
        if recent is None:
            recent = self._recent_by_root[root] = deque(maxlen=SLOW_WINDOW)
        return recent

    # ---- the decision ----
    def quiet(self, root: str) -> tuple[float, float, deque[float]] | None:
        """What it takes to be kept right now, for steps named `root`: (tail tokens,
        anomaly threshold in ns, the recent-steps window). A step of `n` spans, not
        head-selected (`head_window`), no error and a duration under the threshold, with
        `n` above the tail tokens, is sampled out by `_decide` (tail.slowest needs tail
        tokens), so a caller may decide a run of such steps without it. None when no step
        is certainly sampled out now.
        Valid until the next `_decide` (which may take tokens) or for a fraction of a
        second (tokens refill): the builder publishes one per drain (`_recorder.OnThreadSampler`).
        Takes nothing."""
        if self.keep_all or self._capture_left > 0:
            return None
        recent = self._recent_by_root.get(root)
        if recent is None or len(recent) < 10:
            return None
        # the rule keeps a slow step during a capture's cooldown too: never inf
        # (a step over it the anomaly budget refuses still goes to `_decide`, to be counted)
        anomaly_ns = anomaly_threshold(statistics.median(recent)) * 1e9
        return self._tail.available(), anomaly_ns, recent

    # ---- head sampling: the same steps on every rank ----
    def head_selects(self, ctx: Any) -> bool:
        """Whether head sampling selects step `ctx` (by its phase and number only)."""
        level = self.head_level
        if level is None:
            return False
        number = getattr(ctx, "number", None)
        if number is None:
            return False
        phase = getattr(ctx, "phase", None) or PHASE_TRAIN
        self.last_number[phase] = number
        if level == 0:
            return number >= 0
        window = self._windows.get(phase)
        if window is None or window[0] != level or number >= window[2]:
            window = self._window(phase, number, level)
        if number < window[1]:  # behind the published window (the builder lags): compute
            return self._traces.head_selected(phase, number, level)
        return number in window[3]

    def head_window(self, phase: str, start: int) -> tuple[float, frozenset[int]]:
        """For the on-thread sampler: (numbers at or above it are not known here, the numbers
        below it that head sampling selects), from `start` on."""
        level = self.head_level
        if level is None:
            return math.inf, frozenset()
        if level == 0:
            return -math.inf, frozenset()  # every step: all to the builder
        _, low, high, selected = self._window(phase, start, level)
        return (high, selected) if low <= start else (-math.inf, frozenset())

    def _window(
        self, phase: str, number: int, level: int
    ) -> tuple[int | None, int, int, frozenset[int]]:
        window = self._windows.get(phase)
        if (
            window is None
            or window[0] != level
            or not window[1] <= number < (window[1] + window[2]) // 2
        ):
            low = max(0, number)
            high = low + min(HEAD_WINDOW, HEAD_WINDOW_SELECTED << level)
            window = (level, low, high, self._traces.head_numbers(phase, low, high, level))
            self._windows[phase] = window
        return window

    def offered(self, spans: int) -> None:
        """Spans of ended steps (kept or not): the load the head level follows."""
        self._offered += spans
        now = self._clock()
        elapsed = now - self._offered_since
        if elapsed >= LEVEL_WINDOW_S or (  # and as soon as the burst is half spent
            self._bursting and elapsed > 0 and self._head_spent >= self._head.burst / 2
        ):
            windows = self._offered_windows
            windows.append((self._offered_since, self._offered))
            while len(windows) > 1 and now - windows[1][0] >= LEVEL_RATE_S:
                windows.popleft()
            self._update_level(sum(n for _, n in windows) / (now - windows[0][0]))
            self._offered = 0
            self._offered_since = now

    def _update_level(self, offered_per_s: float) -> None:
        head = self._head
        if self._fixed_level or self.keep_all or head.rate <= 0:
            return
        if self._bursting:
            if self._head_spent < head.burst / 2:
                return  # a short run keeps everything
            self._bursting = False
        need = 0 if offered_per_s <= head.rate else math.ceil(math.log2(offered_per_s / head.rate))
        level = self.head_level or 0
        if need > level:
            level = need
        elif need + 1 < level:  # lowered with a margin: a load near a boundary stays put
            level = need + 1
        self.head_level = level

    def _decide(
        self, ctx: Any, pending: _Pending, step_item: Any, seconds: float, root: str
    ) -> None:
        n = len(pending.items) + 1
        recent = self._recent_of(root)
        why: str | None = None
        ratio = 0.0
        captures = False
        if self.keep_all:
            why = "all"
        if len(recent) >= 10:
            median, age = self._median.get(root, (0.0, 0))
            if age <= 0:  # recomputed every 16 steps: cheap, and the window moves slowly
                median, age = statistics.median(recent), 16
            self._median[root] = (median, age - 1)
            ratio = seconds / median if median > 0 else math.inf
            now = self._clock()
            # a slow step inside a running capture stays one of its captured steps
            if seconds >= anomaly_threshold(median) and self._capture_left == 0:
                self.anomalies += 1
                starts = now - self._last_capture >= CAPTURE_COOLDOWN_S
                if (
                    self.keep_all
                    or self._every_anomaly
                    or self._anomaly.take(1)
                    or (starts and self._anomaly.burst > 0)  # one per cooldown, always
                ):
                    why = "anomaly"
                    if starts:
                        self._last_capture = now
                        captures = True
                        self._capture_left = CAPTURE_STEPS
                        if self.on_anomaly is not None and self.on_anomaly(ctx, ratio):
                            self._awaiting_window = KINETO_WINDOW_STEPS
                else:
                    self.anomalies_refused += 1  # head and tail sampling may still keep it
        if why is None and self._capture_left > 0:
            self._capture_left -= 1
            why = "capture"
        self.offered(n)
        if why is None and self.head_selects(ctx):
            if self._head.take(n):
                why = "head"
                self._head_spent += n
            else:
                self.head_refused += 1
        if why is None and pending.error and self._tail.take(n):
            why = "tail.error"
        if (
            why is None
            and recent
            and self._tail.could_take(n)  # mostly empty at fast steps: skip max() then
            and seconds > max(recent)
            and self._tail.take(n)
        ):
            why = "tail.slowest"
        recent.append(seconds)
        if why is None:
            ctx.kept = False
            self.sampled_out += n
            if self.on_sampled_out is not None:
                self.on_sampled_out(pending.items)
            return
        self._release(ctx, pending, why)
        step = self._build(step_item)
        if step is None:
            return
        attributes = dict(step.attributes)
        attributes[ATTR_SAMPLED] = why
        if why == "anomaly":
            attributes[ATTR_ANOMALY_RATIO] = round(ratio, 3)
        if captures:
            # held until its capture is done, so it can link to the captured steps
            self._release_held()
            self._held = step._replace(attributes=attributes)
            self._held_links = []
            return
        self._output(step._replace(attributes=attributes))
        if why == "capture" and self._held is not None:
            self._held_links.append((step.trace_id, step.span_id, {ATTR_SAMPLED: "capture"}))
            if self._capture_left == 0 and self._awaiting_window <= 0:
                self._release_held()

    def window_step(self, fields: SpanFields) -> None:
        """A step of the Kineto window an anomaly started (kept in full, its ops are child
        spans): the held slow step links to it too, and is released after the last one."""
        if self._held is None:
            return
        self._held_links.append((fields.trace_id, fields.span_id, {ATTR_SAMPLED: "capture.kineto"}))
        self._awaiting_window -= 1
        if self._awaiting_window <= 0 and self._capture_left == 0:
            self._release_held()

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._output(held._replace(links=tuple(self._held_links)))
