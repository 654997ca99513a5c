"""Benchmark: `otelprof report` and `otelprof trace` over many ranks' one-hour run files.

The runs are derived from one real short run (bench/_scale_runs.py: the same record shapes
and rates as a real hour at default settings), written into one shared run directory, then
the real CLI runs in child processes: wall time, CPU time (user + system) and peak RSS.
`--baseline PATH` also runs the otelprof package found under PATH (an older checkout) on the
same files, alternated with this tree's (A-B-A-B).

    .venv/bin/python bench/scale_report.py --source RUN_DIR --ranks 1024 --dir DIR
    .venv/bin/python bench/scale_report.py --reuse DIR/run1024 --runs 2 --baseline OLD

A thousand one-hour ranks are ~24 GB of JSON: `--dir` should be on a file system that
compresses (e.g. btrfs mounted with compress-force=zstd, ~2 GB on disk) or have the room.
The generated run is deleted afterwards unless `--keep` (then `--reuse` it: generating
1,024 ranks takes ~5 minutes of both cores). Figures: wall time; CPU time (user + system)
of the report and its worker processes; peak RSS of the main process, of the largest
worker, and of all of them together (sampled).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _machine import cpu_model
from _scale_runs import build_templates, record_source_run, write_ranks

REPO = Path(__file__).resolve().parents[1]

_MEASURED = (
    "import resource, sys\n"
    "from otelprof.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "u = resource.getrusage(resource.RUSAGE_SELF)\n"
    "c = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "print('measured', u.ru_maxrss, c.ru_maxrss, u.ru_utime + u.ru_stime,\n"
    "      c.ru_utime + c.ru_stime, file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


class _TreeRss:
    """Peak of the summed RSS of a process and all its descendants (the report's worker
    processes), sampled every 20 ms; shared pages count once per process, so this is an
    upper bound of what they hold together."""

    def __init__(self, pid: int) -> None:
        import psutil

        self._root = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.02):
            total = 0
            try:
                for proc in [self._root, *self._root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        total += proc.memory_info().rss
            except psutil.Error:
                return
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_cli(args: list[str], tree: Path, out: Path | None = None) -> dict[str, float]:
    """Wall s, CPU s (all processes) and peak RSS MiB of `otelprof ARGS` from the package
    under `tree`: the main process's, the largest worker's and all processes' together."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", _MEASURED, *args],
        stdout=out.open("wb") if out else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tree,
    )
    tree_rss = _TreeRss(proc.pid)
    _out, raw_err = proc.communicate()
    wall = time.perf_counter() - start
    all_rss = tree_rss.stop()
    err = raw_err.decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"otelprof {' '.join(args)} failed ({proc.returncode}): {err[-2000:]}")
    line = [ln for ln in err.splitlines() if ln.startswith("measured ")][-1]
    _tag, peak_kib, child_kib, cpu, child_cpu = line.split()
    return {
        "wall_s": round(wall, 1),
        "cpu_s": round(float(cpu) + float(child_cpu), 1),
        "main_cpu_s": round(float(cpu), 1),
        "peak_rss_mib": round(int(peak_kib) / 1024),
        "worker_peak_rss_mib": round(int(child_kib) / 1024),
        "all_processes_rss_mib": round(all_rss / (1 << 20)),
    }


def evict(paths: list[Path]) -> None:
    """Drop the page cache of these files (clean pages only: what a first read finds)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--source", type=Path, help="a real 2-rank detached run (default: record one now)"
    )
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--dir", type=Path, help="where to generate (default: a temp dir)")
    parser.add_argument("--reuse", type=Path, help="an already generated run directory")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--runs", type=int, default=1, help="report runs per tree")
    parser.add_argument("--baseline", type=Path, help="a tree with an older otelprof")
    parser.add_argument("--trace", action="store_true", help="also time `otelprof trace`")
    parser.add_argument(
        "--trace-only", action="store_true", help="time `otelprof trace` only (no report)"
    )
    parser.add_argument("--trace-args", default="", help="extra trace arguments, e.g. '--read-all'")
    parser.add_argument(
        "--report-args", default="", help="extra report arguments, e.g. '--read-all'"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="evict the run files' cached pages before each report run (and --evict files')",
    )
    parser.add_argument(
        "--evict",
        type=Path,
        action="append",
        default=[],
        help="a file whose cached pages --cold evicts too (e.g. a loop file system's image)",
    )
    args = parser.parse_args()
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    base = None
    if args.reuse:
        run = args.reuse
    else:
        base = Path(tempfile.mkdtemp(prefix="otelprof-scale-", dir=args.dir))
        if args.source is None:
            args.source = record_source_run(base / "source")
        run = base / f"run{args.ranks}"
        begun = time.perf_counter()
        templates = build_templates(args.source, args.hours * 3600)
        written = sum(
            write_ranks(templates, run, args.ranks, f"scale-{args.ranks}", jobs=os.cpu_count() or 1)
        )
        facts = {k: v.facts for k, v in templates.items()}
        print(
            f"generated {args.ranks} ranks x {args.hours:g} h: {written / 1e9:.2f} GB in "
            f"{time.perf_counter() - begun:.0f} s; per-rank facts {json.dumps(facts)}",
            flush=True,
        )
    try:
        size = sum(p.stat().st_size for p in run.glob("*.jsonl"))
        print(f"run: {len(list(run.glob('*.jsonl')))} files, {size / 1e9:.2f} GB", flush=True)
        trees = [("this tree", REPO)]
        if args.baseline:
            trees.append(("baseline", args.baseline))
        extra = args.report_args.split()
        for i in range(0 if args.trace_only else args.runs):
            for name, tree in trees if i % 2 == 0 else trees[::-1]:
                out = Path(tempfile.mkstemp(suffix=".json")[1])
                report_args = ["report", "--json", str(run)]
                if args.cold:
                    evict([*run.iterdir(), *args.evict])
                if name == "this tree":
                    report_args += extra
                figures = run_cli(report_args, tree, out)
                doc = json.loads(out.read_text())
                out.unlink()
                figures["load"] = round(os.getloadavg()[0], 1)
                print(
                    f"report ({name}, {' '.join(extra) if name == 'this tree' else ''}): "
                    f"{json.dumps(figures)}; processes {doc['run']['processes']}, "
                    f"spans read {doc['run']['spans']:,}, "
                    f"bytes read {doc['run']['bytes'] / 1e6:.0f} MB, "
                    f"steps {doc['steps'].get('count')}",
                    flush=True,
                )
        if args.trace or args.trace_only:
            for i in range(args.runs):
                for name, tree in trees if i % 2 == 0 else trees[::-1]:
                    trace_args = args.trace_args.split() if name == "this tree" else []
                    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                        output = Path(tmp) / "trace.json.gz"
                        said = Path(tmp) / "said.txt"
                        figures = run_cli(["trace", str(run), "-o", str(output), *trace_args],
                                          tree, said)  # fmt: skip
                        figures["output_mb"] = round(output.stat().st_size / 1e6, 1)
                        wrote = said.read_text().strip()
                    figures["load"] = round(os.getloadavg()[0], 1)
                    print(
                        f"trace ({name}, {' '.join(trace_args)}): {json.dumps(figures)}; {wrote}",
                        flush=True,
                    )
    finally:
        if base is not None and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
