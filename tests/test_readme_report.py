"""The README's picture of a report is what `otelprof report` prints today for its run
(scripts/readme_report.py makes both), so the picture cannot drift from the report."""

from __future__ import annotations

import importlib.util

from tests.docs_pages import ROOT, page


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "readme_report", ROOT / "scripts" / "readme_report.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_report_is_what_the_report_prints_for_its_run() -> None:
    script = _script()
    held = script.readme_block(page("README.md"))
    made = script.block()
    assert "verdict: data-loader bound" in made and "dataloader_next" in made
    assert held == made, "README's report is stale: run `python3 scripts/readme_report.py --write`"
