"""A collector outage is told in one line, and its end in one more, with the losses counted.

The OpenTelemetry SDK's OTLP exporter logs every failed export and every retry while the
collector is down (issue #22); otelprof counts those losses and says it once. A real OTLP
gRPC server that is not yet serving, then serves.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import otelprof
from otelprof.export.counters import is_loss
from tests.otlp_files import read_lines, timing_histograms
from tests.otlp_sink import OtlpSink
from tests.services import wait_for

SDK_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"


def _train_until(prof: otelprof.Profiler, done: object, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, prof.stats()
        with otelprof.timing("train_batch"):
            time.sleep(0.005)
        otelprof.step()


def test_a_collector_outage_logs_one_line_and_one_on_recovery_with_the_losses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    sink = OtlpSink()  # its port is reserved, nothing answers yet: the collector is down
    prof = otelprof.instrument(
        detached=False,
        endpoint=sink.endpoint,
        interval=0.2,
        export_timeout=1,
        host_metrics=False,
        gpus="none",
        output_dir=tmp_path,
    )
    try:
        # several failed exports of each kind: the SDK logged each one (and its retries)
        _train_until(
            prof,
            lambda: (
                prof.stats().get("otlp.metric_exports_failed", 0) >= 4
                and prof.stats().get("otlp.spans_failed", 0) > 0
            ),
        )
        sink.start()
        _train_until(prof, lambda: "recovered after" in caplog.text)
        wait_for(
            lambda: sink.metric_requests and sink.trace_requests,
            timeout_s=120,
            what="exports to arrive",
        )
    finally:
        prof.shutdown()
        sink.stop()
    stats = prof.stats()
    sdk_records = [r for r in caplog.records if r.name == SDK_LOGGER]
    assert not sdk_records, [r.getMessage()[:200] for r in sdk_records[:5]]
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("otelprof")]
    failing = [m for m in ours if "is failing" in m]
    recovered = [m for m in ours if "recovered after" in m]
    assert len(failing) == 1, ours
    # the destination, and the gRPC status of the SDK's last error (the port is reserved but
    # not served: UNAVAILABLE or DEADLINE_EXCEEDED)
    assert re.search(r"otlp export to 127\.0\.0\.1:\d+ is failing \([A-Z_]+: ", failing[0]), failing
    assert len(recovered) == 1, ours
    # what the recovery line says was lost is what stats() counts as failed
    lost = {what: int(n) for n, what in re.findall(r"(\d+) (spans|metric points)", recovered[0])}
    assert lost["spans"] == stats["otlp.spans_failed"] > 0, (recovered, stats)
    assert lost["metric points"] == stats["otlp.metric_points_failed"] > 0, (recovered, stats)
    assert stats["dropped_total"] >= lost["spans"] + lost["metric points"]


@pytest.fixture(params=["down", "stalled"])
def dead_collector(request: pytest.FixtureRequest) -> Iterator[str]:
    """A collector's endpoint that refuses connections, or accepts them and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        if request.param == "stalled":
            listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_the_detached_metrics_file_keeps_the_final_export_whatever_the_collector_does(
    tmp_path: Path, dead_collector: str
) -> None:
    steps = 50
    # interval 3600: the only metrics export is the final one, at shutdown
    with otelprof.instrument(
        endpoint=dead_collector, detached=True, output_dir=tmp_path, interval=3600,
        export_timeout=1, gpus="none", host_metrics=False,
    ) as prof:  # fmt: skip
        for _ in range(steps):
            with otelprof.timing("train_batch"):
                time.sleep(0.001)
            otelprof.step()
    stats = prof.stats()
    (metrics,) = tmp_path.glob("*/metrics.jsonl")
    points = sum(
        len(next(iter(v for v in m.values() if isinstance(v, dict)))["dataPoints"])
        for request in read_lines(metrics)
        for rm in request.get("resourceMetrics", [])
        for sm in rm["scopeMetrics"]
        for m in sm["metrics"]
    )
    histogram = timing_histograms(metrics)[("train_batch", "train")]
    assert int(histogram["count"]) == steps  # the final export, whole
    assert stats["files.metric_points_exported"] == points > 0, stats
    assert not [k for k in stats if k.startswith("files.") and is_loss(k)], stats
    assert stats["otlp.metric_points_failed"] > 0, stats  # the collector's share is counted
    # items lost, every one under a key that names it (exports are not items)
    lost = stats["otlp.spans_failed"] + stats["otlp.metric_points_failed"]
    assert (
        stats["dropped_total"]
        == lost
        == sum(v for k, v in stats.items() if is_loss(k) and k != "dropped_total")
    ), stats
