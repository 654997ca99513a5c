"""The README's picture of a report is what `otelprof report` prints today for its run
(scripts/readme_report.py makes both), so the picture cannot drift from the report."""

from __future__ import annotations

import subprocess
import sys

from tests.docs_pages import ROOT, page

START, END = "<!-- --8<-- [start:report] -->\n", "<!-- --8<-- [end:report] -->"


def test_the_readme_report_is_what_the_report_prints_for_its_run() -> None:
    readme = page("README.md")
    held = readme[readme.index(START) + len(START) : readme.index(END)]
    made = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "readme_report.py")],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    assert "verdict: data-loader bound" in made and "dataloader_next" in made
    assert held == made, "README's report is stale: run `python3 scripts/readme_report.py --write`"
