"""The demo job: a small real PyTorch training loop under otelprof.

Everything is real (a DataLoader over a synthetic dataset, host-to-device copies, forward,
backward, optimizer and LR-scheduler steps, metric reduction), so the timings otelprof
reports are the timings of real work. Tests and benchmarks reuse `train()`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import otelprof
from otelprof import determined_timings
from otelprof._profiler import Profiler


class SyntheticImages(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Deterministic random 3x32x32 images and labels, generated on access like real decoding."""

    def __init__(self, size: int = 100_000, seed: int = 0) -> None:
        self.size = size
        self.seed = seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.rand(3, 32, 32, generator=generator)
        label = torch.randint(0, 10, (), generator=generator)
        return image, label


class _SlowCollate:
    """Collate that sleeps, to make a data-loader-bound run on purpose."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, batch: list[Any]) -> Any:
        time.sleep(self.delay_s)
        return torch.utils.data.default_collate(batch)


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(32 * 16, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


@dataclass
class TrainResult:
    steps: int
    epochs: int
    seconds: float
    final_loss: float
    step_times_s: list[float]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def train(
    profiler: Profiler | None,
    *,
    steps: int | None = None,
    seconds: float | None = None,
    batch_size: int = 64,
    slow_dataloader_s: float = 0.0,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> TrainResult:
    """Train until `steps` steps or `seconds` of wall time, whichever comes first.

    With `profiler=None` the same loop runs unprofiled (the benchmarks' baseline): the
    otelprof helpers are cheap no-ops when no profiler is active.
    """
    if steps is None and seconds is None:
        raise ValueError("give steps, seconds or both")
    torch.manual_seed(seed)
    device = torch.device(device) if device is not None else default_device()
    model = build_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.9)
    loss_fn = nn.CrossEntropyLoss()
    collate = _SlowCollate(slow_dataloader_s) if slow_dataloader_s > 0 else None
    loader = DataLoader(
        SyntheticImages(seed=seed),
        batch_size=batch_size,
        shuffle=True,
        collate_fn=collate,
        pin_memory=device.type == "cuda",
        drop_last=True,
    )
    hooks = [
        otelprof.instrument_optimizer(optimizer),
        determined_timings.instrument_lr_scheduler(scheduler),
    ]
    deadline = None if seconds is None else time.perf_counter() + seconds
    step_times: list[float] = []
    losses: list[torch.Tensor] = []
    done = 0
    epoch = 0
    started = last_step_end = time.perf_counter()
    try:
        while True:
            otelprof.set_epoch(epoch)
            for images, labels in otelprof.timed_dataloader(loader):
                images, labels = determined_timings.to_device(
                    (images, labels), device, non_blocking=device.type == "cuda"
                )
                with otelprof.timing("train_batch"):
                    optimizer.zero_grad(set_to_none=True)
                    with torch.profiler.record_function("forward"):
                        loss = loss_fn(model(images), labels)
                    with torch.profiler.record_function("backward"):
                        loss.backward()
                    optimizer.step()
                scheduler.step()
                losses.append(determined_timings.from_device(loss.detach()))
                with otelprof.timing("reduce_metrics"):
                    window_loss = float(torch.stack(losses[-20:]).mean())
                done += 1
                otelprof.step()
                now = time.perf_counter()
                step_times.append(now - last_step_end)  # data loading included
                last_step_end = now
                if (steps is not None and done >= steps) or (
                    deadline is not None and time.perf_counter() >= deadline
                ):
                    return TrainResult(
                        done, epoch + 1, time.perf_counter() - started, window_loss, step_times
                    )
            epoch += 1
    finally:
        for hook in hooks:
            hook.remove()
