"""instrument()/shutdown(): lifecycle, the three export modes, and failures kept from training."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import otelprof
from otelprof import _profiler
from tests.otlp_files import read_points, read_spans
from tests.otlp_sink import OtlpSink


@pytest.fixture(autouse=True)
def _no_profiler_left_running() -> Iterator[None]:
    yield
    otelprof.uninstrument()


@pytest.fixture
def sink() -> Iterator[OtlpSink]:
    server = OtlpSink().start()
    yield server
    server.stop()


def small_loop(steps: int = 5, sleep_s: float = 0.01) -> None:
    for _ in range(steps):
        with otelprof.timing("dataloader_next"):
            time.sleep(sleep_s)
        with otelprof.timing("train_batch"):
            time.sleep(sleep_s)
        otelprof.step()


def test_second_instrument_call_returns_the_running_profiler(tmp_path: Path) -> None:
    first = otelprof.instrument(output_dir=tmp_path)
    assert otelprof.instrument().run_dir == first.run_dir  # a handle on the same profiler
    assert _profiler.active_profiler() is first
    first.shutdown()
    assert _profiler.active_profiler() is None
    second = otelprof.instrument(output_dir=tmp_path)
    assert second is not first


def test_each_profilers_step_steps_its_own_running_session_and_nothing_once_it_is_down(
    tmp_path: Path,
) -> None:
    """`Profiler.step()` is deprecated (use `otelprof.step()`) but keeps its meaning for a
    release: it steps its own profiler's session and nothing else."""
    first = otelprof.instrument(output_dir=tmp_path / "first")
    engine = first._timings
    with pytest.warns(DeprecationWarning, match=r"otelprof\.step\(\)"):
        first.step()
        otelprof.instrument().step()  # a handle on the running profiler steps the same engine
    assert engine.step_number == 2
    first.shutdown()
    with pytest.warns(DeprecationWarning):
        first.step()  # harmless once it is down
    second = otelprof.instrument(output_dir=tmp_path / "second")
    with pytest.warns(DeprecationWarning):
        first.step()  # the old profiler never steps the new one
    assert second._timings.step_number == 0
    with pytest.warns(DeprecationWarning):
        second.step()
    assert second._timings.step_number == 1
    second.shutdown()


def test_context_manager_shuts_down_once_and_shutdown_is_idempotent(tmp_path: Path) -> None:
    with otelprof.instrument(output_dir=tmp_path, interval=0.2) as prof:
        small_loop(2)
    assert _profiler.active_profiler() is None
    prof.shutdown()  # a second call is harmless
    info = json.loads((prof.settings.run_dir / "run.json").read_text())
    assert info["run_id"] == prof.settings.run_id
    assert info["stats"]["dropped_total"] == 0


def test_bad_configuration_raises_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(otelprof.ConfigError, match="interval"):
        otelprof.instrument(output_dir=tmp_path, interval=0)
    assert _profiler.active_profiler() is None


def test_an_output_dir_no_run_can_be_made_in_is_a_config_error_naming_it_and_why() -> None:
    # /proc takes no new directory, even from root: mkdir fails where the check cannot tell
    with pytest.raises(
        otelprof.ConfigError,
        match=r"output directory '/proc/otelprof-nope': cannot make the run directory "
        r"'/proc/otelprof-nope/r1' \(No such file or directory\)",
    ):
        otelprof.instrument(output_dir="/proc/otelprof-nope", run_id="r1")
    assert _profiler.active_profiler() is None


def test_detached_mode_writes_metrics_and_spans_as_otlp_json_lines(tmp_path: Path) -> None:
    with otelprof.instrument(output_dir=tmp_path, interval=0.2, service_name="unit") as prof:
        small_loop(5)
        time.sleep(0.5)
    assert prof.run_dir is not None and prof.run_dir.parent == tmp_path
    points = read_points(prof.files["metrics"])
    names = {p.name for p in points}
    assert {"system.cpu.utilization", "system.memory.linux.available"} <= names
    assert all(p.resource["service.name"] == "unit" for p in points)
    spans = read_spans(prof.files["traces"])
    assert sum(s.name == "train_batch" for s in spans) == 5
    assert sum(s.name == "dataloader_next" for s in spans) == 5
    stats = prof.stats()
    assert stats["files.spans_exported"] == len(spans)
    assert stats["dropped_total"] == 0


