"""Who may send to the bridge, where they may write, and what one sender may cost the others."""

from __future__ import annotations

import ast
import logging
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from otelprof.config import ConfigError
from otelprof.determined.aggregate import Report, build_body
from otelprof.determined.client import Credentials, DeterminedClient, Outcome
from otelprof.determined.ingest_auth import IngestLimits, IngestTokens, Scope, TlsFiles
from otelprof.determined.pipeline import Pipeline
from otelprof.determined.server import BridgeServer
from otelprof.determined.spool import DiskSpool, MemorySpool
from tests.determined_contract import DeterminedContractServer, available_series, trial_metrics
from tests.determined_feed import (
    BRIDGE_TOKEN,
    BridgeProcess,
    OtlpClient,
    bridge_tokens,
    dense_metrics_request,
    kv,
    seed_metrics_request,
    timing_spans_request,
    trial_resource,
    write_token_file,
)
from tests.services import wait_for

TRIAL_42_TOKEN = "token-for-trial-42-only-0123456789"
EXPERIMENT_7_TOKEN = "token-for-experiment-7-0123456789"
TOKENS = (f"{BRIDGE_TOKEN} *", f"{TRIAL_42_TOKEN} trial=42", f"{EXPERIMENT_7_TOKEN} experiment=7")


@pytest.fixture
def master() -> Iterator[DeterminedContractServer]:
    server = DeterminedContractServer().start()
    server.token = server.add_user("alice")  # type: ignore[attr-defined]
    server.add_trial(42, run_id=1, experiment_id=7)
    server.add_trial(43, run_id=1, experiment_id=8)  # another user's experiment
    server.add_trial(44, run_id=1, experiment_id=7)
    yield server
    server.stop()


class Bridge:
    def __init__(self, master: DeterminedContractServer, tmp: Path, **kw: Any) -> None:
        client = DeterminedClient(master.url, Credentials(user_token=master.token))  # type: ignore[attr-defined]
        self.pipeline = Pipeline(
            client,
            DiskSpool(tmp / "spool"),
            window_s=kw.pop("window_s", 3600.0),
            retry_initial_s=0.05,
            retry_max_s=0.3,
            max_steps_per_s=kw.pop("max_steps_per_s", 10_000.0),
        )
        self.server = BridgeServer(
            self.pipeline, kw.pop("listen", "127.0.0.1:0"), tokens=bridge_tokens(TOKENS), **kw
        )
        self.server.start()
        self.port = self.server.port

    def client(self, token: str | None) -> OtlpClient:
        return OtlpClient(self.port, token=token)

    def report_now(self) -> None:
        self.pipeline.flush()
        assert self.pipeline.wait_delivered(20), self.pipeline.stats()

    def stop(self) -> None:
        self.server.stop(grace_s=0.5, drain_timeout_s=2.0)


@pytest.fixture
def bridge(master: DeterminedContractServer, tmp_path: Path) -> Iterator[Bridge]:
    b = Bridge(master, tmp_path)
    yield b
    b.stop()


def _code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_a_producer_without_a_valid_token_is_refused_and_nothing_is_stored(
    master: DeterminedContractServer, bridge: Bridge
) -> None:
    request = timing_spans_request(trial_resource(42), range(10))
    for token in (None, "not-a-token-of-this-bridge-000000"):
        otlp = bridge.client(token)
        assert _code(lambda o=otlp: o.send_traces(request)) == grpc.StatusCode.UNAUTHENTICATED
        assert (
            _code(lambda o=otlp: o.send_metrics(seed_metrics_request(trial_resource(42))))
            == grpc.StatusCode.UNAUTHENTICATED
        )
        otlp.close()
    bridge.report_now()
    assert master.posts() == []
    assert bridge.server.stats()["refused_unauthenticated"] == 4


