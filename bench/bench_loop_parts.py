"""Where the README loop's extra time goes: each part of a step, bare beside instrumented.

    .venv/bin/python bench/bench_loop_parts.py [--step-ms 0.3] [--rounds 10] [--steps 1500]
        [--clock thread|wall] [--option timings=false ...]

`bench_real_loop.py`'s loop and model, cut into the parts a step runs (the next batch, the
copy to the device, entering `train_batch`, `zero_grad`, forward, backward, the optimizer
step, leaving `train_batch`, the scheduler, the copy back, the metric, `otelprof.step()`), each
timed with the training thread's CPU clock (`--clock thread`, the default: otelprof's own
work and what it costs torch's code around it) or the wall clock (`--clock wall`: lock waits
too). One `instrument()` session stays up; rounds of `--steps` steps alternate bare (no step
open, as in `bench_real_loop.py`; the bare loop has no `train_batch` block at all) and
instrumented. Printed per part: the median time per step in each arm, and the difference of
the two arms' medians within each round (blocks of a round run back to back, so drift between
rounds cancels) as a mean over the rounds with its 95 % interval. Then the parts with
otelprof's calls in them summed per step ("otelprof's calls": every part but forward and
backward), and the whole step, each as µs and as a share of the bare step. At 30 ms steps
forward and backward drift by more than otelprof costs, so their interval says how well the
whole step is resolved; "otelprof's calls" is the figure the cost goal is read from.
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
from bench_step_rate import between_steps, mean_and_interval

import otelprof
from otelprof import determined_timings

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
    "otelprof.step()",
)


class Loop:
    """The README loop, one step at a time, in either arm (each arm its own epochs)."""

    def __init__(self, m: Any, prof: Any, clock: Callable[[], int]) -> None:
        self.m, self.prof, self.clock = m, prof, clock
        self.batches: dict[bool, Any] = {}

    def step(self, instrumented: bool) -> list[int]:
        """One step; per part, its time in ns."""
        m, clock = self.m, self.clock
        model, optimizer, scheduler, loss_fn = m.model, m.optimizer, m.scheduler, m.loss_fn
        while True:
            batches = self.batches.get(instrumented)
            if batches is None:
                loader = otelprof.timed_dataloader(m.loader) if instrumented else m.loader
                batches = self.batches[instrumented] = iter(loader)
            t = [clock()]
            try:
                x, y = next(batches)
                break
            except StopIteration:
                del self.batches[instrumented]
        t.append(clock())
        if instrumented:
            x, y = determined_timings.to_device((x, y), "cpu")
        else:
            x, y = x.to("cpu"), y.to("cpu")
        t.append(clock())
        block: Any = determined_timings.train_batch() if instrumented else None
        if instrumented:  # the bare loop has no block at all
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
        if instrumented:
            block.__exit__(None, None, None)
        t.append(clock())
        if instrumented:
            with otelprof.timing("step_lr_schedulers"):
                scheduler.step()
        else:
            scheduler.step()
        t.append(clock())
        out = determined_timings.from_device(loss) if instrumented else loss.detach().cpu()
        t.append(clock())
        if instrumented:
            with determined_timings.reduce_metrics():
                out.item()
        else:
            out.item()
        t.append(clock())
        if instrumented:
            otelprof.step()
        t.append(clock())
        return [t[index + 1] - t[index] for index in range(len(PARTS))]


def run_steps(loop: Loop, steps: int, instrumented: bool) -> list[list[int]]:
    """`steps` steps of one arm; per part, each step's time in ns."""
    times: list[list[int]] = [[] for _ in PARTS]
    for _ in range(steps):
        for part, took in enumerate(loop.step(instrumented)):
            times[part].append(took)
    return times


def arm(prof: Any, instrumented: bool) -> contextlib.AbstractContextManager[Any]:
    """What a block of one arm runs in: a bare one with no step open (`between_steps`)."""
    if instrumented or prof._timings is None:
        return contextlib.nullcontext()
    return between_steps(prof)


