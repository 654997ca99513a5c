"""`otelprof report --html`: one self-contained HTML file (inline SVG plots, inline CSS)."""

from __future__ import annotations

import functools
from html import escape

from otelprof.analysis import format as fmt
from otelprof.analysis.problems import notes, problems
from otelprof.analysis.sections import Section
from otelprof.analysis.summary import RunSummary, SeriesAgg
from otelprof.analysis.svg import bar_chart, line_chart
from otelprof.analysis.tables import (
    hardware_cells,
    hardware_series,
    rank_cells,
    rank_rows,
    timing_cells,
    timing_rows,
)
from otelprof.analysis.verdict import Verdict, direct_shares

CSS = """
body{font-family:sans-serif;margin:24px;color:#222;max-width:1000px}
h1{font-size:20px} h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;font-size:13px}
th,td{padding:3px 9px;border-bottom:1px solid #ddd;text-align:right}
th:first-child,td:first-child,td.l,th.l{text-align:left}
tr.dim td{color:#888}
.verdict{border:2px solid #c0392b;border-radius:6px;padding:10px 14px;background:#fdf2f0}
.problems{border:2px solid #c0392b;border-radius:6px;padding:6px 14px;background:#fff0f0}
.note{color:#8a6d00}
.verdict b{font-size:15px} .meta{color:#555;font-size:13px}
"""
"""The page's style (`otelprof compare`'s too, with its own rules added)."""


def _table(
    headers: list[str], rows: list[list[str]], dim: list[bool] | None = None, left: int = 1
) -> str:
    head = "".join(
        f'<th class="{"l" if i < left else ""}">{escape(h)}</th>' for i, h in enumerate(headers)
    )
    body = []
    for r, row in enumerate(rows):
        cls = ' class="dim"' if dim and dim[r] else ""
        cells = "".join(
            f'<td class="{"l" if i < left else ""}">{escape(c)}</td>' for i, c in enumerate(row)
        )
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _byte_scale(group: list[SeriesAgg]) -> float:
    """GiB, MiB or KiB: the unit the axis of a bytes chart counts in."""
    peak = max((s.max for s in group), default=0.0)
    for scale in (2**30, 2**20, 2**10):
        if peak >= scale:
            return float(scale)
    return 1.0


def _metric_charts(
    summary: RunSummary, t0: float, t1: float, phases: list[tuple[str, float, float]]
) -> list[str]:
    by_metric: dict[str, list[SeriesAgg]] = {}
    for s in hardware_series(summary):
        by_metric.setdefault(s.name, []).append(s)
    charts = []
    for name, group in by_metric.items():
        unit = group[0].unit
        lines = []
        for s in group:
            where = s.device or "host"
            who = s.host if s.scope == "" else f"{s.host} {s.scope.split(' @ ')[0]}"
            label = f"{who} {where}" if len({x.host for x in group}) > 1 or s.scope else where
            lines.append((label, [(t, v) for t, v in s.series.points()]))
        charts.append(
            line_chart(
                f"{name} ({unit})" if unit else name,
                lines,
                (t0, t1),
                phases,
                y_format=functools.partial(fmt.value, unit=unit),
                y_max=1.0 if unit == "1" else None,
                y_scale=_byte_scale(group) if unit.startswith("By") else 1.0,
            )
        )
    return charts


