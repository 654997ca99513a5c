"""Tiny inline-SVG charts for the HTML report: no plotting library, no CDN, no JavaScript.

Why hand-written: the HTML report must be one self-contained file and otelprof's runtime
dependencies stay small; line charts with shaded phases and a bar chart are all it needs.
"""

from __future__ import annotations

import bisect
import itertools
import math
import zlib
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
EPOCH_FILLS = ("#dbe9f6", "#c9ddf0")
"""Epochs (and a run without epochs, "training"), alternating so neighbours differ."""
PHASE_FILLS = {
    "validation": "#fde9d9",
    "checkpoint": "#e2f0d9",
    "test": "#ece4f3",
    "predict": "#fff2cc",
    "after_training": "#e7e6e6",
    "crashed step": "#f4c7c3",
    "interrupted step": "#f4c7c3",
}
OTHER_FILLS = ("#f9e0f0", "#e0f4f1", "#f6ecd9", "#e6e6f7", "#eef5d6", "#f2e1e1")
CHAR_EM = 0.6
"""A sans-serif character's width in ems, about (digits and most lowercase are narrower):
what labels are measured with so that they fit."""


def _is_epoch(label: str) -> bool:
    return label == "training" or label.startswith("epoch ")


def phase_fill(label: str) -> str:
    """A phase band's colour, by its name (the same in every report), not by its order."""
    if _is_epoch(label):
        number = label.removeprefix("epoch ")
        return EPOCH_FILLS[int(number) % 2 if number.isdigit() else 0]
    return PHASE_FILLS.get(label) or OTHER_FILLS[zlib.crc32(label.encode()) % len(OTHER_FILLS)]


def text_width(text: str, font_px: float) -> float:
    return CHAR_EM * font_px * len(text)


def fit(text: str, room_px: float, font_px: float) -> str:
    """`text`, cut with an ellipsis to fit `room_px` ("" when not even that fits)."""
    if text_width(text, font_px) <= room_px:
        return text
    keep = int(room_px / (CHAR_EM * font_px)) - 1
    return text[:keep] + "…" if keep >= 3 else ""


