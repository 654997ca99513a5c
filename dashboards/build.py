"""Generate otelprof's Grafana dashboards (otelprof-system.json, otelprof-training.json).

    python dashboards/build.py          # rewrite the JSON files next to this script

The JSON files are committed (Grafana provisions them as they are); this script is how they
are edited, and tests/test_dashboards.py checks that the committed files match its output.
Panels, queries and variables are made with Grafana's typed builder (grafana-foundation-sdk,
the dev extra), which also places them on the grid and encodes the JSON.
Every PromQL expression here is run against a real Prometheus fed by a real pipeline run
(tests/test_dashboards.py), so only names the collector really produces appear:

- hardware gauges: otelprof.system names through the prometheus exporter
  (system_cpu_utilization_ratio, hw_gpu_utilization_ratio, ...), resource attributes as
  labels (service_name, host_name, otelprof_rank, determined_trial_id, ...);
- timings: otelprof's own otelprof_timing_duration_seconds_* histograms (every range of
  every step, aggregated in process, so they stay exact while traces are sampled), labelled
  otelprof_timing and otelprof_phase, with exemplars pointing at kept traces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus as pq
from grafana_foundation_sdk.builders import stat as st
from grafana_foundation_sdk.builders import timeseries as ts
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

from otelprof.determined_timings import DETERMINED_TIMINGS

HERE = Path(__file__).resolve().parent
PROMETHEUS_REF = dm.DataSourceRef(type_val="prometheus", uid="otelprof-prometheus")
TEMPO_UID = "otelprof-tempo"

PHASES = "|".join(DETERMINED_TIMINGS)
HIST = "otelprof_timing_duration_seconds"
CALLS = "otelprof_timing_duration_seconds_count"

# Label filters of each dashboard's template variables. `otelprof_run_id` (the resource's
# otelprof.run_id, one per job, shared by its ranks) keeps concurrent jobs apart: every
# per-rank or per-job aggregation below groups by it, so two jobs on one host never add up.
RUN = "otelprof_run_id"
RANK_KEY = f"{RUN}, host_name, otelprof_rank"
HOST_SEL = (
    'service_name=~"$service", otelprof_run_id=~"$run", host_name=~"$host", '
    'determined_trial_id=~"$trial"'
)
RANK_SEL = HOST_SEL + ', otelprof_rank=~"$rank"'
GPU_SEL = RANK_SEL + ', gpu_index=~"$gpu"'
SPAN_SEL = RANK_SEL


def variable(
    name: str, label: str, query: str, *, all_value: str = ".+", multi: bool = True
) -> db.QueryVariable:
    """A Prometheus query variable (label_values), All selected by default."""
    return (
        db.QueryVariable(name)
        .label(label)
        .datasource(PROMETHEUS_REF)
        .query(
            {
                "qryType": 1,
                "query": query,
                "refId": "PrometheusVariableQueryEditor-VariableQuery",
            }
        )
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .all_value(all_value)
        .multi(multi)
        .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
        .sort(dm.VariableSort.NUMERICAL_ASC)
        .hide(dm.VariableHide.DONT_HIDE)
        .options([])
        .regex("")
    )


def target(expr: str, legend: str, ref: str = "A", *, exemplar: bool = False) -> pq.Dataquery:
    return (
        pq.Dataquery()
        .datasource(PROMETHEUS_REF)
        .expr(expr)
        .legend_format(legend)
        .ref_id(ref)
        .range()
        .exemplar(exemplar)
        .editor_mode(pm.QueryEditorMode.CODE)
    )


class Layout:
    """Collects rows and panels in order and numbers them; Grafana's builder places them
    left to right on its 24-column grid (db.Dashboard.with_panel / with_row)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Any]] = []
        self.next_id = 1

    def row(self, title: str) -> None:
        self.items.append(("row", db.Row(title).id(self._id()).collapsed(False)))

    def timeseries(
        self,
        title: str,
        description: str,
        targets: list[pq.Dataquery],
        *,
        unit: str,
        width: int = 12,
        height: int = 8,
        stacked: bool = False,
        bars: bool = False,
        min_value: float | None = 0,
        max_value: float | None = None,
    ) -> None:
        panel = (
            ts.Panel()
            .id(self._id())
            .title(title)
            .description(description)
            .datasource(PROMETHEUS_REF)
            .span(width)
            .height(height)
            .unit(unit)
            .draw_style(cm.GraphDrawStyle.BARS if bars else cm.GraphDrawStyle.LINE)
            .line_width(1)
            .fill_opacity(60 if stacked else 10)
            .show_points(cm.VisibilityMode.NEVER)
            .span_nulls(True)
            .stacking(
                cb.StackingConfig()
                .mode(cm.StackingMode.NORMAL if stacked else cm.StackingMode.NONE)
                .group("A")
            )
            .legend(
                cb.VizLegendOptions()
                .display_mode(cm.LegendDisplayMode.LIST)
                .placement(cm.LegendPlacement.BOTTOM)
                .show_legend(True)
            )
            .tooltip(
                cb.VizTooltipOptions()
                .mode(cm.TooltipDisplayMode.MULTI)
                .sort(cm.SortOrder.DESCENDING)
            )
        )
        for query in targets:
            panel.with_target(query)
        if min_value is not None:
            panel.min(min_value)
        if max_value is not None:
            panel.max(max_value)
        self.items.append(("panel", panel))

    def stat(self, title: str, description: str, expr: str, *, unit: str, width: int = 6) -> None:
        panel = (
            st.Panel()
            .id(self._id())
            .title(title)
            .description(description)
            .datasource(PROMETHEUS_REF)
            .span(width)
            .height(4)
            .with_target(target(expr, "", "A"))
            .unit(unit)
            .decimals(2)
            .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
            .color_mode(cm.BigValueColorMode.VALUE)
            .graph_mode(cm.BigValueGraphMode.AREA)
            .text_mode(cm.BigValueTextMode.AUTO)
        )
        self.items.append(("panel", panel))

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def dashboard(
    uid: str, title: str, description: str, variables: list[db.QueryVariable], layout: Layout
) -> db.Dashboard:
    board = (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["otelprof"])
        .version(1)
        .readonly()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .time("now-30m", "now")
        .refresh("10s")
        .timezone("browser")
        .annotation(
            db.AnnotationQuery()
            .built_in(1)
            .datasource(dm.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
            .enable(True)
            .hide(True)
            .icon_color("rgba(0, 211, 255, 1)")
            .name("Annotations & Alerts")
            .type("dashboard")
        )
        .links(
            [
                db.DashboardLink("otelprof")
                .type(dm.DashboardLinkType.DASHBOARDS)
                .tags(["otelprof"])
                .as_dropdown(False)
                .include_vars(True)
                .keep_time(True),
                _determined_link(),
            ]
        )
    )
    for var in variables:
        board.with_variable(var)
    board.with_variable(_determined_variable())
    for kind, item in layout.items:
        if kind == "row":
            board.with_row(item)
        else:
            board.with_panel(item)
    return board


