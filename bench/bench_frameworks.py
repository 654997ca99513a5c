"""Step-time cost of the framework integrations, baseline and otelprof side by side.

    .venv/bin/python bench/bench_frameworks.py [--pairs 6] [--steps 300]

Each variant trains the same model on CPU (1 intra-op thread) in blocks that alternate
A-B-B-A: plain framework code (A) and the same code with the integration's one line (B,
detached mode, hardware metrics every 1 s, FLOPs counted once by FlopCounterMode). The time
of every training step is taken between consecutive batch boundaries (Accelerate: the loop
body; Lightning: a measuring callback's `on_train_batch_end`), the first 10 steps of a block
(warm-up, FLOP counting) left out; a block's figure is its median step time. Printed: the
median over pairs of (B median / A median), and the spans and steps recorded.

Variants: a fast step (Linear 32->4, batch 16: well under a millisecond with Accelerate) and
a slow one (MLP 1024 wide, batch 256), for Accelerate and for Lightning; Lightning's fast
step again with `timings=False` (the callback's hooks, throughput and metrics without any
span), which separates the integration's own cost from the cost of the spans. Plus the cost
of one `otelprof.step_work()` call with a profiler running.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import timeit
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _machine import cpu_model

import otelprof

SKIP = 10


def _model(slow: bool) -> tuple[torch.nn.Module, int, int]:
    if slow:
        width, batch = 1024, 256
        model = torch.nn.Sequential(
            torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, 10)
        )
        return model, batch, 256
    return torch.nn.Linear(32, 4), 16, 32


def _data(steps: int, batch: int, features: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.randn(steps * batch, features)
    y = torch.randint(0, 4, (steps * batch,))
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def accelerate_block(instrumented: bool, slow: bool, steps: int, out: str) -> list[float]:
    from accelerate import Accelerator

    from otelprof.integrations.accelerate import instrument_accelerator

    accelerator = Accelerator(cpu=True)
    handle = None
    if instrumented:
        handle = instrument_accelerator(accelerator, output_dir=out, interval=1.0)
    model, batch, features = _model(slow)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _data(steps, batch, features))
    times: list[float] = []
    last = time.perf_counter()
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    if handle is not None:
        handle.remove()
    return times[SKIP:]


def lightning_block(
    instrumented: bool, slow: bool, steps: int, out: str, timings: bool = True
) -> list[float]:
    import lightning.pytorch as pl

    from otelprof.integrations.lightning import OtelprofCallback

    model, batch, features = _model(slow)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, b: Any, _i: int) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.net(b[0]), b[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    times: list[float] = []

    class Clock(pl.Callback):
        last = 0.0

        def on_train_batch_end(self, *_args: Any) -> None:
            now = time.perf_counter()
            if self.last:
                times.append(now - self.last)
            self.last = now

    callbacks: list[Any] = [Clock()]
    if instrumented:
        callbacks.append(OtelprofCallback(output_dir=out, interval=1.0, timings=timings))
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(Module(), _data(steps, batch, features))
    return times[SKIP:]


def _pairs(
    block: Callable[..., list[float]], slow: bool, pairs: int, steps: int, **kwargs: Any
) -> None:
    ratios, a_medians, b_medians = [], [], []
    with tempfile.TemporaryDirectory() as out:
        block(False, slow, steps, out)  # warm-up: imports, allocator, first compile paths
        for i in range(pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            medians = {}
            for instrumented in order:
                times = block(instrumented, slow, steps, out, **kwargs)
                medians[instrumented] = statistics.median(times)
            a_medians.append(medians[False])
            b_medians.append(medians[True])
            ratios.append(medians[True] / medians[False])
    name = f"{block.__name__.split('_')[0]:10s} {'slow' if slow else 'fast'}"
    if kwargs:
        name += " " + ",".join(f"{k}={v}" for k, v in kwargs.items())
    print(
        f"{name}: baseline {statistics.median(a_medians) * 1e3:8.3f} ms/step, "
        f"otelprof {statistics.median(b_medians) * 1e3:8.3f} ms/step, "
        f"ratio median {statistics.median(ratios):.3f} "
        f"(pairs {min(ratios):.3f} .. {max(ratios):.3f})",
        flush=True,
    )


def step_work_cost() -> None:
    with tempfile.TemporaryDirectory() as out:
        prof = otelprof.instrument(output_dir=out, host_metrics=False, process_metrics=False)
        n = 200_000
        seconds = timeit.timeit(lambda: otelprof.step_work(samples=16, tokens=512), number=n)
        bare = timeit.timeit(lambda: None, number=n)
        prof.shutdown()
    print(f"step_work(samples=, tokens=): {(seconds - bare) / n * 1e9:.0f} ns per call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("otelprof").setLevel(logging.ERROR)
    print(f"machine: {cpu_model()}; torch {torch.__version__}; 1 intra-op thread", flush=True)
    step_work_cost()
    for block in (accelerate_block, lightning_block):
        for slow in (False, True):
            _pairs(block, slow, args.pairs, args.steps if not slow else args.steps // 3)
    # the integration's hooks alone: the same callback with timing spans off
    _pairs(lightning_block, False, args.pairs, args.steps, timings=False)


if __name__ == "__main__":
    main()
