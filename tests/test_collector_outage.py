"""Collector outages never hurt training, and data flows again once the collector is back.

A real training process (tests/outage_worker.py) exports OTLP gRPC to a real collector that
is down at the start, comes up mid-run, is SIGKILLed, and comes back on the same ports.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.services import Collector, wait_for

pytestmark = pytest.mark.e2e

WORKER = Path(__file__).with_name("outage_worker.py")
DOWN_S = 5.0  # each outage lasts longer than a metric interval and a span batch delay


@dataclass
class Worker:
    process: subprocess.Popen[bytes]
    control: Path
    log: Path

    def progress(self) -> list[dict[str, Any]]:
        path = self.control / "progress.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def steps(self) -> int:
        lines = self.progress()
        return int(lines[-1]["steps"]) if lines else 0

    def alive(self) -> bool:
        """True while the training process runs; raises with its log once it has exited."""
        if self.process.poll() is not None:
            raise AssertionError(
                f"training process exited ({self.process.returncode}):\n{self.log.read_text()}"
            )
        return True

    def finish(self, timeout_s: float = 180.0) -> dict[str, Any]:
        (self.control / "stop").touch()
        self.process.wait(timeout=timeout_s)
        assert self.process.returncode == 0, self.log.read_text()
        return dict(json.loads((self.control / "result.json").read_text()))


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    workers: list[Worker] = []

    def start(endpoint: str, env: dict[str, str] | None = None) -> Worker:
        control = tmp_path / f"worker-{len(workers)}"
        control.mkdir()
        log = control / "worker.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, str(WORKER), endpoint, str(control)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        worker = Worker(process, control, log)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.kill()
            worker.process.wait()


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples in Prometheus text format, filtered by labels."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _received_steps(collector: Collector) -> set[int]:
    """otelprof.step values of the step spans this collector incarnation wrote to its file."""
    path = collector.debug_dir / "traces.jsonl"
    if not path.exists():
        return set()
    steps: set[int] = set()
    for line in path.read_text().splitlines():
        try:
            request = json.loads(line)
        except json.JSONDecodeError:  # the line being written right now
            continue
        for rs in request.get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                for span in ss.get("spans", []):
                    if span["name"] != "step":
                        continue
                    for attr in span.get("attributes", []):
                        if attr["key"] == "otelprof.step":
                            steps.add(int(attr["value"]["intValue"]))
    return steps


def _wait_for_flow(collector: Collector, worker: Worker, after_step: int) -> None:
    """Spans of steps after `after_step` and metric points reach this collector incarnation."""

    def flowing() -> bool:
        worker.alive()
        text = collector.self_metrics()
        points = _metric(text, "otelcol_receiver_accepted_metric_points", receiver="otlp")
        newer = [s for s in _received_steps(collector) if s > after_step]
        return points > 0 and len(newer) > 0

    started = time.monotonic()
    wait_for(
        flowing,
        timeout_s=120.0,
        what=f"new spans (after step {after_step}) and metrics to reach the restarted collector",
        interval_s=0.5,
    )
    print(f"data flowed again {time.monotonic() - started:.1f} s after the collector started")


def test_training_survives_collector_down_up_killed_up_and_data_flows_again(
    collector_factory: Callable[..., Collector], start_worker: Callable[..., Worker]
) -> None:
    collector = collector_factory(
        traces_exporters=["span_metrics", "file/traces"],
        metrics_exporters=["prometheus"],
        wait=False,
    )
    worker = start_worker(collector.otlp_endpoint, {"OTELPROF_EXPORT_TIMEOUT": "2"})

    # 1. collector down from the start
    wait_for(
        lambda: worker.alive() and worker.steps() > 20, timeout_s=300, what="training to start"
    )
    time.sleep(DOWN_S)
    worker.alive()
    steps_at_first_start = worker.steps()

    # 2. collector comes up mid-run: data flows
    collector.start()
    _wait_for_flow(collector, worker, after_step=0)

    # 3. collector killed (SIGKILL, as by the OOM killer), training goes on
    collector.kill()
    killed_at = worker.steps()
    time.sleep(DOWN_S)
    # Training goes on while the collector stays dead: 20 more steps, however slowly a busy
    # machine runs them (the collector is restarted only after them, so a loop stalled
    # until the collector came back would never get there).
    wait_for(
        lambda: worker.alive() and worker.steps() > killed_at + 20,
        timeout_s=300,
        what="training to go on while the collector was dead",
    )

    # 4. collector back on the same ports: data flows again, with steps from after the restart
    restarted_at = worker.steps()
    collector.start()
    _wait_for_flow(collector, worker, after_step=restarted_at)
    time.sleep(1.0)

    result = worker.finish()
    step_times: list[float] = result["step_times"]
    stats: dict[str, int] = result["stats"]
    rss = [line["rss"] for line in worker.progress()]
    assert len(step_times) > steps_at_first_start

    # The loop never stalls: no step much slower than the run's normal step.
    median = statistics.median(step_times)
    slowest = max(step_times[5:])  # the first steps include DataLoader and model warm-up
    print(
        f"{len(step_times)} steps, median {median * 1e3:.2f} ms, slowest {slowest * 1e3:.1f} ms, "
        f"RSS {min(rss) / 2**20:.0f}-{max(rss) / 2**20:.0f} MiB, stats {stats}"
    )
    assert slowest < max(20 * median, 0.5), (
        f"a step took {slowest * 1000:.1f} ms (median {median * 1000:.2f} ms)"
    )

    # Memory stays bounded: what an outage queues is capped, not proportional to its length.
    # (Baseline: once training runs; PyTorch's first steps allocate ~150 MiB by themselves.)
    progress = worker.progress()
    warm = next(p["rss"] for p in progress if p["steps"] >= 20)
    assert max(rss) - warm < 100 * 2**20, (
        f"RSS grew {(max(rss) - warm) / 2**20:.0f} MiB during outages"
    )

    # Dropped telemetry is counted and shown to the user. Each outage (5 s) outlasts the
    # export timeout (2 s here), so some exports must have failed; every recorded span is
    # either exported or counted as lost.
    assert stats["dropped_total"] > 0, stats
    lost_spans = stats.get("otlp.spans_failed", 0) + stats.get("otlp.spans_dropped_queue_full", 0)
    assert stats.get("otlp.spans_exported", 0) + lost_spans == stats["timings.spans_recorded"], (
        stats
    )
    log = worker.log.read_text()
    assert "telemetry was dropped" in log, log[-2000:]
    assert "Traceback" not in log, log[-4000:]

    # Shutdown with the collector up is prompt (nothing left retrying).
    assert result["shutdown_s"] < 10.0, result["shutdown_s"]

    # The drop counter itself reached the restarted collector as a metric.
    def drops_visible() -> bool:
        return _metric(collector.scrape(), "otelprof_telemetry_dropped_total") > 0

    wait_for(drops_visible, timeout_s=60.0, what="otelprof_telemetry_dropped_total in /metrics")


def test_shutdown_with_the_collector_down_returns_promptly_and_counts_the_loss(
    collector_factory: Callable[..., Collector], start_worker: Callable[..., Worker]
) -> None:
    collector = collector_factory(wait=False)  # never started
    worker = start_worker(collector.otlp_endpoint)
    wait_for(lambda: worker.alive() and worker.steps() > 50, timeout_s=300, what="training")
    time.sleep(2.0)
    result = worker.finish()
    assert result["stats"]["dropped_total"] > 0, result["stats"]
    # Bounded by the export timeout (10 s by default) plus a margin, not by the retries of
    # every queued batch of every signal.
    assert result["shutdown_s"] < 15.0, f"shutdown took {result['shutdown_s']:.1f} s"
