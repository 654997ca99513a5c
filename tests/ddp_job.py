"""A small synchronous DDP job on CPU (gloo), launched for real by the distributed tests.

Run under torchrun (`python -m torch.distributed.run ... tests/ddp_job.py`) or as
`python tests/ddp_job.py --spawn N` (torch.multiprocessing.spawn, the PyTorch tutorial
pattern: no launcher environment, ranks only from the process group). Options:
`--slow-rank R --slow-ms MS` sleeps on rank R each step outside any timing (a straggler;
with `--slow-at STEP`, at that step only); `--validate-every N` runs a validation phase of
three batches (each with an all-reduce) after every N steps;
`--raise-rank R --raise-at STEP` raises there; `--kill-rank R --kill-at STEP` SIGKILLs itself;
`--instrument-first` calls otelprof.instrument() before init_process_group (and
`--early-steps N` trains N steps, without DDP, before the group exists);
`--meet-dir DIR --meet-count N` waits, after training, until N processes (of any job) came;
`--forget-local-rank` drops LOCAL_RANK first (a launcher that sets none: otelprof learns the
local rank from the host names the ranks share).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import otelprof
from otelprof import determined_timings


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument(
        "--lightning-like",
        type=int,
        default=0,
        help="N processes launched as Lightning's DDP launcher does: the script itself is "
        "local rank 0 and starts N-1 copies with LOCAL_RANK set; instrument() runs first",
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=20.0)
    p.add_argument("--slow-at", type=int, default=-1)
    p.add_argument("--validate-every", type=int, default=0)
    p.add_argument("--raise-rank", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--fail-at", type=int, default=10)
    p.add_argument("--fail-attempt", type=int, default=-1, help="fail only in this attempt")
    p.add_argument("--instrument-first", action="store_true")
    p.add_argument("--early-steps", type=int, default=0, help="with --instrument-first")
    p.add_argument("--meet-dir", default="")
    p.add_argument("--meet-count", type=int, default=0)
    p.add_argument("--forget-local-rank", action="store_true")
    p.add_argument("--step-sleep-ms", type=float, default=2.0)
    return p.parse_args(argv)


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if args.forget_local_rank:
        os.environ.pop("LOCAL_RANK", None)
    children: list[subprocess.Popen[bytes]] = []
    if args.instrument_first:
        prof = otelprof.instrument()
        for _ in range(args.early_steps):  # under a provisional identity: no group yet
            with otelprof.timing("dataloader_next"):
                time.sleep(args.step_sleep_ms / 1000)
            otelprof.step()
    if args.lightning_like:
        prof = otelprof.instrument()  # at import time of the script, before the launcher
        children = _launch_like_lightning(args.lightning_like)
        rank = int(os.environ["LOCAL_RANK"])
    if args.spawn or args.lightning_like:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    else:
        dist.init_process_group("gloo")
    if not args.instrument_first:
        prof = otelprof.instrument()
    rank = dist.get_rank()
    # one write per line: the ranks share torchrun's stdout, and print's separate write of
    # the newline let two ranks' lines run together
    sys.stdout.write(f"rank {rank} ready\n")
    sys.stdout.flush()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    failing = args.fail_attempt < 0 or args.fail_attempt == attempt
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(16, 32)
    target = torch.randn(16, 1)
    try:
        with prof:  # an exception leaving the block is recorded as this rank's end
            for step in range(args.steps):
                if rank == args.slow_rank and args.slow_at in (-1, step):
                    time.sleep(args.slow_ms / 1000)  # extra work outside any timing
                if failing and step == args.fail_at and rank == args.raise_rank:
                    raise RuntimeError(f"rank {rank} failed at step {step}")
                if failing and step == args.fail_at and rank == args.kill_rank:
                    os.kill(os.getpid(), signal.SIGKILL)
                with otelprof.timing("dataloader_next"):
                    time.sleep(args.step_sleep_ms / 1000)
                with determined_timings.train_batch():
                    loss = torch.nn.functional.mse_loss(model(data), target)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                with determined_timings.reduce_metrics():
                    value = loss.detach().clone()
                    dist.all_reduce(value)
                otelprof.step()
                if args.validate_every and step % args.validate_every == args.validate_every - 1:
                    _validate(prof, model, data)
            dist.barrier()
            if args.meet_dir:
                _meet(args.meet_dir, args.meet_count)
    finally:
        dist.destroy_process_group()
        codes = [child.wait(timeout=120) for child in children]
        if any(codes):
            raise SystemExit(f"child processes exited with {codes}")


def _meet(directory: str, count: int) -> None:
    """Wait until `count` processes (of this job or others) have come here: their runs are
    all alive at once."""
    open(os.path.join(directory, f"{socket.gethostname()}-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 120
    while len(os.listdir(directory)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(os.listdir(directory))} of {count} processes came")
        time.sleep(0.05)


def _validate(prof: otelprof.Profiler, model: torch.nn.Module, data: torch.Tensor) -> None:
    with otelprof.phase("validation"), torch.no_grad():
        for batch in range(3):
            with otelprof.timing("eval_batch"):
                value = model(data).sum()
                dist.all_reduce(value)
            if batch < 2:
                otelprof.step()  # the next batch of the phase


def _launch_like_lightning(world_size: int) -> list[subprocess.Popen[bytes]]:
    """What lightning.fabric's _SubprocessScriptLauncher does: in the first process, set
    MASTER_* (a free port unless the environment names one), NODE_RANK, LOCAL_RANK=0 and
    WORLD_SIZE, then start the others with LOCAL_RANK=i (no RANK anywhere)."""
    if "LOCAL_RANK" in os.environ:
        return []  # a child
    os.environ.update(NODE_RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    return [
        subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, "LOCAL_RANK": str(i)})
        for i in range(1, world_size)
    ]


def _spawned(index: int, world_size: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    train(index, world_size, args)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.spawn:
        mp.spawn(_spawned, args=(args.spawn, args), nprocs=args.spawn, join=True)
    elif args.lightning_like:
        train(-1, args.lightning_like, args)
    else:
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
