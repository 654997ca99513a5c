"""Run `otelprof demo` as a user would (a subprocess), for tests that need a real run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_demo(
    output_dir: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The finished command and the one run directory it created under `output_dir`.

    `env` is added to this process's environment. The timeout is a generous bound (a short
    demo took 2.5 minutes at load 20 on 2 cores, mostly starting Python and PyTorch)."""
    result = subprocess.run(
        [sys.executable, "-m", "otelprof", "demo", *args, "--output-dir", str(output_dir)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **env} if env else None,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = [p for p in output_dir.iterdir() if p.is_dir()]
    return result, run_dir
