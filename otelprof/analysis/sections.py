"""Extra report sections, shown alike by the text and JSON reports.

An analysis module registers a builder with `@section` and lists itself in `_BUILTIN`
(DEVELOPING.md, "Report sections (analysis/)"). Row values must be JSON values (str, int,
float, bool, None). A builder that raises is reported as a warning and its section left out;
the rest of the report stands.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from otelprof.analysis.reader import Warn
from otelprof.analysis.summary import RunSummary


@dataclass
class Section:
    key: str  # the JSON key, snake_case
    title: str  # the heading in the text report
    rows: list[dict[str, Any]]  # one table; columns are the keys of the first row
    notes: list[str] = field(default_factory=list)


SectionBuilder = Callable[[RunSummary], "Section | None"]
_BUILDERS: list[SectionBuilder] = []
_BUILTIN: tuple[str, ...] = (
    "otelprof.analysis.gpu_energy",
    "otelprof.analysis.straggler_section",
    "otelprof.analysis.throughput",
    "otelprof.analysis.memory_section",
    "otelprof.analysis.module_section",
)
"""Analysis modules whose sections every report shows (imported on first use)."""


def section(builder: SectionBuilder) -> SectionBuilder:
    """Register a section builder (decorator); registering twice is harmless."""
    if builder not in _BUILDERS:
        _BUILDERS.append(builder)
    return builder


def build_sections(summary: RunSummary, warn: Warn) -> list[Section]:
    """Every registered section that has something to show, in registration order."""
    for module in _BUILTIN:
        importlib.import_module(module)
    out: list[Section] = []
    for builder in list(_BUILDERS):
        try:
            result = builder(summary)
        except Exception as error:
            warn(f"report section {getattr(builder, '__name__', builder)!r} failed: {error!r}")
            continue
        if result is not None:
            out.append(result)
    return out
