"""Tiny inline-SVG charts for the HTML report: no plotting library, no CDN, no JavaScript.

Why hand-written: the HTML report must be one self-contained file and otelprof's runtime
dependencies stay small; line charts with shaded phases and a bar chart are all it needs.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from html import escape

PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
PHASE_FILLS = ("#dbe9f6", "#fde9d9", "#e2f0d9", "#ece4f3", "#fff2cc", "#e7e6e6")


def _nice_max(v: float) -> float:
    if v <= 0 or not math.isfinite(v):
        return 1.0
    exp = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * exp:
            return m * exp
    return 10 * exp


def line_chart(
    title: str,
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    x_range: tuple[float, float],
    phases: Sequence[tuple[str, float, float]] = (),
    y_format: Callable[[float], str] = lambda v: f"{v:.3g}",
    y_max: float | None = None,
    y_scale: float = 1.0,
    width: int = 920,
    height: int = 230,
    gaps: Sequence[tuple[float, float]] = (),
) -> str:
    """Lines over time (x in seconds since run start) on shaded phase bands.

    The y axis tops at `y_max`, else at a round number of `y_scale` units (e.g. GiB). A line
    is broken where one of `gaps` (start, end) begins between two of its points: a series
    that does not run then (training steps during validation) is not drawn across it.
    """
    left, right, top, bottom = 70, 190, 28, 30
    pw, ph = width - left - right, height - top - bottom
    x0, x1 = x_range
    if x1 <= x0:
        x1 = x0 + 1.0
    peak = max((v for _, pts in series for _, v in pts), default=1.0)
    top_value = y_max if y_max is not None else _nice_max(peak / y_scale) * y_scale

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + ph - (min(max(y, 0.0), top_value) / top_value) * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(title)}" font-family="sans-serif" font-size="11">',
        f'<text x="{left}" y="16" font-size="13" font-weight="bold">{escape(title)}</text>',
    ]
    labels_seen: dict[str, str] = {}
    band_labels: list[str] = []
    for label, start, end in phases:
        a, b = max(sx(start), left), min(sx(end), left + pw)
        if b <= a:
            continue
        fill = labels_seen.setdefault(label, PHASE_FILLS[len(labels_seen) % len(PHASE_FILLS)])
        out.append(
            f'<rect x="{a:.1f}" y="{top}" width="{b - a:.1f}" height="{ph}" '
            f'fill="{fill}"><title>{escape(label)}</title></rect>'
        )
        if b - a > 40:  # drawn over every band, epochs on the first row, other phases below
            row = 0 if label.startswith(("epoch ", "training")) else 1
            band_labels.append(
                f'<text x="{a + 3:.1f}" y="{top + 11 + 12 * row}" fill="#555">'
                f"{escape(label)}</text>"
            )
    out.extend(band_labels)
    for i in range(5):  # y grid
        v = top_value * i / 4
        y = sy(v)
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" '
            'stroke="#ccc" stroke-width="0.5"/>'
        )
        out.append(
            f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{escape(y_format(v))}</text>'
        )
    decimals = 1 if x1 - x0 < 20 else 0
    for i in range(6):  # x ticks
        x = x0 + (x1 - x0) * i / 5
        out.append(
            f'<text x="{sx(x):.1f}" y="{top + ph + 16}" text-anchor="middle">'
            f"{x - x0:.{decimals}f} s</text>"
        )
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
    for i, (label, pts) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        for segment in _split_at_gaps(pts, gaps):
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in segment)
            out.append(
                f'<polyline points="{path}" fill="none" stroke="{color}" '
                f'stroke-width="1.5"><title>{escape(label)}</title></polyline>'
            )
        ly = top + 12 + 14 * i
        if ly < top + ph:
            out.append(
                f'<line x1="{left + pw + 10}" x2="{left + pw + 24}" y1="{ly - 4}" '
                f'y2="{ly - 4}" stroke="{color}" stroke-width="2"/>'
            )
            out.append(f'<text x="{left + pw + 28}" y="{ly}">{escape(label[:30])}</text>')
    out.append("</svg>")
    return "".join(out)


def _split_at_gaps(
    pts: Sequence[tuple[float, float]], gaps: Sequence[tuple[float, float]]
) -> list[list[tuple[float, float]]]:
    starts = sorted(start for start, _end in gaps)
    segments: list[list[tuple[float, float]]] = []
    for x, y in pts:
        if segments:
            prev = segments[-1][-1][0]
            i = bisect.bisect_right(starts, prev)
            if i < len(starts) and starts[i] < x:
                segments.append([])
        else:
            segments.append([])
        segments[-1].append((x, y))
    return segments


def bar_chart(
    title: str,
    bars: Sequence[tuple[str, float, str]],
    width: int = 920,
    bar_height: int = 20,
) -> str:
    """Horizontal bars: (label, fraction 0..1, text shown at the bar's end)."""
    left, top = 170, 28
    pw = width - left - 90
    height = top + bar_height * len(bars) + 10
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(title)}" font-family="sans-serif" font-size="12">',
        f'<text x="0" y="16" font-size="13" font-weight="bold">{escape(title)}</text>',
    ]
    for i, (label, frac, text) in enumerate(bars):
        y = top + i * bar_height
        w = max(0.0, min(frac, 1.0)) * pw
        color = PALETTE[i % len(PALETTE)]
        out.append(
            f'<text x="{left - 6}" y="{y + bar_height * 0.7:.1f}" '
            f'text-anchor="end">{escape(label)}</text>'
        )
        out.append(
            f'<rect x="{left}" y="{y + 2}" width="{w:.1f}" height="{bar_height - 4}" '
            f'fill="{color}"><title>{escape(label)}: {escape(text)}</title></rect>'
        )
        out.append(
            f'<text x="{left + w + 4:.1f}" y="{y + bar_height * 0.7:.1f}">{escape(text)}</text>'
        )
    out.append("</svg>")
    return "".join(out)
