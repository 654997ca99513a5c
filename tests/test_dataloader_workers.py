"""DataLoader workers forked from the training process (Linux's default) export nothing:
no samples of theirs in the parent's files, under the parent's identity or their own."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import otelprof
from otelprof.analysis.chrome_trace import write_trace
from otelprof.analysis.reader import WarningLog, open_run

INTERVAL_S = 0.1  # a metrics line holds 10 exports: a worker's would be written within 1 s
READER_THREAD = "OtelPeriodicExportingMetricReader"  # the SDK's name for it


class _Items(Dataset[torch.Tensor]):
    """Slow items, each saying which process loaded it and whether a metric reader's
    thread still ran there."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._reader_alive: bool | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._reader_alive is None:  # once per worker: does the SDK's restart survive?
            readers = [t for t in threading.enumerate() if t.name == READER_THREAD]
            for thread in readers:
                thread.join(timeout=2.0)
            self._reader_alive = any(t.is_alive() for t in readers)
        time.sleep(0.02)
        return torch.tensor([os.getpid(), int(self._reader_alive)])


def _metric_resources(path: Path) -> tuple[Counter[tuple[str, str]], Counter[str]]:
    """(process.pid, service.instance.id) of every metrics line's resource, and points by name."""
    resources: Counter[tuple[str, str]] = Counter()
    points: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        for rm in doc.get("resourceMetrics", ()):
            attrs = {a["key"]: a["value"] for a in rm["resource"]["attributes"]}
            pid = attrs["process.pid"]["intValue"]
            instance = attrs["service.instance.id"]["stringValue"]
            resources[(pid, instance)] += 1
            for sm in rm["scopeMetrics"]:
                for metric in sm["metrics"]:
                    for kind in ("gauge", "sum", "histogram"):
                        if kind in metric:
                            points[metric["name"]] += len(metric[kind]["dataPoints"])
    return resources, points


def test_forked_dataloader_workers_export_nothing_into_the_parents_files(tmp_path: Path) -> None:
    began = time.monotonic()
    with otelprof.instrument(output_dir=str(tmp_path), run_id="run", interval=INTERVAL_S):
        loader = DataLoader(
            _Items(240), batch_size=4, num_workers=2, multiprocessing_context="fork"
        )
        loaded = []
        for batch in otelprof.timed_dataloader(loader):
            loaded.append(batch)
            otelprof.step()
    elapsed = time.monotonic() - began
    rows = torch.cat(loaded)
    workers = {int(pid) for pid in rows[:, 0]}
    assert len(workers) == 2 and os.getpid() not in workers  # the items came from workers
    assert not rows[:, 1].any(), "a metric reader's thread ran on in a worker"
    assert elapsed > 2 * 10 * INTERVAL_S  # workers lived long enough to write lines

    run = tmp_path / "run"
    resources, points = _metric_resources(run / "metrics.jsonl")
    assert {pid for pid, _ in resources} == {str(os.getpid())}
    assert len({instance for _, instance in resources}) == 1
    # one host sample per collection of this process (the test's clock bounds them)
    assert points["system.cpu.utilization"] <= elapsed / INTERVAL_S + 2, (points, elapsed)

    result = write_trace(open_run([run]), tmp_path / "t.json", WarningLog(sink=lambda _m: None))
    assert result.processes == 1 and result.steps == 0  # no "all ranks" for one process
