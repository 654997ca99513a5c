"""A damaged spool never stops the bridge; spool files are private to their owner."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from otelprof.determined.aggregate import Report, build_body
from otelprof.determined.client import Credentials, DeterminedClient
from otelprof.determined.mapping import GaugeSample, TimingSample
from otelprof.determined.pipeline import Pipeline
from otelprof.determined.spool import DiskSpool
from tests.determined_contract import DeterminedContractServer

T0 = 1_760_000_000_000_000_000


def _report(i: int) -> Report:
    body = build_body(42, 1, "cpu", {"a": {"cpu_util_simple": float(i)}}, T0 + i * 10**9)
    return Report(42, 1, "cpu", body)


def _good(spool_dir: Path) -> None:
    """Two pending batches, a state and an open window's journal, as a killed bridge leaves."""
    spool = DiskSpool(spool_dir, fsync=False)
    spool.recover()
    spool.commit_window(0, [_report(0), _report(1)], {(42, 1): 5})
    spool.commit_window(1, [_report(2)], {(42, 1): 5})
    spool.journal(2, [GaugeSample(42, 1, "a", "cpu", "", "cpu_util_simple", 3.0, T0)], [])


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(data)


def _mkdir(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).mkdir()


def _report_json(**change: object) -> bytes:
    raw = _report(9).to_json()
    raw.update(change)
    return json.dumps([raw]).encode()


DAMAGE: dict[str, Callable[[Path], None]] = {
    "state not json": _write("state.json", b"{not json"),
    "state a list": _write("state.json", b"[1, 2]"),
    "state window a string": _write("state.json", b'{"flushed_window": "x"}'),
    "state steps not triples": _write("state.json", b'{"flushed_window": 1, "last_steps": [[1]]}'),
    "state a directory": lambda d: ((d / "state.json").unlink(), (d / "state.json").mkdir()),
    "batch cut short": _write("batch-000000000005.json", b'[{"trial_id": 42, "ru'),
    "batch an object": _write("batch-000000000005.json", b'{"trial_id": 42}'),
    "batch entry not an object": _write("batch-000000000005.json", b"[1]"),
    "batch entry without body": _write(
        "batch-000000000005.json", b'[{"trial_id": 42, "run_id": 1, "group": "cpu"}]'
    ),
    "batch entry with a string trial id": _write(
        "batch-000000000005.json", _report_json(trial_id="x")
    ),
    "batch entry with a string step count": _write(
        "batch-000000000005.json",
        _report_json(
            body={"group": "t", "metrics": {"stepsCompleted": "x", "metrics": {"avgMetrics": {}}}}
        ),
    ),
    "batch a directory": _mkdir("batch-000000000005.json"),
    "batch with a bad window name": _write("batch-xyz.json", _report_json()),
    "ack a directory": _mkdir("batch-000000000000.ack"),
    "ack of garbage": _write("batch-000000000000.ack", b"zz\n\x00\xff\n"),
    "journal a directory": _mkdir("journal-000000000007.jsonl"),
    "journal with a bad window name": _write("journal-abc.jsonl", b"{}\n"),
    "journal lines of the wrong shape": _write(
        "journal-000000000002.jsonl",
        b'[1]\n{"g": [[1, 2]]}\n{"g": [["x", 1, "a", "cpu", "", "k", 1.0, 1]]}\n{"t": 5}\n',
    ),
    "refused store a directory": _mkdir("refused.jsonl"),
    "temporary file a directory": _mkdir(".batch-000000000009.json.tmp"),
    "empty batch file": _write("batch-000000000006.json", b""),
}


@pytest.fixture
def master() -> Iterator[DeterminedContractServer]:
    server = DeterminedContractServer().start()
    server.token = server.add_user("alice")  # type: ignore[attr-defined]
    server.add_trial(42, run_id=1)
    yield server
    server.stop()


