"""`otelprof report | compare | trace | replay`: subcommands over detached run directories."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from otelprof.analysis.parallel_summary import MAX_DEFAULT_JOBS, PARALLEL_FROM_BYTES, default_jobs
from otelprof.analysis.reader import (
    DEFAULT_MAX_LINE,
    DEFAULT_READ_BUDGET,
    RunDirError,
    WarningLog,
    latest_run,
    open_run,
)


def register(subparsers: Any) -> None:
    """Add report, compare, trace and replay to the `otelprof` parser."""
    report = subparsers.add_parser(
        "report",
        help="summarize a detached run: timings, hardware metrics, bottleneck verdict",
        description="Summarize detached run directories (several merge, e.g. one per node).",
    )
    report.add_argument(
        "run_dir",
        nargs="*",
        type=Path,
        metavar="RUN_DIR",
        help="run directories (default: the latest run under ./otelprof-runs, or "
        "$OTELPROF_OUTPUT_DIR)",
    )
    report.add_argument(
        "--json",
        action="store_true",
        help="print the report as one JSON document (same figures) instead of tables",
    )
    report.add_argument(
        "--steps",
        type=_step_range,
        metavar="A:B",
        help="only steps A <= n < B (either side may be omitted: '1:' skips step 0)",
    )
    report.add_argument("--width", type=int, default=None, help="terminal width for tables")
    report.add_argument("--html", nargs="?", action=_HtmlRemoved, help=argparse.SUPPRESS)
    _add_read_budget(
        report,
        "a larger run is read in evenly spaced parts of every file, timing figures staying exact",
    )
    report.add_argument(
        "--jobs",
        "-j",
        type=_jobs,
        default=None,
        metavar="N",
        help="worker processes that read the run's files (default: one per CPU, at most "
        f"{MAX_DEFAULT_JOBS}, when more than {PARALLEL_FROM_BYTES >> 20} MiB is read; 1: in "
        "this process); the report is the same whatever N",
    )
    report.set_defaults(func=_report)

    compare = subparsers.add_parser(
        "compare",
        help="compare two detached runs: what changed from A to B, and how much",
        description="Compare run A with run B (each read as `otelprof report` reads it): "
        "step time and its parts, throughput, memory by phase, top modules, hardware, "
        "verdicts; the main changes in words.",
    )
    compare.add_argument("run_a", type=Path, metavar="A", help="the run before the change")
    compare.add_argument("run_b", type=Path, metavar="B", help="the run after the change")
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")
    compare.add_argument("--width", type=int, default=None, help="terminal width for tables")
    compare.add_argument("--html", nargs="?", action=_HtmlRemoved, help=argparse.SUPPRESS)
    _add_read_budget(compare, "a larger run is read in parts, as by `otelprof report`")
    compare.set_defaults(func=_compare)

    trace = subparsers.add_parser(
        "trace",
        help="convert a detached run to a Chrome/Perfetto trace (ranks merged on one time axis)",
    )
    trace.add_argument("run_dir", nargs="+", type=Path, metavar="RUN_DIR")
    trace.add_argument(
        "-o",
        "--output",
        type=Path,
        default=Path("trace.json"),
        help="output file (default trace.json; .gz compresses)",
    )
    trace.add_argument(
        "--no-metrics", action="store_true", help="leave hardware counter tracks out"
    )
    _add_read_budget(
        trace,
        "a larger run is read in time windows that are the same on every rank (its start "
        "and windows spread to its end, whole steps), noted in the trace",
    )
    trace.set_defaults(func=_trace)

    replay = subparsers.add_parser(
        "replay", help="send a detached run to an OTLP gRPC collector with its original timestamps"
    )
    replay.add_argument("run_dir", nargs="+", type=Path, metavar="RUN_DIR")
    replay.add_argument(
        "--endpoint",
        required=True,
        metavar="HOST:PORT",
        help="the collector's OTLP gRPC receiver, e.g. localhost:4317",
    )
    replay.add_argument("--tls", action="store_true", help="use TLS (default: plaintext)")
    replay.add_argument(
        "--shift-to-now",
        action="store_true",
        help="move all timestamps so the run ends now (for Prometheus, which "
        "drops samples older than its head block; see docs/guide/detached-runs.md)",
    )
    replay.add_argument(
        "--batch-bytes",
        type=int,
        default=1 << 20,
        help="approximate size of one export request (default 1 MiB)",
    )
    replay.add_argument(
        "--retries",
        type=int,
        default=5,
        help="attempts per request on retryable errors (default 5)",
    )
    replay.add_argument(
        "--timeout", type=float, default=10.0, help="seconds per request (default 10)"
    )
    replay.add_argument("--signals", choices=("all", "traces", "metrics"), default="all")
    replay.set_defaults(func=_replay)


class _HtmlRemoved(argparse.Action):
    """`--html`, which is no more: an error that says what to use instead."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        parser.error(
            "--html was removed: use --json for a machine-readable report, "
            "or `otelprof trace` for a timeline in Perfetto"
        )


def _add_read_budget(parser: Any, larger: str) -> None:
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--read-budget",
        type=_size,
        default=DEFAULT_READ_BUDGET,
        metavar="SIZE",
        help="read at most this much of the run's files (e.g. 500M, 4G; default "
        f"{DEFAULT_READ_BUDGET >> 20}M): "
        f"{larger} (see docs/guide/detached-runs.md)",
    )
    budget.add_argument(
        "--read-all",
        dest="read_budget",
        action="store_const",
        const=None,
        help="read every byte of the run's files, however large",
    )
    parser.add_argument(
        "--max-line",
        type=_size,
        default=DEFAULT_MAX_LINE,
        metavar="SIZE",
        help=f"skip, with a warning naming file and line, any line longer than this (default "
        f"{DEFAULT_MAX_LINE >> 20}M; otelprof writes lines of at most a few MiB): memory "
        "stays bounded whatever a file holds",
    )


