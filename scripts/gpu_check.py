"""`scripts/gpu-check`'s GPU steps: everything otelprof claims about GPUs, on one GPU.

    PYTHONPATH=SITE python3 scripts/gpu_check.py --out DIR [--budget-s 450]

Run by `scripts/gpu-check` from a copy of tests/, bench/ and scripts/ (no otelprof/ beside
them), so `import otelprof` is the one installed from the bundle. Steps, each with its own
figures, none stopping the next when it fails:

1. the GPU tests (real NVML, CUDA events, GPM where the GPU has it, per-process memory, MIG
   or its absence) under pytest;
2. a CUDA training job (bench/gpu_train.py: a small transformer in bf16, a DataLoader with
   workers, AdamW) for `--job-seconds` with otelprof in detached mode, `nvidia-smi` sampling
   every 100 ms beside it; then `otelprof report`, which must show GPU metrics and a GPU
   verdict;
3. GPU utilization and memory of every otelprof window against the nvidia-smi samples in it;
4. CUDA-event durations against synchronized host timings of the same ranges;
5. a Kineto window: its kernels as spans under the steps they ran in;
6. the overhead: the job's step rate with otelprof against without it, in one process.

Writes DIR/summary.txt (also printed: every figure with its unit), gpu-check.log,
tests.log, nvidia-smi.csv, report.txt, report.json and run.tar.gz: at most 8 files, each
small enough to bring back. Exits 2 without an NVIDIA GPU (before any step), 1 when a check
failed, 0 when all passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # the copy holding tests/ and bench/
sys.path[:0] = [str(HERE), str(HERE / "bench")]

from tests.otlp_files import Point, read_points, read_spans  # noqa: E402  (the copy's tests/)

GPU_TESTS = (
    "tests/test_system_gpu_real.py",
    "tests/test_timings_cuda.py",
    "tests/test_system_gpu.py",
    "tests/test_system_gpu_perf.py",
    "tests/test_analysis_gpu_energy.py",
)
DEVICE = "cuda"  # what the steps run on (a developer's rehearsal of the code may change it)
UTILIZATION_TOLERANCE = 5.0  # percentage points per window
MAX_FILE_BYTES = 16 << 20


class Log:
    """Everything said goes to stdout and gpu-check.log; the summary rows are kept."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("w")
        self.rows: list[tuple[str, str, str]] = []
        self.failed: list[str] = []

    def say(self, text: str) -> None:
        print(text, flush=True)
        self._file.write(text + "\n")
        self._file.flush()

    def figure(self, step: str, what: str, value: str) -> None:
        self.rows.append((step, what, value))
        self.say(f"   {what}: {value}")

    def check(self, step: str, what: str, ok: bool, detail: str = "") -> None:
        self.figure(step, what, ("ok" if ok else "FAILED") + (f" ({detail})" if detail else ""))
        if not ok:
            self.failed.append(f"{step}: {what}")


@dataclass
class Budget:
    """The wall-clock budget: a step that would not finish in what is left is not started."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


def gpu_environment(log: Log) -> dict[str, object]:
    """The GPU, its driver and modes; exits 2 (before any step) without an NVIDIA GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:
        log.say(f"gpu-check needs an NVIDIA GPU and its driver: NVML is not usable ({exc})")
        raise SystemExit(2) from None
    import torch

    if count == 0 or not torch.cuda.is_available():
        log.say(
            "gpu-check needs an NVIDIA GPU and a CUDA build of PyTorch (NVML GPUs: "
            f"{count}, torch.cuda.is_available(): {torch.cuda.is_available()})"
        )
        raise SystemExit(2)
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    try:
        gpm = bool(pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
    except pynvml.NVMLError:
        gpm = False
    try:
        mig = "on" if pynvml.nvmlDeviceGetMigMode(handle)[0] else "off"
    except pynvml.NVMLError:
        mig = "not supported"
    name = pynvml.nvmlDeviceGetName(handle)
    env = {
        "gpu": name.decode() if isinstance(name, bytes) else name,
        "gpus": count,
        "driver": pynvml.nvmlSystemGetDriverVersion(),
        "memory_gib": pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30,
        "gpm": gpm,
        "mig": mig,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }
    pynvml.nvmlShutdown()
    import otelprof

    compiled = sorted(Path(otelprof.__file__).parent.glob("**/_speedups*.so"))
    env["otelprof"] = str(Path(otelprof.__file__).parent)
    env["extension"] = compiled[0].name if compiled else "not built"
    log.say("== 0. environment")
    for key, value in env.items():
        log.figure("environment", key, f"{value:.1f}" if isinstance(value, float) else str(value))
    return env


def step_tests(log: Log, out: Path, budget: Budget) -> None:
    log.say("== 1. GPU tests")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *GPU_TESTS]
    with (out / "tests.log").open("w") as f:
        result = subprocess.run(
            cmd,
            cwd=HERE,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=min(max(budget.left(), 1), 150),
        )
    text = (out / "tests.log").read_text()
    tail = text.strip().splitlines()[-1] if text.strip() else "no output"
    skipped = [line for line in text.splitlines() if line.startswith("SKIPPED")]
    log.figure("tests", "pytest", tail)
    for line in skipped:
        log.say(f"   {line}")
    log.check("tests", "GPU tests passed", result.returncode == 0, f"exit {result.returncode}")
    # on a GPU machine only what the GPU lacks may skip (GPM before Hopper, MIG off)
    log.check(
        "tests",
        "nothing skipped for want of a GPU",
        not any("no CUDA" in s or "no NVIDIA" in s for s in skipped),
    )