def test_a_token_writes_only_into_its_own_trial_or_experiment(
    master: DeterminedContractServer, bridge: Bridge
) -> None:
    trial_only = bridge.client(TRIAL_42_TOKEN)
    experiment = bridge.client(EXPERIMENT_7_TOKEN)
    # Into another user's trial: refused whole, whatever the resource claims.
    forged = trial_resource(43, **{"determined.experiment.id": 7})
    assert _code(lambda: trial_only.send_metrics(seed_metrics_request(forged))) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert _code(lambda: experiment.send_metrics(seed_metrics_request(forged))) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    # Its own trials go through; a mixed request is answered with partial success.
    trial_only.send_metrics(seed_metrics_request(trial_resource(42)))
    mixed = seed_metrics_request(trial_resource(44))
    mixed.resource_metrics.extend(seed_metrics_request(forged).resource_metrics)
    answer = experiment.send_metrics(mixed)
    assert answer.partial_success.rejected_data_points == 12
    assert "not into trial(s) 43" in answer.partial_success.error_message
    bridge.report_now()
    assert {p.trial_id for p in master.posts()} == {42, 44}
    stats = bridge.server.stats()
    assert stats["refused_out_of_scope_requests"] == 2
    assert stats["refused_out_of_scope_points"] == 36
    trial_only.close()
    experiment.close()


