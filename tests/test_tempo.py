"""Tempo for users with and without Docker: its config takes listen addresses and storage
paths from the environment with compose's values as defaults, and the documentation's TraceQL
queries parse with Grafana's own TraceQL grammar (@grafana/lezer-traceql, from npm).

Tempo itself cannot be installed here (no Debian package); the config is checked as Tempo
would expand it, against compose.yaml and the collector's defaults.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import tempo_config
from tests.docs_pages import page, section
from tests.services import REPO

LIVE_STACK = "docs/guide/live-stack.md"
COLLECTOR = "docs/operations/collector.md"
COMPOSE = REPO / "compose.yaml"
PARSER = REPO / "tests" / "traceql_parse.cjs"
GRAMMAR_SCRIPT = REPO / "scripts" / "traceql-grammar.sh"


def traceql_dir() -> Path:
    """Where scripts/traceql-grammar.sh installed the grammar ($OTELPROF_TRACEQL_GRAMMAR,
    else the same cache path the script computes)."""
    given = os.environ.get("OTELPROF_TRACEQL_GRAMMAR")
    if given:
        return Path(given)
    version = re.search(r"^GRAMMAR_VERSION=(\S+)", GRAMMAR_SCRIPT.read_text(), re.M)
    assert version
    cache = os.environ.get("OTELPROF_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "otelprof"
    )
    return Path(cache) / f"traceql-{version[1]}"


def parse_traceql(queries: list[str]) -> list[dict[str, object]]:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node not found: install Node.js and npm, then run `make traceql-grammar`")
    grammar = traceql_dir()
    if not (grammar / "node_modules" / "@grafana" / "lezer-traceql").is_dir():
        pytest.fail(
            f"Grafana's TraceQL grammar is not installed in {grammar}: run "
            "`make traceql-grammar` (needs npm)"
        )
    result = subprocess.run(
        [node, str(PARSER), str(grammar)],
        input=json.dumps(queries),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    parsed = json.loads(result.stdout)
    assert isinstance(parsed, list)
    return parsed


def readme_traceql_queries() -> list[str]:
    """Every TraceQL query of the live stack guide: unlabelled code blocks and inline code
    that start with a span selector `{ ... }`, in its Tempo sections."""
    text = section(LIVE_STACK, "Finding the slowest steps in Tempo") + section(
        LIVE_STACK, "Finding a straggler in synchronous DDP"
    )
    blocks = re.findall(r"```\n(.*?)```", text, re.S)
    inline = re.findall(r"`(\{[^`]*\})`", text)
    queries = [b.strip() for b in blocks if b.lstrip().startswith("{")] + inline
    assert len(queries) >= 3, queries
    return queries


def test_readme_traceql_queries_parse_with_grafanas_grammar() -> None:
    queries = readme_traceql_queries()
    results = parse_traceql([*queries, '{ name = "step" && duration > }'])
    *readme, broken = results
    assert broken["errors"], "the grammar must reject a broken query (else this test is void)"
    bad = [r for r in readme if r["errors"]]
    assert not bad, f"documented TraceQL queries Grafana's parser rejects: {bad}"


def test_tempo_config_defaults_are_composes_values() -> None:
    config = tempo_config.load()
    server = config["server"]
    assert (server["http_listen_address"], server["http_listen_port"]) == ("0.0.0.0", 3200)
    grpc = config["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert grpc == "0.0.0.0:4317"
    storage = config["storage"]["trace"]
    compose = yaml.safe_load(COMPOSE.read_text())
    volumes = compose["services"]["tempo"]["volumes"]
    data_mount = next(v.split(":")[1] for v in volumes if v.startswith("tempo-data:"))
    assert storage["wal"]["path"] == f"{data_mount}/wal"
    assert storage["local"]["path"] == f"{data_mount}/blocks"
    # compose starts Tempo with env expansion, else the ${...} would reach it verbatim
    assert "-config.expand-env=true" in compose["services"]["tempo"]["command"]


def test_tempo_config_takes_addresses_and_paths_from_the_environment(tmp_path: Path) -> None:
    names = tempo_config.variables()
    assert {
        "TEMPO_OTLP_GRPC_ENDPOINT",
        "TEMPO_HTTP_LISTEN_ADDRESS",
        "TEMPO_HTTP_LISTEN_PORT",
        "TEMPO_GRPC_LISTEN_ADDRESS",
        "TEMPO_GRPC_LISTEN_PORT",
        "TEMPO_STORAGE_DIR",
    } <= set(names)
    assert all(default for default in names.values()), "every variable has a default"
    env = {
        "TEMPO_OTLP_GRPC_ENDPOINT": "127.0.0.1:4417",
        "TEMPO_HTTP_LISTEN_ADDRESS": "127.0.0.1",
        "TEMPO_HTTP_LISTEN_PORT": "3300",
        "TEMPO_GRPC_LISTEN_ADDRESS": "127.0.0.1",
        "TEMPO_STORAGE_DIR": str(tmp_path),
    }
    config = tempo_config.load(env)
    assert config["server"]["http_listen_port"] == 3300  # still an integer after expansion
    assert config["server"]["http_listen_address"] == "127.0.0.1"
    grpc = config["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert grpc == "127.0.0.1:4417"
    assert config["storage"]["trace"]["wal"]["path"] == f"{tmp_path}/wal"


def test_the_docs_run_tempo_without_docker_where_the_collector_sends_traces() -> None:
    section = page(COLLECTOR)
    assert "tempo -config.file=tempo/tempo.yaml -config.expand-env=true" in section
    endpoint = re.search(r"TEMPO_OTLP_GRPC_ENDPOINT=(\S+)", section)
    assert endpoint
    # the collector's otlp_grpc/tempo exporter default, as the page's variable list says
    collector_default = re.search(r"`OTELCOL_TEMPO_ENDPOINT`\s*\[([^\]]+)\]", section)
    assert collector_default and endpoint[1] == collector_default[1]
    for name in tempo_config.variables():
        assert name in section, f"{name} is not documented in {COLLECTOR}"


# -- the straggler query, on a real synchronous DDP job -------------------------------------

_CONDITION = re.compile(
    r'(resource\.service\.name|name|duration)\s*(=|<|>)\s*("[^"]*"|\d+(?:\.\d+)?(?:us|ms|s))'
)
_UNITS_NS = {"us": 1_000, "ms": 1_000_000, "s": 1_000_000_000}


def straggler_queries() -> list[str]:
    text = section(LIVE_STACK, "Finding a straggler in synchronous DDP")
    queries = [b.strip() for b in re.findall(r"```\n(.*?)```", text, re.S)]
    assert len(queries) == 2, queries
    return queries


def matches(query: str, span: Any, service: str) -> bool:
    """The span selector's conditions (`name`, `resource.service.name`, `duration`), with
    "my-job" read as `service`: what Tempo evaluates for each span of the query's selector."""
    selector = query[query.index("{") + 1 : query.index("}")]
    conditions = _CONDITION.findall(selector)
    assert len(conditions) == selector.count("&&") + 1, f"a condition not understood: {query}"
    for field, op, raw in conditions:
        if field == "duration":
            value = float(re.sub(r"[a-z]+$", "", raw)) * _UNITS_NS[re.sub(r"^[\d.]+", "", raw)]
            duration = span.end_ns - span.start_ns
            if not (duration < value if op == "<" else duration > value):
                return False
        else:
            assert op == "="
            wanted = raw.strip('"')
            have = span.name if field == "name" else span.resource.get("service.name")
            if have != (service if wanted == "my-job" else wanted):
                return False
    return True