def _jobs(text: str) -> int:
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise argparse.ArgumentTypeError(f"--jobs must be a whole number >= 1, not {text!r}")
    return jobs


def _size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number, unit = text.strip(), ""
    if number[-1:].upper() in units:
        number, unit = number[:-1], number[-1].upper()
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use bytes or a number with K, M, G or T"
        ) from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be over 0")
    return int(value)


def _step_range(text: str) -> tuple[int | None, int | None]:
    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError
        a = int(low) if low.strip() else None
        b = int(high) if high.strip() else None
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a step range; use A:B, A: or :B with integers"
        ) from None
    if (a is not None and a < 0) or (a is not None and b is not None and b <= a):
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= A < B")
    return a, b


def _open(paths: list[Path], command: str, warn: WarningLog) -> Any:
    """The run directories' files (none given: the latest run's), or None with the error."""
    try:
        if not paths:
            paths = [latest_run()]
            print(f"otelprof {command}: latest run {paths[0]}", file=sys.stderr)
        return open_run(paths, warn)
    except RunDirError as exc:
        print(f"otelprof {command}: error: {exc}", file=sys.stderr)
        return None


def _finish(warn: WarningLog) -> None:
    summary = warn.summary()
    if summary:
        print(f"warning: {summary}", file=sys.stderr)


def _console(width: int | None) -> Any:
    """The terminal for the tables; piped output is not squeezed below 132 columns."""
    from rich.console import Console

    console = Console(width=width)
    if width is None and not console.is_terminal:
        console = Console(width=max(console.width, 132))
    return console


def _read(
    label: str, files: Any, warn: WarningLog, args: argparse.Namespace, **options: Any
) -> Any:
    """A run's summary, verdict and sections (`compare.Run`), as `otelprof report` reads it."""
    from otelprof.analysis.compare import Run
    from otelprof.analysis.sections import build_sections
    from otelprof.analysis.summary import summarize
    from otelprof.analysis.verdict import judge

    jobs = options.pop("jobs", None) or default_jobs(files, args.read_budget)
    summary = summarize(
        files, warn, read_budget=args.read_budget, jobs=jobs, max_line=args.max_line, **options
    )
    return Run(label, summary, judge(summary), build_sections(summary, warn))


def _report(args: argparse.Namespace) -> int:
    warn = WarningLog()
    files = _open(args.run_dir, "report", warn)
    if files is None:
        return 2
    run = _read("", files, warn, args, steps=args.steps, jobs=args.jobs)
    summary, verdict, sections = run.summary, run.verdict, run.sections
    if args.json:
        import json

        from otelprof.analysis.report_json import build_json

        # streamed: the document of 100,000 ranks is never one string in memory
        json.dump(build_json(summary, verdict, sections), sys.stdout, indent=2, allow_nan=False)
        print()
    else:
        from otelprof.analysis.report_text import render

        render(summary, verdict, _console(args.width), sections)
    _finish(warn)
    return 0


def _compare(args: argparse.Namespace) -> int:
    """Both runs read as `otelprof report` reads them, then the comparison rendered."""
    from otelprof.analysis import compare_report
    from otelprof.analysis.compare import compare

    warn = WarningLog()
    try:
        runs = []
        for label, directory in (("A", args.run_a), ("B", args.run_b)):
            files = _open([directory], "compare", warn)
            if files is None:
                return 2
            runs.append(_read(label, files, warn, args))
        comparison = compare(*runs)
        if args.json:
            import json

            print(json.dumps(compare_report.build_json(comparison), indent=2, allow_nan=False))
        else:
            compare_report.render_text(comparison, _console(args.width))
        return 0
    finally:
        _finish(warn)


def _trace(args: argparse.Namespace) -> int:
    from otelprof.analysis.chrome_trace import write_trace

    warn = WarningLog()
    files = _open(args.run_dir, args.command, warn)
    if files is None:
        return 2
    result = write_trace(
        files,
        args.output,
        warn,
        metrics=not args.no_metrics,
        read_budget=args.read_budget,
        max_line=args.max_line,
    )
    if result.sample:
        print(f"otelprof trace: {result.sample['note']}", file=sys.stderr)
    print(
        f"wrote {args.output}: {result.processes} process(es), {result.slices:,} slices, "
        f"{result.counters:,} counter samples"
        + (f', {result.steps:,} steps of all ranks ("all ranks" on top)' if result.steps else "")
        + f"; read {result.spans_read:,} spans, {result.bytes_read / 1e6:,.0f} of "
        f"{result.total_bytes / 1e6:,.0f} MB"
        + "; open it in https://ui.perfetto.dev or chrome://tracing"
    )
    _finish(warn)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from otelprof.analysis.replay import ReplayError, ReplayOptions, replay

    warn = WarningLog()
    files = _open(args.run_dir, args.command, warn)
    if files is None:
        return 2
    options = ReplayOptions(
        endpoint=args.endpoint,
        tls=args.tls,
        shift_to_now=args.shift_to_now,
        batch_bytes=args.batch_bytes,
        retries=args.retries,
        timeout_s=args.timeout,
        signals=args.signals,
    )
    try:
        result = replay(files, options, warn)
    except ReplayError as exc:
        print(f"otelprof replay: error: {exc}", file=sys.stderr)
        _finish(warn)
        return 1
    for line in result.describe():
        print(line)
    _finish(warn)
    return 0 if result.ok else 1
