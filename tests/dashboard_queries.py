"""Read otelprof's Grafana dashboards and run their PromQL against a real Prometheus.

Shared by tests/test_dashboards.py and scripts/render_dashboards.py: the same variable
substitution Grafana would do for one selected value per variable, the same range queries.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.services import REPO, Prometheus

DASHBOARD_DIR = REPO / "dashboards"
DASHBOARD_FILES = sorted(DASHBOARD_DIR.glob("otelprof-*.json"))

# Grafana's own variables, substituted by Grafana itself.
BUILTIN = {"__rate_interval", "__interval", "__range", "__all", "__tags", "__span"}
VARIABLE_REF = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.*),\s*(?P<label>\w+)\)$", re.DOTALL)


@dataclass
class Query:
    dashboard: str
    panel: str
    ref: str
    expr: str
    legend: str
    panel_type: str


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included, rows themselves included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: Mapping[str, Any]) -> list[Query]:
    """Every PromQL expression in the dashboard's panels."""
    out = []
    for panel in panels(dashboard):
        for t in panel.get("targets", []):
            if "expr" in t:
                out.append(
                    Query(
                        dashboard["title"],
                        panel["title"],
                        t["refId"],
                        t["expr"],
                        t.get("legendFormat", ""),
                        panel["type"],
                    )
                )
    return out


def variable_query(variable: Mapping[str, Any]) -> str:
    query = variable.get("query")
    return str(query["query"] if isinstance(query, dict) else query)


def references(text: str) -> set[str]:
    """Variable names a text refers to ($name, ${name}, ${name:fmt}, [[name]])."""
    return {next(g for g in m.groups() if g) for m in VARIABLE_REF.finditer(text)} - BUILTIN


def substitute(text: str, values: Mapping[str, str], rate_interval: str = "4s") -> str:
    """Replace variables by one selected value each (regex-escaped), as Grafana would.

    $__rate_interval becomes what Grafana computes for the tests' 1 s scrape interval and
    1 s steps: max(4 x scrape interval, step + scrape interval) = 4 s.
    """

    def replace(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        if name == "__rate_interval":
            return rate_interval
        if name not in values:
            raise KeyError(f"no value for variable ${name}")
        return promql_regex_escape(values[name])

    return VARIABLE_REF.sub(replace, text)


def promql_regex_escape(value: str) -> str:
    """Escape a value for a =~ matcher inside a PromQL string, like Grafana does.

    Regex metacharacters get a backslash, itself doubled inside the PromQL string literal.
    """
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", value)


def label_values(prometheus: Prometheus, query: str, start: float) -> list[str]:
    """Evaluate Grafana's label_values(selector, label) against Prometheus's series API."""
    match = LABEL_VALUES.match(query.strip())
    if not match:
        raise ValueError(f"not a label_values() query: {query}")
    series = prometheus.series(match["selector"], start=start)
    return sorted({s[match["label"]] for s in series if match["label"] in s})


def panel_expr(title: str, service: str, dashboard: str = "otelprof-training.json") -> str:
    """A dashboard panel's query as Grafana sends it with service `service` and every
    job, rank, host and trial selected (All), rate windows of 4 s."""
    [query] = [q for q in queries(load(DASHBOARD_DIR / dashboard)) if q.panel == title]
    expr = query.expr.replace("$__rate_interval", "4s").replace('"$service"', f'"{service}"')
    return re.sub(r'"\$(run|rank|host|trial)"', '".*"', expr)


def run_range(
    prometheus: Prometheus, expr: str, start: float, end: float, step_s: float = 1.0
) -> list[tuple[str, list[float], list[float]]]:
    """(series label text, times, values) of a range query, NaN/Inf points dropped."""
    out = []
    for series in prometheus.query_range(expr, start, end, step_s):
        times, values = [], []
        for t, v in series["values"]:
            value = float(v)
            if math.isfinite(value):
                times.append(float(t))
                values.append(value)
        labels = series["metric"]
        out.append((",".join(f"{k}={labels[k]}" for k in sorted(labels)), times, values))
    return out


def legend(template: str, labels_text: str) -> str:
    labels = dict(item.split("=", 1) for item in labels_text.split(",") if "=" in item)
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    return text or labels_text or "value"
