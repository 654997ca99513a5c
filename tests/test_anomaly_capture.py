"""Anomaly-triggered deep capture with kineto=True: a torch.profiler window, linked."""

from __future__ import annotations

import time
from pathlib import Path
from statistics import median

import pytest
import torch

import otelprof
from otelprof._timings import _sampling
from tests.otlp_files import read_spans


def test_an_anomaly_runs_a_kineto_window_whose_steps_the_slow_step_links_to(
    tmp_path: Path,
) -> None:
    # Every anomaly is kept (no anomaly budget): on a loaded machine, stalls of 20+ ms
    # before step 150 are anomalies too, and 20 of them would empty the budget's bucket, so
    # that the injected one were refused (test_trace_sampling checks the budget).
    prof = otelprof.instrument(
        output_dir=str(tmp_path), run_id="a", kineto=True, trace_budget=0,
        trace_anomaly_budget=float("inf"), host_metrics=False, process_metrics=False,
    )  # fmt: skip
    x = torch.randn(32, 32)
    # The slow step is slow relative to the steps before it, as measured here, so that it
    # is an anomaly (ANOMALY_FACTOR x their median) however slow a loaded machine makes them.
    step_times: list[float] = []
    last = time.perf_counter()
    try:
        for i in range(400):
            with otelprof.timing("train_batch"):
                (x @ x).relu()
                if i == 150:
                    recent = step_times[-_sampling.SLOW_WINDOW :]
                    time.sleep(max(0.05, 10 * _sampling.ANOMALY_FACTOR * median(recent)))
                else:
                    time.sleep(0.002)
            otelprof.step()
            now = time.perf_counter()
            step_times.append(now - last)
            last = now
    finally:
        prof.shutdown()
    stats = prof.stats()
    assert stats["timings.anomalies"] >= 1
    # every step the rule fired on was kept or refused by the anomaly budget, and counted
    kept_anomalies = stats.get("timings.steps_kept.anomaly", 0)
    assert kept_anomalies + stats["timings.anomalies_refused"] == stats["timings.anomalies"]
    assert stats["timings.kineto_captures"] == 1
    assert stats["timings.kineto_traces"] == 2  # the default first window + the capture
    spans = read_spans(prof.files["traces"])
    steps = {s.span_id: s for s in spans if s.name == "step"}
    anomalous = [s for s in steps.values() if s.attributes.get("otelprof.sampled") == "anomaly"]
    # the steps kept as anomalies are the rule's (the profiler's own window may slow some
    # more steps past its threshold; the anomaly budget's burst keeps them)
    assert all(s.attributes["otelprof.anomaly.ratio"] >= 3 for s in anomalous), [
        (s.attributes["otelprof.step"], s.attributes["otelprof.anomaly.ratio"]) for s in anomalous
    ]
    # The injected step is kept: as an anomaly, or, when a loaded machine stalled a step
    # just before it past the rule, as one of the steps that real anomaly's capture keeps
    # (a slow step inside a running capture is one of its captured steps, not a new anomaly).
    (injected,) = [s for s in steps.values() if s.attributes["otelprof.step"] == 150]
    assert injected.attributes["otelprof.sampled"] in ("anomaly", "capture", "capture.kineto")
    window = [s for s in steps.values() if s.attributes.get("otelprof.sampled") == "capture.kineto"]
    assert len(window) == 3
    # The capture follows the anomaly that started it, which links to the steps captured
    # after it, the Kineto window's among them. That is the injected step, or, on a machine
    # loaded enough to stall an earlier step past the rule, that earlier (real) anomaly:
    # one capture per cooldown either way.
    links = {
        line_span["spanId"]: {link["spanId"] for link in line_span.get("links", [])}
        for request in _requests(prof.files["traces"])
        for line_span in request
    }
    window_ids = {w.span_id for w in window}
    (starter,) = [s for s in anomalous if window_ids <= links.get(s.span_id, set())]
    assert all(w.start_ns > starter.end_ns for w in window)
    if injected.attributes["otelprof.sampled"] != "anomaly":
        assert starter.attributes["otelprof.step"] < 150
        assert injected.span_id in links[starter.span_id]  # captured after the starter
    # the window's operator events are child spans of those steps
    kineto = [s for s in spans if s.attributes.get("otelprof.source") == "kineto"]
    window_traces = {w.trace_id for w in window}
    assert kineto and window_traces <= {s.trace_id for s in kineto}


def _requests(path: Path) -> list[list[dict]]:  # type: ignore[type-arg]
    from tests.otlp_files import read_lines

    return [
        ss["spans"]
        for request in read_lines(path)
        for rs in request["resourceSpans"]
        for ss in rs["scopeSpans"]
    ]


def test_steps_of_a_scheduled_kineto_window_are_kept_whatever_the_trace_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_sampling, "HEAD_BURST", 0.0)  # no head sample at all
    monkeypatch.setattr(_sampling, "TAIL_BURST", 0.0)
    prof = otelprof.instrument(  # Kineto's default window: steps 2-4
        output_dir=str(tmp_path), run_id="k", kineto=True, trace_budget=0,
        host_metrics=False, process_metrics=False,
    )  # fmt: skip
    x = torch.randn(16, 16)
    try:
        for _ in range(30):
            with otelprof.timing("train_batch"):
                (x @ x).relu()
            otelprof.step()
    finally:
        prof.shutdown()
    spans = read_spans(prof.files["traces"])
    kineto = [s for s in spans if s.attributes.get("otelprof.source") == "kineto"]
    steps = {s.trace_id: s for s in spans if s.name == "step"}
    assert kineto
    # no orphan: every operator span's step was written
    assert {s.trace_id for s in kineto} <= set(steps)
    assert {steps[s.trace_id].attributes["otelprof.step"] for s in kineto} == {2, 3, 4}
    assert prof.stats()["timings.spans_sampled_out"] > 0
