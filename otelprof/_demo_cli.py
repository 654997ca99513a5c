"""`otelprof demo`: run the demo training job in detached mode and report on it."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train a small PyTorch model under otelprof (detached mode) and report on it",
        description="Train a small CNN on synthetic data under otelprof.instrument() in "
        "detached mode, then print where the run files are and a report of the run.",
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="training time (default 30)")
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--interval", type=float, default=1.0, help="metrics interval, seconds")
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="where run directories go (./otelprof-runs)"
    )
    parser.add_argument(
        "--slow-dataloader",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="sleep this long per batch in the data loader (to see a data-loader-bound verdict)",
    )
    parser.add_argument("--no-report", action="store_true", help="skip the report at the end")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import otelprof
    from otelprof._demo import default_device, train

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    console = Console()
    options: dict[str, Any] = {"interval": args.interval, "service_name": "otelprof-demo"}
    if args.output_dir is not None:
        options["output_dir"] = args.output_dir
    device = default_device()
    console.print(
        f"[bold]otelprof demo[/]: training on {device} for "
        + (f"{args.steps} steps" if args.steps else f"{args.seconds:g} s")
    )
    with otelprof.instrument(detached=True, **options) as prof:
        result = train(
            prof,
            steps=args.steps,
            seconds=None if args.steps else args.seconds,
            slow_dataloader_s=args.slow_dataloader,
        )
    stats = prof.stats()
    run_dir = prof.run_dir
    assert run_dir is not None
    console.print(f"\n[bold]Run files[/]: {run_dir}", soft_wrap=True, highlight=False)
    table = Table(title="What was collected", show_header=False)
    for kind, path in prof.files.items():
        size = path.stat().st_size if path.exists() else 0
        table.add_row(f"{kind} file", f"{path.name} ({size / 1024:.0f} KiB)")
    table.add_row("steps / epochs", f"{result.steps} / {result.epochs}")
    mean_step = sum(result.step_times_s) / max(len(result.step_times_s), 1)
    table.add_row("mean step time", f"{mean_step * 1000:.1f} ms")
    table.add_row("final loss (20-step mean)", f"{result.final_loss:.3f}")
    table.add_row("spans written", str(stats.get("files.spans_exported", 0)))
    table.add_row("metric points written", str(stats.get("files.metric_points_exported", 0)))
    table.add_row("telemetry dropped", str(stats["dropped_total"]))
    console.print(table)
    if args.no_report:
        return 0
    from otelprof.cli import main as cli_main

    return cli_main(["report", str(run_dir)])
