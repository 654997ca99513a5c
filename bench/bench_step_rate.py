"""Step-rate overhead, background CPU per span and data volume, measured the way users run it.

    .venv/bin/python bench/bench_step_rate.py [--step-ms 0.3 30] [--pairs 40] [--block-seconds 0.5]
    .venv/bin/python bench/bench_step_rate.py --method sessions [--pairs 6] [--block-seconds 2]

`--method interleaved` (default): one `otelprof.instrument()` session stays up (default
settings, every background thread free), in its steady state; short blocks alternate A-B-B-A
between the bare loop (the same matmuls, no otelprof call at all) and the instrumented loop
(six `otelprof.timing` blocks and `otelprof.step()` per step). A shared VM's speed drifts by
±25 % over seconds, so many short pairs compared pair by pair give a far steadier figure than
a few long sessions. An instrumented block's time includes the span builder's catch-up after
it (the ranges it recorded that were still queued when the block ended, built before the
next bare block starts), so no otelprof work is left to land in a bare block.

`--method sessions`: the older way, a whole `instrument()`/`shutdown()` per instrumented block:

A CPU training step of `--step-ms` (small torch matmuls, 1 intra-op thread) split over
Determined's six timings (`dataloader_next`, `to_device`, `train_batch`, `step_lr_schedulers`,
`from_device`, `reduce_metrics`), each an `otelprof.timing` block, then `otelprof.step()`.
Instrumented blocks run under a plain `otelprof.instrument()` (default settings: detached
mode writing OTLP JSON Lines, hardware metrics every 1 s, every background thread free to
run); baseline blocks run the same loop with no profiler. Blocks alternate A-B-B-A. The
step's work is recalibrated before every pair (machine load moves the time per matmul);
pairs whose bare step lands outside 1.25x of the target are printed and not counted.
Instrumented blocks are timed once the head budget's initial burst (5,000 written spans) is
spent, as in any run longer than a few seconds; `--include-burst` times them from
`instrument()` on.

Printed per step length:
- steps/s bare and instrumented (median over blocks) and their ratio (goal: <= 5 % slower at
  0.3 ms steps, <= 1 % at 30 ms);
- background CPU per range and per written span: CPU of otelprof's and the SDK's threads in
  the timed part of instrumented blocks / ranges recorded (7 per step) or spans written
  (goal <= 10 µs per span);
- detached data per day in the steady state (goal <= 1 GB/rank/day): one longer
  instrumented block per step length, bytes written over `--volume-seconds` once the head
  and tail budgets' initial bursts are spent (both window ends flushed: lines hold up to
  5 s), times 86,400; with `--compress` also for compress=True.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from _machine import background_cpu, cpu_model

import otelprof

TIMINGS = (
    "dataloader_next",
    "to_device",
    "train_batch",
    "step_lr_schedulers",
    "from_device",
    "reduce_metrics",
)
SHARES = (0.2, 0.05, 0.6, 0.05, 0.05, 0.05)
TOLERANCE = 1.25
"""A pair counts only if its bare block's measured step is within this factor of the target:
a load change mid-pair otherwise turns a "0.3 ms" figure into one for 0.15 ms steps."""


_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)
"""Student's t, 97.5th percentile, for 1-9 degrees of freedom (the expansion below is off
by more than 0.003 there)."""


def t975(df: int) -> float:
    """Student's t, 97.5th percentile, for `df` degrees of freedom: the 95 % half-interval
    of a mean over few rounds is wider than 1.96 standard errors (2.09 at 20 rounds). Past
    9 degrees of freedom, the normal quantile's two-term expansion (within 0.003)."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_and_interval(values: list[float]) -> tuple[float, float]:
    """The mean of paired differences or ratios and its 95 % half-interval (Student's t):
    whether a cost below the scatter of single pairs was resolved at all (two or more
    values)."""
    n = len(values)
    return statistics.fmean(values), t975(n - 1) * statistics.stdev(values) / math.sqrt(n)


