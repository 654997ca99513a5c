"""otelprof's Prometheus alerting rules, with their thresholds and windows as parameters.

    python3 prometheus/alerts.py                     # rewrite the shipped files (defaults)
    python3 prometheus/alerts.py --check             # exit 1 if they are out of date
    python3 prometheus/alerts.py --set stall_window=30m --set gpu_idle_ratio=0.05 \\
        --out /etc/prometheus/otelprof-alerts.yml    # your own thresholds
    python3 prometheus/alerts.py --set ... --kubernetes --out rules.yaml   # as a PrometheusRule

One source for both shipped forms: prometheus/otelprof-alerts.yml (a Prometheus rule file,
loaded by prometheus/prometheus.yml) and deploy/kubernetes/monitoring/otelprof-alerts.yaml
(the same groups in a PrometheusRule for the Prometheus Operator). Prometheus has no
variables in rules, so a threshold is changed by rendering again with `--set` (or by editing
the number in the rendered file). Standard library only. tests/test_alerts.py checks the
shipped files are this script's output, runs `promtool check rules` and `promtool test rules`
(tests/alerts/*.test.yml) on them, and evaluates the rules in a real Prometheus fed by real
jobs through the collector.

Every expression reads what otelprof exports through the collector's Prometheus exporter:
`otelprof_timing_duration_seconds_{count,sum}` (every range of every step, per timing and
phase), `hw_gpu_utilization_ratio`, `otelprof_collective_duration_seconds_total` (and the
straggler path's copy), `otelprof_telemetry_dropped_total` (every rank exports it from its
start: the sign that a rank still reports) and `otelprof_run_ended` (1 in a rank's last
export when its run ended: shutdown, exit, exception or SIGTERM; never after a SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RULES_FILE = REPO / "prometheus" / "otelprof-alerts.yml"
PROMETHEUS_RULE = REPO / "deploy" / "kubernetes" / "monitoring" / "otelprof-alerts.yaml"

# name -> (default, what it means). Durations are Prometheus durations (30s, 15m, 1h).
PARAMETERS: dict[str, tuple[str, str]] = {
    "evaluation_interval": ("30s", "how often Prometheus evaluates these rules"),
    "rate_window": ("5m", "window of the rates that the shares and waits are computed over"),
    "stall_window": ("15m", "JobStalled: no step or timed range completed for this long"),
    "stall_for": ("1m", "JobStalled: ... and still so after this long"),
    "gpu_idle_ratio": ("0.1", "GpuIdle: mean GPU utilization under this (0-1) ..."),
    "gpu_idle_window": ("15m", "GpuIdle: ... over this window while training steps ran"),
    "gpu_idle_for": ("5m", "GpuIdle: ... and still so after this long"),
    "data_bound_share": ("0.3", "DataBound: share of step time in dataloader_next over this"),
    "data_bound_for": ("15m", "DataBound: ... for this long"),
    "straggler_gap": ("0.2", "Straggler: a rank waits in collectives this many s/s less ..."),
    "straggler_for": ("10m", "Straggler: ... than the rank of its job that waits most, this long"),
    "dropped_window": ("10m", "TelemetryDropped: items otelprof dropped in this window ..."),
    "dropped_threshold": ("0", "TelemetryDropped: ... more than this many"),
    "lost_window": ("15m", "RankLost: a rank that reported in this window but no longer does"),
    "lost_for": ("1m", "RankLost: ... (and sent no run end) for this long"),
}
DEFAULTS = {name: default for name, (default, _) in PARAMETERS.items()}
_DURATION = re.compile(r"([0-9]+(ms|s|m|h|d|w|y))+")
_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?")

# Every alert is per rank of a job: service, job (run id), Determined trial (when there is
# one), host and rank, the labels the dashboards' variables select by.
KEY = "service_name, otelprof_run_id, determined_trial_id, host_name, otelprof_rank"
JOB = "service_name, otelprof_run_id"
TIMINGS = "otelprof_timing_duration_seconds"
TRAIN_STEP = 'otelprof_timing="step", otelprof_phase="train"'
WHO = (
    "rank {{ $labels.otelprof_rank }} on {{ $labels.host_name }} of job "
    "{{ $labels.otelprof_run_id }} (service {{ $labels.service_name }}"
    "{{ with $labels.determined_trial_id }}, Determined trial {{ . }}{{ end }})"
)
WHO_FIRST = "R" + WHO[1:]
SHORT = (
    "job {{ $labels.otelprof_run_id }} rank {{ $labels.otelprof_rank }} on {{ $labels.host_name }}"
)


def _wait(window: str) -> str:
    """Seconds per second each rank spends in collectives: the straggler path's copy of the
    counter where a collector serves it, otelprof's own counter otherwise (as the
    dashboards' collective-wait panel)."""
    return (
        f"(sum by ({KEY}) (rate(straggler_otelprof_collective_duration_seconds_total[{window}]))"
        f" or sum by ({KEY}) (rate(otelprof_collective_duration_seconds_total[{window}])))"
    )


