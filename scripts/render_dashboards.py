"""Draw what otelprof's Grafana dashboards would show, from a real pipeline run, as PNGs.

    python scripts/render_dashboards.py --out out/dashboards      # (`make dashboards-png`)

Runs tests/pipeline_run.py (the built collector, Debian's Prometheus, a CPU PyTorch loop
under otelprof; GPU gauges from a scripted NVML driver, marked SYNTHETIC on the plots), then
evaluates every panel's PromQL as Grafana would for that run and plots one PNG per
dashboard, plus summary.json (points per panel). The images are for people to look at; they
are not committed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dashboards.build import MULTI_RANK_PANELS  # noqa: E402
from tests.dashboard_queries import (  # noqa: E402
    DASHBOARD_FILES,
    legend,
    load,
    panels,
    run_range,
    substitute,
)
from tests.pipeline_run import RANK_ENV, PipelineRun, run_pipeline  # noqa: E402

UNITS = {
    "percentunit": ("%", 100.0),
    "bytes": ("GiB", 1 / 2**30),
    "Bps": ("MB/s", 1e-6),
    "s": ("ms", 1000.0),
    "watt": ("W", 1.0),
    "celsius": ("°C", 1.0),
    "iops": ("ops/s", 1.0),
    "none": ("", 1.0),
}


def render(run: PipelineRun, out: Path) -> list[Path]:
    """One PNG per dashboard (every panel with its queries over the run) + summary.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    values = {
        "service": run.service_name,
        "run": run.run_id,
        "host": run.host_name,
        "rank": run.rank,
        "trial": RANK_ENV["DET_TRIAL_ID"],
        "gpu": "0",
    }
    start, end = run.started, run.finished + 3.0
    written: list[Path] = []
    summary: list[dict[str, Any]] = []
    for path in DASHBOARD_FILES:
        dashboard = load(path)
        # panels that need several ranks' collectives stay empty on this one-process run
        # (tests/test_distributed.py proves them on a real multi-process job)
        shown = [
            p
            for p in panels(dashboard)
            if p["type"] != "row" and p["title"] not in MULTI_RANK_PANELS
        ]
        columns = 3
        rows = (len(shown) + columns - 1) // columns
        fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.2 * rows), squeeze=False)
        for ax, panel in zip(axes.flat, shown, strict=False):
            unit, scale = UNITS.get(panel["fieldConfig"]["defaults"].get("unit", "none"), ("", 1))
            points = 0
            synthetic = False
            for target in panel["targets"]:
                expr = substitute(target["expr"], values)
                synthetic |= "hw_gpu" in expr or "hw_power" in expr or "hw_temperature" in expr
                for labels, times, ys in run_range(run.prometheus, expr, start, end):
                    points += len(ys)
                    ax.plot(
                        [t - start for t in times],
                        [y * scale for y in ys],
                        label=legend(target.get("legendFormat", ""), labels),
                    )
            title = panel["title"] + ("  [SYNTHETIC GPU data]" if synthetic else "")
            ax.set_title(title, fontsize=9, color="darkred" if synthetic else "black")
            ax.set_xlabel("seconds into the run", fontsize=7)
            ax.set_ylabel(unit, fontsize=7)
            ax.tick_params(labelsize=7)
            if points:
                ax.legend(fontsize=6, loc="best")
            else:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            summary.append({"dashboard": path.name, "panel": panel["title"], "points": points})
        for ax in list(axes.flat)[len(shown) :]:
            ax.axis("off")
        fig.suptitle(f"{dashboard['title']}: service {run.service_name}, {run.steps} steps")
        fig.tight_layout()
        png = out / f"{path.stem}.png"
        fig.savefig(png, dpi=90)
        plt.close(fig)
        written.append(png)
    (out / "summary.json").write_text(json.dumps({"panels": summary}, indent=2) + "\n")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "dashboards")
    parser.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="otelprof-dashboards-") as work:
        run = run_pipeline(Path(work), steps=args.steps)
        try:
            written = render(run, args.out)
        finally:
            run.stop()
    for png in written:
        print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
