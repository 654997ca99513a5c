"""The `otelprof` command: a thin dispatcher; each package registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Packages that contribute subcommands through a `register(subparsers)` function.
_SUBCOMMAND_MODULES = (
    "otelprof._demo_cli",
    "otelprof.analysis.cli",
    "otelprof.determined.cli",
)


def build_parser() -> argparse.ArgumentParser:
    """Build the full parser; kept separate from main() so tests can inspect it."""
    parser = argparse.ArgumentParser(
        prog="otelprof",
        description="OpenTelemetry profiler for deep-learning training.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _SUBCOMMAND_MODULES:
        module = importlib.import_module(module_name)
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `otelprof` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