def rules(p: dict[str, str]) -> list[dict[str, str]]:
    """The alerting rules with parameters `p` (every name of PARAMETERS)."""
    return [
        {
            "alert": "OtelprofJobStalled",
            "expr": (
                f"sum by ({KEY}) (increase({TIMINGS}_count[{p['stall_window']}])) == 0\n"
                f"and on ({KEY}) sum by ({KEY}) ({TIMINGS}_count offset {p['stall_window']})\n"
                f"and on ({KEY}) group by ({KEY}) (otelprof_telemetry_dropped_total)"
            ),
            "for": p["stall_for"],
            "severity": "critical",
            "summary": f"Training stalled: {SHORT}",
            "description": (
                f"The process of {WHO} still sends its metrics, but completed no step and no "
                f"timed range in the last {p['stall_window']}."
            ),
            "runbook": (
                "Open the otelprof training dashboard for this job (Job = the run id) and look "
                "at Steps per second per rank: every rank at 0 is a job-wide hang (a collective "
                "waiting for a dead or stuck rank: look for a RankLost alert, check NCCL), one "
                "rank at 0 is that rank's own hang (py-spy dump --pid of its process shows "
                "where). A phase without timed ranges longer than the window (a huge "
                "checkpoint) also fires: raise stall_window."
            ),
        },
        {
            "alert": "OtelprofGpuIdle",
            "expr": (
                f"max by ({KEY}, gpu_index, hw_id) "
                f"(avg_over_time(hw_gpu_utilization_ratio[{p['gpu_idle_window']}]))"
                f" < {p['gpu_idle_ratio']}\n"
                f"and on ({KEY}) sum by ({KEY}) "
                f"(rate({TIMINGS}_count{{{TRAIN_STEP}}}[{p['gpu_idle_window']}])) > 0"
            ),
            "for": p["gpu_idle_for"],
            "severity": "warning",
            "summary": f"GPU {{{{ $labels.gpu_index }}}} idle while training: {SHORT}",
            "description": (
                "GPU {{ $labels.gpu_index }} ({{ $labels.hw_id }}) seen by "
                f"{WHO} was busy {{{{ $value | humanizePercentage }}}} of the last "
                f"{p['gpu_idle_window']} on average (under {p['gpu_idle_ratio']}) while the "
                "rank completed training steps."
            ),
            "runbook": (
                "Check the training dashboard's Share of step time per phase and Data-loader "
                "bound? panels: time outside the GPU (data loading, host-side Python, "
                "synchronisation) starves it. A GPU of the job that no rank uses (every rank "
                "sees every GPU of the node and uses one) also fires: give each rank only its "
                "own GPU (CUDA_VISIBLE_DEVICES) or release the unused ones."
            ),
        },
        {
            "alert": "OtelprofDataBound",
            "expr": (
                f"sum by ({KEY}) (rate({TIMINGS}_sum"
                f'{{otelprof_timing="dataloader_next", otelprof_phase="train"}}'
                f"[{p['rate_window']}]))\n"
                f"/ sum by ({KEY}) (rate({TIMINGS}_sum{{{TRAIN_STEP}}}[{p['rate_window']}]))\n"
                f"> {p['data_bound_share']}"
            ),
            "for": p["data_bound_for"],
            "severity": "warning",
            "summary": f"Training waits for data: {SHORT}",
            "description": (
                f"{WHO_FIRST} spent {{{{ $value | humanizePercentage }}}} of its training step "
                f"time waiting for the next batch (dataloader_next) for {p['data_bound_for']} "
                f"(threshold {p['data_bound_share']})."
            ),
            "runbook": (
                "The input pipeline limits throughput: raise DataLoader num_workers and "
                "prefetch_factor, use pin_memory, move decoding and augmentation off the "
                "training process, or check the storage the data is read from (the system "
                "dashboard's disk and network panels)."
            ),
        },
        {
            "alert": "OtelprofStraggler",
            "expr": (
                f"max by ({JOB}) ({_wait(p['rate_window'])})\n"
                f"- on ({JOB}) group_right () {_wait(p['rate_window'])}\n"
                f"> {p['straggler_gap']}"
            ),
            "for": p["straggler_for"],
            "severity": "warning",
            "summary": f"Straggler: {SHORT}",
            "description": (
                f'{WHO_FIRST} waits {{{{ printf "%.2f" $value }}}} s/s less in collectives than '
                "the rank "
                f"of its job that waits most, for {p['straggler_for']}: the other ranks wait "
                "for it at every gradient all-reduce (threshold "
                f"{p['straggler_gap']} s/s)."
            ),
            "runbook": (
                "The training dashboard's Straggler panel names the rank; compare its host "
                "with the others on the system dashboard (GPU clocks, power and temperature, "
                "CPU, other tenants), and its Phase time p50 (a slower data loader on that "
                "host). The README's TraceQL straggler query shows its steps."
            ),
        },
        {
            "alert": "OtelprofTelemetryDropped",
            "expr": (
                f"sum by ({KEY}, otelprof_source, otelprof_reason) "
                f"(increase(otelprof_telemetry_dropped_total[{p['dropped_window']}]))"
                f" > {p['dropped_threshold']}"
            ),
            "for": "0s",
            "severity": "warning",
            "summary": (
                "Telemetry dropped ({{ $labels.otelprof_source }}: "
                f"{{{{ $labels.otelprof_reason }}}}): {SHORT}"
            ),
            "description": (
                f'otelprof in {WHO} dropped {{{{ printf "%.0f" $value }}}} telemetry items '
                "({{ $labels.otelprof_source }}.{{ $labels.otelprof_reason }}) in the last "
                f"{p['dropped_window']}: what it shows for this rank is incomplete."
            ),
            "runbook": (
                "The reason says where: otlp.* (the collector unreachable or refusing: check "
                "its health and logs), files.* (disk full or the run directory gone), "
                "timings.* (queues or memory budgets full: raise max_queued_spans or "
                "max_attribute_bytes), determined.* (the master refused or was unreachable). "
                "prof.stats() and run.json hold the same counts."
            ),
        },
        {
            "alert": "OtelprofRankLost",
            "expr": (
                f"group by ({KEY}) "
                f"(max_over_time(otelprof_telemetry_dropped_total[{p['lost_window']}]))\n"
                f"unless on ({KEY}) group by ({KEY}) (otelprof_telemetry_dropped_total)\n"
                f"unless on ({KEY}) group by ({KEY}) "
                f"(max_over_time(otelprof_run_ended[{p['lost_window']}]) == 1)"
            ),
            "for": p["lost_for"],
            "severity": "critical",
            "summary": f"Rank stopped reporting without a run end: {SHORT}",
            "description": (
                f"{WHO_FIRST} reported in the last {p['lost_window']} but sends nothing any more, "
                "and its last export did not say its run ended: the process was killed "
                "(SIGKILL, out of memory), its node died, or its telemetry cannot reach the "
                "collector."
            ),
            "runbook": (
                "Look for the process on its host (dmesg for the OOM killer, the launcher's "
                "and scheduler's logs for the exit); the job's other ranks usually hang in "
                "their next collective (a JobStalled alert). If the process still runs, check "
                "the path to the collector (an otlp.* TelemetryDropped alert, the collector's "
                "health)."
            ),
        },
    ]