def _common_variables(metrics: str) -> list[db.QueryVariable]:
    """service, job (run id), host, rank and Determined trial, each narrowed by the ones
    before it. Only live series are listed: a finished job's leave the collector's endpoint
    after OTELCOL_METRIC_EXPIRATION and Prometheus marks them stale."""
    return [
        variable("service", "Service", f'label_values({{__name__=~"{metrics}"}}, service_name)'),
        variable(
            "run",
            "Job (run id)",
            f'label_values({{__name__=~"{metrics}", service_name=~"$service"}}, {RUN})',
        ),
        variable(
            "host",
            "Host",
            f'label_values({{__name__=~"{metrics}", service_name=~"$service", '
            f'{RUN}=~"$run"}}, host_name)',
        ),
        variable(
            "rank",
            "Rank",
            f'label_values({{__name__=~"{metrics}", service_name=~"$service", '
            f'{RUN}=~"$run", host_name=~"$host"}}, otelprof_rank)',
        ),
        variable(
            "trial",
            "Determined trial",
            f'label_values({{__name__=~"{metrics}", service_name=~"$service"}}, '
            f"determined_trial_id)",
            all_value=".*",  # runs outside Determined have no trial label
        ),
    ]


DETERMINED_TRIAL_URL = "${determined}/det/trials/${trial}"
"""The trial's page in Determined's Web UI (served under /det, route /trials/:trialId)."""