def test_refused_senders_are_logged_once_per_sender_and_trial_without_their_token(
    master: DeterminedContractServer, bridge: Bridge, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "not-a-token-of-this-bridge-000000"
    for token in [None, wrong] * 9:  # 18 requests without a valid token
        otlp = bridge.client(token)
        _code(lambda o=otlp: o.send_metrics(seed_metrics_request(trial_resource(42))))
        otlp.close()
    trial_only = bridge.client(TRIAL_42_TOKEN)
    for trial in [43, 44] * 72:  # 144 requests into trials the token may not write
        _code(lambda t=trial: trial_only.send_metrics(seed_metrics_request(trial_resource(t))))
    trial_only.close()
    stats = bridge.server.stats()
    assert stats["refused_unauthenticated"] == 18 and stats["refused_out_of_scope_requests"] == 144
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    refused = [m for m in warnings if m.startswith("refused OTLP from 127.0.0.1")]
    assert len(refused) == 3, refused  # one per sender and trial, not 162
    assert sum("no valid bearer token" in m for m in refused) == 1
    for trial in (43, 44):
        (line,) = [m for m in refused if f"trial(s) {trial} " in m]
        assert "ingest token #2" in line and "scope is trial=42" in line, line
    for secret in (BRIDGE_TOKEN, TRIAL_42_TOKEN, EXPERIMENT_7_TOKEN, wrong):
        assert secret not in caplog.text


def test_a_trial_the_master_cannot_vouch_for_yet_is_answered_unavailable(
    master: DeterminedContractServer, bridge: Bridge
) -> None:
    experiment = bridge.client(EXPERIMENT_7_TOKEN)
    with master.down():
        code = _code(lambda: experiment.send_metrics(seed_metrics_request(trial_resource(42))))
    assert code == grpc.StatusCode.UNAVAILABLE  # OTLP exporters retry this one
    experiment.send_metrics(seed_metrics_request(trial_resource(42)))
    assert bridge.server.stats()["refused_unverified_trial"] == 1
    experiment.close()


def _timings_report(master: DeterminedContractServer, steps: int) -> None:
    """What the master holds before the bridge sees the trial: `steps` batches reported."""
    client = DeterminedClient(master.url, Credentials(user_token=master.token))  # type: ignore[attr-defined]
    run = master.trial(42)["runId"]
    body = build_body(42, run, "timings", {"step_s": 0.1}, time.time_ns(), steps)
    assert client.report(Report(42, run, "timings", body)).outcome is Outcome.OK
    client.close()


def test_a_forged_first_report_cannot_raise_the_trials_batch_count(
    master: DeterminedContractServer, tmp_path: Path
) -> None:
    _timings_report(master, 11)  # the master holds 11 batches of trial 42
    rate = 100.0
    b = Bridge(master, tmp_path, max_steps_per_s=rate, window_s=1.0)
    started = time.monotonic()
    try:
        forger = b.client(TRIAL_42_TOKEN)  # a token for trial 42 is all it takes
        forged = trial_resource(42, **{"determined.trial.steps_completed": 2_000_000_000})
        forger.send_traces(timing_spans_request(forged, range(11)))
        b.report_now()
        forger.close()
    finally:
        b.stop()
    elapsed = time.monotonic() - started
    steps = [p.body["metrics"]["stepsCompleted"] for p in master.posts() if p.group == "timings"]
    # from what the master held (11), at most `rate` steps a second since the trial's first
    # data plus one window: not 2,000,000,011
    assert steps[0] == 11 and 11 < steps[-1] <= 11 + 1 + rate * (elapsed + 1.0), steps
    assert master.trial(42)["totalBatchesProcessed"] == steps[-1]
    stats = b.server.stats()
    assert stats["steps_clamped"] == 1 and stats["baseline_lookups"] == 1, stats


def test_a_resumed_trials_first_report_counts_on_from_its_checkpoint_unclamped(
    master: DeterminedContractServer, tmp_path: Path
) -> None:
    _timings_report(master, 3000)  # run 1 trained 3000 batches and checkpointed there
    master.restart_trial(42)
    b = Bridge(master, tmp_path, max_steps_per_s=100.0, window_s=1.0)
    try:
        producer = b.client(TRIAL_42_TOKEN)
        resumed = trial_resource(42, 2, **{"determined.trial.steps_completed": 3000})
        producer.send_traces(timing_spans_request(resumed, range(10)))
        b.report_now()
        producer.close()
    finally:
        b.stop()
    timings = [p.body["metrics"] for p in master.posts() if p.group == "timings"]
    assert [m["stepsCompleted"] for m in timings if m["trialRunId"] == 2] == [3010]
    assert master.rows(42, "timings", archived=True) == []  # run 1's row kept
    assert b.server.stats()["steps_clamped"] == 0


def _big_request(trial: int, n_bytes: int) -> metrics_service_pb2.ExportMetricsServiceRequest:
    request = seed_metrics_request(trial_resource(trial))
    request.resource_metrics[0].resource.attributes.append(kv("padding", "x" * n_bytes))
    return request


def test_an_oversized_request_is_refused_with_resource_exhausted_and_counted(
    master: DeterminedContractServer, tmp_path: Path
) -> None:
    b = Bridge(master, tmp_path, limits=IngestLimits(max_request_bytes=64 * 1024))
    try:
        otlp = b.client(BRIDGE_TOKEN)
        assert _code(lambda: otlp.send_metrics(_big_request(42, 100 * 1024))) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        # Far over: refused by gRPC itself before it is buffered whole.
        assert _code(lambda: otlp.send_metrics(_big_request(42, 1024 * 1024))) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        otlp.send_metrics(_big_request(42, 1024))  # a normal one still goes through
        assert b.server.stats()["refused_too_large"] == 1
        otlp.close()
    finally:
        b.stop()


def test_one_trials_flood_does_not_delay_a_healthy_trial(
    master: DeterminedContractServer, tmp_path: Path
) -> None:
    b = Bridge(master, tmp_path, limits=IngestLimits(max_per_credential=2))
    stop = threading.Event()
    outcomes: dict[str, int] = {}
    lock = threading.Lock()

    def flood() -> None:
        otlp = b.client(EXPERIMENT_7_TOKEN)
        request = _big_request(44, 512 * 1024)
        while not stop.is_set():
            try:
                otlp.send_metrics(request, timeout=30)
                key = "ok"
            except grpc.RpcError as exc:
                key = exc.code().name
            with lock:
                outcomes[key] = outcomes.get(key, 0) + 1
        otlp.close()

    flooders = [threading.Thread(target=flood) for _ in range(8)]
    for t in flooders:
        t.start()
    try:
        healthy = b.client(TRIAL_42_TOKEN)
        time.sleep(0.5)
        waits = []
        for _ in range(10):
            started = time.monotonic()
            healthy.send_metrics(seed_metrics_request(trial_resource(42)), timeout=30)
            waits.append(time.monotonic() - started)
        healthy.close()
    finally:
        stop.set()
        for t in flooders:
            t.join()
    # Every healthy request was taken; the flood was held to its share and told to retry.
    assert len(waits) == 10
    assert outcomes.get("UNAVAILABLE", 0) > 0, outcomes
    assert b.server.stats()["refused_throttled"] == outcomes["UNAVAILABLE"]
    b.report_now()
    assert {r.group for r in master.profiling_rows(42, "cpu")} == {"cpu"}
    b.stop()


MB = 1 << 20


def _bridge_stats(log: str) -> dict[str, Any]:
    """The counters of the bridge's last `stats:` line (it logs them when it stops)."""
    line = [x for x in log.splitlines() if "stats: {" in x][-1]
    return dict(ast.literal_eval(line.split("stats: ", 1)[1]))


@pytest.mark.parametrize("gives_up", ["deadline", "hang-up"])
def test_abandoned_requests_free_their_tokens_share_and_memory_at_once(
    master: DeterminedContractServer, tmp_path: Path, gives_up: str
) -> None:
    token_file = tmp_path / "det-token"
    token_file.write_text(master.token)  # type: ignore[attr-defined]
    token_file.chmod(0o600)
    bridge = BridgeProcess(
        master.url, token_file, tmp_path / "spool", tmp_path / "bridge.log",
        tokens=[f"{TRIAL_42_TOKEN} trial=42"], args=["--max-request-mb", "4"],
    )  # fmt: skip
    bridge.start()
    assert bridge.proc is not None
    process = psutil.Process(bridge.proc.pid)
    otlp = OtlpClient(bridge.port, token=TRIAL_42_TOKEN)
    small = seed_metrics_request(trial_resource(42))
    otlp.send_metrics(small)
    baseline = process.memory_info().rss
    big = dense_metrics_request(trial_resource(42), int(3.8 * MB))  # ~3 s of mapping each
    peak = [baseline]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.01):
            peak[0] = max(peak[0], process.memory_info().rss)

    def send() -> str:
        client = OtlpClient(bridge.port, token=TRIAL_42_TOKEN)
        try:
            if gives_up == "deadline":
                client.send_metrics(big, timeout=0.5)  # the client gives up after 0.5 s
            else:  # its process goes away after 0.5 s: the connection closes
                call = client.metrics.Export.future(big, timeout=60, metadata=client.metadata)
                time.sleep(0.5)
                client.close()
                call.result()
            return "OK"
        except grpc.RpcError as exc:
            return str(exc.code().name)
        finally:
            client.close()

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(8) as clients:  # one token, 8 at once: 4 admitted (its share)
            outcomes = list(clients.map(lambda _i: send(), range(8)))
        gave_up = time.monotonic()
        # the token's share is free as soon as the admitted ones reach their next check
        wait_for(
            lambda: otlp.send_metrics(small, timeout=5) is not None,
            timeout_s=10, what="the token's next request to be admitted", interval_s=0.01,
        )  # fmt: skip
        admitted_after = time.monotonic() - gave_up
        rss_after = wait_for(
            lambda: (rss := process.memory_info().rss) <= baseline + 40 * MB and rss,
            timeout_s=10, what="the bridge's memory to come back",
            on_timeout=lambda: f"RSS {baseline / MB:.0f} MB at first, "
            f"{process.memory_info().rss / MB:.0f} now, peak {peak[0] / MB:.0f}",
        )  # fmt: skip
    finally:
        sampling.set()
        sampler.join()
        otlp.close()
        bridge.stop()
    log = bridge.log.read_text()
    stats = _bridge_stats(log)
    print(
        f"outcomes {outcomes}; admitted {admitted_after:.2f} s after the clients gave up; "
        f"RSS {baseline / MB:.0f} -> peak {peak[0] / MB:.0f} -> {rss_after / MB:.0f} MB"
    )
    assert set(outcomes) <= {"DEADLINE_EXCEEDED", "CANCELLED", "UNAVAILABLE"}, outcomes
    # what was admitted was dropped and counted (gRPC drops, unseen, a call that ends
    # before a worker takes it)
    assert stats["refused_abandoned"] >= 1, stats
    assert stats["refused_abandoned"] + stats["refused_throttled"] <= 8, stats
    assert admitted_after < 2.0
    # per admitted request at most ~9x its size (ARCHITECTURE.md), and every request's
    # bytes as received twice: 4 x 9 x 3.8 + 8 x 2 x 3.8 MB
    assert peak[0] - baseline <= (4 * 9 + 8 * 2) * 3.8 * MB, peak[0] - baseline
    assert TRIAL_42_TOKEN not in log