def _check(values: dict[str, str]) -> dict[str, str]:
    unknown = sorted(set(values) - set(PARAMETERS))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)}; known: {', '.join(PARAMETERS)}"
        )
    merged = {**DEFAULTS, **values}
    for name, value in merged.items():
        is_duration = _DURATION.fullmatch(DEFAULTS[name]) is not None
        pattern = _DURATION if is_duration else _NUMBER
        if not pattern.fullmatch(value):
            kind = "a Prometheus duration (e.g. 15m)" if is_duration else "a number (e.g. 0.3)"
            raise ValueError(f"{name}={value!r}: expected {kind}")
    for name in ("gpu_idle_ratio", "data_bound_share"):
        if not 0 < float(merged[name]) <= 1:
            raise ValueError(f"{name}={merged[name]!r}: expected a share above 0 and at most 1")
    return merged


def _quoted(text: str) -> str:
    """A YAML double-quoted scalar (JSON's string syntax is YAML's)."""
    return json.dumps(text, ensure_ascii=False)


def groups_yaml(values: dict[str, str] | None = None, indent: str = "") -> str:
    """The `groups:` document of the rule file, each line prefixed with `indent`."""
    p = _check(values or {})
    lines = [
        "groups:",
        "  - name: otelprof",
        f"    interval: {p['evaluation_interval']}",
        "    rules:",
    ]
    for rule in rules(p):
        lines += [f"      - alert: {rule['alert']}", "        expr: |"]
        lines += [f"          {line}" for line in rule["expr"].splitlines()]
        lines += [
            f"        for: {rule['for']}",
            "        labels:",
            f"          severity: {rule['severity']}",
            "        annotations:",
        ]
        lines += [
            f"          {key}: {_quoted(rule[key])}"
            for key in ("summary", "description", "runbook")
        ]
    return "".join(f"{indent}{line}\n" for line in lines)


