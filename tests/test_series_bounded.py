"""Every metric series otelprof exports has a bounded label set: none grows with steps,
ranges, epochs or time, so a rank's series count (README, "Series per rank") is fixed.

Two real runs of the same loop, one ten times longer (more steps, epochs, validation
passes, ranges, collectives' worth of timings), must export exactly the same series: the
same metric names with the same attribute sets, and the same resource attributes but for
the run's own identity (pid, run id, start).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import otelprof
from otelprof.analysis.aggregates import HistRec
from otelprof.analysis.reader import PointRec, WarningLog, iter_records, open_run

IDENTITY = {"process.pid", "otelprof.run_id", "service.instance.id"}
"""Resource attributes that differ between two runs by design (one value per process)."""

FORBIDDEN_KEYS = {"otelprof.step", "otelprof.epoch", "trace_id", "span_id", "step", "epoch"}


def _run(out: Path, run_id: str, epochs: int, steps: int) -> Path:
    prof = otelprof.instrument(output_dir=str(out), run_id=run_id, interval=0.2)
    try:
        for epoch in range(epochs):
            for i in range(steps):
                with otelprof.timing("dataloader_next"):
                    pass
                with otelprof.timing("train_batch"), otelprof.timing("forward"):
                    time.sleep(0.0002 if i % 11 else 0.003)  # some anomalies too
                otelprof.step_work(samples=4, tokens=32)
                otelprof.step()
            with otelprof.phase("validation"):
                for _ in range(3):
                    with otelprof.timing("forward"):
                        pass
            del epoch
        time.sleep(0.5)  # a few collections of every gauge
    finally:
        prof.shutdown()
    assert prof.run_dir is not None
    return prof.run_dir


def _series(run: Path) -> tuple[set[tuple[str, Any]], dict[str, Any]]:
    series: set[tuple[str, Any]] = set()
    resource: dict[str, Any] = {}
    warn = WarningLog(sink=lambda _m: None)
    for rec in iter_records(
        open_run([run]).jsonl, warn, kinds=frozenset({"metrics"}), histograms=True
    ):
        if isinstance(rec, HistRec):
            series.add(("otelprof.timing.duration", (rec.timing, rec.phase)))
        elif isinstance(rec, PointRec):
            series.add((rec.name, rec.attributes))
        resource.update(dict(rec.resource.attrs))
    assert warn.count == 0, warn.messages
    return series, resource


def test_a_ten_times_longer_run_exports_exactly_the_same_series(tmp_path: Path) -> None:
    short, short_resource = _series(_run(tmp_path, "short", epochs=1, steps=60))
    long, long_resource = _series(_run(tmp_path, "long", epochs=10, steps=60))
    assert short, "no metric series exported"
    assert long == short, (sorted(long - short)[:10], sorted(short - long)[:10])
    assert {k: v for k, v in long_resource.items() if k not in IDENTITY} == {
        k: v for k, v in short_resource.items() if k not in IDENTITY
    }
    for name, attrs in long:
        keys = {k for k, _v in attrs} if name != "otelprof.timing.duration" else set()
        assert not keys & FORBIDDEN_KEYS, (name, attrs)
    assert not set(long_resource) & FORBIDDEN_KEYS
