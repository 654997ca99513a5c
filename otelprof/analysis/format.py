"""Human formatting of metric values by their OTel unit (reports, comparisons, notes)."""

from __future__ import annotations

import math
import re


def value(v: float, unit: str) -> str:
    """'23.0%' for unit 1, '1.50 GiB' for By, '12.0 MiB/s' for By/s, else 3 significant digits."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if unit == "1":  # 23.0%, and a small share with its digits: 0.026%, not 0.0%
        pct = 100 * v
        return f"{pct:.2g}%" if 0 < abs(pct) < 0.95 else f"{pct:.1f}%"
    if unit in ("By", "By/s"):
        suffix = "/s" if unit == "By/s" else ""
        size = abs(v)
        for name, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if size >= scale:
                return f"{v / scale:.2f} {name}{suffix}"
        return f"{v:.0f} B{suffix}"
    text = f"{v:.3g}"
    # annotations such as {operation}/s carry no unit: show "/s"
    clean = re.sub(r"\{[^}]*\}", "", unit)
    if not clean or clean.startswith("/"):
        return f"{text}{clean}"
    return f"{text} {clean}"


def ms(seconds: float) -> str:
    if seconds is None or math.isnan(seconds):
        return "-"
    return f"{seconds * 1e3:.2f}"


def ms_text(seconds: float) -> str:
    """A duration in milliseconds with its significant digits: '1,234.5 ms', '12.3 ms',
    '0.0412 ms' (not '0.0 ms')."""
    ms = seconds * 1e3
    return f"{ms:,.1f} ms" if abs(ms) >= 10 else f"{ms:.3g} ms"


def size(nbytes: int) -> str:
    return value(float(nbytes), "By")


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def number(v: float | None) -> str:
    """A figure with the digits that carry information: '399,600' (not '399,600.000'),
    '12.35', '0.034', '4.2e-05' (not '0.000' beside another figure of the same row)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool) or math.isinf(v):
        return str(v)
    magnitude = abs(v)
    if magnitude >= 1000 or (v == int(v) and magnitude < 1e15):
        return f"{v:,.0f}"
    if magnitude >= 1:
        return f"{v:.4g}"
    return f"{v:.3g}"


def cell(value: object) -> str:
    """A section's table cell in the text report: figures by `number`, a flag as yes or
    blank (not Python's True/False), nothing as '-'."""
    if isinstance(value, bool):
        return "yes" if value else ""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return number(value)
    return str(value)