@pytest.mark.e2e
def test_documented_straggler_queries_name_the_slow_rank_of_a_real_ddp_job(tmp_path: Path) -> None:
    """A 2-rank synchronous DDP job (gloo, CPU) whose rank 1 does 60 ms more work per step:
    the live stack guide's `duration > ...` step query returns both ranks alike, the straggler query
    returns (nearly) only rank 1, the waiting query (nearly) only rank 0. The straggler's lead
    is far above the waiting query's 10 ms, so that a loaded machine, which can hold rank 0
    back tens of ms now and then, does not make rank 1 the waiting one (20 ms did, 15 of 73
    waits at load 10-20). The straggler's own all-reduce still moves the gradients, about a
    millisecond here, so its query's threshold is 5 ms: at 1 ms it kept 20-45 of 60 steps,
    a coin flip around this test's 30."""
    import sys

    from tests.otlp_files import read_spans
    from tests.services import free_port

    service = "straggler-traceql"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTELPROF_", "OTEL_"))}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    env.update(
        OTELPROF_OUTPUT_DIR=str(tmp_path / "runs"),
        OTELPROF_SERVICE_NAME=service,
        PYTHONPATH=str(REPO),
        GLOO_SOCKET_IFNAME="lo",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    job = [sys.executable, str(REPO / "tests" / "ddp_job.py"), "--spawn", "2", "--steps", "60"]
    result = subprocess.run(
        [*job, "--slow-rank", "1", "--slow-ms", "60"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    spans = [s for rank in (0, 1) for s in read_spans(run_dir / f"traces.rank{rank}.jsonl")]
    steps = [s for s in spans if s.name == "step" and s.attributes.get("otelprof.step", 0) > 5]

    def ranks_of(query: str) -> list[int]:
        return [int(s.resource["otelprof.rank"]) for s in spans if matches(query, s, service)]

    # the slow-steps query cannot tell: both ranks' steps last as long
    durations = sorted(s.end_ns - s.start_ns for s in steps)
    median_ms = durations[len(durations) // 2] / 1e6
    slow_steps = ranks_of(f'{{ name = "step" && duration > {median_ms:.3f}ms }}')
    assert 0.25 <= slow_steps.count(1) / len(slow_steps) <= 0.75, slow_steps

    straggler, waiting = straggler_queries()
    found = ranks_of(straggler)
    assert found and found.count(1) / len(found) >= 0.8, found
    assert found.count(1) >= 30, "the straggler query finds most of the straggler's steps"
    waiters = ranks_of(waiting)
    assert waiters and waiters.count(0) / len(waiters) >= 0.8, waiters
    assert waiters.count(0) >= 30