def test_attached_mode_sends_metrics_and_spans_to_a_real_otlp_grpc_server(
    tmp_path: Path, sink: OtlpSink
) -> None:
    with otelprof.instrument(endpoint=sink.endpoint, interval=0.2, output_dir=tmp_path) as prof:
        assert prof.run_dir is None  # attached only: no files
        small_loop(4)
        assert sink.wait_for(lambda: "system.cpu.utilization" in sink.metric_names())
    assert not any(tmp_path.iterdir())
    assert {"system.cpu.utilization", "system.memory.linux.available"} <= sink.metric_names()
    names = [span.name for span in sink.spans()]
    assert names.count("train_batch") == 4
    resource = sink.resources()[0]
    assert resource["service.name"] == "otelprof"
    assert resource["otelprof.rank"] == 0
    assert "host.name" in resource
    assert prof.stats()["otlp.spans_exported"] == len(names)


def test_collector_failures_are_counted_and_never_reach_training(
    tmp_path: Path, sink: OtlpSink
) -> None:
    sink.refuse = True
    prof = otelprof.instrument(
        endpoint=sink.endpoint, interval=0.2, export_timeout=0.5, output_dir=tmp_path
    )
    small_loop(6)  # must not raise although every export fails
    time.sleep(0.6)
    prof.shutdown()
    stats = prof.stats()
    assert stats["otlp.spans_failed"] >= 6
    assert stats["otlp.metric_points_failed"] > 0
    assert stats["dropped_total"] >= stats["otlp.spans_failed"]


def test_unreachable_collector_at_startup_does_not_block_or_raise(tmp_path: Path) -> None:
    prof = otelprof.instrument(
        endpoint="http://127.0.0.1:9", interval=0.2, export_timeout=0.5, output_dir=tmp_path
    )
    started = time.perf_counter()  # the loop only: instrument() may start slowly when busy
    small_loop(3)
    loop_s = time.perf_counter() - started
    before_shutdown = time.perf_counter()
    prof.shutdown()
    shutdown_s = time.perf_counter() - before_shutdown
    assert loop_s < 2.0  # 3 steps of ~20 ms: exports never ran on this thread
    assert prof.stats()["dropped_total"] > 0
    # flushing to a dead collector is bounded by one export timeout, not retries per batch
    assert shutdown_s < 0.5 + 2.0


def test_a_source_that_fails_to_start_is_left_out_and_the_rest_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import otelprof.system

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("sampler exploded")

    monkeypatch.setattr(otelprof.system, "register_system_metrics", broken)
    with otelprof.instrument(output_dir=tmp_path, interval=0.2) as prof:
        small_loop(2)
    assert "could not start system metrics" in caplog.text
    assert [s.name for s in read_spans(prof.files["traces"])].count("train_batch") == 2


RANK_SCRIPT = """
import otelprof, time
with otelprof.instrument(interval=0.2) as prof:
    for _ in range(3):
        with otelprof.timing("train_batch"):
            time.sleep(0.01)
        otelprof.step()
"""


def test_ranks_of_one_job_share_a_run_directory_with_a_file_each(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "OTELPROF_OUTPUT_DIR": str(tmp_path),
        "OTELPROF_RUN_ID": "job-1",
        "WORLD_SIZE": "2",
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in (0, 1)
    ]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0]  # neither waited on the other
    run_dir = tmp_path / "job-1"
    for rank in (0, 1):
        spans = read_spans(run_dir / f"traces.rank{rank}.jsonl")
        assert [s.name for s in spans].count("train_batch") == 3
        assert {s.resource["otelprof.rank"] for s in spans} == {rank}
        assert {s.resource["otelprof.world_size"] for s in spans} == {2}
        points = read_points(run_dir / f"metrics.rank{rank}.jsonl")
        host_metrics = {p.name for p in points} & {"system.cpu.utilization"}
        # host metrics come from local rank 0 only: one set per node
        assert host_metrics == ({"system.cpu.utilization"} if rank == 0 else set())
        assert (run_dir / f"run.rank{rank}.json").exists()
