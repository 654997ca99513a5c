"""What each README helper costs on top of the operation it wraps, per call.

    .venv/bin/python bench/bench_helpers.py [--rounds 9] [--calls 2000]

Each helper is timed beside the bare operation it wraps (`to_device((x, y), "cpu")` beside
`x.to("cpu"), y.to("cpu")`, `from_device(loss)` beside `loss.detach().cpu()`, ...), in one
running `instrument()` session (detached, default settings, background threads running),
rounds alternating helper and bare. In the helper's rounds a step boundary (`otelprof.step()`)
follows every 8 calls, then 0.3 ms of other work (both untimed), so its spans land in
ordinary small steps at a training loop's rate, sampled out like a training loop's; the
bare rounds have the same gaps and no steps (a loop without a profiler has none). Printed
per helper: the training thread's CPU per call (its thread CPU clock, median over rounds)
with and without otelprof, and the difference: the margin the README promises.

These are hot-cache figures (the same call thousands of times in a row); on a real step,
between a model's operators, the same code costs about 2-3x more (`bench_real_loop.py`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from _machine import load_average, print_machine

import otelprof
from otelprof import determined_timings

STEP_EVERY = 8
GAP_S = 0.0003


def per_call_ns(fn: Callable[[], object], calls: int, step: Callable[[], None] | None) -> float:
    """Training-thread CPU per call of `fn`, timed per block of `STEP_EVERY` calls; between
    blocks the step boundary (if any) and `GAP_S` of other work, untimed, so steps come at a
    training loop's rate (~3,000 a second), not at a million."""
    spent = 0
    for _ in range(calls // STEP_EVERY):
        start = time.thread_time_ns()
        for _ in range(STEP_EVERY):
            fn()
        spent += time.thread_time_ns() - start
        if step is not None:
            step()
        until = time.perf_counter() + GAP_S
        while time.perf_counter() < until:
            pass
    return spent / (calls // STEP_EVERY * STEP_EVERY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print_machine(torch.__version__)
    x, y = torch.randn(10, 32), torch.randint(0, 10, (10,))
    loss = (torch.randn(3, requires_grad=True) * 2).sum()
    items = list(range(STEP_EVERY))
    name = "step_lr_schedulers"

    def iterate_timed() -> None:
        for _item in otelprof.timed_dataloader(items):
            pass

    def iterate_bare() -> None:
        for _item in items:
            pass

    def timed_block() -> None:
        with otelprof.timing(name):
            pass

    def helper_block() -> None:
        with determined_timings.train_batch():
            pass

    cases: list[tuple[str, Callable[[], object], Callable[[], object], int]] = [
        ("to_device((x, y), 'cpu')", lambda: determined_timings.to_device((x, y), "cpu"),
         lambda: (x.to("cpu"), y.to("cpu")), 1),
        ("from_device(loss)", lambda: determined_timings.from_device(loss),
         lambda: loss.detach().cpu(), 1),
        ("timed_dataloader, per item", iterate_timed, iterate_bare, STEP_EVERY),
        ("with timing(name): pass", timed_block, lambda: None, 1),
        ("with train_batch(): pass", helper_block, lambda: None, 1),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, otelprof.instrument(output_dir=tmp) as prof:
        step = otelprof.step
        for _label, helper, bare, _per in cases:  # warm-up: the session's start-up burst too
            per_call_ns(helper, args.calls, step)
            per_call_ns(bare, args.calls, None)
        print(f"{args.rounds} rounds of {args.calls} calls each, helper and bare alternating")
        print(f"{'helper':30s} {'otelprof':>10s} {'bare':>10s} {'extra':>10s}")
        for label, helper, bare, per in cases:
            timed: list[float] = []
            plain: list[float] = []
            for index in range(args.rounds):
                order = ((helper, timed, step), (bare, plain, None))
                for fn, into, steps in order if index % 2 == 0 else order[::-1]:
                    into.append(per_call_ns(fn, args.calls, steps) / per)
            a, b = statistics.median(timed) / 1000, statistics.median(plain) / 1000
            print(f"{label:30s} {a:8.2f} µs {b:8.2f} µs {a - b:+8.2f} µs")
        print(f"spans dropped: {prof.stats().get('dropped_total', 0)}")
    print(f"load average at end: {load_average()}")


if __name__ == "__main__":
    main()
