"""A Determined trial links to its Grafana view: a line in its experiment's notes.

The master is the contract server, which enforces GetExperiment / PatchExperiment as the
reference's §0.1 records them (a PATCH replaces the whole notes), failures included. The
link is written by the training process of global rank 0 on its own thread: the request the
master receives is checked, and the URL in it decoded (the training dashboard with the job's
service, run, trial and the Determined URL set).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

import otelprof
from otelprof.config import ConfigError, Settings
from otelprof.determined.client import Credentials, DeterminedClient
from otelprof.determined.links import (
    TRAINING_DASHBOARD_UID,
    TrialLink,
    dashboard_url,
    has_link,
    notes_with_link,
)
from tests.determined_contract import DeterminedContractServer, set_trial_env
from tests.services import REPO, wait_for

GRAFANA = "https://grafana.example.com/g"
LINK = "- [otelprof: trial 42 in Grafana]("


@pytest.fixture
def master() -> Iterator[DeterminedContractServer]:
    server = DeterminedContractServer().start()
    server.token = server.add_user("alice")  # type: ignore[attr-defined]
    server.add_trial(42, run_id=1, experiment_id=7)
    server.set_experiment_notes(7, "Baseline with lr 0.1; compare with exp 6.\n")
    yield server
    server.stop()


def _api(master: DeterminedContractServer, method: str, path: str, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {master.token}"}  # type: ignore[attr-defined]
    return httpx.request(method, f"{master.url}{path}", headers=headers, timeout=10, **kw)


def _decoded(url: str) -> tuple[str, dict[str, list[str]]]:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}", parse_qs(parts.query)


def _link_url(notes: str) -> str:
    (line,) = [line for line in notes.splitlines() if line.startswith(LINK)]
    assert line.endswith(")")
    return line[len(LINK) : -1]


# -- the contract: GetExperiment / PatchExperiment as the real master answers -------------------


def test_patch_replaces_the_whole_notes_and_get_returns_them(
    master: DeterminedContractServer,
) -> None:
    for notes in ("user's own notes", "otelprof link"):
        answer = _api(master, "PATCH", "/api/v1/experiments/7", json={"notes": notes})
        assert answer.status_code == 200 and answer.json()["experiment"]["notes"] == notes
    got = _api(master, "GET", "/api/v1/experiments/7")
    assert got.status_code == 200 and got.json()["experiment"]["notes"] == "otelprof link"
    # unknown fields are ignored, the path's id wins, an absent field is left as it was
    answer = _api(master, "PATCH", "/api/v1/experiments/7", json={"id": 9, "color": "red"})
    assert answer.json()["experiment"] == got.json()["experiment"]


@pytest.mark.parametrize(
    ("method", "path", "body", "auth", "status", "code", "message"),
    [
        ("GET", "/api/v1/experiments/99", None, True, 404, 5, "experiment not found: 99"),
        ("PATCH", "/api/v1/experiments/99", {"notes": "x"}, True, 404, 5, "not found: 99"),
        ("PATCH", "/api/v1/experiments/7", {"notes": "x"}, False, 401, 16, "unauthenticated"),
        ("GET", "/api/v1/experiments/7", None, False, 401, 16, "unauthenticated"),
        ("PATCH", "/api/v1/experiments/x", {"notes": "x"}, True, 400, 3, "type mismatch"),
        ("PATCH", "/api/v1/experiments/7", {"notes": 5}, True, 400, 3, "invalid value"),
        ("PATCH", "/api/v1/experiments/7", {"name": " "}, True, 400, 3, "`name` must not be"),
        ("PATCH", "/api/v1/experiments/7", [1], True, 400, 3, "expected a JSON object"),
    ],
)
def test_the_master_refuses_what_the_real_one_refuses(
    master: DeterminedContractServer,
    method: str,
    path: str,
    body: Any,
    auth: bool,
    status: int,
    code: int,
    message: str,
) -> None:
    headers = {"Authorization": f"Bearer {master.token}"} if auth else {}  # type: ignore[attr-defined]
    answer = httpx.request(method, f"{master.url}{path}", json=body, headers=headers, timeout=10)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["code"] == code and message in error["error"], error
    assert master.experiment_notes(7) == "Baseline with lr 0.1; compare with exp 6.\n"


def test_a_database_outage_is_a_500_and_changes_nothing(master: DeterminedContractServer) -> None:
    with master.database_down():
        answer = _api(master, "PATCH", "/api/v1/experiments/7", json={"notes": "x"})
    assert answer.status_code == 500 and "terminating connection" in answer.json()["error"]["error"]
    assert master.experiment_notes(7).startswith("Baseline")


# -- the link ------------------------------------------------------------------------------------


def test_the_url_opens_the_training_dashboard_with_the_jobs_variables() -> None:
    url = dashboard_url(
        GRAFANA,
        service="resnet & co",
        run_id="run/7",
        trial_id=42,
        determined_url="http://det:8080",
        since_ms=1_760_000_000_000,
    )
    base, query = _decoded(url)
    assert base == f"{GRAFANA}/d/otelprof-training"
    assert query == {
        "var-service": ["resnet & co"],
        "var-run": ["run/7"],
        "var-trial": ["42"],
        "var-determined": ["http://det:8080"],
        "from": ["1760000000000"],
        "to": ["now"],
    }
    assert " " not in url and "(" not in url and ")" not in url  # a Markdown link's target
    dashboard = json.loads((REPO / "dashboards" / "otelprof-training.json").read_text())
    assert dashboard["uid"] == TRAINING_DASHBOARD_UID
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"service", "run", "trial", "determined"} <= variables


def test_notes_keep_the_users_text_and_other_trials_links_and_one_line_per_trial() -> None:
    user = "Baseline.\n\n* compare with exp 6\n"
    first = notes_with_link(user, 42, "https://g/a?var-run=r1&x")
    assert (
        first
        == "Baseline.\n\n* compare with exp 6\n\n- [otelprof: trial 42 in Grafana](https://g/a?var-run=r1&x)\n"
    )
    both = notes_with_link(first, 43, "https://g/b?var-run=r1&x")
    assert both.endswith(
        "(https://g/a?var-run=r1&x)\n- [otelprof: trial 43 in Grafana](https://g/b?var-run=r1&x)\n"
    )
    restarted = notes_with_link(both, 42, "https://g/c?var-run=r2&x")  # a new run's link
    assert restarted == both.replace("https://g/a?var-run=r1&x", "https://g/c?var-run=r2&x")
    assert notes_with_link(restarted, 42, "https://g/c?var-run=r2&x") == restarted
    assert has_link(restarted, 42, "r2") and not has_link(restarted, 42, "r1")
    assert has_link(restarted, 43, "r1") and not has_link(restarted, 44, "r1")


def test_grafana_url_is_an_option_validated_before_anything_starts(tmp_path: Path) -> None:
    env = {"OTELPROF_GRAFANA_URL": "https://grafana.example.com/"}
    assert Settings.from_options(env=env, output_dir=tmp_path).grafana_url == (
        "https://grafana.example.com"
    )
    for value, why in (
        ("grafana:3000", "expected an http:// or https:// URL"),
        ("https://admin:pw@grafana", "user info"),
        ("https://grafana/?orgId=2", "query or fragment"),
    ):
        with pytest.raises(
            ConfigError, match=f"^environment variable OTELPROF_GRAFANA_URL: .*{why}"
        ):
            Settings.from_options(env={"OTELPROF_GRAFANA_URL": value}, output_dir=tmp_path)
        with pytest.raises(ConfigError, match=f"^option 'grafana_url': .*{why}"):
            Settings.from_options(env={}, grafana_url=value, output_dir=tmp_path)


def _run(
    tmp_path: Path, *, run_id: str = "job-1", wait: bool = True, **options: Any
) -> dict[str, int]:
    prof = otelprof.instrument(
        grafana_url=GRAFANA,
        service_name="resnet",
        run_id=run_id,
        output_dir=str(tmp_path),
        interval=0.2,
        **options,
    )
    try:
        for _ in range(3):
            with otelprof.timing("train_batch"):
                pass
            otelprof.step()
        if wait:
            wait_for(
                lambda: (
                    prof.stats()["determined.grafana_link_set"]
                    or prof.stats()["determined.grafana_link_errors"]
                ),
                timeout_s=30,
                what="the trial's link to be written",
            )
    finally:
        prof.shutdown()
    return prof.stats()


@pytest.mark.parametrize("determined", [True, False], ids=["in-process", "through-a-bridge"])
def test_rank_zero_links_its_trial_once_whichever_path_carries_the_data(
    master: DeterminedContractServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    determined: bool,
) -> None:
    set_trial_env(monkeypatch, master, DET_EXPERIMENT_ID="7")
    stats = _run(tmp_path, determined=determined)
    assert stats["determined.grafana_link_set"] == 1
    assert stats["determined.grafana_link_errors"] == 0
    assert stats["dropped_total"] == 0
    # what the master received: one PATCH of the whole notes, the user's text kept
    (patch,) = master.patches()
    assert patch.experiment_id == 7 and patch.auth_header == "Authorization"
    assert set(patch.body) == {"notes"}
    notes = patch.body["notes"]
    assert notes.startswith("Baseline with lr 0.1; compare with exp 6.\n\n" + LINK)
    assert master.experiment_notes(7) == notes
    base, query = _decoded(_link_url(notes))
    assert base == f"{GRAFANA}/d/otelprof-training"
    assert query["var-service"] == ["resnet"] and query["var-run"] == ["job-1"]
    assert query["var-trial"] == ["42"] and query["var-determined"] == [master.url]
    assert query["to"] == ["now"] and abs(int(query["from"][0]) / 1000 - time.time()) < 120

    # the same job again (another process of it, a second session): nothing is written
    _run(tmp_path / "again", determined=determined)
    assert len(master.patches()) == 1
    # the trial restarts as a new job: its line is replaced, still one per trial
    stats = _run(tmp_path / "restart", run_id="job-2", determined=determined)
    assert stats["determined.grafana_link_set"] == 1 and len(master.patches()) == 2
    notes = master.experiment_notes(7)
    assert _decoded(_link_url(notes))[1]["var-run"] == ["job-2"]


def test_other_ranks_and_processes_outside_a_trial_write_nothing(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    set_trial_env(monkeypatch, master, DET_EXPERIMENT_ID="7", RANK="1", WORLD_SIZE="2")
    stats = _run(tmp_path, wait=False)
    assert "determined.grafana_link_set" not in stats
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("DET_TRIAL_ID")
    stats = _run(tmp_path / "no-trial", wait=False)
    assert "determined.grafana_link_set" not in stats
    assert master.patches() == [] and master.refusals() == []


def test_no_master_or_credentials_is_counted_and_logged_never_raised(
    master: DeterminedContractServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    set_trial_env(monkeypatch, master, DET_EXPERIMENT_ID="7")
    monkeypatch.delenv("DET_MASTER")
    with caplog.at_level("WARNING", logger="otelprof.determined"):
        stats = _run(tmp_path, wait=False)
    assert stats["determined.grafana_link_errors"] == 1 and stats["dropped_total"] == 0
    assert "not linking trial 42 to Grafana: no master or credentials" in caplog.text


def _link(master: DeterminedContractServer, trial: int, run: str, **kw: Any) -> TrialLink:
    client = DeterminedClient(master.url, Credentials(user_token=master.token))  # type: ignore[attr-defined]
    url = dashboard_url(
        GRAFANA, service="s", run_id=run, trial_id=trial, determined_url=master.url, since_ms=0
    )
    kw.setdefault("recheck_s", ())
    return TrialLink(client, trial, run, url, retry_initial_s=0.01, **kw)


def test_transient_failures_are_retried_and_counted(master: DeterminedContractServer) -> None:
    master.fail_next(2, status=503)
    link = _link(master, 42, "job-1", experiment_id=7).start()
    assert link.done.wait(30)
    assert link.stats() == {"determined.grafana_link_set": 1, "determined.grafana_link_errors": 2}
    assert has_link(master.experiment_notes(7), 42, "job-1")
    master.fail_next(0)
    with master.database_down():  # the master's own 500 for an outage: retried too
        link = _link(master, 42, "job-2", experiment_id=7, attempts=2).start()
        assert link.done.wait(30)
    assert link.stats()["determined.grafana_link_errors"] == 2 and not link.linked
    assert has_link(master.experiment_notes(7), 42, "job-1")


def test_a_refusal_is_given_up_at_once_and_logged_with_the_masters_message(
    master: DeterminedContractServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="otelprof.determined"):
        link = _link(master, 42, "job-1", experiment_id=99).start()
        assert link.done.wait(30)
        unknown_trial = _link(master, 77, "job-1").start()  # experiment asked of the master
        assert unknown_trial.done.wait(30)
    assert link.stats() == {"determined.grafana_link_set": 0, "determined.grafana_link_errors": 1}
    assert "the master refused (HTTP 404 experiment not found: 99)" in caplog.text
    assert unknown_trial.stats()["determined.grafana_link_errors"] == 1
    assert "trial 77 not found" in caplog.text
    assert master.patches() == []


def test_the_trials_experiment_is_asked_of_the_master_when_the_environment_lacks_it(
    master: DeterminedContractServer,
) -> None:
    link = _link(master, 42, "job-1").start()
    assert link.done.wait(30) and link.linked and link.experiment_id == 7


def test_concurrent_trials_of_one_experiment_each_keep_their_line(
    master: DeterminedContractServer,
) -> None:
    """Read-merge-write races: a PATCH of one trial can overwrite another's line (the
    master has no compare-and-swap); each reads its write back, looks again a few times
    after, and writes again whenever its own line is gone."""
    for trial in range(43, 51):
        master.add_trial(trial, experiment_id=7)
    links = [
        _link(master, trial, "job-1", experiment_id=7, recheck_s=(0.2, 0.5, 1.0))
        for trial in range(42, 51)
    ]
    barrier = threading.Barrier(len(links))
    threads = [
        threading.Thread(target=lambda link=link: (barrier.wait(), link._run())) for link in links
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    notes = master.experiment_notes(7)
    assert all(link.linked for link in links), [link.stats() for link in links]
    for trial in range(42, 51):
        assert has_link(notes, trial, "job-1"), notes
    assert notes.startswith("Baseline with lr 0.1")


def test_an_unreachable_master_never_holds_up_training_or_shutdown(
    master: DeterminedContractServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    set_trial_env(monkeypatch, master, DET_EXPERIMENT_ID="7")
    with master.down():
        started = time.monotonic()
        stats = _run(tmp_path, wait=False)
        took = time.monotonic() - started
    assert took < 10, took
    assert stats["determined.grafana_link_set"] == 0
    assert master.patches() == []
