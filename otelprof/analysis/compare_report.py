"""`otelprof compare`'s three renderings (terminal, JSON, self-contained HTML) of one
`Comparison`, so they never disagree."""

from __future__ import annotations

import math
from html import escape
from typing import Any

from rich.console import Console
from rich.markup import escape as rich_escape
from rich.panel import Panel
from rich.table import Table

from otelprof.analysis import format as fmt
from otelprof.analysis.compare import Comparison, Delta, Run, percent
from otelprof.analysis.report_html import CSS
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
    body = "\n".join(f"• {rich_escape(c)}" for c in cmp.changes)
    console.print(
        Panel(body, title=f"what changed: {rich_escape(cmp.headline)}", title_align="left")
    )
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
            f"A: {rich_escape(cmp.a.verdict.headline)}\nB: {rich_escape(cmp.b.verdict.headline)}",
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


# ---- HTML ----

_CSS = """td.good{color:#1a7f37} td.bad{color:#c0392b}
.changed{border:2px solid #1f77b4;border-radius:6px;padding:10px 14px;background:#eef5fb}
"""  # after the report's own (report_html.CSS)
_COLOURS = ("#1f77b4", "#ff7f0e")  # run A, run B: the same in every chart


def _pairs_chart(title: str, rows: list[Delta]) -> str:
    """Horizontal bars, A above B for each row, one scale (ms)."""
    rows = [d for d in rows if d.a is not None or d.b is not None]
    if not rows:
        return ""
    width, left, bar, gap, top = 920, 220, 14, 8, 44
    height = top + len(rows) * (2 * bar + gap) + 6
    scale = max(max(d.a or 0.0, d.b or 0.0) for d in rows) or 1.0
    plot = width - left - 120
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="{escape(title)}" font-family="sans-serif" font-size="12">',
        f'<text x="0" y="16" font-size="13" font-weight="bold">{escape(title)}</text>',
    ]
    for i, name in enumerate(("A", "B")):
        x = left + i * 60
        out.append(f'<rect x="{x}" y="24" width="12" height="10" fill="{_COLOURS[i]}"/>')
        out.append(f'<text x="{x + 16}" y="33">{name}</text>')
    for i, d in enumerate(rows):
        y = top + i * (2 * bar + gap)
        label = d.name if len(d.name) <= 32 else d.name[:31] + "…"
        out.append(
            f'<text x="{left - 6}" y="{y + bar + 4}" text-anchor="end">'
            f"<title>{escape(d.name)}</title>{escape(label)}</text>"
        )
        for j, v in enumerate((d.a, d.b)):
            if v is None:
                continue
            w = plot * max(v, 0.0) / scale
            yy = y + j * bar
            out.append(
                f'<rect x="{left}" y="{yy}" width="{w:.1f}" height="{bar - 2}" '
                f'fill="{_COLOURS[j]}"/>'
            )
            out.append(f'<text x="{left + w + 4:.1f}" y="{yy + bar - 4}">{v * 1e3:.2f} ms</text>')
    out.append("</svg>")
    return "".join(out)


def build_html(cmp: Comparison) -> str:
    title = f"otelprof compare: {cmp.a.name} vs {cmp.b.name}"
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
        f"<style>{CSS}{_CSS}</style></head><body><h1>{escape(title)}</h1>",
        f"<p class='meta'>{escape(_run_line(cmp.a))}<br>{escape(_run_line(cmp.b))}</p>",
        f"<div class='changed'><b>{escape(cmp.headline)}</b><ul>"
        + "".join(f"<li>{escape(c)}</li>" for c in cmp.changes)
        + "</ul></div>",
        f"<p class='meta'>verdict A: {escape(cmp.a.verdict.headline)}<br>"
        f"verdict B: {escape(cmp.b.verdict.headline)}</p>",
    ]
    chart = _pairs_chart("time per training step, A and B", cmp.group("per step"))
    if chart:
        parts.append(chart)
    for key, heading in GROUPS:
        rows = cmp.group(key)
        if not rows:
            continue
        parts.append(f"<h2>{escape(heading)}</h2><table>")
        parts.append("<tr><th></th><th>A</th><th>B</th><th>change</th><th></th></tr>")
        for d in rows:
            cls = "good" if d.direction in _GOOD else "bad" if d.direction in _BAD else ""
            parts.append(
                f"<tr><td>{escape(d.name)}</td><td>{escape(value(d.a, d.unit))}</td>"
                f"<td>{escape(value(d.b, d.unit))}</td><td class='{cls}'>{escape(change(d))}"
                f"</td><td class='{cls}'>{escape(d.direction)}</td></tr>"
            )
        parts.append("</table>")
        if key == "modules":
            parts.append(_pairs_chart("top modules, A and B", rows))
    parts.append("</body></html>\n")
    return "".join(parts)
