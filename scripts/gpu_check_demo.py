"""`make gpu-check`, step 2: the demo's run on CUDA must carry the GPU figures.

    python scripts/gpu_check_demo.py OUTPUT_DIR

Reads the newest run directory under OUTPUT_DIR and fails (exit 1, naming what is missing)
unless it has GPU utilization, memory (device-wide and this process's), CUDA-event
durations on spans and, on a GPU with NVML GPM, SM and tensor activity from GPM. Prints
the energy-per-step / GPU-idle-by-phase analysis of the run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from otelprof.analysis.gpu_energy import analyze, section_rows, summary_notes
from otelprof.analysis.reader import PointRec, ReadStats, SpanRec, iter_records


def _gpm_supported() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return bool(pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
    except pynvml.NVMLError:
        return False
    finally:
        pynvml.nvmlShutdown()


def main() -> int:
    runs = sorted(
        (p for p in Path(sys.argv[1]).iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime
    )
    if not runs:
        print(f"no run directory under {sys.argv[1]}")
        return 1
    run = runs[-1]
    files = sorted(run.glob("*.jsonl"))
    metrics: dict[str, set[str]] = {}
    cuda_spans = 0
    for rec in iter_records(files, print, ReadStats()):
        if isinstance(rec, PointRec):
            metrics.setdefault(rec.name, set()).add(
                str(dict(rec.attributes).get("otelprof.gpu.source", ""))
            )
        elif isinstance(rec, SpanRec) and rec.attr("otelprof.cuda.duration_s") is not None:
            cuda_spans += 1
    wanted = [
        "hw.gpu.utilization",
        "hw.gpu.memory.usage",
        "otelprof.gpu.process.memory.usage",
        "hw.power",
    ]
    if _gpm_supported():
        wanted += ["hw.gpu.sm.activity", "hw.gpu.sm.occupancy", "hw.gpu.tensor.activity"]
    missing = [name for name in wanted if name not in metrics]
    if _gpm_supported() and "gpm" not in metrics.get("hw.gpu.sm.activity", set()):
        missing.append("hw.gpu.sm.activity from GPM")
    if not cuda_spans:
        missing.append("spans with CUDA-event durations (otelprof.cuda.duration_s)")
    print(f"run {run}: {len(metrics)} metrics, {cuda_spans} spans with CUDA durations")
    for name in sorted(n for n in metrics if n.startswith(("hw.", "otelprof.gpu"))):
        print(f"  {name}  source: {', '.join(sorted(s for s in metrics[name] if s)) or '-'}")
    result = analyze(files, print)
    if result is None:
        missing.append("energy / GPU idle analysis (no GPU samples joined with spans)")
    else:
        for note in summary_notes(result):
            print(f"  {note}")
        for row in section_rows(result):
            print(f"  {row}")
    if missing:
        print("gpu-check demo: MISSING " + "; ".join(missing))
        return 1
    print("gpu-check demo: OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
