"""otelprof beside the profilers users would pick instead, on the same loop, in one process.

    .venv/bin/python bench/bench_compare.py [--step-ms 1] [--pairs 4] [--block-seconds 12]
        [--only plain lightning]

Plain loop (`bench_real_loop.py`'s: a real DataLoader, an MLP's forward, backward and SGD
step, an LR scheduler, the copies to and from the device), each arm against the bare loop in
blocks that alternate A-B-B-A:

- `otelprof`: `otelprof.instrument()` (default settings) and the README's helpers;
- `torch.profiler`: `torch.profiler.profile(schedule=schedule(wait=1, warmup=1, active=3,
  repeat=1), on_trace_ready=tensorboard_trace_handler(dir))` and `otelprof.step()` per step,
  one profile per block: one traced cycle per block, as a user samples a run now and then;
- `wandb`: `wandb.init(mode="offline")`, system metrics at W&B's default interval, nothing
  logged per step (the profiling part only);
- `mlflow`: `mlflow.start_run(log_system_metrics=True)` on a local file store, MLflow's
  default sampling (every 10 s; blocks are 12 s so that samples land in them).

Lightning (`--only lightning`): the same model in `Trainer.fit` (one fit per block, steps
timed between `on_train_batch_end` calls), plain against `OtelprofCallback()`, Lightning's
`SimpleProfiler` and its `PyTorchProfiler` (defaults: a schedule of wait 1, warmup 1,
active 3 that repeats).

Every block starts its tool, runs `--warmup-seconds` (otelprof: also until its head
budget's burst of spans is spent and flushed), then times
`--block-seconds` of steps, then stops the tool; the bare block runs the same loop with
nothing started. Printed per arm: step-rate ratio (median over pairs, and the range), the
training thread's own CPU per step (its thread CPU clock) bare and with the tool, and the
data the tool wrote per hour (the bytes its directory grew from the start of timing to the
tool's stop, over the timed seconds: outputs written once per run, like a profiler summary,
are charged to the block).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from _machine import print_machine
from bench_real_loop import Model, bare_loop, calibrate, instrumented_loop

import otelprof

WHAT = {
    "otelprof": "timings per phase and step (spans, histograms), hardware, process",
    "torch.profiler": "every op of 3 traced steps per cycle (Chrome trace), no hardware",
    "wandb": "hardware and process only (no timings)",
    "mlflow": "hardware only (no timings)",
    "otelprof callback": "timings per hook and step, hardware, process",
    "SimpleProfiler": "a table of time per hook at the end of the fit",
    "PyTorchProfiler": "every op of 3 steps per cycle, written at the end of the fit",
}


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total


Tool = Callable[[Path], contextlib.AbstractContextManager[Any]]


@contextlib.contextmanager
def _otelprof(out: Path) -> Iterator[Any]:
    prof = otelprof.instrument(output_dir=str(out), run_id="run")
    try:
        yield prof
    finally:
        prof.shutdown()


@contextlib.contextmanager
def _torch_profiler(out: Path) -> Iterator[Any]:
    from torch.profiler import profile, schedule, tensorboard_trace_handler

    with profile(
        schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(out)),
    ) as prof:
        yield prof


@contextlib.contextmanager
def _wandb(out: Path) -> Iterator[Any]:
    import wandb

    run = wandb.init(mode="offline", dir=str(out), project="bench", settings=wandb.Settings())
    try:
        yield None
    finally:
        run.finish()


@contextlib.contextmanager
def _mlflow(out: Path) -> Iterator[Any]:
    import mlflow

    mlflow.set_tracking_uri((out / "mlruns").as_uri())
    with mlflow.start_run(log_system_metrics=True):
        yield None


def _plain_block(tool: str | None, m: Model, args: Any, out: Path) -> dict[str, float]:
    """One block: start the tool, warm up, time `block_seconds`, stop; bytes written."""
    makers: dict[str, Tool] = {
        "otelprof": _otelprof,
        "torch.profiler": _torch_profiler,
        "wandb": _wandb,
        "mlflow": _mlflow,
    }
    context: contextlib.AbstractContextManager[Any] = (
        makers[tool](out) if tool is not None else contextlib.nullcontext()
    )
    with context as opened:
        loop = instrumented_loop if tool == "otelprof" else bare_loop
        handle: Any = opened if tool in ("otelprof", "torch.profiler") else None
        if tool != "torch.profiler":  # its cycle starts at the first step: timed with it
            loop(m, args.warmup_seconds, handle)
        if tool == "otelprof":  # past the head budget's burst, its lines on disk
            for _ in range(120):
                if handle.stats().get("timings.spans_sampled_out", 0):
                    break
                loop(m, 0.5, handle)
            handle.tracer_provider.force_flush()
            handle.meter_provider.force_flush()
        written = _dir_bytes(out)
        cpu, start = time.thread_time(), time.perf_counter()
        steps = loop(m, args.block_seconds, handle)
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    return {
        "step_us": wall / steps * 1e6,
        "cpu_us": cpu / steps * 1e6,
        "bytes_per_s": (_dir_bytes(out) - written) / wall,
    }


def _lightning_block(tool: str | None, m: Model, args: Any, out: Path) -> dict[str, float]:
    import lightning.pytorch as pl
    from lightning.pytorch.profilers import PyTorchProfiler, SimpleProfiler

    from otelprof.integrations.lightning import OtelprofCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = m.model

        def training_step(self, batch: Any, _index: int) -> torch.Tensor:
            return m.loss_fn(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler}}

    marks: list[tuple[float, float, int]] = []
    warm_until = [0.0]

    class Clock(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *_args: Any) -> None:
            now = time.perf_counter()
            if not warm_until[0]:
                warm_until[0] = now + args.warmup_seconds
            if now >= warm_until[0]:
                marks.append((now, time.thread_time(), _dir_bytes(out) if not marks else 0))
                if now - marks[0][0] >= args.block_seconds:
                    trainer.should_stop = True

    callbacks: list[Any] = [Clock()]
    profiler: Any = None
    if tool == "otelprof callback":
        callbacks.append(OtelprofCallback(output_dir=str(out), run_id="run"))
    elif tool == "SimpleProfiler":
        profiler = SimpleProfiler(dirpath=str(out), filename="simple")
    elif tool == "PyTorchProfiler":
        profiler = PyTorchProfiler(dirpath=str(out), filename="torch")
    trainer = pl.Trainer(
        max_epochs=10_000, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        profiler=profiler, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Module(), m.loader)
    (t0, c0, written), (t1, c1, _) = marks[0], marks[-1]
    steps = max(len(marks) - 1, 1)
    return {
        "step_us": (t1 - t0) / steps * 1e6,
        "cpu_us": (c1 - c0) / steps * 1e6,
        "bytes_per_s": (_dir_bytes(out) - written) / (t1 - t0),
    }


def compare(tool: str, block: Callable[..., dict[str, float]], m: Model, args: Any) -> None:
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            for armed in order:
                out = Path(tmp) / f"{pair}-{int(armed)}"
                out.mkdir()
                results[armed].append(block(tool if armed else None, m, args, out))
    bare, tooled = results[False], results[True]
    ratios = sorted(b["step_us"] / a["step_us"] for b, a in zip(bare, tooled, strict=True))
    cpu_bare = statistics.median(b["cpu_us"] for b in bare)
    cpu_armed = statistics.median(a["cpu_us"] for a in tooled)
    per_hour = statistics.median(a["bytes_per_s"] for a in tooled) * 3600 / 1e6
    print(
        f"| {tool} | {statistics.median(ratios):.3f} ({ratios[0]:.3f}–{ratios[-1]:.3f}) | "
        f"{cpu_bare:.0f} → {cpu_armed:.0f} µs ({cpu_armed - cpu_bare:+.0f}) | "
        f"{per_hour:.1f} MB | {WHAT[tool]} |",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=1.0)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--block-seconds", type=float, default=12.0)
    parser.add_argument("--warmup-seconds", type=float, default=2.0)
    parser.add_argument(
        "--only", nargs="+", default=["plain", "lightning"], choices=("plain", "lightning")
    )
    parser.add_argument(
        "--tools", nargs="+", default=None, help="a subset of the arms, by the names printed"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "otelprof", "wandb", "mlflow"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file store, no server
    print_machine(torch.__version__)
    m = calibrate(args.step_ms)
    print(
        f"{args.step_ms} ms steps (batch {m.batch}); {args.pairs} A-B-B-A pairs of "
        f"{args.block_seconds:g} s timed blocks after {args.warmup_seconds:g} s of warm-up\n"
    )
    print("| arm | step-rate ratio (range) | training-thread CPU per step | data per hour | "
          "what it tells |")  # fmt: skip
    print("|---|---|---|---|---|")
    arms: list[tuple[str, Callable[..., dict[str, float]]]] = []
    if "plain" in args.only:
        arms += [(t, _plain_block) for t in ("otelprof", "torch.profiler", "wandb", "mlflow")]
    if "lightning" in args.only:
        arms += [
            (t, _lightning_block)
            for t in ("otelprof callback", "SimpleProfiler", "PyTorchProfiler")
        ]
    for tool, block in arms:
        if args.tools and tool not in args.tools:
            continue
        try:
            compare(tool, block, m, args)
        except ImportError as missing:
            print(f"| {tool} | not installed ({missing.name}: `pip install -e .[bench]`) | | | |")
    print(f"\nload average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
