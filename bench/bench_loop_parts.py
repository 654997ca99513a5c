"""Where the README loop's extra time goes: each part of a step, bare beside instrumented.

    .venv/bin/python bench/bench_loop_parts.py [--step-ms 0.3] [--rounds 10] [--steps 1500]
        [--clock thread|wall] [--option timings=false ...]

`bench_real_loop.py`'s loop and model, cut into the parts a step runs (the next batch, the
copy to the device, entering `train_batch`, `zero_grad`, forward, backward, the optimizer
step, leaving `train_batch`, the scheduler, the copy back, the metric, `prof.step()`), each
timed with the training thread's CPU clock (`--clock thread`, the default: otelprof's own
work and what it costs torch's code around it) or the wall clock (`--clock wall`: lock waits
too). One `instrument()` session stays up; rounds of `--steps` steps alternate bare (no step
open, as in `bench_real_loop.py`) and instrumented. Printed per part: the median and mean
time per step in each arm and the difference. A part with no otelprof code in it (forward,
backward) that still grows shows a cost otelprof's code causes elsewhere: caches it evicts.
The clock reads themselves (~0.1 µs wall, ~0.3 µs thread CPU each) are in both arms.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from _machine import load_average, print_machine
from bench_real_loop import _option, calibrate
from bench_step_rate import between_steps

import otelprof

PARTS = (
    "next batch",
    "to_device",
    "train_batch enter",
    "zero_grad",
    "forward",
    "backward",
    "optimizer step",
    "train_batch exit",
    "scheduler",
    "from_device",
    "reduce_metrics",
    "prof.step()",
)


def run_steps(
    m: Any, steps: int, prof: Any, instrumented: bool, clock: Callable[[], int]
) -> list[list[int]]:
    """`steps` steps of the loop; per part, each step's time in ns."""
    model, optimizer, scheduler, loss_fn = m.model, m.optimizer, m.scheduler, m.loss_fn
    times: list[list[int]] = [[] for _ in PARTS]
    done = 0
    while True:
        batches = iter(otelprof.timed_dataloader(m.loader) if instrumented else m.loader)
        while True:
            t = [clock()]
            try:
                x, y = next(batches)
            except StopIteration:
                break
            t.append(clock())
            if instrumented:
                x, y = otelprof.to_device((x, y), "cpu")
            else:
                x, y = x.to("cpu"), y.to("cpu")
            t.append(clock())
            block: Any = otelprof.train_batch() if instrumented else contextlib.nullcontext()
            block.__enter__()
            t.append(clock())
            optimizer.zero_grad()
            t.append(clock())
            loss = loss_fn(model(x), y)
            t.append(clock())
            loss.backward()
            t.append(clock())
            optimizer.step()
            t.append(clock())
            block.__exit__(None, None, None)
            t.append(clock())
            if instrumented:
                with otelprof.timing("step_lr_schedulers"):
                    scheduler.step()
            else:
                scheduler.step()
            t.append(clock())
            out = otelprof.from_device(loss) if instrumented else loss.detach().cpu()
            t.append(clock())
            if instrumented:
                with otelprof.reduce_metrics():
                    out.item()
            else:
                out.item()
            t.append(clock())
            if instrumented:
                prof.step()
            t.append(clock())
            for index in range(len(PARTS)):
                times[index].append(t[index + 1] - t[index])
            done += 1
            if done >= steps:
                return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread")
    parser.add_argument("--option", type=_option, action="append", default=[], dest="options")
    args = parser.parse_args()
    torch.set_num_threads(1)
    clock = time.thread_time_ns if args.clock == "thread" else time.perf_counter_ns
    print_machine(torch.__version__)
    m = calibrate(args.step_ms)
    options = dict(args.options)
    with (
        tempfile.TemporaryDirectory() as tmp,
        otelprof.instrument(output_dir=tmp, **options) as prof,
    ):
        for _ in range(4):  # past the session's start-up burst
            run_steps(m, args.steps, prof, True, clock)
        arms: dict[bool, list[list[int]]] = {False: [[] for _ in PARTS], True: [[] for _ in PARTS]}
        for index in range(args.rounds):
            for instrumented in (False, True) if index % 2 == 0 else (True, False):
                bare = not instrumented and prof._timings is not None
                with between_steps(prof) if bare else contextlib.nullcontext():
                    for part, times in enumerate(
                        run_steps(m, args.steps, prof, instrumented, clock)
                    ):
                        arms[instrumented][part].extend(times)
    print(
        f"{args.step_ms} ms steps (batch {m.batch}), {args.rounds} rounds of {args.steps} steps, "
        f"{args.clock} clock, options {options or 'default'}"
    )
    print(f"{'part':18s} {'bare':>9s} {'otelprof':>9s} {'extra':>8s}   mean extra")
    for part, name in enumerate(PARTS):
        bare, timed = arms[False][part], arms[True][part]
        b, a = statistics.median(bare) / 1e3, statistics.median(timed) / 1e3
        extra_mean = (statistics.fmean(timed) - statistics.fmean(bare)) / 1e3
        print(f"{name:18s} {b:7.2f}µs {a:7.2f}µs {a - b:+7.2f}µs   {extra_mean:+7.2f}µs")
    steps_bare = [sum(s) for s in zip(*arms[False], strict=True)]
    steps_timed = [sum(s) for s in zip(*arms[True], strict=True)]
    b, a = statistics.median(steps_bare) / 1e3, statistics.median(steps_timed) / 1e3
    extra_mean = (statistics.fmean(steps_timed) - statistics.fmean(steps_bare)) / 1e3
    print(f"{'whole step':18s} {b:7.2f}µs {a:7.2f}µs {a - b:+7.2f}µs   {extra_mean:+7.2f}µs")
    print(f"load average at end: {load_average()}")


if __name__ == "__main__":
    main()