class NvidiaSmi:
    """`nvidia-smi` sampling GPU 0 every 100 ms, each line stamped when it arrives."""

    QUERY = "utilization.gpu,memory.used,memory.total"

    def __init__(self, path: Path) -> None:
        self.samples: list[tuple[int, float, float]] = []  # (unix ns, util %, used MiB)
        self._path = path
        query = [f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits", "-lms", "100"]
        self._proc = subprocess.Popen(
            ["nvidia-smi", "-i", "0", *query], stdout=subprocess.PIPE, text=True
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        with self._path.open("w") as f:
            f.write("unix_ns,utilization_pct,memory_used_mib,memory_total_mib\n")
            for line in self._proc.stdout:
                now = time.time_ns()
                try:
                    util, used, total = (float(x) for x in line.split(","))
                except ValueError:
                    continue
                self.samples.append((now, util, used))
                f.write(f"{now},{util:g},{used:g},{total:g}\n")

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self._thread.join(timeout=10)


def _run_dir(output_dir: Path) -> Path:
    (run,) = (p for p in output_dir.iterdir() if p.is_dir())
    return run


def step_job(log: Log, out: Path, seconds: float, work: Path) -> Path | None:
    log.say(f"== 2. a {seconds:.0f} s CUDA training job, detached, nvidia-smi beside it")
    runs = work / "runs"
    try:
        smi = NvidiaSmi(out / "nvidia-smi.csv")
    except OSError as exc:  # no nvidia-smi: the job and its report still count
        log.check("job", "nvidia-smi started", False, str(exc))
        smi = None
    try:
        result = subprocess.run(
            [
                sys.executable,
                str(HERE / "bench" / "gpu_train.py"),
                "--seconds",
                str(seconds),
                "--output-dir",
                str(runs),
                "--interval",
                "1",
            ],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=seconds + 120,
        )
    finally:
        if smi is not None:
            smi.stop()
    log.say(result.stdout.strip())
    if result.returncode != 0:
        log.say(result.stderr[-4000:])
        log.check("job", "training job ran", False, f"exit {result.returncode}")
        return None
    log.figure("job", "nvidia-smi samples", f"{len(smi.samples) if smi else 0} (every 100 ms)")
    run = _run_dir(runs)
    check_run(log, out, run)
    return run


def check_run(log: Log, out: Path, run: Path) -> None:
    """The report of the job's run: its steps, GPU metrics, a GPU verdict, throughput."""
    report = subprocess.run(
        [sys.executable, "-m", "otelprof", "report", str(run), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    (out / "report.json").write_text(report.stdout)
    text = subprocess.run(
        [sys.executable, "-m", "otelprof", "report", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    (out / "report.txt").write_text(text.stdout + text.stderr)
    doc = json.loads(report.stdout)
    steps = doc["steps"]
    log.figure("job", "steps", f"{steps['count']}, median {steps['p50_s'] * 1e3:.2f} ms")
    hardware = {h["metric"]: h for h in doc["hardware"] if h["scope"] != "host"}
    for name, scale, unit in (
        ("hw.gpu.utilization", 100, "%"),
        ("hw.gpu.memory.usage", 2**-30, "GiB"),
        ("otelprof.gpu.process.memory.usage", 2**-30, "GiB"),
        ("hw.power", 1, "W"),
        ("hw.temperature", 1, "°C"),
        ("hw.gpu.sm.activity", 100, "%"),
        ("hw.gpu.tensor.activity", 100, "%"),
    ):
        row = hardware.get(name)
        log.figure("job", f"{name} mean", f"{row['mean'] * scale:.2f} {unit}" if row else "absent")
    wanted = ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.power")
    log.check("job", "GPU utilization, memory and power in the run", set(wanted) <= set(hardware))
    verdict = doc["verdict"]
    log.figure("job", "verdict", verdict["headline"])
    log.check("job", "a GPU verdict", "GPU" in verdict["kind"], verdict["kind"])
    for key, section in doc["sections"].items():
        for row in section["rows"]:
            if key == "throughput" or row.get("kind") == "phase":
                log.figure("job", f"{section['title']}", json.dumps(row))


def _points(run: Path, name: str) -> list[Point]:

    return sorted(
        (p for f in sorted(run.glob("metrics*.jsonl")) for p in read_points(f) if p.name == name),
        key=lambda p: p.time_ns,
    )


def step_truth(log: Log, out: Path, run: Path) -> None:
    log.say("== 3. utilization and memory per window against nvidia-smi (100 ms)")
    smi = []
    csv = out / "nvidia-smi.csv"
    for line in csv.read_text().splitlines()[1:] if csv.exists() else []:
        ns, util, used, _total = line.split(",")
        smi.append((int(ns), float(util), float(used)))
    windows = _utilization_windows(run, smi)
    worst, explained, unexplained = 0.0, [], []
    for i, (start, end, ours, theirs) in enumerate(windows):
        diff = abs(ours - theirs)
        reason = _edge_reason(windows, i) if diff > UTILIZATION_TOLERANCE else None
        if reason:
            explained.append(f"{start:.1f}-{end:.1f} s: {ours:.1f} vs {theirs:.1f} %, {reason}")
        else:
            worst = max(worst, diff)
            if diff > UTILIZATION_TOLERANCE:
                unexplained.append(f"{start:.1f}-{end:.1f} s: {ours:.1f} vs {theirs:.1f} %")
    log.figure("truth", "utilization windows compared", str(len(windows)))
    log.figure("truth", "largest difference (load changes aside)", f"{worst:.2f} percentage points")
    for text in explained:
        log.say(f"   beyond {UTILIZATION_TOLERANCE:g} points at a load change: {text}")
    for text in unexplained:
        log.say(f"   beyond {UTILIZATION_TOLERANCE:g} points: {text}")
    log.figure("truth", "windows differing at a load change", str(len(explained)))
    log.check(
        "truth",
        f"utilization within {UTILIZATION_TOLERANCE:g} points per window",
        bool(windows) and not unexplained,
    )
    diffs = []
    for p in _points(run, "hw.gpu.memory.usage"):
        near = min(smi, key=lambda s: abs(s[0] - p.time_ns), default=None)
        if near is not None and abs(near[0] - p.time_ns) < 150_000_000:
            diffs.append(p.value / 2**20 - near[2])
    if diffs:
        log.figure(
            "truth",
            "memory used, otelprof − nvidia-smi",
            f"median {statistics.median(diffs):.0f} MiB, range {min(diffs):.0f} to "
            f"{max(diffs):.0f} MiB over {len(diffs)} samples",
        )
    log.check("truth", "memory samples matched to nvidia-smi", bool(diffs))


def _utilization_windows(
    run: Path, smi: list[tuple[int, float, float]]
) -> list[tuple[float, float, float, float]]:
    """(start s, end s, otelprof %, mean of nvidia-smi's readings in it %) per window."""
    out, previous, first = [], None, None
    for p in _points(run, "hw.gpu.utilization"):
        # a point without a window is NVML's last period: taken as the time since the last
        start, previous = (p.start_ns or previous), p.time_ns
        first = first or start
        inside = [u for ns, u, _ in smi if start is not None and start < ns <= p.time_ns]
        if start is None or first is None or len(inside) < 3:
            continue
        begin, end = (start - first) / 1e9, (p.time_ns - first) / 1e9
        out.append((begin, end, 100 * p.value, statistics.fmean(inside)))
    return out


def _edge_reason(windows: list[tuple[float, float, float, float]], i: int) -> str | None:
    """Why window i may differ: nvidia-smi's utilization.gpu is the driver's rate over its
    trailing sample period (up to 1 s), so at a load change near a window's edge its readings
    lag the driver's samples that otelprof averages, and part of the change is read in the
    neighbouring window. Then the pair of windows agrees, which is what this checks."""
    _, _, ours, theirs = windows[i]
    for j in (i - 1, i + 1):
        if not 0 <= j < len(windows):
            continue
        _, _, ours_j, theirs_j = windows[j]
        changed = abs(theirs_j - theirs) > 2 * UTILIZATION_TOLERANCE
        pair = abs((ours + ours_j) - (theirs + theirs_j)) / 2
        if changed and pair <= UTILIZATION_TOLERANCE:
            return f"the pair with its neighbour agrees within {pair:.1f} points"
    return None


def step_events(log: Log, work: Path) -> None:
    log.say("== 4. CUDA-event durations against synchronized host timings")
    import torch

    import otelprof

    def block() -> None:
        a = torch.randn(4096, 4096, device=DEVICE)
        for _ in range(10):
            a = a @ a
            a = a / a.norm()

    block()
    torch.cuda.synchronize()
    synced = []
    for _ in range(30):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        block()
        torch.cuda.synchronize()
        synced.append(time.perf_counter() - t0)
    with otelprof.instrument(output_dir=work / "events", interval=1.0) as prof:
        for _ in range(30):
            with otelprof.timing("gpu_block"):
                block()
            otelprof.step()
        torch.cuda.synchronize()
    spans = [s for s in read_spans(Path(prof.files["traces"])) if s.name == "gpu_block"]
    device = [
        s.attributes["otelprof.cuda.duration_s"]
        for s in spans
        if "otelprof.cuda.duration_s" in s.attributes
    ]
    host = [s.duration_s for s in spans]
    if not device:
        log.check("events", "spans carry CUDA-event durations", False)
        return
    sync_ms, device_ms = statistics.median(synced) * 1e3, statistics.median(device) * 1e3
    ratio = device_ms / sync_ms
    log.figure("events", "synchronized host timing, median", f"{sync_ms:.3f} ms")
    log.figure("events", "CUDA-event duration, median", f"{device_ms:.3f} ms ({len(device)} spans)")
    log.figure(
        "events", "host time inside the range, median", f"{statistics.median(host) * 1e3:.3f} ms"
    )
    log.check("events", "event / synchronized within 10 %", abs(ratio - 1) <= 0.10, f"{ratio:.3f}")


def step_kineto(log: Log, work: Path) -> None:
    log.say("== 5. a Kineto window: operators and kernels as spans under their steps")
    import torch

    import otelprof

    a = torch.randn(2048, 2048, device=DEVICE)
    with otelprof.instrument(output_dir=work / "kineto", kineto=True, interval=1.0) as prof:
        for _ in range(8):
            with otelprof.timing("matmuls"):
                for _ in range(5):
                    a = (a @ a).tanh()
            otelprof.step()
        torch.cuda.synchronize()
    spans = read_spans(Path(prof.files["traces"]))
    by_id = {s.span_id: s for s in spans}
    kineto = [s for s in spans if s.attributes.get("otelprof.source") == "kineto"]
    kernels = [s for s in kineto if s.attributes.get("otelprof.kineto.category") == "kernel"]

    def root(span: object) -> object:
        while getattr(span, "parent_span_id", "") in by_id:
            span = by_id[span.parent_span_id]  # type: ignore[attr-defined]
        return span

    under_step = [k for k in kernels if getattr(root(k), "name", "").startswith("step")]
    log.figure("kineto", "Kineto spans", f"{len(kineto)}, of them {len(kernels)} kernels")
    log.figure("kineto", "kernels under a step span", str(len(under_step)))
    log.check(
        "kineto",
        "kernels become child spans of their steps",
        bool(kernels) and len(under_step) == len(kernels),
    )


def step_overhead(log: Log, work: Path, pairs: int) -> None:
    log.say("== 6. overhead: the job's step rate with otelprof against without, one process")
    import torch
    from gpu_train import bare_steps, instrumented_steps, make_job

    import otelprof

    job = make_job(DEVICE)
    data = job.batches()
    bare_steps(job, data, 5)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    bare_steps(job, data, 10)
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / 10
    block = max(5, int(1.0 / step_s))  # about a second a block

    def timed(run: Callable[[], None]) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    ratios = []
    with otelprof.instrument(output_dir=work / "overhead", interval=1.0):
        timed_data = iter(otelprof.timed_dataloader(job.batches()))
        instrumented_steps(job, timed_data, block)  # the budgets' first bursts spent
        for i in range(pairs):
            arms = [
                ("bare", lambda: bare_steps(job, data, block)),
                ("otelprof", lambda: instrumented_steps(job, timed_data, block)),
            ]
            if i % 2:
                arms.reverse()
            times = {name: timed(run) for name, run in arms}
            ratios.append(times["bare"] / times["otelprof"])
    mean, median = statistics.fmean(ratios), statistics.median(ratios)
    half = 2.0 * statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else math.nan
    log.figure("overhead", "bare step", f"{step_s * 1e3:.2f} ms ({block} steps a block)")
    log.figure(
        "overhead",
        "step rate, otelprof / bare",
        f"median {median:.4f}, mean {mean:.4f} ± {half:.4f} (95 %, {len(ratios)} pairs)",
    )
    log.check("overhead", "step rate at least 0.98 of bare", median >= 0.98, f"{median:.4f}")


def pack_run(run: Path, out: Path) -> None:
    """The job's run folder as one file under the size that comes back (traces last)."""
    target = out / "run.tar.gz"
    files = sorted(run.rglob("*"), key=lambda p: ("trace" in p.name, p.name))
    with tarfile.open(target, "w:gz") as tar:
        for path in files:
            if path.is_file() and target.stat().st_size + path.stat().st_size // 4 < MAX_FILE_BYTES:
                tar.add(path, arcname=str(path.relative_to(run.parent)))


@contextlib.contextmanager
def guarded(log: Log, step: str, budget: Budget, needs_s: float) -> Iterator[bool]:
    """Run a step unless the budget is spent; any error is that step's failure, not the end."""
    if budget.left() < needs_s:
        log.check(step, "run within the time budget", False, f"{budget.left():.0f} s left")
        yield False
        return
    t0 = time.monotonic()
    try:
        yield True
    except Exception:
        log.say(traceback.format_exc())
        log.check(step, "completed", False, "an exception, above")
    log.say(f"   ({time.monotonic() - t0:.0f} s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=450.0)
    parser.add_argument("--job-seconds", type=float, default=60.0)
    parser.add_argument("--pairs", type=int, default=20)
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "gpu-check.log")
    budget = Budget(args.budget_s)
    env = gpu_environment(log)
    with tempfile.TemporaryDirectory(prefix="otelprof-gpu-check-") as tmp:
        work = Path(tmp)
        run = None
        with guarded(log, "tests", budget, 60) as go:
            if go:
                step_tests(log, out, budget)
        with guarded(log, "job", budget, args.job_seconds + 30) as go:
            if go:
                run = step_job(log, out, args.job_seconds, work)
        if run is not None:
            with guarded(log, "truth", budget, 5) as go:
                if go:
                    step_truth(log, out, run)
            pack_run(run, out)
        with guarded(log, "events", budget, 20) as go:
            if go:
                step_events(log, work)
        with guarded(log, "kineto", budget, 20) as go:
            if go:
                step_kineto(log, work)
        with guarded(log, "overhead", budget, 2.5 * args.pairs + 10) as go:
            if go:
                step_overhead(log, work, args.pairs)
    width = max(len(w) for _, w, _ in log.rows)
    lines = [
        f"gpu-check on {env['gpu']} (driver {env['driver']}, torch {env['torch']}, "
        f"CUDA {env['cuda']}): {len(log.failed)} check(s) failed"
    ]
    lines += [f"{step:<12} {what:<{width}}  {value}" for step, what, value in log.rows]
    lines += [f"FAILED: {f}" for f in log.failed]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    log.say("== summary\n" + "\n".join(lines))
    return 1 if log.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
