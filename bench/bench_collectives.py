"""Cost of timing collectives, side by side in one process (gloo, CPU, one rank).

    .venv/bin/python bench/bench_collectives.py [--rounds 12] [--burst 300]

Variants, measured in interleaved rounds (so a noisy neighbour hits all alike); the figure
is the median over rounds of the per-call (per-step) time:

  all_reduce bare    dist.all_reduce of a 1-element tensor, no otelprof
  all_reduce timed   the same under otelprof.instrument(): span dist.all_reduce + counter
  DDP step bare      forward/backward/SGD step of a small DDP model, no otelprof
  DDP step timed     a twin model under otelprof: DDP's all-reduce through otelprof's
                     timed comm hook (span ddp.allreduce), the step's own spans as usual

One rank is the worst case for the relative cost: a one-process all-reduce is the cheapest
collective there is (no network, no waiting). Timed rounds run under a plain
`otelprof.instrument()` (detached mode, hardware metrics on, every background thread free).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from _machine import cpu_model
from torch.nn.parallel import DistributedDataParallel as DDP

import otelprof


def _per_call(fn: Callable[[], None], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--burst", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    value = torch.ones(1)
    data, target = torch.randn(16, 32), torch.randn(16, 1)

    def make() -> tuple[DDP, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        model = DDP(net)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    def step_of(model: DDP, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            loss = torch.nn.functional.mse_loss(model(data), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            otelprof.step()

        return step

    bare_model = make()
    bare_model[0](data)  # first forward outside otelprof: no hook on this one
    timed_model = make()
    results: dict[str, list[float]] = {
        k: [] for k in ("ar_bare", "ar_timed", "ddp_bare", "ddp_timed")
    }
    with tempfile.TemporaryDirectory() as out:

        def bare() -> None:
            results["ar_bare"].append(_per_call(lambda: dist.all_reduce(value), args.burst))
            results["ddp_bare"].append(_per_call(step_of(*bare_model), args.burst // 3))

        def timed() -> None:
            with otelprof.instrument(output_dir=out):
                results["ar_timed"].append(_per_call(lambda: dist.all_reduce(value), args.burst))
                results["ddp_timed"].append(_per_call(step_of(*timed_model), args.burst // 3))

        for i in range(args.rounds):  # alternate which goes first: no order effect
            for variant in (bare, timed) if i % 2 else (timed, bare):
                variant()
    dist.destroy_process_group()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; torch {torch.__version__}")
    print(f"rounds {args.rounds}, burst {args.burst} all_reduce calls / {args.burst // 3} steps")
    for name, bare, timed in (
        ("all_reduce (1 float, 1 rank)", "ar_bare", "ar_timed"),
        ("DDP step (small MLP, 1 rank)", "ddp_bare", "ddp_timed"),
    ):
        b, t = med[bare] * 1e6, med[timed] * 1e6
        print(f"{name:30s} bare {b:8.1f} us  timed {t:8.1f} us  +{t - b:6.1f} us  x{t / b:.2f}")


if __name__ == "__main__":
    main()
