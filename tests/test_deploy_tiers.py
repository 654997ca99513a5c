"""The cluster deployment's collector tiers, run for real on loopback with their shipped configs.

Two node agents (deploy/collector/agent.yaml, one per "node"), one gateway (gateway.yaml) and
one sampler (sampler.yaml), all the built collector, wired with the variables the Kubernetes
manifests set; a real OTLP gRPC server plays Tempo. One test, a few seconds of collector time:
- an OTLP request without the node's ingest token is refused by the agent;
- a step traced on two ranks of two nodes reaches "Tempo" whole when one rank kept it for an
  anomaly and the other only by its head sample: the gateway routed both nodes' spans of the
  trace to one sampler, whose tail sampling kept the trace for the anomaly;
- a trace kept by otelprof's head sample alone is dropped when it exceeds the cluster's span
  budget (1 span/s, a bucket of 2: a 3-span trace never fits); an error trace is kept;
- each agent stamps its node's name on what it forwards, and its span metrics and the
  processes' own metrics come out of the sampler's Prometheus endpoint labelled by node;
- the collective waiting counter also comes out of the sampler's straggler endpoint (the
  metrics/straggler pipeline), alone;
- no tier logs a deprecated component name or a failed export (tokens accepted downstream).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from otelprof._schema import ATTR_RANK, ATTR_SAMPLED, COLLECTIVE_DURATION
from tests.otlp_sink import OtlpSink
from tests.services import REPO, Collector, free_port, wait_for

CONFIGS = REPO / "deploy" / "collector"
INGEST_TOKEN = "ingest-4b1d"
GATEWAY_TOKEN = "gateway-7c0e"
NODES = ("gpu-node-a", "gpu-node-b")
NODE_ATTRIBUTE = "k8s.node.name"
TIMEOUT_S = 120.0  # collectors start in seconds, minutes on a loaded machine


def _tier(
    binary: Path, tier: str, workdir: Path, env: dict[str, str], *, prometheus: bool = False
) -> Collector:
    names = ("grpc", "health", "telemetry", *(("prometheus", "straggler") if prometheus else ()))
    ports = {name: free_port() for name in names}
    full_env = {
        "PATH": "/usr/bin:/bin",
        "OTELCOL_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{ports['grpc']}",
        "OTELCOL_HEALTH_ENDPOINT": f"127.0.0.1:{ports['health']}",
        "OTELCOL_TELEMETRY_PORT": str(ports["telemetry"]),
        "OTELCOL_BATCH_TIMEOUT": "200ms",
        **(
            {
                "OTELCOL_PROMETHEUS_ENDPOINT": f"127.0.0.1:{ports['prometheus']}",
                "OTELCOL_STRAGGLER_ENDPOINT": f"127.0.0.1:{ports['straggler']}",
            }
            if prometheus
            else {}
        ),
        **env,
    }
    return Collector(
        binary=binary,
        config=CONFIGS / f"{tier}.yaml",
        workdir=workdir / tier,
        env=full_env,
        ports=ports,
    )


@pytest.fixture
def tiers(collector_binary: Path, tmp_path: Path) -> Iterator[dict[str, Any]]:
    tempo = OtlpSink().start()
    started: list[Collector] = []
    try:
        sampler = _tier(
            collector_binary,
            "sampler",
            tmp_path,
            prometheus=True,
            env={
                "OTELCOL_GATEWAY_TOKEN": GATEWAY_TOKEN,
                "OTELCOL_TEMPO_ENDPOINT": f"127.0.0.1:{tempo.port}",
                "OTELCOL_TAIL_DECISION_WAIT": "5s",
                "OTELCOL_TEMPO_SPANS_PER_SECOND": "1",
                "OTELCOL_TEMPO_SPANS_BURST": "2",
            },
        )
        gateway = _tier(
            collector_binary,
            "gateway",
            tmp_path,
            env={
                "OTELCOL_GATEWAY_TOKEN": GATEWAY_TOKEN,
                # the DNS resolver, given a name that resolves to the one sampler here
                "OTELCOL_SAMPLER_HOSTNAME": "127.0.0.1",
                "OTELCOL_SAMPLER_PORT": str(sampler.ports["grpc"]),
            },
        )
        agents = [
            _tier(
                collector_binary,
                "agent",
                tmp_path / node,
                env={
                    "OTELCOL_INGEST_TOKEN": INGEST_TOKEN,
                    "OTELCOL_GATEWAY_TOKEN": GATEWAY_TOKEN,
                    "OTELCOL_GATEWAY_ENDPOINT": f"127.0.0.1:{gateway.ports['grpc']}",
                    "OTELCOL_NODE_NAME": node,
                    "OTELCOL_SPANMETRICS_FLUSH_INTERVAL": "1s",
                },
            )
            for node in NODES
        ]
        for collector in (sampler, gateway, *agents):
            collector.start(timeout_s=TIMEOUT_S)
            started.append(collector)
        yield {"tempo": tempo, "sampler": sampler, "gateway": gateway, "agents": agents}
    finally:
        for collector in reversed(started):
            collector.stop()
        tempo.stop()


def _attributes(values: dict[str, Any]) -> list[common_pb2.KeyValue]:
    out = []
    for key, value in values.items():
        any_value = (
            common_pb2.AnyValue(int_value=value)
            if isinstance(value, int)
            else common_pb2.AnyValue(string_value=value)
        )
        out.append(common_pb2.KeyValue(key=key, value=any_value))
    return out


def _resource(rank: int) -> resource_pb2.Resource:
    return resource_pb2.Resource(
        attributes=_attributes(
            {"service.name": "deploy-test", "host.name": f"pod-{rank}", ATTR_RANK: rank}
        )
    )


def _span(trace: int, span: int, name: str, **attributes: Any) -> trace_pb2.Span:
    error = attributes.pop("error", False)
    built = trace_pb2.Span(
        trace_id=trace.to_bytes(16, "big"),
        span_id=span.to_bytes(8, "big"),
        name=name,
        kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=1_700_000_000_000_000_000 + span * 1_000_000,
        end_time_unix_nano=1_700_000_000_000_000_000 + span * 1_000_000 + 500_000,
        attributes=_attributes(attributes),
    )
    if error:
        built.status.code = trace_pb2.Status.STATUS_CODE_ERROR
    return built


def _export_spans(agent: Collector, rank: int, spans: list[trace_pb2.Span], token: str) -> None:
    request = trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[
            trace_pb2.ResourceSpans(
                resource=_resource(rank), scope_spans=[trace_pb2.ScopeSpans(spans=spans)]
            )
        ]
    )
    with grpc.insecure_channel(f"127.0.0.1:{agent.ports['grpc']}") as channel:
        trace_service_pb2_grpc.TraceServiceStub(channel).Export(
            request, metadata=[("authorization", f"Bearer {token}")], timeout=30
        )


def _export_gauge(
    agent: Collector, rank: int, name: str, value: float, *, counter: bool = False
) -> None:
    """One point of a gauge, or of a cumulative counter in seconds (`counter`)."""
    point = metrics_pb2.NumberDataPoint(
        start_time_unix_nano=1_699_999_000_000_000_000,
        time_unix_nano=1_700_000_000_000_000_000,
        as_double=value,
    )
    if counter:
        metric = metrics_pb2.Metric(
            name=name,
            unit="s",
            sum=metrics_pb2.Sum(
                data_points=[point],
                is_monotonic=True,
                aggregation_temporality=metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE,
            ),
        )
    else:
        metric = metrics_pb2.Metric(
            name=name, unit="1", gauge=metrics_pb2.Gauge(data_points=[point])
        )
    request = metrics_service_pb2.ExportMetricsServiceRequest(
        resource_metrics=[
            metrics_pb2.ResourceMetrics(
                resource=_resource(rank),
                scope_metrics=[metrics_pb2.ScopeMetrics(metrics=[metric])],
            )
        ]
    )
    with grpc.insecure_channel(f"127.0.0.1:{agent.ports['grpc']}") as channel:
        metrics_service_pb2_grpc.MetricsServiceStub(channel).Export(
            request, metadata=[("authorization", f"Bearer {INGEST_TOKEN}")], timeout=30
        )


def _received(tempo: OtlpSink) -> dict[int, dict[int, str]]:
    """trace id -> {span id: the node attribute of its resource} of every span Tempo got."""
    out: dict[int, dict[int, str]] = {}
    for request in list(tempo.trace_requests):
        for resource_spans in request.resource_spans:
            attributes = {kv.key: kv.value for kv in resource_spans.resource.attributes}
            node = attributes[NODE_ATTRIBUTE].string_value if NODE_ATTRIBUTE in attributes else ""
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    trace = int.from_bytes(span.trace_id, "big")
                    out.setdefault(trace, {})[int.from_bytes(span.span_id, "big")] = node
    return out


def _decisions(sampler: Collector) -> dict[str, int]:
    """The sampler's own count of tail-sampling decisions, by decision."""
    own = httpx.get(f"http://127.0.0.1:{sampler.ports['telemetry']}/metrics", timeout=5).text
    found = re.findall(r'global_count_traces_sampled\{decision="(\w+)",[^}]*\} (\d+)', own)
    return {decision: int(count) for decision, count in found}


