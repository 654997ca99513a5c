"""Determined auth and transport: tokens, allocation tokens, login, HTTPS, settings."""

from __future__ import annotations

import argparse
import logging
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from otelprof.cli import main as otelprof_main
from otelprof.determined.aggregate import Report, build_body
from otelprof.determined.client import ConfigError, Credentials, DeterminedClient, Outcome
from otelprof.determined.pipeline import Pipeline
from otelprof.determined.settings import BridgeSettings
from otelprof.determined.spool import MemorySpool
from tests.determined_contract import DeterminedContractServer
from tests.determined_feed import write_token_file

T0 = 1_760_000_000_000_000_000


def _report(trial: int = 42, run: int = 1) -> Report:
    body = build_body(trial, run, "cpu", {"agent-1": {"cpu_util_simple": 12.5}}, T0)
    return Report(trial, run, "cpu", body)


@pytest.fixture
def master() -> Iterator[DeterminedContractServer]:
    server = DeterminedContractServer().start()
    server.add_trial(42, run_id=1, editors=("alice",))
    yield server
    server.stop()


def test_user_token_goes_in_the_authorization_header(master: DeterminedContractServer) -> None:
    token = master.add_user("alice")
    client = DeterminedClient(master.url, Credentials(user_token=token))
    assert client.report(_report()).outcome is Outcome.OK
    assert master.posts()[0].auth_header == "Authorization"


def test_allocation_token_goes_in_the_task_header(master: DeterminedContractServer) -> None:
    master.add_user("alice")
    token = master.add_allocation_token("alice")
    client = DeterminedClient(master.url, Credentials(allocation_token=token))
    assert client.report(_report()).outcome is Outcome.OK
    assert master.posts()[0].auth_header == "Grpc-Metadata-x-allocation-token"


def test_username_and_password_log_in_once(master: DeterminedContractServer) -> None:
    master.add_user("alice", "s3cret")
    client = DeterminedClient(master.url, Credentials(username="alice", password="s3cret"))
    for _ in range(3):
        assert client.report(_report()).outcome is Outcome.OK
    assert master.store.logins == 1


def test_rotated_token_file_is_reread_after_a_401(
    master: DeterminedContractServer, tmp_path: Path
) -> None:
    old = master.add_user("alice")
    token_file = tmp_path / "token"
    token_file.write_text(old + "\n")
    client = DeterminedClient(master.url, Credentials(user_token_file=str(token_file)))
    assert client.report(_report()).outcome is Outcome.OK
    del master.store.user_tokens[old]  # session expired on the master
    token_file.write_text(master.add_user("alice"))
    assert client.report(_report()).outcome is Outcome.OK
    assert len(master.posts()) == 2


