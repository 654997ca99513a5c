"""A tiny Lightning DDP job on CPU (gloo), written as a user would: `otelprof.instrument()`
at the top of the script, the one-line callback, `Trainer(strategy="ddp", devices=2)`.

Lightning's subprocess script launcher re-runs this very script (same argv) for local rank 1
with `LOCAL_RANK=1` in its environment; ranks exist only once the Trainer calls
`init_process_group`. `--slow-rank R --slow-ms MS` makes rank R sleep in each training step
(a straggler); `--callback-only` leaves instrument() out, so the callback starts otelprof at
the Trainer's setup. Random data; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import otelprof
from otelprof import _profiler

if "--callback-only" not in sys.argv:
    otelprof.instrument()  # at the top of the script, before Lightning starts any rank

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from otelprof.integrations.lightning import OtelprofCallback

RANKS = ("rank", "local_rank", "world_size")


class TinyModule(pl.LightningModule):
    def __init__(self, slow_rank: int, slow_ms: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
        )
        self.slow_rank = slow_rank
        self.slow_s = slow_ms / 1000

    def training_step(self, batch: Any, _index: int) -> torch.Tensor:
        if self.global_rank == self.slow_rank:
            time.sleep(self.slow_s)  # this rank's own extra work
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def on_train_end(self) -> None:
        active = _profiler.active_profiler()
        assert active is not None
        trainer = self.trainer
        seen = {  # what Lightning and otelprof each say this process is
            "lightning": [trainer.global_rank, trainer.local_rank, trainer.world_size],
            "otelprof": [active.resource.attributes.get(f"otelprof.{k}") for k in RANKS],
            "run_dir": str(active.run_dir),
        }
        root = Path(trainer.default_root_dir)
        root.mkdir(parents=True, exist_ok=True)
        (root / f"process{os.getpid()}.json").write_text(json.dumps(seen))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=20.0)
    p.add_argument("--root", required=True, help="Lightning's default_root_dir")
    p.add_argument(
        "--callback-only",
        action="store_true",
        help="no instrument() at the top: the callback starts otelprof at the Trainer's setup",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16 * args.steps, 32), torch.randint(0, 4, (16 * args.steps,)))
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        limit_train_batches=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.root,
        callbacks=[OtelprofCallback()],
    )
    trainer.fit(TinyModule(args.slow_rank, args.slow_ms), DataLoader(data, batch_size=8))
    otelprof.uninstrument()  # a no-op when the callback started otelprof (ended at teardown)


if __name__ == "__main__":
    main()