def job_bands(phases: Sequence[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """One band set for the job: bands that never overlap. Where phases overlap (ranks in
    different phases at once, a validation inside an epoch's span), the time goes to the
    phase that is not an epoch, and among those to the one that began last."""
    edges = sorted({t for _label, start, end in phases for t in (start, end)})
    order = sorted(range(len(phases)), key=lambda i: phases[i][1])
    bands: list[tuple[str, float, float]] = []
    active: list[int] = []
    taken = 0
    for a, b in itertools.pairwise(edges):
        while taken < len(order) and phases[order[taken]][1] <= a:
            active.append(order[taken])
            taken += 1
        active = [i for i in active if phases[i][2] > a]  # each covers a..b: edges hold ends
        if not active:
            continue
        best = max(active, key=lambda i: (not _is_epoch(phases[i][0]), phases[i][1], i))
        label = phases[best][0]
        if bands and bands[-1][0] == label and bands[-1][2] == a:
            bands[-1] = (label, bands[-1][1], b)
        else:
            bands.append((label, a, b))
    return bands


def bulk_top(values: Sequence[float]) -> float | None:
    """The top of the bulk of `values`: the largest one within Tukey's far-out fence
    (Q3 + 3 IQR, with the IQR at least 5 % of the median); None when none lies beyond it."""
    if len(values) < 4:
        return None
    ordered = sorted(values)
    q1, q2, q3 = (ordered[round(q * (len(ordered) - 1))] for q in (0.25, 0.5, 0.75))
    fence = q3 + 3 * max(q3 - q1, 0.05 * abs(q2))
    if ordered[-1] <= fence:
        return None
    return max(v for v in ordered if v <= fence)


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
    gaps: Sequence[tuple[float, float]] = (),
    spreads: Sequence[Sequence[tuple[float, float, float]]] = (),
    outliers: bool = False,
) -> str:
    """Lines over time (x in seconds since run start) on shaded phase bands.

    The y axis tops at `y_max`, else at a round number of `y_scale` units (e.g. GiB) above
    the highest value, or with `outliers`, above the bulk of the values (`bulk_top`): a
    value beyond it is drawn at the top edge and marked (a triangle, its value in a
    tooltip). `spreads[i]` holds series i's (time, least, greatest) per point, drawn as a
    bar where a point stands for several values. A line is broken where one of `gaps`
    (start, end) begins between two of its points (training steps during validation); a
    point alone between gaps is drawn as a dot. Phase bands are one set for the job
    (`job_bands`), coloured by name (`phase_fill`), with a legend under the lines'.
    """
    width, height, left, right, top, bottom = 920, 230, 70, 190, 28, 30
    pw, ph = width - left - right, height - top - bottom
    x0, x1 = x_range
    if x1 <= x0:
        x1 = x0 + 1.0
    values = [v for _, pts in series for _, v in pts]
    highs = values + [hi for spread in spreads for _, _, hi in spread]
    peak = max(highs, default=1.0)
    bulk = bulk_top(values) if outliers else None
    scale_peak = peak if bulk is None else bulk
    top_value = y_max if y_max is not None else _nice_max(scale_peak / y_scale) * y_scale
    if bulk is not None and top_value >= peak:  # the outliers fit after all
        bulk = None

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + ph - (min(max(y, 0.0), top_value) / top_value) * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(title)}" font-family="sans-serif" font-size="11">',
        f'<text x="{left}" y="16" font-size="13" font-weight="bold">{escape(title)}</text>',
    ]
    band_labels: list[str] = []
    labelled: set[str] = set()
    shown: dict[str, str] = {}
    for label, start, end in job_bands(phases):
        a, b = max(sx(start), left), min(sx(end), left + pw)
        if b <= a:
            continue
        fill = shown.setdefault(label, phase_fill(label))
        out.append(
            f'<rect x="{a:.1f}" y="{top}" width="{b - a:.1f}" height="{ph}" '
            f'fill="{fill}"><title>{escape(label)}</title></rect>'
        )
        if label not in labelled and text_width(label, 11) + 6 <= b - a:
            labelled.add(label)  # once, over every band; epochs first row, others below
            row = 0 if _is_epoch(label) else 1
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
            f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">'
            f"{escape(fit(y_format(v), left - 6, 11))}</text>"
        )
    decimals = 1 if x1 - x0 < 20 else 0
    for i in range(6):  # x ticks
        x = x0 + (x1 - x0) * i / 5
        out.append(
            f'<text x="{sx(x):.1f}" y="{top + ph + 16}" text-anchor="middle">'
            f"{x - x0:.{decimals}f} s</text>"
        )
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
    legend: list[tuple[str, str, bool]] = []  # (label, colour, is a line)
    for i, (label, pts) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        legend.append((label, color, True))
        spread = spreads[i] if i < len(spreads) else ()
        for t, lo, hi in spread:
            if hi > lo:
                out.append(
                    f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{sy(lo):.1f}" '
                    f'y2="{sy(hi):.1f}" stroke="{color}" stroke-opacity="0.35"/>'
                )
        for segment in _split_at_gaps(pts, gaps):
            if len(segment) == 1:
                x, y = segment[0]
                out.append(
                    f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2" fill="{color}">'
                    f"<title>{escape(label)}: {escape(y_format(y))}</title></circle>"
                )
                continue
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in segment)
            out.append(
                f'<polyline points="{path}" fill="none" stroke="{color}" '
                f'stroke-width="1.5"><title>{escape(label)}</title></polyline>'
            )
        if bulk is not None:
            beyond = [(t, v) for t, v in pts] + [(t, hi) for t, _lo, hi in spread]
            for t, v in sorted({(t, v) for t, v in beyond if v > top_value}):
                x = sx(t)
                out.append(
                    f'<g class="outlier"><title>{escape(label)}: {escape(y_format(v))} at '
                    f"{t - x0:.1f} s, beyond the axis</title>"
                    f'<polygon points="{x - 5:.1f},{top + 9} {x + 5:.1f},{top + 9} '
                    f'{x:.1f},{top + 1}" fill="{color}" stroke="#000" stroke-width="0.5"/>'
                    "</g>"
                )
    if bulk is not None:
        legend.append(("▲ beyond the axis", "#000", False))
    legend.extend((label, fill, False) for label, fill in shown.items())
    rows = int((ph - 4) // 14)
    for i, (label, color, is_line) in enumerate(legend[:rows]):
        if i == rows - 1 and len(legend) > rows:
            label, color, is_line = f"+{len(legend) - i} more", "#fff", False
        ly = top + 12 + 14 * i
        if is_line:
            out.append(
                f'<line x1="{left + pw + 10}" x2="{left + pw + 24}" y1="{ly - 4}" '
                f'y2="{ly - 4}" stroke="{color}" stroke-width="2"/>'
            )
        elif not label.startswith(("▲", "+")):
            out.append(
                f'<rect x="{left + pw + 10}" y="{ly - 9}" width="14" height="10" '
                f'fill="{color}" stroke="#aaa" stroke-width="0.5"/>'
            )
        text = fit(label, right - 32, 11)
        out.append(
            f'<text x="{left + pw + 28}" y="{ly}">{escape(text)}'
            f"<title>{escape(label)}</title></text>"
        )
    out.append("</svg>")
    return "".join(out)


def _split_at_gaps(
    pts: Sequence[tuple[float, float]], gaps: Sequence[tuple[float, float]]
) -> list[list[tuple[float, float]]]:
    starts = sorted(start for start, _end in gaps)
    segments: list[list[tuple[float, float]]] = []
    for x, y in pts:
        i = bisect.bisect_right(starts, segments[-1][-1][0]) if segments else 0
        if not segments or (i < len(starts) and starts[i] < x):  # a gap begins before x
            segments.append([])
        segments[-1].append((x, y))
    return segments


def bar_chart(title: str, bars: Sequence[tuple[str, float, str]]) -> str:
    """Horizontal bars: (label, fraction 0..1, text shown at the bar's end). The labels'
    column is as wide as the longest label needs, up to 40 % of the chart; a longer label
    is cut with an ellipsis (its whole name in the tooltip). Bars are coloured by name (the
    same colour in every report)."""
    width, bar_height, font = 920, 20, 12
    longest = max((text_width(label, font) for label, _, _ in bars), default=0.0)
    left = int(min(max(80.0, longest + 12), 0.4 * width))
    top = 28
    pw = width - left - 90
    height = top + bar_height * len(bars) + 10
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(title)}" font-family="sans-serif" font-size="{font}">',
        f'<text x="0" y="16" font-size="13" font-weight="bold">{escape(title)}</text>',
    ]
    for i, (label, frac, text) in enumerate(bars):
        y = top + i * bar_height
        w = max(0.0, min(frac, 1.0)) * pw
        color = PALETTE[zlib.crc32(label.encode()) % len(PALETTE)]
        out.append(
            f'<text x="{left - 6}" y="{y + bar_height * 0.7:.1f}" text-anchor="end">'
            f"{escape(fit(label, left - 10, font))}<title>{escape(label)}</title></text>"
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
