"""Right numbers under the right titles in Determined's Web UI: one producer per key, no
key the Metrics tab renames, timings from global rank 0 only, steps no faster than possible."""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import otelprof
from otelprof._schema import TIMING_OVERFLOW
from otelprof._timings._names import RESERVED
from otelprof.determined.aggregate import WindowAggregator
from otelprof.determined.client import Credentials, DeterminedClient
from otelprof.determined.mapping import (
    _KNOWN_RANGES,
    GAUGE_RULES,
    TIMINGS_GROUP,
    Route,
    TimingSample,
    extract_spans,
    phase_timing_name,
)
from otelprof.determined.pipeline import Pipeline
from otelprof.determined.server import BridgeServer
from otelprof.determined.spool import MemorySpool
from tests.determined_contract import DeterminedContractServer, set_trial_env, trial_metrics
from tests.determined_feed import (
    OTLP_HEADERS_ENV,
    OtlpClient,
    bridge_tokens,
    seed_metrics_request,
    timing_spans_request,
    trial_resource,
)

PREFIX_WORDS = ("t", "train", "training", "v", "val", "validation")
# Determined 0.38.1's Metrics tab (TrialDetailsMetrics.tsx) strips these from each key, in
# this order, and uses the rest as the chart's title and as the key grouping charts across
# groups.
WEBUI_STRIPPED = (re.compile(r"^(t_|train_|training_)"), re.compile(r"^(v_|val_|validation_)"))
# Every range name otelprof itself records or bridges, and names people give ranges.
RANGE_NAMES = sorted(
    RESERVED
    | {TIMING_OVERFLOW, "forward", "backward", "optimizer_zero_grad", "checkpoint",
       "save_checkpoint", "validation", "test", "predict", "train", "## forward ##",
       "## backward ##", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
       "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__",
       "Optimizer.step#AdamW.step", "Optimizer.zero_grad#SGD.zero_grad", "MyBlock.forward",
       "TrainStep", "ValLoss", "t", "v", "t_step", "v_loss", "train_val", "val_train",
       "training_validation_loop", "t_v_t", "validation_", "_train", "T Step", "VAL"}
    | {f"{a}_{b}" for a, b in itertools.product(PREFIX_WORDS, PREFIX_WORDS)}
    | {f"{p}_step" for p in PREFIX_WORDS}
)  # fmt: skip
PHASES = (None, "train", "validation", "test", "predict", "checkpoint", *PREFIX_WORDS)


def webui_title(key: str) -> str:
    """The chart title Determined 0.38.1's Metrics tab gives a key (both strips, in order)."""
    for pattern in WEBUI_STRIPPED:
        key = pattern.sub("", key, count=1)
    return key


def _emitted_keys() -> set[str]:
    """Every key otelprof can put into Determined's timings group (Metrics tab)."""
    keys = set()
    for name, phase in itertools.product(RANGE_NAMES, PHASES):
        stem = phase_timing_name(name, phase)
        keys |= {f"{stem}_s", f"{stem}_count"}
    keys |= {r.key for r in GAUGE_RULES.values() if r.group == TIMINGS_GROUP and r.key}
    return keys


def test_no_key_otelprof_emits_is_renamed_or_merged_by_the_web_ui() -> None:
    keys = _emitted_keys()
    assert len(keys) > 1000
    for key in keys:
        # Determined 0.38.1's six prefix rules, in its order: the title is the whole key,
        # so no title is bare ("s", "count") and no two keys share a chart.
        assert webui_title(key) == key, key
        assert key.split("_")[0] not in PREFIX_WORDS, key
    titles = [webui_title(k) for k in keys]
    assert len(set(titles)) == len(keys)


def test_the_title_rule_is_determineds() -> None:
    assert webui_title("validation_s") == "s"
    assert webui_title("t_step_s") == "step_s"
    assert webui_title("train_val_loss") == "loss"
    assert webui_title("training_validation_x") == "x"
    assert webui_title("val_train_x") == "train_x"  # one pass of each rule, in order


def test_each_known_range_maps_to_its_own_key() -> None:
    shorts = [short for _, short in _KNOWN_RANGES]
    assert "dataloader_next" not in shorts  # otelprof's own range; torch's has its own key


