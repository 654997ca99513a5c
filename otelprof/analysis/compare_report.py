"""`otelprof compare`'s two renderings (terminal, JSON) of one `Comparison`, so they never
disagree."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from otelprof.analysis import format as fmt
from otelprof.analysis.compare import Comparison, Delta, Run, percent
from otelprof.analysis.report_json import json_safe

SCHEMA_VERSION = 1
GROUPS = (
    ("steps", "Steps"),
    ("per step", "Time per training step (ms): the step's parts"),
    ("processes", "Per process"),
    ("throughput", "Throughput"),
    ("memory", "Memory by phase"),
    ("modules", "Top modules (forward + backward ms per step)"),
    ("hardware", "Hardware (means over samples)"),
)
_GOOD = ("faster", "better")
_BAD = ("slower", "worse")


def value(v: float | None, unit: str) -> str:
    """A figure in its unit: times in ms, bytes in KiB-GiB, shares in %."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if unit == "s":
        return f"{v * 1e3:.2f} ms"
    if unit.startswith("{") and unit.endswith("}"):  # a count: steps, processes
        return f"{v:,.0f}"
    return fmt.value(v, unit)


def change(d: Delta) -> str:
    """The difference in the row's unit (points for shares), then relative."""
    diff = d.change
    if diff is None:
        return d.direction or "-"
    if d.unit == "s":
        text = f"{diff * 1e3:+.2f} ms"
    elif d.unit == "1":
        text = f"{100 * diff:+.1f} pp"
    elif d.unit.startswith("{") and d.unit.endswith("}"):
        text = f"{diff:+,.0f}"
    else:
        text = ("+" if diff >= 0 else "-") + fmt.value(abs(diff), d.unit)
    relative = d.relative
    return text if relative is None else f"{text} ({percent(relative)})"


def _run_line(run: Run) -> str:
    s = run.summary
    steps = f"{s.step.count:,} steps" if s.step.count else "no steps"
    return f"{run.label}: {run.name} ({len(s.ranks)} process(es), {steps})"


# ---- terminal ----


def render_text(cmp: Comparison, console: Console) -> None:
    console.print(_run_line(cmp.a))
    console.print(_run_line(cmp.b))
    body = "\n".join(f"• {escape(c)}" for c in cmp.changes)
    console.print(Panel(body, title=f"what changed: {escape(cmp.headline)}", title_align="left"))
    for key, title in GROUPS:
        rows = cmp.group(key)
        if not rows:
            continue
        table = Table(title=title, title_justify="left")
        for col in ("", "A", "B", "change", ""):
            table.add_column(col, justify="left" if col == "" else "right", overflow="fold")
        for d in rows:
            style = "green" if d.direction in _GOOD else "red" if d.direction in _BAD else None
            table.add_row(
                d.name, value(d.a, d.unit), value(d.b, d.unit), change(d), d.direction, style=style
            )
        console.print(table)
    console.print(
        Panel(
            f"A: {escape(cmp.a.verdict.headline)}\nB: {escape(cmp.b.verdict.headline)}",
            title=f"verdict: {cmp.a.verdict.kind} -> {cmp.b.verdict.kind}",
            title_align="left",
        )
    )


# ---- JSON ----


def _run_json(run: Run) -> dict[str, Any]:
    s = run.summary
    return {
        "label": run.label,
        "run_ids": s.files.run_ids,
        "dirs": [str(d) for d in s.files.dirs],
        "processes": len(s.ranks),
        "steps": s.step.count,
        "verdict": {"kind": run.verdict.kind, "headline": run.verdict.headline},
    }


def build_json(cmp: Comparison) -> dict[str, Any]:
    """The comparison as a JSON-ready dict: times in seconds, bytes, shares as fractions."""
    doc: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "a": _run_json(cmp.a),
        "b": _run_json(cmp.b),
        "headline": cmp.headline,
        "changes": cmp.changes,
        "rows": [
            {
                "group": d.group,
                "name": d.name,
                "unit": d.unit,
                "a": d.a,
                "b": d.b,
                "change": d.change,
                "relative": d.relative,
                "better": d.better or None,
                "direction": d.direction,
            }
            for d in cmp.rows
        ],
    }
    cleaned: dict[str, Any] = json_safe(doc)
    return cleaned
