"""`otelprof compare A B`: read both runs as `otelprof report` does, then render the
comparison (terminal tables, `--json`, `--html`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otelprof.analysis.compare import Run, compare
from otelprof.analysis.parallel_summary import default_jobs
from otelprof.analysis.reader import WarningLog


def read_run(label: str, files: Any, warn: WarningLog, read_budget: int | None) -> Run:
    """One run, read once by the report's reader: summary, verdict and sections."""
    from otelprof.analysis.sections import build_sections
    from otelprof.analysis.summary import summarize
    from otelprof.analysis.verdict import judge

    jobs = default_jobs(files, read_budget)
    summary = summarize(files, warn, read_budget=read_budget, jobs=jobs)
    return Run(label, summary, judge(summary), build_sections(summary, warn))


def run_compare(
    args: argparse.Namespace,
    warn: WarningLog,
    open_run: Callable[[argparse.Namespace, WarningLog], Any],
) -> int:
    runs = []
    for label, directory in (("A", args.run_a), ("B", args.run_b)):
        files = open_run(argparse.Namespace(run_dir=[directory], command="compare"), warn)
        if files is None:
            return 2
        runs.append(read_run(label, files, warn, args.read_budget))
    comparison = compare(*runs)
    from otelprof.analysis import compare_report

    if args.json:
        doc = compare_report.build_json(comparison)
        print(json.dumps(doc, indent=2, allow_nan=False))
    else:
        from rich.console import Console

        console = Console(width=args.width)
        if args.width is None and not console.is_terminal:
            console = Console(width=max(console.width, 132))
        compare_report.render_text(comparison, console)
    if args.html:
        html: Path = args.html
        compare_report.write_html(comparison, html)
        if not args.json:
            print(f"HTML comparison written to {html}")
    return 0