def _determined_variable() -> db.TextBoxVariable:
    """The Determined master's URL, for the link back to the trial: set by the link in the
    trial's experiment notes (otelprof/determined/links.py), or typed in."""
    return (
        db.TextBoxVariable("determined")
        .label("Determined URL")
        .description("The Determined master the trial link opens, e.g. http://det:8080")
        .default_value("")
        .hide(dm.VariableHide.DONT_HIDE)
    )


def _determined_link() -> db.DashboardLink:
    return (
        db.DashboardLink("Determined trial ${trial}")
        .type(dm.DashboardLinkType.LINK)
        .url(DETERMINED_TRIAL_URL)
        .tooltip("This trial in Determined's Web UI (one trial and the Determined URL set)")
        .icon("external link")
        .target_blank(True)
        .include_vars(False)
        .keep_time(False)
        .as_dropdown(False)
        .tags([])
    )


def system_dashboard() -> db.Dashboard:
    metrics = "system_cpu_utilization_ratio|hw_gpu_utilization_ratio|process_cpu_utilization_ratio"
    variables = _common_variables(metrics)
    variables.append(
        variable(
            "gpu",
            "GPU",
            'label_values(hw_gpu_utilization_ratio{service_name=~"$service", '
            'host_name=~"$host"}, gpu_index)',
        )
    )
    gpu = "max by (host_name, gpu_index, hw_id)"
    lay = Layout()
    lay.row("GPUs (per host and GPU)")
    lay.timeseries(
        "GPU utilization",
        "Share of time a kernel ran on the GPU, averaged over the collection interval (NVML).",
        [
            target(
                f"{gpu} (hw_gpu_utilization_ratio{{{GPU_SEL}}})", "{{host_name}} GPU {{gpu_index}}"
            )
        ],
        unit="percentunit",
        max_value=1,
    )
    lay.timeseries(
        "GPU memory used and free",
        "Device memory in use and free per GPU (NVML); free is Determined's gpu_free_memory.",
        [
            target(
                f"{gpu} (hw_gpu_memory_usage_bytes{{{GPU_SEL}}})",
                "used {{host_name}} GPU {{gpu_index}}",
            ),
            target(
                f"{gpu} (hw_gpu_memory_free_bytes{{{GPU_SEL}}})",
                "free {{host_name}} GPU {{gpu_index}}",
                "B",
            ),
        ],
        unit="bytes",
    )
    lay.timeseries(
        "GPU power",
        "Power drawn per GPU (NVML).",
        [
            target(
                f'{gpu} (hw_power_watts{{hw_type="gpu", {GPU_SEL}}})',
                "{{host_name}} GPU {{gpu_index}}",
            )
        ],
        unit="watt",
    )
    lay.timeseries(
        "GPU temperature",
        "GPU core temperature (NVML).",
        [
            target(
                f'{gpu} (hw_temperature_celsius{{hw_type="gpu", {GPU_SEL}}})',
                "{{host_name}} GPU {{gpu_index}}",
            )
        ],
        unit="celsius",
    )
    lay.timeseries(
        "SM and tensor-pipe activity (GPM)",
        "What the GPU's units did, averaged over the interval (NVML GPM, Hopper and later): "
        "share of SMs busy and of time the tensor pipes were busy. Utilization near 100 % "
        "with low SM activity means small kernels or launch gaps, not a saturated GPU.",
        [
            target(
                f"{gpu} (hw_gpu_sm_activity_ratio{{{GPU_SEL}}})",
                "SM {{host_name}} GPU {{gpu_index}}",
            ),
            target(
                f"{gpu} (hw_gpu_tensor_activity_ratio{{{GPU_SEL}}})",
                "tensor {{host_name}} GPU {{gpu_index}}",
                "B",
            ),
        ],
        unit="percentunit",
        max_value=1,
    )
    lay.timeseries(
        "SM occupancy and memory bandwidth",
        "Active warps over the theoretical maximum (GPM), and DRAM bandwidth used over peak "
        "(GPM; on older GPUs the memory controller's busy share, otelprof_gpu_source=nvml).",
        [
            target(
                f"{gpu} (hw_gpu_sm_occupancy_ratio{{{GPU_SEL}}})",
                "occupancy {{host_name}} GPU {{gpu_index}}",
            ),
            target(
                f"max by (host_name, gpu_index, hw_id, otelprof_gpu_source) "
                f"(hw_gpu_memory_bandwidth_utilization_ratio{{{GPU_SEL}}})",
                "DRAM bw ({{otelprof_gpu_source}}) {{host_name}} GPU {{gpu_index}}",
                "B",
            ),
        ],
        unit="percentunit",
        max_value=1,
    )
    lay.timeseries(
        "PCIe and NVLink traffic",
        "Bytes per second over the interval per GPU and direction (GPM, or NVML's byte "
        "counters on older GPUs).",
        [
            target(
                "max by (host_name, gpu_index, hw_id, network_io_direction) "
                f"(hw_gpu_pcie_throughput_bytes_per_second{{{GPU_SEL}}})",
                "PCIe {{network_io_direction}} {{host_name}} GPU {{gpu_index}}",
            ),
            target(
                "max by (host_name, gpu_index, hw_id, network_io_direction) "
                f"(hw_gpu_nvlink_throughput_bytes_per_second{{{GPU_SEL}}})",
                "NVLink {{network_io_direction}} {{host_name}} GPU {{gpu_index}}",
                "B",
            ),
        ],
        unit="Bps",
    )
    lay.timeseries(
        "GPU memory: this job vs the whole device",
        "Memory held on each GPU by the selected ranks' processes (NVML's process list) "
        "beside the device-wide figure, which includes other tenants of a shared node.",
        [
            target(
                "sum by (host_name, gpu_index) "
                f"(otelprof_gpu_process_memory_usage_bytes{{{GPU_SEL}}})",
                "job {{host_name}} GPU {{gpu_index}}",
            ),
            target(
                f"{gpu} (hw_gpu_memory_usage_bytes{{{GPU_SEL}}})",
                "device {{host_name}} GPU {{gpu_index}}",
                "B",
            ),
        ],
        unit="bytes",
    )
    lay.row("Host (reported by local rank 0 of each host)")
    lay.timeseries(
        "CPU utilization",
        "Share of all logical CPUs busy, averaged over the collection interval.",
        [
            target(
                f"max by (host_name) (system_cpu_utilization_ratio{{{HOST_SEL}}})", "{{host_name}}"
            )
        ],
        unit="percentunit",
        max_value=1,
    )
    lay.timeseries(
        "Available memory",
        "Memory available to start new work (MemAvailable), swap excluded.",
        [
            target(
                f"max by (host_name) (system_memory_linux_available_bytes{{{HOST_SEL}}})",
                "{{host_name}}",
            )
        ],
        unit="bytes",
    )
    lay.timeseries(
        "Disk IOPS",
        "Completed read and write operations per second on physical disks.",
        [
            target(
                "max by (host_name, disk_io_direction) "
                f"(system_disk_iops_per_second{{{HOST_SEL}}})",
                "{{host_name}} {{disk_io_direction}}",
            )
        ],
        unit="iops",
    )
    lay.timeseries(
        "Disk throughput",
        "Bytes read and written per second on physical disks.",
        [
            target(
                "max by (host_name, disk_io_direction) "
                f"(system_disk_throughput_bytes_per_second{{{HOST_SEL}}})",
                "{{host_name}} {{disk_io_direction}}",
            )
        ],
        unit="Bps",
    )
    lay.timeseries(
        "Network sent and received",
        "Bytes per second over all interfaces (loopback included), transmit and receive.",
        [
            target(
                "max by (host_name, network_io_direction) "
                f"(system_network_throughput_bytes_per_second{{{HOST_SEL}}})",
                "{{host_name}} {{network_io_direction}}",
            )
        ],
        unit="Bps",
        width=24,
    )
    lay.row("Training processes (every rank)")
    lay.timeseries(
        "Process CPU utilization per rank",
        "CPU time of each training process over the interval, as a share of usable CPUs.",
        [
            target(
                f"max by ({RANK_KEY}) (process_cpu_utilization_ratio{{{RANK_SEL}}})",
                LEGEND_RANK,
            )
        ],
        unit="percentunit",
    )
    lay.timeseries(
        "Process resident memory per rank",
        "Resident memory of each training process.",
        [
            target(
                f"max by ({RANK_KEY}) (process_memory_usage_bytes{{{RANK_SEL}}})",
                LEGEND_RANK,
            )
        ],
        unit="bytes",
    )
    return dashboard(
        "otelprof-system",
        "otelprof — system",
        "Hardware metrics of training jobs per host and GPU (otelprof observable gauges).",
        variables,
        lay,
    )


