"""The public API is small, documented and cheap to import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import otelprof

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_importing_otelprof_does_not_import_torch() -> None:
    code = "import sys, otelprof; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_every_public_name_exists_and_is_documented_in_the_readme() -> None:
    for name in otelprof.__all__:
        assert getattr(otelprof, name) is not None
        if name not in {"Settings", "HookHandle", "Timing", "ScheduleAction"}:
            assert f"{name}" in README, f"otelprof.{name} is not mentioned in README.md"
