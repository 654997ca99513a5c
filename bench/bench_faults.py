"""shutdown() duration under faults, and RSS over a run with large attributes.

    .venv/bin/python bench/bench_faults.py [--checkout DIR] [--seconds 10]

Each scenario is a fresh child process (a real profiler, detached unless said otherwise,
`export_timeout=2`) that trains for a while, then calls `shutdown()` and reports how long
it took and what was counted:

- `clean`: nothing wrong (the reference);
- `hung write`: the trace file's writer blocks forever in its write (a frozen file system)
  from just before shutdown;
- `hung collector`: attached mode to a socket that accepts and never answers,
  `trace_budget=inf`;
- `disk full`: the run directory on a full 4 MiB tmpfs (needs root);
- `deleted dir`: the run directory removed mid-run;
- `64 KB attributes`: a distinct 64 KB string attribute per step for `--seconds`; RSS growth
  (peak - after instrument()) and shutdown time.

`--checkout DIR` runs the children with DIR first on the import path (a pristine copy of
main, for before/after figures). Timings are wall-clock on whatever machine runs them: say
its load (`uptime`) next to the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PRELUDE = """
import json, os, shutil, socket, subprocess, sys, threading, time
import otelprof
out = sys.argv[1]
seconds = float(sys.argv[2])
def rss_mb():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
def train(prof, n=200, **attrs):
    for _ in range(n):
        with otelprof.timing("train_batch", **attrs):
            time.sleep(0.001)
        otelprof.step()
def report(prof, **extra):
    start = time.monotonic()
    prof.shutdown()
    took = time.monotonic() - start
    stats = prof.stats()
    print(json.dumps({"shutdown_s": round(took, 3), "dropped_total": stats["dropped_total"],
                      **extra}))
"""

SCENARIOS = {
    "clean": """
prof = otelprof.instrument(output_dir=out, interval=0.2, export_timeout=2)
train(prof)
report(prof)
""",
    "hung write": """
from otelprof.export import _spanlines
prof = otelprof.instrument(output_dir=out, interval=0.2, export_timeout=2,
                           trace_budget=float("inf"))
train(prof)
frozen = threading.Event()
_spanlines.SpanLineWriter._write_line = lambda self, header, spans: frozen.wait()
train(prof)
report(prof)
""",
    "hung collector": """
silent = socket.socket()
silent.bind(("127.0.0.1", 0))
silent.listen(64)
prof = otelprof.instrument(endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}",
                           insecure=True, detached=False, interval=0.2, export_timeout=2,
                           trace_budget=float("inf"))
train(prof, 500)
report(prof)
""",
    "disk full": """
mount = os.path.join(out, "fs")
os.makedirs(mount)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mount], check=True)
try:
    prof = otelprof.instrument(output_dir=mount, interval=0.2, export_timeout=2,
                               trace_budget=float("inf"))
    train(prof)
    with open(os.path.join(mount, "ballast"), "wb", buffering=0) as ballast:
        try:
            while True:
                ballast.write(b"\\0" * 65536)
        except OSError:
            pass
    train(prof, note="x" * 1000)
    report(prof)
finally:
    subprocess.run(["umount", "-l", mount])
""",
    "deleted dir": """
prof = otelprof.instrument(output_dir=out, interval=0.2, export_timeout=2,
                           trace_budget=float("inf"))
train(prof)
shutil.rmtree(prof.run_dir)
train(prof)
report(prof)
""",
    "64 KB attributes": """
prof = otelprof.instrument(output_dir=out, interval=0.5, export_timeout=2)
base = peak = rss_mb()
end = time.monotonic() + seconds
i = 0
while time.monotonic() < end:
    with otelprof.timing("load_batch", batch=(str(i) * 70000)[:65536]):
        pass
    otelprof.step()
    i += 1
    if i % 200 == 0:
        peak = max(peak, rss_mb())
report(prof, steps=i, rss_growth_mb=round(peak - base))
""",
}


def run(name: str, checkout: Path, seconds: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=str(checkout))
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        try:
            done = subprocess.run(
                [sys.executable, "-c", PRELUDE + SCENARIOS[name], out, str(seconds)],
                capture_output=True,
                text=True,
                env=env,
                cwd=str(checkout),  # `-c` puts the working directory first on the path
                timeout=180,
            )
        except subprocess.TimeoutExpired:
            return {"error": "did not end within 180 s"}
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            return {"error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
        result: dict[str, object] = json.loads(lines[-1])
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, default=REPO)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--only", nargs="*", default=list(SCENARIOS))
    args = parser.parse_args()
    print(f"checkout {args.checkout}; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name in args.only:
        print(f"{name:18} {json.dumps(run(name, args.checkout, args.seconds))}", flush=True)


if __name__ == "__main__":
    main()