LEGEND_RANK = "rank {{otelprof_rank}} ({{host_name}}, {{otelprof_run_id}})"


def _rate(metric: str, selector: str) -> str:
    return f"rate({metric}{{{selector}}}[$__rate_interval])"


def training_dashboard() -> db.Dashboard:
    variables = _common_variables(CALLS)
    step = f'otelprof_timing="step", otelprof_phase="train", {SPAN_SEL}'
    phases = f'otelprof_timing=~"{PHASES}", otelprof_phase="train", {SPAN_SEL}'
    phase_buckets = _rate(HIST + "_bucket", phases)
    phase_sums = _rate(HIST + "_sum", phases)
    lay = Layout()
    lay.row("Steps")
    lay.stat(
        "Steps per second",
        "Training steps completed per second, averaged over the selected ranks of each job.",
        f"avg by ({RUN}) (sum by ({RANK_KEY}) ({_rate(CALLS, step)}))",
        unit="none",
    )
    lay.stat(
        "Step time p50",
        "Median step time (otelprof's histogram of every step span).",
        f"histogram_quantile(0.5, sum by (le, {RUN}) ({_rate(HIST + '_bucket', step)}))",
        unit="s",
    )
    lay.stat(
        "Step time p95",
        "95th percentile of the step time.",
        f"histogram_quantile(0.95, sum by (le, {RUN}) ({_rate(HIST + '_bucket', step)}))",
        unit="s",
    )
    lay.stat(
        "Rank skew (slowest / fastest mean step)",
        "1.0 when every rank steps equally fast; above 1 a straggler holds the others back.",
        f"max by ({RUN}) ({_mean_step_by_rank(step)})"
        f" / min by ({RUN}) ({_mean_step_by_rank(step)})",
        unit="none",
    )
    lay.timeseries(
        "Step time p50 / p95 (exemplars link to traces)",
        "Quantiles of the step span's duration. The dots are exemplars: click one to open "
        "that step's trace in Tempo.",
        [
            target(
                f"histogram_quantile(0.5, sum by (le, {RUN}) ({_rate(HIST + '_bucket', step)}))",
                "p50 {{otelprof_run_id}}",
                exemplar=True,
            ),
            target(
                f"histogram_quantile(0.95, sum by (le, {RUN}) ({_rate(HIST + '_bucket', step)}))",
                "p95 {{otelprof_run_id}}",
                "B",
                exemplar=True,
            ),
        ],
        unit="s",
    )
    lay.timeseries(
        "Steps per second per rank",
        "Steps completed per second by each rank.",
        [
            target(
                f"sum by ({RANK_KEY}) ({_rate(CALLS, step)})",
                LEGEND_RANK,
            )
        ],
        unit="none",
    )
    lay.row("Where the step time goes")
    lay.timeseries(
        "Phase time p50",
        "Median duration of each Determined timing (data loading, copies, forward/backward/"
        "optimizer, LR schedulers, metric reduction).",
        [
            target(
                f"histogram_quantile(0.5, sum by (le, {RUN}, otelprof_timing) ({phase_buckets}))",
                "{{otelprof_timing}} ({{otelprof_run_id}})",
            )
        ],
        unit="s",
    )
    lay.timeseries(
        "Phase time p95",
        "95th percentile of each Determined timing.",
        [
            target(
                f"histogram_quantile(0.95, sum by (le, {RUN}, otelprof_timing) ({phase_buckets}))",
                "{{otelprof_timing}} ({{otelprof_run_id}})",
                exemplar=True,
            )
        ],
        unit="s",
    )
    step_time = f"sum by ({RUN}) ({_rate(HIST + '_sum', step)})"
    loader = f'otelprof_timing="dataloader_next", otelprof_phase="train", {SPAN_SEL}'
    lay.timeseries(
        "Share of step time per phase",
        "Time spent in each timing divided by the step time; 'other' is step time outside "
        "every timing (Python overhead, unannotated work).",
        [
            target(
                f"sum by ({RUN}, otelprof_timing) ({phase_sums})"
                f" / on({RUN}) group_left() {step_time}",
                "{{otelprof_timing}} ({{otelprof_run_id}})",
            ),
            target(
                f"clamp_min(1 - sum by ({RUN}) ({phase_sums}) / {step_time}, 0)",
                "other ({{otelprof_run_id}})",
                "B",
            ),
        ],
        unit="percentunit",
        stacked=True,
        max_value=1,
    )
    lay.timeseries(
        "Data-loader bound?",
        "Share of step time spent waiting for the next batch (dataloader_next) against GPU "
        "utilization. A high share with low GPU utilization means the input pipeline, not "
        "the model, limits throughput.",
        [
            target(
                f"sum by ({RUN}) ({_rate(HIST + '_sum', loader)}) / {step_time}",
                "time in dataloader_next ({{otelprof_run_id}})",
            ),
            target(
                f"avg by ({RUN}) (hw_gpu_utilization_ratio{{{SPAN_SEL}}})",
                "GPU utilization ({{otelprof_run_id}})",
                "B",
            ),
        ],
        unit="percentunit",
        max_value=1,
    )
    lay.timeseries(
        "GPU energy per step",
        "Joules drawn by the selected GPUs per training step: GPU energy per second over "
        "steps per second of one rank (the ranks step together).",
        [
            target(
                f"sum by ({RUN}) "
                f'(rate(hw_energy_joules_total{{hw_type="gpu", {RANK_SEL}}}[$__rate_interval]))'
                f" / max by ({RUN}) (sum by ({RANK_KEY}) ({_rate(CALLS, step)}))",
                "J per step ({{otelprof_run_id}})",
            )
        ],
        unit="J",
    )
    lay.timeseries(
        "GPU idle time by phase",
        "GPU-idle seconds per second, (1 - utilization) summed over the selected GPUs, by "
        "the training phase they fell in (otelprof.phase: train, validation, checkpoint).",
        [
            target(
                f"sum by ({RUN}, otelprof_phase) "
                f"({_rate('otelprof_gpu_idle_seconds_total', RANK_SEL)})",
                "{{otelprof_phase}} ({{otelprof_run_id}})",
            )
        ],
        unit="s",
    )
    lay.row("Ranks")
    lay.timeseries(
        "Mean step time per rank (stragglers)",
        "Mean step time of each rank; a rank above the others is a straggler.",
        [target(_mean_step_by_rank(step), LEGEND_RANK)],
        unit="s",
    )
    lay.timeseries(
        "Rank skew over time",
        "Slowest rank's mean step time divided by the fastest's (1 = balanced).",
        [
            target(
                f"max by ({RUN}) ({_mean_step_by_rank(step)})"
                f" / min by ({RUN}) ({_mean_step_by_rank(step)})",
                "slowest / fastest",
            )
        ],
        unit="none",
        min_value=None,
    )
    wait = _collective_wait_by_rank()
    lay.timeseries(
        COLLECTIVE_WAIT_PANEL,
        "Share of each rank's time spent in collectives (DDP's gradient all-reduce, "
        "torch.distributed calls): communication plus waiting for the other ranks. In "
        "synchronous training step times are equal, but the straggler waits least.",
        [target(wait, LEGEND_RANK)],
        unit="percentunit",
    )
    lay.timeseries(
        STRAGGLER_PANEL,
        "How much less each rank waits in collectives than the rank that waits most, in "
        "seconds per second: near 0 for every rank when balanced; the straggler stands out.",
        [target(f"max by ({RUN}) ({wait}) - on({RUN}) group_right() {wait}", LEGEND_RANK)],
        unit="percentunit",
    )
    lay.row("Throughput and MFU")
    lay.timeseries(
        "Samples per second",
        "Samples trained per second of training-step time (validation and other phases "
        "excluded), over each rank's last 100 steps; from otelprof.step_work() or a "
        "framework integration.",
        [
            target(
                f"sum by ({RANK_KEY}) (otelprof_train_throughput_samples_per_second{{{RANK_SEL}}})",
                LEGEND_RANK,
            )
        ],
        unit="none",
        width=8,
    )
    lay.timeseries(
        "Tokens per second",
        "Tokens trained per second of training-step time, per rank (last 100 steps).",
        [
            target(
                f"sum by ({RANK_KEY}) (otelprof_train_throughput_tokens_per_second{{{RANK_SEL}}})",
                LEGEND_RANK,
            )
        ],
        unit="none",
        width=8,
    )
    lay.timeseries(
        "MFU (model FLOP utilization)",
        "Achieved FLOP/s over one device's peak (declared, OTELPROF_PEAK_FLOPS, or the "
        "table of common GPUs), per rank, last 100 steps.",
        [
            target(
                f"avg by ({RANK_KEY}) (otelprof_train_mfu_ratio{{{RANK_SEL}}})",
                LEGEND_RANK,
            )
        ],
        unit="percentunit",
        width=8,
    )
    return dashboard(
        "otelprof-training",
        "otelprof — training",
        "Step time and its breakdown into Determined's timings, from otelprof's in-process "
        "histograms of every step (exact while traces are sampled); exemplars link to "
        "kept traces in Tempo.",
        variables,
        lay,
    )