def run_pairs(loop: Loop, pairs: int) -> dict[bool, list[list[int]]]:
    """`pairs` bare and instrumented steps, alternately (which goes first alternates too),
    so each instrumented step is compared with a bare one run next to it."""
    arms: dict[bool, list[list[int]]] = {False: [[] for _ in PARTS], True: [[] for _ in PARTS]}
    for index in range(pairs):
        for instrumented in (False, True) if index % 2 == 0 else (True, False):
            with arm(loop.prof, instrumented):
                times = loop.step(instrumented)
            for part, took in enumerate(times):
                arms[instrumented][part].append(took)
    return arms


OUTSIDE_TORCH = [i for i, name in enumerate(PARTS) if name not in ("forward", "backward")]
"""The parts with otelprof's calls in them: forward and backward have none."""


def report(rounds: list[dict[bool, list[list[int]]]], paired: bool) -> None:
    """Per part: the pooled medians, and per round the extra (the median of the step pairs'
    differences when steps alternate, else the difference of the two blocks' medians) as a
    mean over the rounds with its 95 % interval; then the parts with otelprof's calls summed
    per step, and the whole step, as µs and as a share of the bare step."""

    def per_round(parts: list[int]) -> list[float]:
        extras = []
        for r in rounds:
            bare, timed = (
                [sum(step) for step in zip(*(r[arm][p] for p in parts), strict=True)]
                for arm in (False, True)
            )
            if paired:
                extra = statistics.median(a - b for a, b in zip(timed, bare, strict=True))
            else:
                extra = statistics.median(timed) - statistics.median(bare)
            extras.append(extra / 1e3)
        return extras

    print(f"{'part':18s} {'bare':>9s} {'otelprof':>9s}   per-round extra (95 % interval)")
    for part, name in enumerate(PARTS):
        b, a = (
            statistics.median(t for r in rounds for t in r[arm][part]) / 1e3
            for arm in (False, True)
        )
        mean, half = mean_and_interval(per_round([part]))
        print(f"{name:18s} {b:7.2f}µs {a:7.2f}µs   {mean:+8.2f} ± {half:6.2f}µs")
    every = list(range(len(PARTS)))
    step = statistics.fmean(
        statistics.median(sum(s) for s in zip(*r[False], strict=True)) / 1e3 for r in rounds
    )
    for label, parts in (("otelprof's calls", OUTSIDE_TORCH), ("whole step", every)):
        mean, half = mean_and_interval(per_round(parts))
        print(
            f"{label:18s} {mean:+8.2f} ± {half:6.2f}µs = {100 * mean / step:.3f} % "
            f"± {100 * half / step:.3f} % of the bare step ({step:.0f} µs)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread")
    parser.add_argument(
        "--alternate",
        choices=("blocks", "steps"),
        default="blocks",
        help="run each round as two blocks of --steps steps, or as --steps pairs of steps",
    )
    parser.add_argument("--option", type=_option, action="append", default=[], dest="options")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds: at least 2 (the interval is taken over the rounds)")
    torch.set_num_threads(1)
    clock = time.thread_time_ns if args.clock == "thread" else time.perf_counter_ns
    print_machine(torch.__version__)
    m = calibrate(args.step_ms)
    options = dict(args.options)
    with (
        tempfile.TemporaryDirectory() as tmp,
        otelprof.instrument(output_dir=tmp, **options) as prof,
    ):
        loop = Loop(m, prof, clock)
        for _ in range(4):  # past the session's start-up burst
            run_steps(loop, args.steps, True)
        rounds: list[dict[bool, list[list[int]]]] = []
        for index in range(args.rounds):
            if args.alternate == "steps":
                rounds.append(run_pairs(loop, args.steps))
                continue
            this: dict[bool, list[list[int]]] = {}
            for instrumented in (False, True) if index % 2 == 0 else (True, False):
                with arm(prof, instrumented):
                    this[instrumented] = run_steps(loop, args.steps, instrumented)
            rounds.append(this)
    unit = "pairs of steps" if args.alternate == "steps" else "steps per arm"
    print(
        f"{args.step_ms} ms steps (batch {m.batch}), {args.rounds} rounds of {args.steps} "
        f"{unit}, {args.clock} clock, options {options or 'default'}"
    )
    report(rounds, args.alternate == "steps")
    print(f"load average at end: {load_average()}")


if __name__ == "__main__":
    main()