@contextlib.contextmanager
def between_steps(prof: Any) -> Iterator[None]:
    """Run a bare block of an interleaved pair with no step open, as a user's loop never
    runs hundreds of ms of work outside `otelprof.step()`. Without it the step the instrumented
    block's last `otelprof.step()` began spans the whole bare block: torch's own bridged ranges
    there (DataLoader, Optimizer) are recorded into it, and the next instrumented block
    pays for one 0.5 s step of thousands of ranges, while the bare block pays the bridge.
    The step's clock restarts when the bare block ends; background threads run throughout."""
    from otelprof._timings import _recorder

    engine = prof._timings
    ctx = engine._ctx
    _recorder.recorder.record(None)
    try:
        yield
    finally:
        now = time.perf_counter_ns()
        if ctx is not None:
            ctx.start_ns = now
        engine._step_start = now
        if engine._train_t0 is not None:
            engine._train_t0 = now
        _recorder.recorder.record(ctx)


class GcClock:
    """Time the garbage collector runs, on any thread, and how many full collections: state
    that outlives a step (rows, queued ranges) gets promoted, and a full collection of a
    training process's heap holds the GIL for 0.1 s or more."""

    def __init__(self) -> None:
        self.ns = 0
        self.full = 0
        self._started: dict[int, int] = {}

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, *_exc: object) -> None:
        gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        thread = threading.get_ident()
        if phase == "start":
            self._started[thread] = time.perf_counter_ns()
            return
        started = self._started.pop(thread, None)
        if started is not None:
            self.ns += time.perf_counter_ns() - started
            self.full += info["generation"] == 2


class Work:
    """`units` small matmuls: calibrated so the six parts add up to the step length."""

    def __init__(self) -> None:
        self.a = torch.randn(32, 32)

    def run(self, units: int) -> None:
        a = self.a
        for _ in range(units):
            torch.mm(a, a)


def _calibrate(work: Work, step_s: float, units: list[int] | None = None) -> list[int]:
    """Units per timing so that a bare step takes `step_s` *now*: the time per matmul moves
    with the machine's load, so this is re-run before every A-B pair, measuring whole bare
    steps (the loop itself included) and scaling until one lands within 5 % of the target."""
    if units is None:
        start = time.perf_counter()
        work.run(2000)
        per_unit = (time.perf_counter() - start) / 2000
        total = max(len(SHARES), round(step_s / per_unit))
        units = [max(1, round(total * share)) for share in SHARES]
    for _ in range(4):
        steps = _loop(work, units, 0.25, None)
        measured = 0.25 / max(steps, 1)
        scale = step_s / measured
        if abs(scale - 1) < 0.05:
            break
        units = [max(1, round(n * scale)) for n in units]
    return units


def _loop(work: Work, units: list[int], seconds: float, prof: Any) -> int:
    timing = otelprof.timing
    steps = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for name, n in zip(TIMINGS, units, strict=True):
            with timing(name):
                work.run(n)
        if prof is not None:
            otelprof.step()
        steps += 1
    return steps


def _block(
    work: Work,
    units: list[int],
    seconds: float,
    instrumented: bool,
    out: Path,
    index: int,
    steady: bool,
) -> dict[str, float]:
    """One timed block; with `steady`, timing starts once the sampler samples out (the head
    budget's initial burst of 5,000 written spans is spent), as in any run longer than a few
    seconds; both kinds of block get the same short warm-up besides."""
    prof = None
    if instrumented:
        prof = otelprof.instrument(output_dir=str(out), run_id=f"b{index}")
    if steady:
        waited = 0.0
        while prof is not None and waited < 60 and not _stat(prof, "timings.spans_sampled_out"):
            _loop(work, units, 0.25, prof)
            waited += 0.25
        _loop(work, units, 0.3, prof)
    before = _stat(prof, "timings.spans_recorded") if prof is not None else 0
    background = background_cpu()
    start = time.perf_counter()
    steps = _loop(work, units, seconds, prof)
    wall = time.perf_counter() - start
    result: dict[str, float] = {"steps_per_s": steps / wall, "step_ms": wall / max(steps, 1) * 1e3}
    if prof is not None:
        background = background_cpu() - background
        spans = _stat(prof, "timings.spans_recorded") - before  # lags by one builder wake-up
        prof.shutdown()
        stats = prof.stats()
        run_dir = out / f"b{index}"
        size = sum(p.stat().st_size for p in run_dir.iterdir() if p.is_file())
        result.update(
            background_s=background,
            spans=spans,
            ranges=steps * (len(TIMINGS) + 1),
            bytes_per_s=size / wall,
            bytes_per_step=size / max(steps, 1),
            dropped=stats.get("dropped_total", 0),
        )
    return result