@pytest.fixture
def master() -> Iterator[DeterminedContractServer]:
    server = DeterminedContractServer().start()
    server.token = server.add_user("alice")  # type: ignore[attr-defined]
    server.add_trial(42, run_id=1, experiment_id=7)
    yield server
    server.stop()


def _rows(master: DeterminedContractServer) -> list[dict[str, Any]]:
    return trial_metrics(master.url, master.token, 42, "timings")  # type: ignore[attr-defined]


def _counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        for key, value in (row["metrics"]["batch_metrics"] or [{}])[0].items():
            counts[key] = counts.get(key, 0) + value
    return counts


def test_torchs_dataloader_range_inside_timed_dataloader_is_not_added_into_it(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    set_trial_env(monkeypatch, master)
    loader = DataLoader(TensorDataset(torch.zeros(12, 2)), batch_size=2)
    with otelprof.instrument(determined=True, detached=False, interval=0.2):
        for _batch in otelprof.timed_dataloader(loader):
            otelprof.step()
        time.sleep(0.5)
    counts = _counts(_rows(master))
    assert counts["dataloader_next_count"] == 6  # one per batch, not two
    assert counts.get("torch_dataloader_next_count", 0) in (0, 6)


def test_the_bridge_builds_timings_from_global_rank_0_only(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two producers of one trial: rank 0 posts itself, rank 1 (another node) goes through
    the bridge. One timing series lands (rank 0's), and rank 1's node still gets its
    system metrics."""
    client = DeterminedClient(master.url, Credentials(user_token=master.token))  # type: ignore[attr-defined]
    pipeline = Pipeline(client, MemorySpool(), window_s=0.3, skip_direct=True)
    bridge = BridgeServer(pipeline, "127.0.0.1:0", tokens=bridge_tokens())
    bridge.start()
    try:
        set_trial_env(monkeypatch, master)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", OTLP_HEADERS_ENV)
        rank1 = OtlpClient(bridge.port)
        node2 = trial_resource(42, agent="agent-2", **{"otelprof.rank": 1})
        with otelprof.instrument(determined=True, detached=False, interval=0.2):
            for step in range(20):
                with otelprof.timing("forward"):
                    time.sleep(0.002)
                otelprof.step()
                rank1.send_traces(timing_spans_request(node2, [step * 3, step * 3 + 1]))
            rank1.send_metrics(seed_metrics_request(node2))
            time.sleep(0.5)
        rank1.close()
        pipeline.flush()
        assert pipeline.wait_delivered(10)
    finally:
        bridge.stop(grace_s=0.5, drain_timeout_s=2.0)
    rows = _rows(master)
    steps = [r["totalBatches"] for r in rows]
    assert steps == sorted(set(steps)) and steps[-1] == 20  # one series, rank 0's steps
    assert _counts(rows)["forward_count"] == 20
    assert master.refusals() == []
    assert {p.trial_id for p in master.posts() if p.group == "cpu"} == {42}
    assert master.profiling_rows(42, "cpu")


def test_spans_of_other_ranks_are_not_timings() -> None:
    resource = trial_resource(42, **{"otelprof.rank": 1})
    out = extract_spans(timing_spans_request(resource, range(5)), Route())
    assert out.timings == [] and out.ignored > 0


def test_steps_completed_never_grow_faster_than_training_can(tmp_path: Path) -> None:
    agg = WindowAggregator(max_steps_per_s=100.0, window_s=1.0)
    t = time.time_ns()
    agg.add_timings([TimingSample(42, 1, "forward", 1.0, 10, 2_000_000_010, t)])
    reports = agg.drain()
    steps = reports[0].body["metrics"]["stepsCompleted"]
    assert 1 <= steps <= 1 + 100 * 2  # a window's worth at the limit, not two billion
    assert agg.stats.steps_clamped == 1
    agg.add_timings([TimingSample(42, 1, "forward", 1.0, 10, 2_000_000_020, t)])
    later = agg.drain()[0].body["metrics"]["stepsCompleted"]
    assert steps < later <= steps + 1 + 100 * 2  # still at most the limit per second
    assert agg.stats.steps_clamped == 2
