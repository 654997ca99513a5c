"""Stand-ins for what the README's no-Docker path downloads (no network in the tests), and
the check that the stack it starts works (tests/test_readme_live_stack.py).

    python -m tests.readme_standins tempo -config.file=tempo/tempo.yaml -config.expand-env=true
    python -m tests.readme_standins grafana server --homepath grafana
    python -m tests.readme_standins check

`tempo` reads its config as Tempo 2.10 does (environment expanded only with
-config.expand-env=true; it refuses Tempo 3's layout the way 3.x refuses 2.x's, by key),
receives OTLP gRPC traces where `distributor.receivers.otlp` says and answers /ready on the
server's HTTP address; /standin/spans counts the spans it got by name. `grafana` expands the
provisioning files under GF_PATHS_PROVISIONING as Grafana does, lists the dashboards its
provider path holds, and answers /api/health on GF_SERVER_HTTP_ADDR:3000; /standin/datasources
asks each provisioned data source for data, as Grafana's "Test" button does. `check` trains a
small job against the README's collector address and checks each service got its share.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SERVICE = "readme-live-stack"
STEPS = 30


def _serve_http(address: str, port: int, routes: dict[str, Callable[[], Any]]) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            route = routes.get(self.path)
            if route is None:
                self.send_response(404)
                self.end_headers()
                return
            body = json.dumps(route()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    ThreadingHTTPServer((address, port), Handler).serve_forever()


def tempo(args: list[str]) -> int:
    from tests import tempo_config

    flags = dict(a.lstrip("-").split("=", 1) for a in args if "=" in a)
    path = Path(flags["config.file"])
    if flags.get("config.expand-env") != "true":
        print("tempo stand-in: without -config.expand-env=true Tempo reads ${...} verbatim")
        return 1
    config = tempo_config.load(os.environ, path)
    for key in ("ingester", "compactor", "distributor", "storage", "server"):
        if key not in config:  # Tempo 2.10's layout (3.x's refuses ingester and compactor)
            print(f"tempo stand-in: {path} has no {key} section")
            return 1
    storage = Path(config["storage"]["trace"]["wal"]["path"])
    storage.mkdir(parents=True, exist_ok=True)

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    spans: Counter[str] = Counter()
    lock = threading.Lock()

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            with lock:
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        spans.update(span.name for span in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    endpoint = config["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    server.add_insecure_port(endpoint)
    server.start()

    def counts() -> dict[str, int]:
        with lock:
            return dict(spans)

    http = config["server"]
    _serve_http(
        http["http_listen_address"],
        int(http["http_listen_port"]),
        {"/ready": lambda: "ready", "/standin/spans": counts},
    )
    return 0


def grafana(args: list[str]) -> int:
    import httpx

    from tests import grafana_provisioning

    if args[:1] != ["server"] or "--homepath" not in args:
        print("grafana stand-in: expected `grafana server --homepath DIR`")
        return 1
    provisioning = Path(os.environ["GF_PATHS_PROVISIONING"])
    env = dict(os.environ)
    datasources = grafana_provisioning.load(provisioning / "datasources" / "datasources.yaml", env)[
        "datasources"
    ]
    (provider,) = grafana_provisioning.load(provisioning / "dashboards" / "dashboards.yaml", env)[
        "providers"
    ]
    dashboards = sorted(p.name for p in Path(provider["options"]["path"]).glob("*.json"))
    Path(os.environ["GF_PATHS_DATA"]).mkdir(parents=True, exist_ok=True)

    def test_datasources() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for source in datasources:
            url = source["url"]
            probe = {"prometheus": "/api/v1/query?query=up", "tempo": "/ready"}[source["type"]]
            try:
                status = httpx.get(url + probe, timeout=5).status_code
            except httpx.HTTPError as error:
                status = repr(error)
            out[source["type"]] = {"url": url, "status": status}
        return {"datasources": out, "dashboards": dashboards}

    _serve_http(
        os.environ.get("GF_SERVER_HTTP_ADDR", "0.0.0.0"),
        int(os.environ.get("GF_SERVER_HTTP_PORT", "3000")),
        {"/api/health": lambda: {"database": "ok"}, "/standin/datasources": test_datasources},
    )
    return 0


def _wait(what: str, probe: Callable[[], Any], timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
            if last:
                return last
        except Exception as error:  # not up yet
            last = error
        time.sleep(0.5)
    raise SystemExit(f"check: timed out waiting for {what} (last: {last!r})")


def check() -> int:
    import httpx

    import otelprof
    from tests.pipeline_run import training_loop

    def ok(url: str) -> bool:
        return httpx.get(url, timeout=5).status_code == 200

    _wait("the collector", lambda: ok("http://127.0.0.1:13133/"))
    _wait("Prometheus", lambda: ok("http://127.0.0.1:9091/-/ready"))
    _wait("Tempo", lambda: ok("http://127.0.0.1:3200/ready"))
    _wait("Grafana", lambda: ok("http://127.0.0.1:3000/api/health"))

    prof = otelprof.instrument(endpoint="http://127.0.0.1:4317", service_name=SERVICE, interval=0.5)
    try:
        training_loop(prof, steps=STEPS, pause_s=0.05)
    finally:
        prof.shutdown()

    query = (
        f'otelprof_timing_duration_seconds_count{{service_name="{SERVICE}", '
        f'otelprof_timing="step"}}'
    )

    def counted() -> bool:
        result = httpx.get(
            "http://127.0.0.1:9091/api/v1/query", params={"query": query}, timeout=5
        ).json()["data"]["result"]
        return sum(float(r["value"][1]) for r in result) >= STEPS

    _wait(f"Prometheus to count {STEPS} steps ({query})", counted)

    def every_step_span() -> dict[str, int] | None:
        spans = httpx.get("http://127.0.0.1:3200/standin/spans", timeout=5).json()
        return spans if spans.get("step", 0) >= STEPS else None

    spans = _wait("Tempo to receive every step span", every_step_span)
    grafana_view = httpx.get("http://127.0.0.1:3000/standin/datasources", timeout=30).json()
    groups = httpx.get("http://127.0.0.1:9091/api/v1/rules", timeout=5).json()["data"]["groups"]
    alerts = sorted(rule["name"] for group in groups for rule in group["rules"])
    print(json.dumps({"tempo_spans": spans, "grafana": grafana_view, "alert_rules": alerts}))
    return 0


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "tempo":
        return tempo(args)
    if command == "grafana":
        return grafana(args)
    return check()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
