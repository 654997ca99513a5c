"""Cost of per-module timings and of memory peaks by phase, A-B in one process.

    .venv/bin/python bench/bench_model_parts.py [--step-ms 1 30]
        [--pairs 20] [--block-seconds 0.3] [--depth 1] [--device cpu|cuda]
        [--part modules boundary phase] [--boundary-steps 2000]

One `instrument()` session (default options) runs the README loop over torch's own MLP
(`bench_real_loop.Model`, calibrated to `--step-ms` of the training thread's CPU on this
machine; on `--device cuda` the same model and batches on the GPU). Blocks alternate
A-B-B-A between the loop as it is (arm A) and the same loop with the part on (arm B):

- `modules`: `ModuleTimings(depth)` started for the block and closed after it, as
  `module_timings=<depth>` does (it finds the model in the block's first two iterations and
  hooks its children: the MLP's 5 at depth 1, each a forward range and, for those whose
  output needs a gradient, a backward range);
- `boundary`: `otelprof.step()` alone, timed call by call (the whole loop's scatter hides a few
  µs), with a matrix product between steps, with and without `PhasePeaks` attached as
  `memory_peaks=True` attaches it (it adds no step hook: the figure is the method's floor);
- `phase`: a change of phase there and back (`set_phase("validation")`, `set_phase("train")`),
  with and without `PhasePeaks`, which reads and resets the allocator's peaks at each change
  (on CPU CUDA is not initialized: the listener's own cost; on `--device cuda` the reads).

Printed per part and step length: the training thread's own CPU per step (its thread
clock) in both arms, the paired extra with its 95 % interval (the figure BENCHMARKS.md
quotes), the step-rate ratio, and the extra per hooked module call.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _machine import print_machine
from bench_real_loop import calibrate
from bench_step_rate import mean_and_interval

import otelprof
from otelprof._module_timings import ModuleTimings
from otelprof.determined_timings import to_device, train_batch
from otelprof.system.memory_peaks import PhasePeaks


def loop(m: Any, seconds: float, prof: Any, device: str) -> int:
    """The README's loop (helpers, timed DataLoader, otelprof.step())."""
    model, optimizer, loss_fn = m.model, m.optimizer, m.loss_fn
    steps = 0
    deadline = time.perf_counter() + seconds
    while True:
        for x, y in otelprof.timed_dataloader(m.loader):
            x, y = to_device((x, y), device)
            with train_batch():
                optimizer.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
            otelprof.step()
            steps += 1
            if time.perf_counter() >= deadline:
                if device == "cuda":
                    torch.cuda.synchronize()
                return steps


class Part:
    """Turns module timings on for arm B's block and off after it."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.calls_per_step = 0.0
        self._on: Any = None

    def on(self) -> None:
        self._on = ModuleTimings(self.depth, torch)
        self._on.start()

    def off(self) -> None:
        self.calls_per_step = float(self._on.hooked)
        self._on.close()


def block(m: Any, seconds: float, prof: Any, device: str, part: Part | None) -> dict[str, float]:
    gc.collect()
    if part is not None:
        part.on()
    own = time.thread_time()
    start = time.perf_counter()
    steps = loop(m, seconds, prof, device)
    wall = time.perf_counter() - start
    cpu = time.thread_time() - own
    if part is not None:
        part.off()
    prof._timings.flush()
    n = max(steps, 1)
    return {"step_us": wall / n * 1e6, "thread_us": cpu / n * 1e6, "steps": steps}


def run(part_name: str, step_ms: float, args: Any, out: Path) -> None:
    m = calibrate(step_ms)
    if args.device == "cuda":
        m.model.to("cuda")
    prof = otelprof.instrument(output_dir=str(out), run_id=f"{part_name}-{step_ms}")
    part = Part(args.depth)
    try:
        loop(m, 2.0, prof, args.device)  # steady state: first bursts of the budgets spent
        pairs: list[tuple[dict[str, float], dict[str, float]]] = []
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {
                on: block(m, args.block_seconds, prof, args.device, part if on else None)
                for on in order
            }
            pairs.append((got[False], got[True]))
    finally:
        prof.shutdown()
    extra = [b["thread_us"] - a["thread_us"] for a, b in pairs]
    ratio = [a["step_us"] / b["step_us"] for a, b in pairs]
    mean, half = mean_and_interval(extra)
    r_mean, r_half = mean_and_interval(ratio)
    bare = statistics.median(a["thread_us"] for a, _ in pairs)
    on = statistics.median(b["thread_us"] for _, b in pairs)
    print(
        f"{part_name} on {args.device}, step {step_ms} ms (batch {m.batch}, {len(pairs)} pairs): "
        f"training-thread CPU per step {bare:.1f} µs off, {on:.1f} µs on; paired extra "
        f"{mean:+.1f} ± {half:.1f} µs ({100 * mean / bare:+.2f} % of the step); step-rate "
        f"ratio {r_mean:.4f} ± {r_half:.4f}"
    )
    if part.calls_per_step:
        calls = part.calls_per_step
        print(
            f"  {calls:.0f} hooked module calls per step (depth {args.depth}): "
            f"{mean / calls:+.2f} ± {half / calls:.2f} µs per module call (forward + backward)"
        )


def at_boundaries(part: str, args: Any, out: Path) -> None:
    """`otelprof.step()` (or a change of phase there and back) alone, with and without
    `PhasePeaks` attached: blocks with a small matrix product between calls (torch's work
    evicts caches as a model's does); per block the median call, paired blocks alternated."""
    prof = otelprof.instrument(output_dir=str(out), run_id=part)
    device = args.device
    x = torch.randn(128, 128, device=device)

    def act() -> None:
        if part == "boundary":
            otelprof.step()
        else:
            prof.set_phase("validation")
            prof.set_phase("train")

    def block(on: bool) -> float:
        peaks = PhasePeaks() if on else None
        if peaks is not None:
            peaks.attach(prof._timings)
        times = []
        for _ in range(args.boundary_steps):
            x.matmul(x)
            start = time.perf_counter_ns()
            act()
            times.append(time.perf_counter_ns() - start)
        if peaks is not None:
            peaks.close()
        return statistics.median(times) / 1e3

    try:
        if device == "cuda":
            torch.cuda.synchronize()
        block(False)
        pairs = []
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {on: block(on) for on in order}
            pairs.append((got[False], got[True]))
    finally:
        prof.shutdown()
    extra = [b - a for a, b in pairs]
    mean, half = mean_and_interval(extra)
    off = statistics.median(a for a, _ in pairs)
    what = "otelprof.step()" if part == "boundary" else "a change of phase there and back"
    print(
        f"{what} on {device} ({len(pairs)} pairs of {args.boundary_steps}): {off:.2f} µs "
        f"without memory_peaks, paired extra with it {mean:+.2f} ± {half:.2f} µs (CUDA "
        f"{'initialized' if device == 'cuda' else 'not initialized'})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part",
        nargs="+",
        choices=("modules", "boundary", "phase"),
        default=["modules", "boundary", "phase"],
    )
    parser.add_argument("--boundary-steps", type=int, default=2000)
    parser.add_argument("--step-ms", type=float, nargs="+", default=[1.0, 30.0])
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--block-seconds", type=float, default=0.3)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print_machine(torch.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.part:
            if part in ("boundary", "phase"):
                at_boundaries(part, args, Path(tmp))
                continue
            for step_ms in args.step_ms:
                run(part, step_ms, args, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