def _bare_loop(work: Work, units: list[int], seconds: float) -> int:
    """The baseline of the interleaved method: the same work, no otelprof call at all."""
    steps = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for n in units:
            work.run(n)
        steps += 1
    return steps


def _interleaved(work: Work, step_ms: float, args: Any, out: Path, index: int) -> list[int]:
    """Pairs of bare and instrumented blocks inside one steady-state session (see module
    doc); prints each pair and the summary, returns the last calibration."""
    units = _calibrate(work, step_ms / 1000, None)
    prof = otelprof.instrument(output_dir=str(out), run_id=f"i{index}")
    builder = prof._timings._builder  # the span builder, for its catch-up after a block
    try:
        waited = 0.0  # steady state: the initial head and tail bursts are spent, and
        # steps are sampled out where they ran (timings.steps_sampled_out_on_thread)
        while waited < 120 and _stat(prof, "timings.steps_sampled_out_on_thread") < 1000:
            _loop(work, units, 0.25, prof)
            waited += 0.25
        _loop(work, units, 0.5, prof)
        builder.drain(final=True, timeout_s=10.0)
        bare: list[float] = []
        inst: list[float] = []
        cpu_per_step: dict[bool, list[float]] = {False: [], True: []}  # training thread, µs
        gc_ns = {False: 0, True: 0}
        gc_full = {False: 0, True: 0}
        all_steps = {False: 0, True: 0}
        ranges = 0
        background = 0.0
        off = 0
        with GcClock() as collector:
            for pair in range(args.pairs):
                if pair % 4 == 0:
                    units = _calibrate_bare(work, step_ms / 1000, units)
                order = (False, True) if pair % 2 == 0 else (True, False)
                times: dict[bool, float] = {}
                thread_cpu: dict[bool, float] = {}
                for instrumented in order:
                    own = time.thread_time()
                    collected = (collector.ns, collector.full)
                    if instrumented:
                        cpu = background_cpu()
                        start = time.perf_counter()
                        steps = _loop(work, units, args.block_seconds, prof)
                        builder.drain(final=True, timeout_s=10.0)
                        wall = time.perf_counter() - start
                        background += background_cpu() - cpu
                        ranges += steps * (len(TIMINGS) + 1)
                    else:
                        with between_steps(prof):
                            start = time.perf_counter()
                            steps = _bare_loop(work, units, args.block_seconds)
                            wall = time.perf_counter() - start
                    times[instrumented] = wall / max(steps, 1) * 1e3
                    thread_cpu[instrumented] = (time.thread_time() - own) / max(steps, 1) * 1e6
                    gc_ns[instrumented] += collector.ns - collected[0]
                    gc_full[instrumented] += collector.full - collected[1]
                    all_steps[instrumented] += steps
                ratio = times[False] / step_ms
                if not 1 / TOLERANCE <= ratio <= TOLERANCE:
                    off += 1
                    continue
                bare.append(times[False])
                inst.append(times[True])
                for instrumented, used in thread_cpu.items():
                    cpu_per_step[instrumented].append(used)
        stats = prof.stats()
    finally:
        prof.shutdown()
    print(
        f"step {step_ms} ms, interleaved in one session, {len(bare)} of {args.pairs} pairs "
        f"counted ({off} off target: bare step outside ±{TOLERANCE}x)"
    )
    if not bare:
        return units
    over = sorted(i / b - 1 for b, i in zip(bare, inst, strict=True))
    quart = (over[len(over) // 4], over[(3 * len(over)) // 4])
    print(
        f"  bare step median {statistics.median(bare):.3f} ms, instrumented "
        f"{statistics.median(inst):.3f} ms; per-pair overhead median "
        f"{statistics.median(over) * 100:+.1f} % (quartiles {quart[0] * 100:+.1f} / "
        f"{quart[1] * 100:+.1f} %); total {(sum(inst) / sum(bare) - 1) * 100:+.1f} %"
    )
    per_step = background / max(ranges, 1) * 1e6 * (len(TIMINGS) + 1)
    print(
        f"  background CPU {background:.2f} s over {ranges:,} ranges = "
        f"{background / max(ranges, 1) * 1e6:.2f} µs per range "
        f"({per_step:.1f} µs per step); dropped {stats.get('dropped_total', 0)}"
    )
    # CPU accounting, steadier than wall clock on a shared machine: what the training thread
    # spends per step beyond the bare loop, plus the background threads' CPU per step (an
    # upper bound of what they can take from it through the GIL)
    own = statistics.median(cpu_per_step[True]) - statistics.median(cpu_per_step[False])
    share = (own + per_step) / (statistics.median(bare) * 1e3) * 100
    print(
        f"  training-thread CPU per step: bare {statistics.median(cpu_per_step[False]):.1f} µs, "
        f"instrumented {statistics.median(cpu_per_step[True]):.1f} µs ({own:+.1f} µs); "
        f"with the background's: {share:+.1f} % of a bare step"
    )
    # at long steps the training thread's own extra CPU is far below the bare step's scatter:
    # the pairs' differences, mean and 95 % interval, say whether it was resolved at all
    paired = [i - b for b, i in zip(cpu_per_step[False], cpu_per_step[True], strict=True)]
    if len(paired) > 1:
        mean, half = mean_and_interval(paired)
        step_us = statistics.median(bare) * 1e3
        print(
            f"  training-thread CPU per step, paired: {mean:+.1f} ± {half:.1f} µs (95 %); with "
            f"the background's: {(mean + per_step) / step_us * 100:+.2f} ± "
            f"{half / step_us * 100:.2f} % of a bare step"
        )
    print(
        "  garbage collection (any thread) per step: bare "
        + ", instrumented ".join(
            f"{gc_ns[kind] / max(all_steps[kind], 1) / 1e3:.2f} µs ({gc_full[kind]} full)"
            for kind in (False, True)
        )
        + "\n"
    )
    return units


def _calibrate_bare(work: Work, step_s: float, units: list[int]) -> list[int]:
    """`_calibrate` for the bare loop of the interleaved method."""
    for _ in range(4):
        steps = _bare_loop(work, units, 0.25)
        scale = step_s / (0.25 / max(steps, 1))
        if abs(scale - 1) < 0.05:
            break
        units = [max(1, round(n * scale)) for n in units]
    return units


def _stat(prof: Any, name: str) -> float:
    return float(prof.stats().get(name, 0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, nargs="+", default=[0.3, 30.0])
    parser.add_argument("--method", choices=("interleaved", "sessions"), default="interleaved")
    parser.add_argument("--pairs", type=int, default=None, help="default 40 (sessions: 6)")
    parser.add_argument(
        "--block-seconds", type=float, default=None, help="default 0.5 (sessions: 2)"
    )
    parser.add_argument("--volume-seconds", type=float, default=20.0)
    parser.add_argument("--compress", action="store_true", help="also measure compress=True")
    parser.add_argument(
        "--include-burst",
        action="store_true",
        help="time instrumented blocks from instrument() on, the initial burst of written "
        "spans included (default: from the steady state on)",
    )
    args = parser.parse_args()
    interleaved = args.method == "interleaved"
    if args.pairs is None:
        args.pairs = 40 if interleaved else 6
    if args.block_seconds is None:
        args.block_seconds = 0.5 if interleaved else 2.0
    torch.set_num_threads(1)
    work = Work()
    work.run(500)
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; torch {torch.__version__}")
    print(f"{args.pairs} A-B-B-A pairs of {args.block_seconds} s blocks per step length")
    print(
        "timed from instrument() on, initial burst included\n"
        if args.include_burst and not interleaved
        else "timed in the steady state (head budget's initial burst spent)\n"
    )
    index = 0  # run ids stay unique across step lengths
    with tempfile.TemporaryDirectory() as tmp:
        for step_ms in args.step_ms:
            units: list[int] | None = None
            if interleaved:
                index += 1
                units = _interleaved(work, step_ms, args, Path(tmp), index)
                _volumes(work, units, args, Path(tmp), index)
                index += 2
                continue
            bare: list[dict[str, float]] = []
            inst: list[dict[str, float]] = []
            off = 0
            for pair in range(args.pairs):
                units = _calibrate(work, step_ms / 1000, units)
                order = (False, True) if pair % 2 == 0 else (True, False)
                results: dict[bool, dict[str, float]] = {}
                for instrumented in order:
                    index += 1
                    r = _block(
                        work,
                        units,
                        args.block_seconds,
                        instrumented,
                        Path(tmp),
                        index,
                        not args.include_burst,
                    )
                    results[instrumented] = r
                b, i = results[False], results[True]
                ratio = b["step_ms"] / step_ms
                flag = "" if 1 / TOLERANCE <= ratio <= TOLERANCE else "  OFF TARGET: not counted"
                over = (i["step_ms"] / b["step_ms"] - 1) * 100
                print(
                    f"  pair {pair + 1}: bare step {b['step_ms']:.3f} ms, instrumented "
                    f"{i['step_ms']:.3f} ms, overhead {over:+.1f} %{flag}"
                )
                if flag:
                    off += 1
                    continue
                bare.append(b)
                inst.append(i)
            if not bare:
                print(f"step {step_ms} ms: every pair was off target; no figure\n")
                continue
            if off:
                print(f"  {off} of {args.pairs} pairs off target (bare step outside ±{TOLERANCE}x)")
            _print(step_ms, bare, inst)
            if units is not None:
                _volumes(work, units, args, Path(tmp), index)
                index += 2
    return 0


def _volumes(work: Work, units: list[int], args: Any, out: Path, index: int) -> None:
    for compress in (False, True) if args.compress else (False,):
        if args.volume_seconds <= 0:
            break
        index += 1
        per_day = _volume(work, units, args.volume_seconds, out, index, compress)
        print(f"  steady-state data (compress={compress}): {per_day / 1e9:.3f} GB/day\n")


def _run_bytes(run_dir: Path) -> int:
    return sum(p.stat().st_size for p in run_dir.iterdir() if p.is_file())


def _volume(
    work: Work, units: list[int], seconds: float, out: Path, index: int, compress: bool
) -> float:
    """Bytes per day written in the steady state: `seconds` measured once the head budget's
    initial burst is spent (the sampler has started sampling out), up to 300 s of waiting,
    and the tail budget's burst too where slow steps are drawing on it (up to 60 s more).
    The files hold up to 5 s of data per line, so both ends of the window are flushed: the
    bytes are those of the window's own data (plus two partial lines' headers)."""
    prof = otelprof.instrument(output_dir=str(out), run_id=f"v{index}", compress=compress)
    try:
        waited = 0.0
        while waited < 300 and not prof.stats().get("timings.spans_sampled_out"):
            _loop(work, units, 1.0, prof)
            waited += 1.0
        _loop(work, units, 2.0, prof)  # let the builder's and exporters' buffers turn over
        tail = prof._timings._builder.sampler._tail  # full (inf) when slow steps do not use it
        for _ in range(60):
            if not 20 < tail.available() < math.inf:
                break
            _loop(work, units, 1.0, prof)
        prof.tracer_provider.force_flush()
        prof.meter_provider.force_flush()
        before, t0 = _run_bytes(out / f"v{index}"), time.perf_counter()
        _loop(work, units, seconds, prof)
        prof.tracer_provider.force_flush()
        prof.meter_provider.force_flush()
        after, t1 = _run_bytes(out / f"v{index}"), time.perf_counter()
    finally:
        prof.shutdown()
    return (after - before) / (t1 - t0) * 86400


def _print(step_ms: float, bare: list[dict[str, float]], inst: list[dict[str, float]]) -> None:
    b = statistics.median(r["steps_per_s"] for r in bare)
    i = statistics.median(r["steps_per_s"] for r in inst)
    paired = statistics.median(
        ri["step_ms"] / rb["step_ms"] - 1 for rb, ri in zip(bare, inst, strict=True)
    )
    measured = statistics.median(r["step_ms"] for r in bare)
    spans = sum(r["spans"] for r in inst)
    ranges = sum(r["ranges"] for r in inst)
    bg = sum(r["background_s"] for r in inst)
    print(f"step {step_ms} ms (measured bare: median {measured:.3f} ms over {len(bare)} pairs):")
    print(
        f"  steps/s bare {b:,.0f}  instrumented {i:,.0f}  overhead {(1 - i / b) * 100:+.1f} %"
        f"; median per-pair step-time overhead {paired * 100:+.1f} %"
    )
    print(
        f"  ranges {ranges:,.0f}, spans written {spans:,.0f}, "
        f"background CPU {bg:.2f} s = {bg / max(ranges, 1) * 1e6:.1f} µs per range, "
        f"{bg / max(spans, 1) * 1e6:.1f} µs per written span"
    )
    print(
        f"  data in {len(inst)} whole instrumented runs (initial burst included): "
        f"{statistics.median(r['bytes_per_step'] for r in inst):,.0f} B/step; "
        f"dropped {sum(r['dropped'] for r in inst):.0f}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
