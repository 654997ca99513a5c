"""The benchmarks BENCHMARKS.md's step-rate figures come from still run on today's code.

They reach into a running profiler's parts (the span builder, the sampler's budgets) to
measure it in its steady state, so a change inside otelprof can break them where no other
test looks (removing `SpanBuilder.flush` did). A short setting of each runs to its end here;
its figures are noise at this length (most pairs fall off target) and are not checked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
NO_VOLUME = ["--volume-seconds", "0"]  # the data-volume run is 20 s of its own


@pytest.mark.parametrize(
    ("script", "args", "printed"),
    [
        (
            "bench_real_loop.py",
            ["--step-ms", "0.3", "--pairs", "4", "--block-seconds", "0.05", *NO_VOLUME],
            "step 0.3 ms (batch",
        ),
        (
            "bench_step_rate.py",
            ["--step-ms", "0.3", "--pairs", "2", *NO_VOLUME],
            "step 0.3 ms, interleaved in one session",
        ),
    ],
)
def test_a_step_rate_benchmark_runs_to_its_end_on_a_short_setting(
    tmp_path: Path, script: str, args: list[str], printed: str
) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert printed in result.stdout, result.stdout[-3000:]
