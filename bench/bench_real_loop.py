"""Cost of otelprof on the loop the README teaches: a real model, torch's ranges bridged.

    .venv/bin/python bench/bench_real_loop.py [--step-ms 0.3 1 30] [--pairs 30]
        [--block-seconds 0.25] [--option timings=false ...] [--aa]

Per step, instrumented (otelprof's default `instrument()`, detached, hardware metrics on):

    for x, y in otelprof.timed_dataloader(loader):           # dataloader_next (+ torch's range)
        x, y = determined_timings.to_device((x, y), "cpu")                # to_device
        with determined_timings.train_batch():                            # train_batch
            optimizer.zero_grad()                               # torch's Optimizer.zero_grad#SGD
            loss = loss_fn(model(x), y); loss.backward()
            optimizer.step()                                    # torch's Optimizer.step#SGD
        with otelprof.timing("step_lr_schedulers"):
            scheduler.step()
        out = determined_timings.from_device(loss)                        # from_device
        with determined_timings.reduce_metrics():                         # reduce_metrics
            total += out.item()
        otelprof.step()

and bare: the same loop, the same copies (`x.to("cpu")`, `y.to("cpu")`, `loss.detach().cpu()`),
no otelprof call. The model is torch's own (an MLP, SGD, CrossEntropyLoss, a real DataLoader
over a TensorDataset, 1 intra-op thread); the batch size is calibrated so that a bare step
uses `--step-ms` of the training thread's CPU (a Linear layer below 0.5 ms, a 2-hidden-layer
MLP 128 wide below 5 ms, 1024 wide above); pairs whose bare block strays beyond 1.25x of it
are not counted, nor pairs in which the garbage collector ran a full collection (of torch's
heap: 0.1-0.2 s, about every 2 s at 1 ms steps, where the DataLoader's per-sample tuples
alive at each second-generation collection are promoted). Such a pause lands in one block
of the pair at random and would swamp it; the full collections per arm are printed, so a
profiler that caused more of them would show there. Each pair starts after a full collection
run outside its blocks, so fewer pairs are lost.

Method (`bench_step_rate.py --method interleaved`'s): one `instrument()` session stays up in
its steady state (the head and tail budgets' initial bursts spent, every background thread
free to run), and short blocks alternate A-B-B-A between the bare and the instrumented loop;
an instrumented block's time includes the span builder's catch-up after it. Before the
pairs, bare blocks with no session at all are compared with bare blocks under the running
session (`bare outside`/`bare inside`): a profiler that slowed every torch op would show
there, where the A-B pairs cannot see it.

Printed per step length: the step-rate ratio (median of the pairs' bare/instrumented ratios,
quartiles; and the counted blocks' total time, bare over instrumented, which weighs in the
once-a-second background work a short block's median can miss), the training thread's own
CPU per step (its thread CPU clock) bare and instrumented, the background threads' CPU per
step, and the wall-time cost the training thread's own CPU does not explain (interpreter-
lock waits, the scheduler), plus the detached data written per hour. `--option NAME=VALUE`
passes options to `instrument()` (`timings=false`, `record_function=false`, ...) to find
where a cost goes; `--aa` runs the bare loop in both arms (the method's noise floor).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _machine import background_cpu, load_average, print_machine
from bench_step_rate import GcClock, between_steps, mean_and_interval
from torch.utils.data import DataLoader, TensorDataset

import otelprof
from otelprof import determined_timings

FEATURES = 32
TOLERANCE = 1.25


class Model:
    """A model, its optimizer, scheduler and an endless supply of DataLoader epochs."""

    def __init__(self, step_ms: float, batch: int) -> None:
        if step_ms < 0.5:
            layers: list[torch.nn.Module] = [torch.nn.Linear(FEATURES, 10)]
        else:
            width = 128 if step_ms < 5 else 1024
            layers = [torch.nn.Linear(FEATURES, width), torch.nn.ReLU()]
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10)]
        self.model = torch.nn.Sequential(*layers)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1000)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.batch = batch
        rows = batch * 64
        data = TensorDataset(torch.randn(rows, FEATURES), torch.randint(0, 10, (rows,)))
        self.loader = DataLoader(data, batch_size=batch, shuffle=True)


def bare_loop(m: Model, seconds: float, prof: Any) -> int:
    """The baseline: the README's loop with the same copies and no otelprof call (with
    `prof`, another tool's `otelprof.step()` ends each step: bench_compare's torch.profiler)."""
    model, optimizer, scheduler, loss_fn = m.model, m.optimizer, m.scheduler, m.loss_fn
    steps = 0
    total = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        for x, y in m.loader:
            x, y = x.to("cpu"), y.to("cpu")
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            out = loss.detach().cpu()
            total += out.item()
            if prof is not None:
                otelprof.step()
            steps += 1
            if time.perf_counter() >= deadline:
                return steps


def instrumented_loop(m: Model, seconds: float, prof: Any) -> int:
    """The README's loop with its helpers."""
    model, optimizer, scheduler, loss_fn = m.model, m.optimizer, m.scheduler, m.loss_fn
    steps = 0
    total = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        for x, y in otelprof.timed_dataloader(m.loader):
            x, y = determined_timings.to_device((x, y), "cpu")
            with determined_timings.train_batch():
                optimizer.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
            with otelprof.timing("step_lr_schedulers"):
                scheduler.step()
            out = determined_timings.from_device(loss)
            with determined_timings.reduce_metrics():
                total += out.item()
            otelprof.step()
            steps += 1
            if time.perf_counter() >= deadline:
                return steps