@pytest.mark.parametrize("shape", sorted(DAMAGE))
def test_a_damaged_spool_is_set_aside_and_the_rest_delivered(
    shape: str, master: DeterminedContractServer, tmp_path: Path
) -> None:
    spool_dir = tmp_path / "spool"
    _good(spool_dir)
    DAMAGE[shape](spool_dir)
    client = DeterminedClient(master.url, Credentials(user_token=master.token))  # type: ignore[attr-defined]
    pipeline = Pipeline(client, DiskSpool(spool_dir, fsync=False), window_s=3600,
                        retry_initial_s=0.05)  # fmt: skip
    pipeline.start()  # must not raise, whatever the damage
    try:
        pipeline.flush()
        assert pipeline.wait_delivered(10), pipeline.stats()
        stats = pipeline.stats()
        # The three reports of the intact batches reach the master (plus the replayed window).
        delivered = {r.metrics["a"]["cpu_util_simple"] for r in master.profiling_rows(42, "cpu")}
        assert {0.0, 1.0, 2.0} <= delivered
        assert stats["spool_damaged_files"] + stats["spool_damaged_lines"] >= 1, stats
    finally:
        pipeline.shutdown(2)
    aside = spool_dir / "damaged"
    if stats["spool_damaged_files"]:
        assert aside.is_dir() and len(list(aside.iterdir())) == stats["spool_damaged_files"]
        assert stat.S_IMODE(aside.stat().st_mode) == 0o700


def test_every_damaged_shape_of_the_last_round_is_covered() -> None:
    assert len(DAMAGE) >= 13


def _modes(directory: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [directory, *directory.iterdir()]}


@pytest.mark.parametrize(("shared", "dir_mode", "file_mode"), [(False, 0o700, 0o600),
                                                              (True, 0o750, 0o640)])  # fmt: skip
def test_spool_files_are_readable_by_their_owner_only_unless_shared(
    tmp_path: Path, shared: bool, dir_mode: int, file_mode: int
) -> None:
    old = os.umask(0o022)  # the usual umask: 0755 directories, 0644 files
    try:
        spool = DiskSpool(tmp_path / "spool", fsync=False, shared=shared)
        spool.recover()
        spool.journal(0, [], [TimingSample(42, 1, "x", 1.0, 1, 0, T0)])
        spool.commit_window(0, [_report(0), _report(1)], {})
        spool.journal(1, [], [TimingSample(42, 1, "x", 1.0, 1, 0, T0)])
        spool.mark_inflight(0, 0)
        spool.refuse(0, 0, _report(0), 500, "invalid run id")
        modes = _modes(tmp_path / "spool")
        spool.close()
    finally:
        os.umask(old)
    assert set(modes) == {"spool", "batch-000000000000.json", "batch-000000000000.ack",
                          "state.json", "refused.jsonl", "journal-000000000001.jsonl"}  # fmt: skip
    assert modes.pop("spool") == dir_mode
    assert set(modes.values()) == {file_mode}, modes


def test_an_existing_spool_directory_open_to_others_is_tightened(tmp_path: Path) -> None:
    (tmp_path / "spool").mkdir(mode=0o755)
    os.chmod(tmp_path / "spool", 0o755)
    DiskSpool(tmp_path / "spool")
    assert stat.S_IMODE((tmp_path / "spool").stat().st_mode) == 0o700


@pytest.mark.parametrize(("shared", "mode"), [(False, 0o700), (True, 0o750)])
def test_the_run_directory_and_its_files_are_owner_only_unless_shared(
    tmp_path: Path, shared: bool, mode: int
) -> None:
    import otelprof

    old = os.umask(0o022)
    try:  # the run directory is made when the run starts (validating settings makes nothing)
        prof = otelprof.instrument(
            output_dir=str(tmp_path),
            run_id="r1",
            shared_run_dir=shared,
            host_metrics=False,
            process_metrics=False,
            gpus="none",
        )
    finally:
        os.umask(old)
    try:
        assert prof.run_dir is not None
        assert stat.S_IMODE(prof.run_dir.stat().st_mode) == mode
        with otelprof.timing("train_batch"):
            pass
        otelprof.step()
    finally:
        prof.shutdown()
    # every file the run left (run.json rewritten at the end included) is as private
    files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in prof.run_dir.iterdir()}
    assert {"run.json", "metrics.jsonl", "traces.jsonl"} <= set(files), files
    assert set(files.values()) == {mode & 0o666}, files


def test_a_master_token_file_others_can_read_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from otelprof.determined.client import _read_secret_file

    path = tmp_path / "token"
    path.write_text("secret-token\n")
    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="otelprof.determined"):
        assert _read_secret_file(str(path), "token") == "secret-token"
    assert "readable by other users" in caplog.text and "chmod 600" in caplog.text
    assert "secret-token" not in caplog.text
