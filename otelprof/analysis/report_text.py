"""`otelprof report`: the terminal summary (rich tables) of a run."""

from __future__ import annotations

import math

from rich.console import Console
from rich.markup import escape as rich_escape
from rich.panel import Panel
from rich.table import Table

from otelprof.analysis import format as fmt
from otelprof.analysis.problems import notes, problems
from otelprof.analysis.sections import Section
from otelprof.analysis.summary import RunSummary
from otelprof.analysis.tables import (
    hardware_cells,
    hardware_series,
    rank_cells,
    rank_rows,
    timing_cells,
    timing_rows,
)
from otelprof.analysis.verdict import Verdict


def _run_header(summary: RunSummary) -> str:
    files = summary.files
    ids = files.run_ids
    lines = [
        f"run: {', '.join(ids) or ', '.join(str(d) for d in files.dirs)}",
        f"files: {len(files.jsonl)} ({fmt.size(summary.read.bytes)}), "
        f"{summary.read.spans:,} spans, {summary.read.points:,} metric points, "
        f"{summary.processes} process(es)",
    ]
    if summary.first_ns is not None and summary.last_ns is not None:
        lines.append(f"time covered: {fmt.duration((summary.last_ns - summary.first_ns) / 1e9)}")
    if summary.read.bad_lines or summary.read.skipped_items:
        lines.append(
            f"skipped: {summary.read.bad_lines} bad line(s), "
            f"{summary.read.skipped_items} malformed item(s) (see warnings)"
        )
    return "\n".join(lines)


def timings_table(summary: RunSummary) -> Table:
    table = Table(title="Timings (ms; share = part of summed step time)", title_justify="left")
    for col in ("name", "where", "count", "mean", "p50", "p95", "total s", "share"):
        text = col in ("name", "where")
        table.add_column(
            col, justify="left" if text else "right", overflow="fold", no_wrap=not text
        )
    for row in timing_rows(summary):
        style = "bold" if row.level == "step" else ("dim" if row.share is None else None)
        table.add_row(*timing_cells(row, "" if row.exact else "~"), style=style)
    return table


def ranks_table(summary: RunSummary) -> Table:
    table = Table(title="Steps per process", title_justify="left")
    for col in ("process", "steps", "mean ms", "p95 ms", "spans"):
        table.add_column(col, justify="left" if col == "process" else "right", overflow="fold")
    for row in rank_rows(summary):
        table.add_row(*rank_cells(row))
    return table


def hardware_table(summary: RunSummary) -> Table:
    table = Table(title="Hardware metrics (min / mean / max over samples)", title_justify="left")
    for col in ("host", "device", "metric", "min", "mean", "max", "samples"):
        numeric = col in ("min", "mean", "max", "samples")
        table.add_column(
            col, justify="right" if numeric else "left", overflow="fold", no_wrap=numeric
        )
    last_host = None
    for s in hardware_series(summary):
        host = s.host if s.scope == "" else f"{s.host} {s.scope.split(' @ ')[0]}"
        table.add_row(host if host != last_host else "", *hardware_cells(s))
        last_host = host
    return table


def section_table(section: Section) -> Table:
    """A registered section (see sections.py) as a table with its notes as caption."""
    table = Table(title=section.title, title_justify="left", caption_justify="left")
    columns = list(section.rows[0]) if section.rows else []
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in section.rows:
        table.add_row(*(fmt.cell(row.get(col)) for col in columns))
    if section.notes:
        table.caption = "\n".join(section.notes)
    return table


def render(
    summary: RunSummary, verdict: Verdict, console: Console, sections: list[Section] | None = None
) -> None:
    """Print the whole report: problems first, then figures, then the verdict."""
    console.print(_run_header(summary))
    found = problems(summary)
    if found:
        body = "\n".join(f"• [bold]{p.kind}[/bold]: {rich_escape(p.message)}" for p in found)
        console.print(Panel(body, title="problems", title_align="left", border_style="red"))
    for note in notes(summary):
        console.print(f"[yellow]note:[/yellow] {rich_escape(note)}")
    if summary.timings or summary.step.count:
        console.print(timings_table(summary))
        if any(not math.isnan(r.mean_s) for r in rank_rows(summary)) and len(summary.ranks) > 1:
            console.print(ranks_table(summary))
    else:
        console.print("[dim]no timing spans in this run[/dim]")
    if summary.series:
        console.print(hardware_table(summary))
    else:
        console.print("[dim]no hardware gauges in this run[/dim]")
    for extra in sections or ():
        console.print(section_table(extra))
    if summary.counters:
        console.print(
            "[dim]counters (totals at the end of the run): "
            + ", ".join(f"{k} {fmt.number(v)}" for k, v in sorted(summary.counters.items()))
            + "[/dim]"
        )
    if summary.series_over_limit:
        console.print(
            f"[dim]{summary.series_over_limit:,} metric points of series over the report's "
            "limit were not summarized[/dim]"
        )
    body = verdict.headline
    if verdict.evidence:
        body += "\n\nevidence:\n" + "\n".join(f"  • {e}" for e in verdict.evidence)
    console.print(Panel(body, title=f"verdict: {verdict.kind}", title_align="left"))