def calibrate(step_ms: float) -> Model:
    """A model whose bare step uses `step_ms` of the training thread's CPU (batch size
    scaled, up to 6 tries). CPU, not wall time: on a loaded machine a step's wall time is
    mostly waiting for a core, and the figure should be the step's own length."""
    batch = 8
    m = Model(step_ms, batch)
    for _ in range(6):
        bare_loop(m, 0.1, None)
        cpu = time.thread_time()
        steps = bare_loop(m, 0.3, None)
        measured = (time.thread_time() - cpu) * 1e3 / max(steps, 1)
        if abs(measured / step_ms - 1) < 0.07:
            break
        batch = max(1, round(batch * step_ms / measured))
        m = Model(step_ms, batch)
    return m


def _block(
    loop: Callable[[Model, float, Any], int], m: Model, seconds: float, prof: Any, builder: Any
) -> dict[str, float]:
    own = time.thread_time()
    background = background_cpu()
    start = time.perf_counter()
    steps = loop(m, seconds, prof)
    if builder is not None:
        builder.drain(final=True, timeout_s=10.0)
    wall = time.perf_counter() - start
    n = max(steps, 1)
    return {
        "step_us": wall / n * 1e6,
        "thread_us": (time.thread_time() - own) / n * 1e6,
        "background_us": (background_cpu() - background) / n * 1e6,
        "steps": steps,
    }


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 4], statistics.median(ordered), ordered[(3 * n) // 4]


def _outside_inside(m: Model, args: Any, make: Callable[[], Any]) -> None:
    """Bare blocks with no session against bare blocks under a running session (steady)."""
    ratios: list[float] = []
    for pair in range(max(4, args.pairs // 4)):
        order = (False, True) if pair % 2 == 0 else (True, False)
        times: dict[bool, float] = {}
        for inside in order:
            if inside:
                prof = make()
                instrumented_loop(m, 1.0, prof)  # the session busy, as it is when training
                prof._timings._builder.drain(final=True, timeout_s=10.0)
                with between_steps(prof):
                    times[inside] = _block(bare_loop, m, args.block_seconds, None, None)["step_us"]
                prof.shutdown()
            else:
                times[inside] = _block(bare_loop, m, args.block_seconds, None, None)["step_us"]
        ratios.append(times[False] / times[True])
    low, mid, high = _quartiles(ratios)
    print(
        f"  bare loop under a running session vs none (step-rate ratio): {mid:.3f} "
        f"(quartiles {low:.3f} / {high:.3f}, {len(ratios)} pairs)"
    )


def run(step_ms: float, args: Any, out: Path, index: int) -> None:
    m = calibrate(step_ms)
    options: dict[str, Any] = dict(args.options)
    sessions = iter(range(1000))

    def make() -> Any:
        return otelprof.instrument(
            output_dir=str(out), run_id=f"r{index}-{next(sessions)}", **options
        )

    if args.outside:
        _outside_inside(m, args, make)
    prof = make()
    builder = prof._timings._builder if prof._timings is not None else None
    try:
        waited = 0.0  # steady state, as in bench_step_rate
        while waited < 120 and (
            prof.stats().get("timings.steps_sampled_out_on_thread", 0) < 1000
            and prof.stats().get("timings.spans_sampled_out", 0) < 1
        ):
            instrumented_loop(m, 0.25, prof)
            waited += 0.25
        instrumented_loop(m, 0.5, prof)
        if builder is not None:
            builder.drain(final=True, timeout_s=10.0)
        blocks: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        off = 0
        gc_ns = {False: 0, True: 0}
        full = {False: 0, True: 0}  # full collections per arm
        spoiled = 0  # pairs left out for one
        with GcClock() as collector:
            for pair in range(args.pairs):
                order = (False, True) if pair % 2 == 0 else (True, False)
                result: dict[bool, dict[str, float]] = {}
                gc.collect()  # outside the blocks: the next full collection is ~2 s away
                fulls = collector.full
                for instrumented in order:
                    before, before_full = collector.ns, collector.full
                    if instrumented and not args.aa:
                        result[True] = _block(
                            instrumented_loop, m, args.block_seconds, prof, builder
                        )
                    else:  # (--aa: the bare loop in both arms, no otelprof call in either)
                        with between_steps(prof):
                            result[instrumented] = _block(
                                bare_loop, m, args.block_seconds, None, None
                            )
                    gc_ns[instrumented] += collector.ns - before
                    full[instrumented] += collector.full - before_full
                if collector.full != fulls:
                    spoiled += 1  # a whole-heap pause in one block: either arm, so left out
                    continue
                if not 1 / TOLERANCE <= result[False]["thread_us"] / 1e3 / step_ms <= TOLERANCE:
                    off += 1
                    continue
                for kind in (False, True):
                    blocks[kind].append(result[kind])
        stats = prof.stats()
    finally:
        prof.shutdown()
    bare, inst = blocks[False], blocks[True]
    print(
        f"step {step_ms} ms (batch {m.batch}; {len(bare)} of {args.pairs} pairs counted, {off} off "
        f"target, {spoiled} with a full collection), options {options or 'default'}"
        f"{' A/A' if args.aa else ''}"
    )
    if not bare:  # (--pairs 0: the data volume only)
        _print_volume(m, args, out, index, options)
        return
    ratios = [b["step_us"] / i["step_us"] for b, i in zip(bare, inst, strict=True)]
    low, mid, high = _quartiles(ratios)
    bare_step = statistics.median(b["step_us"] for b in bare)
    inst_step = statistics.median(i["step_us"] for i in inst)
    own = [i["thread_us"] - b["thread_us"] for b, i in zip(bare, inst, strict=True)]
    # a mean, not a median: the metric reader's once-a-second collection lands in few blocks
    background = statistics.fmean(i["background_us"] for i in inst)
    totals = sum(b["step_us"] * b["steps"] for b in bare) / sum(b["steps"] for b in bare)
    totals /= sum(i["step_us"] * i["steps"] for i in inst) / sum(i["steps"] for i in inst)
    wall = [i["step_us"] - b["step_us"] for b, i in zip(bare, inst, strict=True)]
    print(
        f"  step-rate ratio {mid:.3f} (quartiles {low:.3f} / {high:.3f}; all counted blocks "
        f"together {totals:.3f}); bare step "
        f"{bare_step:.0f} µs, instrumented {inst_step:.0f} µs"
    )
    own_mid = statistics.median(own)
    print(
        f"  training-thread CPU per step: bare "
        f"{statistics.median(b['thread_us'] for b in bare):.1f} µs, instrumented "
        f"{statistics.median(i['thread_us'] for i in inst):.1f} µs; paired extra "
        f"{own_mid:+.1f} µs (quartiles {_quartiles(own)[0]:+.1f} / {_quartiles(own)[2]:+.1f})"
    )
    if len(own) > 1:  # at long steps the medians are below one step's scatter
        ratio_mean, ratio_half = mean_and_interval(ratios)
        own_mean, own_half = mean_and_interval(own)
        waits_mean, waits_half = mean_and_interval([w - o for w, o in zip(wall, own, strict=True)])
        print(
            f"  paired means, 95 % intervals: step-rate ratio {ratio_mean:.4f} ± "
            f"{ratio_half:.4f}; training-thread extra {own_mean:+.1f} ± {own_half:.1f} µs; "
            f"waits {waits_mean:+.1f} ± {waits_half:.1f} µs"
        )
    print(
        f"  background threads' CPU per step (mean) {background:.1f} µs; wall time per step "
        f"{statistics.median(wall):+.1f} µs, of which not the training thread's own CPU "
        f"{statistics.median(wall) - own_mid:+.1f} µs (waits: interpreter lock, scheduler)"
    )
    steps = sum(b["steps"] for b in blocks[True])
    print(
        f"  garbage collection per step: bare {gc_ns[False] / max(steps, 1) / 1e3:.2f} µs, "
        f"instrumented {gc_ns[True] / max(steps, 1) / 1e3:.2f} µs (full collections: bare "
        f"{full[False]}, instrumented {full[True]}); dropped "
        f"{stats.get('dropped_total', 0)}"
    )
    _print_volume(m, args, out, index, options)
    print(flush=True)


def _print_volume(m: Model, args: Any, out: Path, index: int, options: dict[str, Any]) -> None:
    if args.volume_seconds > 0 and not args.aa:
        mb_per_hour, anomalies, refused, steps = volume(m, args.volume_seconds, out, index, options)
        print(
            f"  data written: {mb_per_hour:.1f} MB/hour; steps kept as anomaly {anomalies} of "
            f"{steps} ({100 * anomalies / max(steps, 1):.1f} %), anomalies refused {refused}"
        )


def _run_bytes(run_dir: Path) -> int:
    if not run_dir.is_dir():
        return 0
    return sum(p.stat().st_size for p in run_dir.iterdir() if p.is_file())


def volume(
    m: Model, seconds: float, out: Path, index: int, options: dict[str, Any]
) -> tuple[float, int, int, int]:
    """MB per hour the detached files grow in the steady state (both window ends flushed),
    and in that window: steps kept as anomalies, anomalies their budget refused, steps."""
    run_id = f"v{index}"
    prof = otelprof.instrument(output_dir=str(out), run_id=run_id, **options)
    try:
        waited = 0.0
        while waited < 120 and not prof.stats().get("timings.spans_sampled_out", 0):
            instrumented_loop(m, 0.5, prof)
            waited += 0.5
        instrumented_loop(m, 2.0, prof)
        tail = prof._timings._builder.sampler._tail  # inf when slow steps do not draw on it
        for _ in range(60):  # the tail budget's burst spent too (bench_step_rate's _volume)
            if not 20 < tail.available() < math.inf:
                break
            instrumented_loop(m, 1.0, prof)
        prof.tracer_provider.force_flush()
        prof.meter_provider.force_flush()
        first = prof.stats()
        before, t0 = _run_bytes(out / run_id), time.perf_counter()
        instrumented_loop(m, seconds, prof)
        prof.tracer_provider.force_flush()
        prof.meter_provider.force_flush()
        after, t1 = _run_bytes(out / run_id), time.perf_counter()
        last = prof.stats()
    finally:
        prof.shutdown()

    def grew(key: str) -> int:
        return last.get(key, 0) - first.get(key, 0)

    return (
        (after - before) / (t1 - t0) * 3600 / 1e6,
        grew("timings.steps_kept.anomaly"),
        grew("timings.anomalies_refused"),
        grew("timings.steps"),
    )


def _option(text: str) -> tuple[str, Any]:
    name, _, value = text.partition("=")
    lowered = value.lower()
    parsed: Any = {"true": True, "false": False}.get(lowered, value)
    if isinstance(parsed, str):
        with contextlib.suppress(ValueError):
            parsed = float(value) if "." in value else int(value)
    return name, parsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, nargs="+", default=[0.3, 1.0, 30.0])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--block-seconds", type=float, default=0.25)
    parser.add_argument("--volume-seconds", type=float, default=20.0)
    parser.add_argument("--option", type=_option, action="append", default=[], dest="options")
    parser.add_argument("--aa", action="store_true", help="bare loop in both arms")
    parser.add_argument(
        "--no-outside", dest="outside", action="store_false",
        help="skip the bare-outside/bare-inside check",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    print_machine(torch.__version__)
    print(f"{args.pairs} A-B-B-A pairs of {args.block_seconds} s blocks per step length\n")
    with tempfile.TemporaryDirectory() as tmp:
        for index, step_ms in enumerate(args.step_ms):
            run(step_ms, args, Path(tmp), index)
    print(f"load average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