COLLECTIVE_WAIT_PANEL = "Time in collectives per rank (the straggler waits least)"
STRAGGLER_PANEL = "Straggler: how much later than the others each rank arrives"
MULTI_RANK_PANELS = (COLLECTIVE_WAIT_PANEL, STRAGGLER_PANEL)
"""Panels that need a multi-process job (collectives); proven by tests/test_distributed.py."""


COLLECTIVE = "otelprof_collective_duration_seconds_total"
STRAGGLER_PATH = "straggler_" + COLLECTIVE
"""The collector's straggler path (its metrics/straggler pipeline and small endpoint, job
otelcol-straggler): the same counter under the `straggler` namespace, scraped apart from the
hundreds of series per rank of the full endpoint."""


def _collective_wait_by_rank() -> str:
    # the straggler path's copy where a collector serves it; the full endpoint's otherwise
    # (a Prometheus without the job): `or` takes a rank's series from the right side only
    # where the left has none for that rank
    by_path = f"sum by ({RANK_KEY}) ({_rate(STRAGGLER_PATH, RANK_SEL)})"
    full = f"sum by ({RANK_KEY}) ({_rate(COLLECTIVE, RANK_SEL)})"
    return f"({by_path} or {full})"


def _mean_step_by_rank(step: str) -> str:
    return (
        f"sum by ({RANK_KEY}) ({_rate(HIST + '_sum', step)})"
        f" / sum by ({RANK_KEY}) ({_rate(HIST + '_count', step)})"
    )


DASHBOARDS = {
    "otelprof-system.json": system_dashboard,
    "otelprof-training.json": training_dashboard,
}


def render(name: str) -> str:
    """The exact text of one dashboard file."""
    built = DASHBOARDS[name]().build()
    return json.dumps(built, cls=JSONEncoder, indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    for name in DASHBOARDS:
        (HERE / name).write_text(render(name))
        print(HERE / name)


if __name__ == "__main__":
    main()
