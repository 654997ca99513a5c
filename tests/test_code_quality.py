"""The style rules hold in CI, not only on a developer's machine: ruff and mypy are clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_no_lint_errors() -> None:
    result = run(str(BIN / "ruff"), "check", "otelprof", "tests", "bench", "scripts")
    assert result.returncode == 0, result.stdout + result.stderr


def test_code_is_ruff_formatted() -> None:
    result = run(str(BIN / "ruff"), "format", "--check", "otelprof", "tests", "bench", "scripts")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_no_type_errors() -> None:
    result = run(str(BIN / "mypy"))
    assert result.returncode == 0, result.stdout + result.stderr