def build_html(summary: RunSummary, verdict: Verdict, sections: list[Section] | None = None) -> str:
    """The report as one HTML string."""
    files = summary.files
    ids = files.run_ids
    title = f"otelprof report: {', '.join(ids) or ', '.join(d.name for d in files.dirs)}"
    t0 = (summary.first_ns or 0) / 1e9
    t1 = (summary.last_ns or 0) / 1e9
    phases = [(p.label, p.start_ns / 1e9, p.end_ns / 1e9) for p in summary.phases]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
        f"<style>{CSS}</style></head><body><h1>{escape(title)}</h1>"
    ]
    parts.append(
        f"<p class='meta'>{len(files.jsonl)} files ({escape(fmt.size(summary.read.bytes))}), "
        f"{summary.read.spans:,} spans, {summary.read.points:,} metric points, "
        f"{summary.processes} process(es), {escape(fmt.duration(max(t1 - t0, 0)))} covered"
        + (
            f"; skipped {summary.read.bad_lines} bad line(s) and "
            f"{summary.read.skipped_items} malformed item(s)"
            if summary.read.bad_lines or summary.read.skipped_items
            else ""
        )
        + "</p>"
    )
    found = problems(summary)
    if found:
        items = "".join(f"<li><b>{escape(p.kind)}</b>: {escape(p.message)}</li>" for p in found)
        parts.append(f"<div class='problems'><b>problems</b><ul>{items}</ul></div>")
    parts.extend(f"<p class='note'>note: {escape(n)}</p>" for n in notes(summary))
    evidence = "".join(f"<li>{escape(e)}</li>" for e in verdict.evidence)
    parts.append(f"<div class='verdict'><b>{escape(verdict.headline)}</b><ul>{evidence}</ul></div>")

    parts.append("<h2>Step-time breakdown</h2>")
    shares = sorted(direct_shares(summary).items(), key=lambda kv: -kv[1])
    if shares:
        parts.append(
            bar_chart(
                "share of summed step time (direct children of step)",
                [(n, s, f"{100 * s:.1f}%") for n, s in shares],
            )
        )
    stepping = [r for r in summary.ranks.values() if r.steps.count]
    if stepping:
        parts.append(
            line_chart(
                "step duration (ms)",
                [
                    (
                        r.resource.label.split(" (pid")[0],
                        [(t, v * 1e3) for t, v in r.step_series.points()],
                    )
                    for r in stepping
                ],
                (t0, t1),
                phases,
                y_format=lambda v: f"{v:,.0f} ms" if v >= 10 else f"{v:.3g} ms",
                gaps=[
                    (a, b) for label, a, b in phases if not label.startswith(("epoch ", "training"))
                ],
                spreads=[
                    [(t, lo * 1e3, hi * 1e3) for t, lo, hi in r.step_series.extremes()]
                    for r in stepping
                ],
                outliers=True,
            )
        )
    rows = timing_rows(summary)
    if rows:
        parts.append("<h2>Timings</h2>")
        parts.append(
            _table(
                ["name", "where", "count", "mean ms", "p50 ms", "p95 ms", "total s", "share"],
                [timing_cells(r) for r in rows],
                dim=[r.share is None for r in rows],
                left=2,
            )
        )
    ranks = rank_rows(summary)
    if len(ranks) > 1:
        parts.append("<h2>Steps per process</h2>")
        parts.append(
            _table(
                ["process", "steps", "mean ms", "p95 ms", "spans"], [rank_cells(r) for r in ranks]
            )
        )
    if summary.series:
        parts.append("<h2>Hardware metrics</h2>")
        parts.append(
            "<p class='meta'>Shaded bands are training phases: epochs (from the "
            "steps' otelprof.epoch) and other top-level spans such as validation."
            "</p>"
        )
        parts.extend(_metric_charts(summary, t0, t1, phases))
        parts.append(
            _table(
                ["host", "device", "metric", "min", "mean", "max", "samples"],
                [
                    [s.host if not s.scope else f"{s.host} {s.scope}", *hardware_cells(s)]
                    for s in hardware_series(summary)
                ],
                left=3,
            )
        )
    for extra in sections or ():
        columns = list(extra.rows[0]) if extra.rows else []
        parts.append(f"<h2>{escape(extra.title)}</h2>")
        cells = [[fmt.cell(row.get(c)) for c in columns] for row in extra.rows]
        parts.append(_table(columns, cells))
        parts.extend(f"<p class='note'>{escape(n)}</p>" for n in extra.notes)
    if summary.counters:
        parts.append(
            "<p class='meta'>counters (totals at the end of the run): "
            + escape(", ".join(f"{k} {fmt.number(v)}" for k, v in sorted(summary.counters.items())))
            + "</p>"
        )
    if not rows and not summary.series:
        parts.append("<p>This run holds no spans and no gauges.</p>")
    parts.append("</body></html>\n")
    return "".join(parts)
