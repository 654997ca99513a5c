"""Benchmark: `otelprof report` and `otelprof trace` on a large run directory (default 1 GB).

Side by side on the same files: a baseline that only reads the lines, a baseline that only
json-parses them (the floor for any pure-Python reader of OTLP JSON Lines), and otelprof's
report (in process, then the real CLI in a child process for wall time and peak RSS).

    .venv/bin/python bench/bench_report.py            # 1 GB in a temporary directory
    .venv/bin/python bench/bench_report.py --gb 0.1   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import cpu_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from otelprof.analysis.reader import WarningLog, open_run  # noqa: E402
from otelprof.analysis.summary import summarize  # noqa: E402
from tests.run_generators import write_big_run  # noqa: E402


def _read_only(files: list[Path]) -> int:
    n = 0
    for path in files:
        with path.open("rb") as f:
            for _line in f:
                n += 1
    return n


def _json_only(files: list[Path]) -> int:
    n = 0
    for path in files:
        with path.open("rb") as f:
            for line in f:
                json.loads(line)
                n += 1
    return n


_MEASURED = (
    "import resource, sys\n"
    "from otelprof.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "print('peak_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


def _child(args: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of `otelprof ARGS` in a child process."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _MEASURED, *args],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wall = time.perf_counter() - start
    peak = [ln for ln in done.stderr.splitlines() if ln.startswith("peak_kib ")][-1]
    return wall, int(peak.split()[1]) / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="run directory size (GB)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the run")
    parser.add_argument("--keep", action="store_true", help="keep the generated run")
    args = parser.parse_args()

    base = args.dir or Path(tempfile.mkdtemp(prefix="otelprof-bench-"))
    run = base / "run"
    print(f"machine: {os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}")
    try:
        start = time.perf_counter()
        size = write_big_run(run, int(args.gb * 1e9), ranks=8)
        print(f"generated {size / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s: {run}")
        files = open_run([run]).jsonl

        t = time.perf_counter()
        lines = _read_only(list(files))
        t_read = time.perf_counter() - t
        t = time.perf_counter()
        _json_only(list(files))
        t_json = time.perf_counter() - t
        t = time.perf_counter()
        summary = summarize(open_run([run]), WarningLog())
        t_report = time.perf_counter() - t
        print(f"{lines:,} lines, {summary.read.spans:,} spans, {summary.read.points:,} points")
        print(f"{'read lines only':<34}{t_read:8.1f} s  {size / 1e6 / t_read:8.0f} MB/s")
        print(f"{'json.loads every line':<34}{t_json:8.1f} s  {size / 1e6 / t_json:8.0f} MB/s")
        print(
            f"{'otelprof summarize (in process)':<34}{t_report:8.1f} s  "
            f"{size / 1e6 / t_report:8.0f} MB/s  ({t_report / t_json:.2f}x json.loads)"
        )
        from otelprof.analysis.gpu_energy import analyze

        t = time.perf_counter()
        analyze(list(files), WarningLog())  # the report's GPU energy / idle section
        t_gpu = time.perf_counter() - t
        print(
            f"{'GPU energy/idle pass (in process)':<34}{t_gpu:8.1f} s  "
            f"{size / 1e6 / t_gpu:8.0f} MB/s  ({t_gpu / t_report:.2f}x summarize)"
        )
        wall_t, rss_t = _child(["trace", str(run), "-o", str(base / "trace.json")])
        wall_r, rss_r = _child(["report", str(run)])
        print(f"{'otelprof trace (CLI)':<34}{wall_t:8.1f} s  peak RSS {rss_t:6.0f} MiB")
        print(f"{'otelprof report (CLI)':<34}{wall_r:8.1f} s  peak RSS {rss_r:6.0f} MiB")
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