def _parameters_comment(values: dict[str, str]) -> str:
    width = max(len(f"{n}={v}") for n, v in values.items())
    return "".join(
        f"#   {f'{name}={values[name]}':<{width}}  {PARAMETERS[name][1]}\n" for name in PARAMETERS
    )


def rules_file(values: dict[str, str] | None = None) -> str:
    """The Prometheus rule file (`rule_files:` of prometheus.yml)."""
    p = _check(values or {})
    return (
        "# otelprof's alerting rules. GENERATED by prometheus/alerts.py: change a threshold with\n"
        "#   python3 prometheus/alerts.py --set NAME=VALUE --out FILE\n"
        "# (or edit the number below). The thresholds and windows of this file:\n"
        f"{_parameters_comment(p)}"
        "# Every alert carries service_name, otelprof_run_id, determined_trial_id (in\n"
        "# Determined), host_name and otelprof_rank; group them by otelprof_run_id in\n"
        "# Alertmanager.\n"
        f"{groups_yaml(p)}"
    )


def prometheus_rule(values: dict[str, str] | None = None) -> str:
    """The same groups as a PrometheusRule (monitoring.coreos.com/v1, Prometheus Operator)."""
    p = _check(values or {})
    return (
        "# otelprof's alerting rules for the Prometheus Operator. GENERATED by\n"
        "# prometheus/alerts.py from the same rules as prometheus/otelprof-alerts.yml\n"
        "# (thresholds: see that file). Your Prometheus must select it: its ruleSelector matches\n"
        "# these"
        " labels (kube-prometheus-stack selects `release: <its release name>`: add that\n"
        "# label)"
        " and its ruleNamespaceSelector this namespace.\n"
        "apiVersion: monitoring.coreos.com/v1\n"
        "kind: PrometheusRule\n"
        "metadata:\n"
        "  name: otelprof-alerts\n"
        "  namespace: otelprof\n"
        "  labels:\n"
        "    app.kubernetes.io/part-of: otelprof\n"
        "spec:\n"
        f"{groups_yaml(p, indent='  ')}"
    )


def outputs() -> dict[Path, str]:
    """Every shipped file and what it must hold (the defaults)."""
    return {RULES_FILE: rules_file(), PROMETHEUS_RULE: prometheus_rule()}


def _parse_sets(items: list[str]) -> dict[str, str]:
    values = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected NAME=VALUE")
        values[name.strip()] = value.strip()
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        epilog="parameters (defaults): "
        + "; ".join(f"{n}={d}: {what}" for n, (d, what) in PARAMETERS.items()),
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a shipped file is stale")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--out", type=Path, help="write one file here instead of the shipped ones")
    parser.add_argument(
        "--kubernetes", action="store_true", help="with --out: write a PrometheusRule"
    )
    args = parser.parse_args(argv)
    try:
        values = _parse_sets(args.set)
        if args.out is not None:
            text = prometheus_rule(values) if args.kubernetes else rules_file(values)
            args.out.write_text(text, encoding="utf-8")
            print(f"wrote {args.out}")
            return 0
        if values or args.kubernetes:
            parser.error("--set and --kubernetes need --out (the shipped files keep the defaults)")
        expected = outputs()
    except ValueError as error:
        parser.error(str(error))
    stale = []
    for path, text in expected.items():
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(REPO)}")
    if args.check and stale:
        names = ", ".join(str(p.relative_to(REPO)) for p in stale)
        print(f"out of date: {names}; run python3 prometheus/alerts.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
