"""A small transformer trained on CUDA in bf16: `scripts/gpu-check`'s job and its overhead A-B.

    python bench/gpu_train.py --seconds 60 --output-dir DIR      (otelprof, detached)

A decoder-only language model (token embedding, `--layers` pre-norm transformer blocks of
`--width`, a tied output head) over random token sequences from a real DataLoader with
worker processes, trained with AdamW under `torch.autocast(bfloat16)`. The instrumented
loop is the one the README teaches: the data loader timed, the host-to-device copy,
`train_batch` around forward, backward and the optimizer step, the work per step declared
(samples, tokens, FLOPs: 6 x parameters x tokens), one `otelprof.step()` per step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import otelprof


class RandomTokens(Dataset[torch.Tensor]):
    """Sequences of random token ids: the loader's work is real (workers, collation, pinning)
    while the data itself is beside the point."""

    def __init__(self, vocab: int, length: int, size: int = 1 << 20) -> None:
        self.vocab, self.length, self.size = vocab, length, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(index)
        return torch.randint(0, self.vocab, (self.length + 1,), generator=g)


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        mask = torch.triu(torch.full((length, length), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        x = self.blocks(x, mask=self.mask, is_causal=True)
        return self.norm(x) @ self.embed.weight.T


@dataclass
class Job:
    model: TinyLM
    optimizer: torch.optim.Optimizer
    dataset: RandomTokens
    workers: int
    device: torch.device
    batch: int
    length: int
    flops_per_step: float

    def batches(self) -> Iterator[torch.Tensor]:
        """Endless batches from a DataLoader of their own (a loader with persistent workers
        has one iterator: two consumers of one loader would reset each other)."""
        loader = DataLoader(
            self.dataset,
            batch_size=self.batch,
            shuffle=True,
            num_workers=self.workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=self.workers > 0,
            drop_last=True,
        )
        while True:
            yield from loader


def make_job(
    device: str = "cuda",
    width: int = 1024,
    layers: int = 8,
    heads: int = 16,
    length: int = 512,
    batch: int = 16,
    vocab: int = 32768,
    workers: int = 2,
) -> Job:
    torch.manual_seed(0)
    dev = torch.device(device)
    model = TinyLM(vocab, width, layers, heads, length).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=dev.type == "cuda")
    params = sum(p.numel() for p in model.parameters())
    flops = 6.0 * params * batch * length
    return Job(model, optimizer, RandomTokens(vocab, length), workers, dev, batch, length, flops)


def _loss(job: Job, batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast(job.device.type, dtype=torch.bfloat16):
        logits = job.model(batch[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def bare_steps(job: Job, data: Iterator[torch.Tensor], steps: int) -> None:
    """The baseline: the same loop with no otelprof call."""
    for _ in range(steps):
        batch = next(data).to(job.device, non_blocking=True)
        job.optimizer.zero_grad(set_to_none=True)
        _loss(job, batch).backward()
        job.optimizer.step()


def instrumented_steps(job: Job, data: Iterator[torch.Tensor], steps: int) -> None:
    """The README's loop: the timed loader, the copy, `train_batch` (forward, backward and the
    optimizer inside it), the step's work, one step."""
    for _ in range(steps):
        batch = next(data)
        with otelprof.timing("to_device"):
            batch = batch.to(job.device, non_blocking=True)
        with otelprof.timing("train_batch"):
            job.optimizer.zero_grad(set_to_none=True)
            with otelprof.timing("forward"):
                loss = _loss(job, batch)
            with otelprof.timing("backward"):
                loss.backward()
            with otelprof.timing("optimizer_step"):
                job.optimizer.step()
        otelprof.step_work(
            samples=job.batch, tokens=job.batch * job.length, flops=job.flops_per_step
        )
        otelprof.step()


def train(seconds: float, output_dir: Path, **options: object) -> Path:
    """Train for `seconds` under otelprof (detached); returns the run directory."""
    job = make_job()
    batches = job.batches()
    bare_steps(job, batches, 3)  # cuBLAS handles, the allocator, workers up
    torch.cuda.synchronize()
    with otelprof.instrument(output_dir=output_dir, **options) as prof:
        data = iter(otelprof.timed_dataloader(batches))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            instrumented_steps(job, data, 10)
        torch.cuda.synchronize()
    return Path(prof.files["metrics"]).parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_train: needs an NVIDIA GPU (torch.cuda.is_available() is False)")
        return 2
    run = train(args.seconds, args.output_dir, interval=args.interval)
    print(f"run directory: {run}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
