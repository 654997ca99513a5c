"""Benchmark: `otelprof report` and `otelprof trace` over many ranks' one-hour run files.

The runs are derived from one real short run (bench/_scale_runs.py: the same record shapes
and rates as a real hour at default settings), written into one shared run directory, then
the real CLI runs in child processes: wall time, CPU time (user + system) and peak RSS.
`--baseline PATH` also runs the otelprof package found under PATH (an older checkout) on the
same files, alternated with this tree's (A-B-A-B).

    .venv/bin/python bench/scale_report.py --source RUN_DIR --ranks 1024 --dir DIR
    .venv/bin/python bench/scale_report.py --reuse DIR/run1024 --runs 2 --baseline OLD
    .venv/bin/python bench/scale_report.py --one-span-files 20000,100000 --trace
    .venv/bin/python bench/scale_report.py --long-line-mib 1024 --trace

The last two are the hostile extremes: N files of one span each, every file its own rank
(the report must stay linear in the file count), and one file of a single line of that
many MiB without a newline (skipped past `--max-line`, in bounded memory).

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
sys.path.insert(0, str(REPO))

from tests.run_generators import write_one_span_files  # noqa: E402

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


def _timed(args: argparse.Namespace, what: str, cli_args: list[str], extra: int = 0) -> None:
    """`otelprof CLI_ARGS` from this tree, `args.runs` times, one line of figures each
    (`extra`: files, for the time per file)."""
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            out = Path(tmp) / "out"
            if cli_args[0] == "trace":
                cli_args = [*cli_args, "-o", str(Path(tmp) / "trace.json")]
            figures = run_cli(cli_args, REPO, out)
        if extra:
            figures["wall_us_per_file"] = round(figures["wall_s"] / extra * 1e6)
        figures["load"] = round(os.getloadavg()[0], 1)
        print(f"{what}: {json.dumps(figures)}", flush=True)


def hostile(args: argparse.Namespace) -> None:
    """The many-files and long-line runs (`--one-span-files`, `--long-line-mib`)."""
    with tempfile.TemporaryDirectory(prefix="otelprof-hostile-", dir=args.dir) as base:
        for count in [int(n) for n in (args.one_span_files or "").split(",") if n]:
            run = write_one_span_files(Path(base) / f"files{count}", count)
            report = ["report", str(run), *args.report_args.split()]
            _timed(args, f"report, {count:,} one-span files", report, count)
            _timed(args, f"report --json, {count:,} one-span files", [*report, "--json"], count)
            if args.trace:
                _timed(args, f"trace, {count:,} one-span files", ["trace", str(run)], count)
            shutil.rmtree(run)
        if args.long_line_mib:
            run = Path(base) / "long-line"
            run.mkdir()
            with (run / "traces.jsonl").open("wb") as handle:
                handle.write(b'{"resourceSpans":[{"resource":{"attributes":[{"key":"x","value":')
                handle.write(b'{"stringValue":"')
                for _ in range(args.long_line_mib):
                    handle.write(b"a" * (1 << 20))
            what = f"a line of {args.long_line_mib:,} MiB"
            _timed(args, f"report, {what}", ["report", str(run), *args.report_args.split()])
            if args.trace:
                _timed(args, f"trace, {what}", ["trace", str(run), *args.trace_args.split()])


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
    parser.add_argument(
        "--one-span-files",
        metavar="N[,N...]",
        help="time report (text and --json) over N files of one span each, per N",
    )
    parser.add_argument(
        "--long-line-mib",
        type=int,
        help="time report over one file of a single line of this many MiB (no newline)",
    )
    args = parser.parse_args()
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    if args.one_span_files or args.long_line_mib:
        hostile(args)
        return 0
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