def test_a_hundred_thousand_agent_ids_in_one_trial_stay_bounded_and_do_not_delay_another(
    master: DeterminedContractServer, bridge: Bridge
) -> None:
    otlp = bridge.client(EXPERIMENT_7_TOKEN)
    t = time.time_ns()
    template = metrics_pb2.ResourceMetrics(
        resource=Resource(attributes=[kv(k, v) for k, v in trial_resource(44).items()]),
        scope_metrics=[
            metrics_pb2.ScopeMetrics(
                metrics=[
                    metrics_pb2.Metric(
                        name="system.cpu.utilization",
                        unit="1",
                        gauge=metrics_pb2.Gauge(
                            data_points=[
                                metrics_pb2.NumberDataPoint(time_unix_nano=t, as_double=0.5)
                            ]
                        ),
                    )
                ]
            )
        ],
    )
    agent_attr = [a.key for a in template.resource.attributes].index("determined.agent.id")
    for start in range(0, 100_000, 10_000):
        request = metrics_service_pb2.ExportMetricsServiceRequest()
        for agent in range(start, start + 10_000):
            resource = request.resource_metrics.add()
            resource.CopyFrom(template)
            resource.resource.attributes[agent_attr].value.string_value = f"a{agent}"
        otlp.send_metrics(request, timeout=120)
    otlp.send_metrics(seed_metrics_request(trial_resource(42)))
    bridge.report_now()
    stats = bridge.server.stats()
    assert stats["dropped_agents"] == 100_000 - 64
    assert len(master.profiling_rows(44, "cpu")) == 64  # one report per agent kept
    assert len(master.profiling_rows(42, "cpu")) == 1
    assert stats["pending"] == 0
    otlp.close()


