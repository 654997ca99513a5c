"""The bridge's own metrics: what it received, delivered, retried and moved aside.

Served in the Prometheus text format (`--metrics-port`), read from `Pipeline.stats()` at
scrape time, so an operator can alert on refusals or a growing spool without reading logs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "otelprof_determined_bridge_"

# stat -> (help, is a gauge); every other stat is a counter.
HELP: dict[str, tuple[str, bool]] = {
    "windows": ("report windows closed", False),
    "reports": ("reports built from the received data", False),
    "delivered": ("reports the master accepted", False),
    "refused_by_master": ("reports the master refused for good (moved aside, kept)", False),
    "refused_kept": ("refused reports kept in the spool's refused store", False),
    "refused_not_kept": ("refused reports beyond the refused store's cap (counted only)", False),
    "gave_up_unknown_error": ("reports moved aside after bounded retries of an unknown 500", False),
    "retries": ("failed attempts that will be retried", False),
    "pending": ("reports waiting in the spool", True),
    "spooled": ("reports written to the spool", False),
    "spool_dropped": ("reports dropped because the spool was full", False),
    "journal_overflow": ("requests not journaled because the journal hit its cap", False),
    "rejected_points": ("OTLP points/spans refused (no trial ids, bad units)", False),
    "skipped_direct": ("points/spans left to processes that post to Determined themselves", False),
    "timings_unsafe_steps": ("timing windows of a restarted trial without a step offset", False),
    "invalid_values": ("non-finite values left out of reports", False),
    "incomplete_groups": ("profiling groups skipped for a missing key", False),
    "timings_held": ("timing windows held until a new step completed", False),
    "dropped_trials": ("samples refused because the trial limit was reached", False),
    "dropped_timing_names": ("timing names beyond the per-trial limit", False),
    "found_stored_after_restart": ("in-flight reports found stored after a restart", False),
    "found_stored_after_lost_response": ("lost answers whose report was stored", False),
    "dropped_agents": ("samples of agents beyond the per-trial agent limit", False),
    "dropped_series": ("histogram points of series beyond the per-trial limit", False),
    "steps_clamped": ("timing reports whose step count grew faster than possible", False),
    "spool_damaged_files": ("damaged spool files moved into damaged/ at start", False),
    "spool_damaged_lines": ("damaged journal lines skipped at start", False),
    "refused_unauthenticated": ("OTLP requests without a valid bearer token", False),
    "refused_too_large": ("OTLP requests over the size limit", False),
    "refused_throttled": ("OTLP requests refused for the sender's share or bytes in flight", False),
    "refused_unverified_trial": ("OTLP requests whose trial the master could not vouch for", False),
    "refused_out_of_scope_requests": ("OTLP requests with nothing in the token's scope", False),
    "refused_out_of_scope_points": ("points/spans for trials outside the token's scope", False),
    "refused_abandoned": ("OTLP requests dropped because their caller went away", False),
    "baseline_lookups": ("trials whose batch count was asked of the master", False),
    "inflight_bytes": ("OTLP request bytes being mapped now", True),
}


class _StatsCollector:
    """A prometheus_client collector reading a stats callable at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        for name, value in sorted(self._stats().items()):
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            text, gauge = HELP.get(name, (name.replace("_", " "), False))
            if gauge:
                yield GaugeMetricFamily(PREFIX + name, text, value=value)
            else:
                yield CounterMetricFamily(PREFIX + name, text, value=value)


def serve_metrics(
    stats: Callable[[], dict[str, Any]], port: int, host: str = "127.0.0.1"
) -> tuple[int, Callable[[], None]]:
    """Start the metrics endpoint; returns (bound port, stop function). A bounded server
    (`_prom_server.py`): slow or idle connections cannot hold it from a scrape."""
    from otelprof.determined._prom_server import BoundedMetricsServer

    registry = CollectorRegistry()
    registry.register(_StatsCollector(stats))
    server = BoundedMetricsServer(host, port, registry)
    return int(server.server_address[1]), server.shutdown