def test_wrong_token_is_refused_clearly_and_never_logged(
    master: DeterminedContractServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "0123456789abcdef-not-a-valid-token"
    client = DeterminedClient(master.url, Credentials(user_token=secret))
    pipeline = Pipeline(client, MemorySpool(), window_s=3600, retry_initial_s=0.01)
    pipeline.start()
    try:
        for _ in range(3):
            pipeline.spool.commit_window(0, [_report()], {})
            pipeline.deliverer.wake()
            assert pipeline.wait_delivered(5)
    finally:
        pipeline.shutdown(1)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors  # logged once, not per report
    assert "HTTP 401" in errors[0] and "invalid credentials" in errors[0]
    assert pipeline.stats()["refused_by_master"] == 3
    assert all(secret not in r.getMessage() for r in caplog.records)


def test_wrong_password_is_refused_clearly_and_never_logged(
    master: DeterminedContractServer, caplog: pytest.LogCaptureFixture
) -> None:
    master.add_user("alice", "right-password")
    client = DeterminedClient(master.url, Credentials(username="alice", password="hunter2-wrong"))
    result = client.report(_report())
    assert result.outcome is Outcome.REJECTED
    assert "login as 'alice' refused" in result.message and "HTTP 401" in result.message
    assert "hunter2-wrong" not in result.message
    assert all("hunter2-wrong" not in r.getMessage() for r in caplog.records)


def test_unreachable_master_is_retryable_and_names_no_secret() -> None:
    client = DeterminedClient("http://127.0.0.1:9", Credentials(user_token="tok-secret-xyz"))
    result = client.report(_report())
    assert result.outcome is Outcome.RETRY
    assert "ConnectError" in result.message and "tok-secret-xyz" not in result.message


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(cert), str(key)


def test_https_master_is_verified_with_the_ca_bundle(certificate: tuple[str, str]) -> None:
    with DeterminedContractServer(tls=certificate) as master:
        master.add_trial(42, run_id=1, editors=("alice",))
        token = master.add_user("alice")
        assert master.url.startswith("https://")
        trusted = DeterminedClient(
            master.url, Credentials(user_token=token), ca_bundle=certificate[0]
        )
        assert trusted.report(_report()).outcome is Outcome.OK
        untrusted = DeterminedClient(master.url, Credentials(user_token=token))
        result = untrusted.report(_report())
        assert result.outcome is Outcome.RETRY
        assert "CERTIFICATE_VERIFY_FAILED" in result.message
        assert len(master.posts()) == 1


def _args(**kw: object) -> argparse.Namespace:
    names = ["listen", "master", "token_file", "allocation_token_file", "user", "password_file",
             "ca_bundle", "report_interval", "spool_dir", "spool_max_mb", "trial_id",
             "trial_run_id", "agent_id", "timings_group", "retry_max_delay", "request_timeout",
             "workers"]  # fmt: skip
    values: dict[str, object] = dict.fromkeys(names)
    values["no_fsync"] = False
    values["ingest_tokens"] = str(_INGEST_TOKENS)
    values.update(kw)
    return argparse.Namespace(**values)


_INGEST_TOKENS = write_token_file(Path(tempfile.mkdtemp(prefix="otelprof-test-")) / "ingest-tokens")


def test_settings_come_from_the_determined_task_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {
        "DET_MASTER": "det-master:8080",
        "DET_SESSION_TOKEN": "alloc-tok",
        "DET_MASTER_CERT_FILE": "noverify",
        "OTELPROF_BRIDGE_REPORT_INTERVAL": "5",
        "OTELPROF_BRIDGE_SPOOL_DIR": "/var/spool/x",
    }
    s = BridgeSettings.from_args(_args(), env)
    assert s.master == "det-master:8080"
    assert s.credentials.allocation_token == "alloc-tok"
    assert s.window_s == 5.0 and s.spool_dir == "/var/spool/x"
    # the client the bridge makes from them (as a task would): verification off, no CA
    made: dict[str, object] = {}
    real = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda **kw: made.update(kw) or real(**kw))
    client = DeterminedClient.in_task(s.master, s.credentials, env, s.ca_bundle)
    assert made["verify"] is False and client.master == "http://det-master:8080"
    tls = DeterminedClient.in_task(s.master, s.credentials, {**env, "DET_USE_TLS": "true"})
    assert tls.master == "https://det-master:8080"
    # flags win over the environment
    s = BridgeSettings.from_args(_args(report_interval=2.0, user="bob"), {**env, "DET_PASS": "pw"})
    assert s.window_s == 2.0 and s.credentials.username == "bob"
    assert s.credentials.password == "pw" and s.credentials.allocation_token is None


@pytest.mark.parametrize(
    ("kw", "env", "message"),
    [
        ({}, {"DET_USER_TOKEN": "t"}, "no Determined master"),
        ({"master": "http://m"}, {}, "no Determined credentials"),
        ({"master": "http://m", "timings_group": "my.timings"}, {"DET_USER_TOKEN": "t"},
         "cannot contain '.'"),
        ({"master": "http://m", "timings_group": "gpu"}, {"DET_USER_TOKEN": "t"}, "built-in"),
        ({"master": "http://m", "trial_id": 3}, {"DET_USER_TOKEN": "t"}, "--trial-run-id"),
        ({"master": "http://m", "report_interval": "soon"}, {"DET_USER_TOKEN": "t"},
         "not a number"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_with_a_clear_message(
    kw: dict[str, object], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        BridgeSettings.from_args(_args(**kw), env)


def test_cli_exits_2_naming_the_problem(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DET_MASTER", raising=False)
    assert otelprof_main(["determined-bridge", "--token-file", "/nonexistent"]) == 2
    assert "no Determined master" in capsys.readouterr().err
    code = otelprof_main(
        ["determined-bridge", "--master", "http://127.0.0.1:1", "--token-file", "/x",
         "--ingest-tokens", str(_INGEST_TOKENS), "--ca-bundle", "/nonexistent/ca.pem"]
    )  # fmt: skip
    assert code == 2
    assert "CA bundle /nonexistent/ca.pem does not exist" in capsys.readouterr().err


def test_master_is_asked_whether_a_report_from_before_a_crash_is_stored(
    master: DeterminedContractServer,
) -> None:
    client = DeterminedClient(master.url, Credentials(user_token=master.add_user("alice")))
    gpu = Report(42, 1, "gpu", build_body(42, 1, "gpu", {"a": {"GPU-1": {"gpu_util": 5.0,
                 "gpu_free_memory": 1.0}}}, T0))  # fmt: skip
    timings = Report(42, 1, "timings",
                     build_body(42, 1, "timings", {"x_s": 0.1, "x_count": 3}, T0, 12))  # fmt: skip
    assert client.already_stored(gpu) is False
    assert client.already_stored(timings) is False
    assert client.report(gpu).outcome is Outcome.OK
    assert client.report(timings).outcome is Outcome.OK
    assert client.already_stored(gpu) is True
    assert client.already_stored(timings) is True
    assert client.already_stored(_report()) is False  # same trial, other group
    unreachable = DeterminedClient("http://127.0.0.1:9", Credentials(user_token="t"))
    assert unreachable.already_stored(gpu) is None  # cannot tell: send it