def test_listening_beyond_loopback_needs_tls(master: DeterminedContractServer) -> None:
    client = DeterminedClient(master.url, Credentials(user_token="t"))
    pipeline = Pipeline(client, MemorySpool(), window_s=1)  # never started
    with pytest.raises(OSError, match="without TLS"):
        BridgeServer(pipeline, "0.0.0.0:0", tokens=bridge_tokens())


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _certificates(tmp: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made by openssl."""
    f = {n: str(tmp / n) for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem",
                                   "cli.key", "cli.csr", "cli.pem", "ext")}  # fmt: skip
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f["ca.key"],
             "-out", f["ca.pem"], "-days", "1", "-subj", "/CN=test-ca")  # fmt: skip
    Path(f["ext"]).write_text("subjectAltName=IP:127.0.0.1\n")
    for who in ("srv", "cli"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f[f"{who}.key"],
                 "-out", f[f"{who}.csr"], "-subj", f"/CN={who}")  # fmt: skip
        _openssl("x509", "-req", "-in", f[f"{who}.csr"], "-CA", f["ca.pem"], "-CAkey",
                 f["ca.key"], "-CAcreateserial", "-out", f[f"{who}.pem"], "-days", "1",
                 "-extfile", f["ext"])  # fmt: skip
    return f


def test_mutual_tls_takes_only_clients_with_a_certificate_and_a_token(
    master: DeterminedContractServer, tmp_path: Path
) -> None:
    f = _certificates(tmp_path)
    tls = TlsFiles(f["srv.pem"], f["srv.key"], client_ca=f["ca.pem"])
    b = Bridge(master, tmp_path, tls=tls)
    try:
        ca = Path(f["ca.pem"]).read_bytes()
        with_cert = grpc.secure_channel(
            f"127.0.0.1:{b.port}",
            grpc.ssl_channel_credentials(
                ca, Path(f["cli.key"]).read_bytes(), Path(f["cli.pem"]).read_bytes()
            ),
        )
        otlp = OtlpClient(b.port, token=TRIAL_42_TOKEN, channel=with_cert)
        otlp.send_metrics(seed_metrics_request(trial_resource(42)))
        no_token = OtlpClient(b.port, token=None, channel=with_cert)
        assert _code(lambda: no_token.send_metrics(seed_metrics_request(trial_resource(42)))) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        without_cert = grpc.secure_channel(f"127.0.0.1:{b.port}", grpc.ssl_channel_credentials(ca))
        anonymous = OtlpClient(b.port, token=TRIAL_42_TOKEN, channel=without_cert)
        assert (
            _code(
                lambda: anonymous.send_metrics(seed_metrics_request(trial_resource(42)), timeout=5)
            )
            == grpc.StatusCode.UNAVAILABLE
        )  # the handshake fails: nothing reaches the bridge
        plain = OtlpClient(b.port, token=TRIAL_42_TOKEN)
        assert _code(
            lambda: plain.send_metrics(seed_metrics_request(trial_resource(42)), timeout=5)
        ) == (grpc.StatusCode.UNAVAILABLE)
        b.report_now()
        assert len(master.profiling_rows(42, "cpu")) == 1
        for c in (otlp, anonymous, plain):
            c.close()
    finally:
        b.stop()


def test_a_token_file_others_can_read_is_refused_like_ssh_does(tmp_path: Path) -> None:
    path = write_token_file(tmp_path / "tokens", [f"{BRIDGE_TOKEN} trial=42"])
    assert IngestTokens.from_file(str(path)).scope_of([("authorization", f"Bearer {BRIDGE_TOKEN}")])
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        IngestTokens.from_file(str(path))


@pytest.mark.parametrize(
    ("line", "message"),
    [("short trial=1", "at least 16"), (f"{BRIDGE_TOKEN} trial=x", "not trial=ID"),
     (f"{BRIDGE_TOKEN}", "has no scope")],
)  # fmt: skip
def test_a_bad_token_file_is_refused_naming_the_line(
    tmp_path: Path, line: str, message: str
) -> None:
    path = write_token_file(tmp_path / "tokens", [line])
    with pytest.raises(ConfigError, match=message):
        IngestTokens.from_file(str(path))


def test_a_token_without_a_scope_gets_the_command_lines_allow_list(tmp_path: Path) -> None:
    path = write_token_file(tmp_path / "tokens", [BRIDGE_TOKEN])
    tokens = IngestTokens.from_file(str(path), Scope(trials=frozenset({42})))
    found = tokens.scope_of([("authorization", f"Bearer {BRIDGE_TOKEN}")])
    assert found is not None and found[1].trials == {42} and not found[1].everything


def test_a_producer_sets_its_token_through_otel_exporter_otlp_headers(
    master: DeterminedContractServer, bridge: Bridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource as SdkResource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer%20{TRIAL_42_TOKEN}")
    provider = TracerProvider(resource=SdkResource.create(trial_resource(42)))
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"127.0.0.1:{bridge.port}", insecure=True))
    )
    tracer = provider.get_tracer("t")
    for step in range(3):
        with tracer.start_as_current_span("train_step", attributes={"otelprof.step": step}):
            pass
    provider.shutdown()
    bridge.report_now()
    rows = trial_metrics(master.url, master.token, 42, "timings")  # type: ignore[attr-defined]
    assert [r["totalBatches"] for r in rows] == [3]
    assert available_series(master.url, master.token, 42) == []  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "no --ingest-tokens"),
        (["--ingest-tokens", "{loose}"], "chmod 600"),
        (["--ingest-tokens", "{tokens}", "--listen", "0.0.0.0:0"], "without TLS"),
        (["--ingest-tokens", "{tokens}", "--tls-cert", "c.pem"], "both --tls-cert and --tls-key"),
    ],
)
def test_the_bridge_command_refuses_to_start_open_to_anyone(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    extra: list[str],
    message: str,
) -> None:
    from otelprof.cli import main as otelprof_main

    monkeypatch.delenv("OTELPROF_BRIDGE_INGEST_TOKENS", raising=False)
    tokens = write_token_file(tmp_path / "tokens")
    loose = write_token_file(tmp_path / "loose")
    loose.chmod(0o644)
    (tmp_path / "token").write_text("master-token")
    argv = ["determined-bridge", "--master", "http://127.0.0.1:9", "--token-file",
            str(tmp_path / "token"), "--spool-dir", str(tmp_path / "spool")]  # fmt: skip
    argv += [a.format(tokens=tokens, loose=loose) for a in extra]
    assert otelprof_main(argv) == 2
    assert message in capsys.readouterr().err