def test_agents_gateway_and_sampler_keep_a_step_whole_across_nodes_and_label_metrics_by_node(
    tiers: dict[str, Any],
) -> None:
    agent_a, agent_b = tiers["agents"]
    tempo: OtlpSink = tiers["tempo"]
    sampler: Collector = tiers["sampler"]

    with pytest.raises(grpc.RpcError) as refused:
        _export_spans(agent_a, 0, [_span(9, 1, "step", **{ATTR_SAMPLED: "head"})], "wrong")
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

    anomaly, head_only, failed = 0xA1, 0xB2, 0xC3
    # step 7 on two ranks, one per node: rank 1 kept it for an anomaly, rank 0 by head sample.
    # Rank 1's span goes first: rank 0's then joins the trace whether it arrives before the
    # decision or after it (the sampled-ids cache releases late spans of kept traces), so the
    # outcome does not depend on how fast the tiers run.
    _export_spans(
        agent_b, 1, [_span(anomaly, 3, "step", **{ATTR_SAMPLED: "anomaly"})], INGEST_TOKEN
    )
    _export_spans(
        agent_a,
        0,
        [_span(anomaly, 1, "step", **{ATTR_SAMPLED: "head"}), _span(anomaly, 2, "forward")],
        INGEST_TOKEN,
    )
    # step 8, head-sampled: 3 spans in one request, more than the cluster budget's bucket holds
    _export_spans(
        agent_a,
        0,
        [
            _span(head_only, 4, "step", **{ATTR_SAMPLED: "head"}),
            _span(head_only, 5, "forward"),
            _span(head_only, 6, "backward"),
        ],
        INGEST_TOKEN,
    )
    # a step that failed
    _export_spans(
        agent_b,
        1,
        [
            _span(failed, 7, "step", error=True),
            _span(failed, 8, "forward"),
            _span(failed, 9, "backward"),
        ],
        INGEST_TOKEN,
    )
    _export_gauge(agent_b, 1, "otelprof.test.gauge", 42.0)
    _export_gauge(agent_b, 1, COLLECTIVE_DURATION, 3.5, counter=True)

    wait_for(
        lambda: sum(_decisions(sampler).values()) >= 3,
        timeout_s=TIMEOUT_S,
        what="the sampler's decisions on the 3 traces",
        on_timeout=lambda: sampler.log_text()[-3000:],
    )
    kept = {
        anomaly: {1: NODES[0], 2: NODES[0], 3: NODES[1]},  # both nodes' spans, node-stamped
        failed: {7: NODES[1], 8: NODES[1], 9: NODES[1]},
    }
    wait_for(
        lambda: all(_received(tempo).get(trace) == spans for trace, spans in kept.items()),
        timeout_s=TIMEOUT_S,
        what=f"the kept traces at Tempo: {kept}",
        on_timeout=lambda: f"received {_received(tempo)}\n{sampler.log_text()[-3000:]}",
    )
    assert _decisions(sampler) == {"sampled": 2, "not_sampled": 1}  # the head-only trace
    assert _received(tempo).keys() == kept.keys()

    def scraped() -> str | None:
        text = httpx.get(f"http://{sampler.prometheus_target}/metrics", timeout=5).text
        return (
            text if "otelprof_test_gauge" in text and "traces_span_metrics_calls" in text else None
        )

    text = wait_for(scraped, timeout_s=TIMEOUT_S, what="metrics at the sampler's /metrics")
    lines = text.splitlines()
    gauge = [line for line in lines if line.startswith("otelprof_test_gauge")]
    assert gauge and all(f'k8s_node_name="{NODES[1]}"' in line for line in gauge), gauge
    calls = [line for line in lines if line.startswith("traces_span_metrics_calls_total{")]
    nodes = {node for line in calls for node in NODES if f'k8s_node_name="{node}"' in line}
    assert nodes == set(NODES), calls
    # the straggler path: the sampler's small endpoint serves the collective counter, by node,
    # and nothing else of the process
    straggler = wait_for(
        lambda: (
            text
            if "straggler_otelprof_collective_duration_seconds_total{"
            in (text := httpx.get(f"http://{sampler.straggler_target}/metrics", timeout=5).text)
            else None
        ),
        timeout_s=TIMEOUT_S,
        what="the collective counter at the sampler's straggler endpoint",
    )
    served = [line for line in straggler.splitlines() if line and not line.startswith("#")]
    names = {line.split("{")[0] for line in served}
    # (straggler_target_info comes with a resource that has service.instance.id)
    assert names - {"straggler_target_info"} == {
        "straggler_otelprof_collective_duration_seconds_total"
    }, served
    assert all(f'k8s_node_name="{NODES[1]}"' in line for line in served), served

    collectors: list[Collector] = [sampler, tiers["gateway"], agent_a, agent_b]
    for collector in collectors:  # current component names only, nothing refused downstream
        log = collector.log_text()
        assert "deprecated" not in log and "Exporting failed" not in log, log[-3000:]
