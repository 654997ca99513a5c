"""One real attached-mode run through collector → Prometheus, shared by tests and scripts.

`run_pipeline()` starts the built collector (collector-config/otelcol.yaml) and a private
Prometheus, trains a small PyTorch model on the CPU under `otelprof.instrument(endpoint=...)`
exporting OTLP gRPC, and waits until Prometheus has every step's timings. The end-to-end
tests assert on the result; the dashboard tests and scripts/render_dashboards.py run every
dashboard query against the same Prometheus.

What is real: the collector, Prometheus, PyTorch, otelprof's profiler, system gauges and
exporters. What is synthetic, and says so: this machine has no GPU, so a second OTLP feed
runs otelprof's own GPU gauges (otelprof.system) over a scripted NVML driver
(tests/fake_nvml.py). Its resource carries `otelprof.synthetic="fake-nvml"`, which becomes
the Prometheus label `otelprof_synthetic`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.fake_nvml import (
    GPM_DRAM,
    GPM_NVLINK_RX,
    GPM_NVLINK_TX,
    GPM_OCCUPANCY,
    GPM_PCIE_RX,
    GPM_PCIE_TX,
    GPM_SM,
    GPM_TENSOR,
)
from tests.otlp_sink import OtlpSink
from tests.services import Collector, Prometheus, start_collector, start_prometheus, wait_for
from tests.spec import DETERMINED_TIMINGS

# The timing names of Determined's profiler, each opened once per step by the loop below.
STEP_SPAN = "step"

# Environment of the training process: the second node's first process of four, so that the
# rank label cannot pass by being the default 0 (and host metrics stay on), inside a
# Determined trial (the ids become resource attributes and labels).
RANK_ENV = {
    "RANK": "2",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "DET_EXPERIMENT_ID": "17",
    "DET_TRIAL_ID": "42",
    "DET_TRIAL_RUN_ID": "1",
    "DET_AGENT_ID": "agent-e2e",
    # the job's id (resource otelprof.run_id, label otelprof_run_id: the dashboards' $run);
    # the synthetic GPU feed builds its resource under the same environment, so it agrees
    "OTELPROF_RUN_ID": "e2e-job",
}

SYNTHETIC_GPUS = 2


@dataclass
class TrainingResult:
    steps: int
    step_times_s: list[float]
    stats: dict[str, int]
    resource: dict[str, Any]


@dataclass
class PipelineRun:
    """Everything a test needs to query what one run left behind."""

    collector: Collector
    prometheus: Prometheus
    tempo: OtlpSink  # a real OTLP gRPC server behind the collector's otlp_grpc/tempo exporter
    training: TrainingResult
    service_name: str
    gpu_uuids: list[str]
    started: float
    finished: float
    extras: dict[str, Any] = field(default_factory=dict)
    complete_at: float = 0.0
    """A time at which Prometheus holds all of the run (set by `wait_until_complete`):
    instant queries about the run are made at it, so they do not depend on how long after
    the run a test happens to ask (series go stale once the collector expires them)."""

    @property
    def steps(self) -> int:
        return self.training.steps

    @property
    def host_name(self) -> str:
        return str(self.training.resource["host.name"])

    @property
    def rank(self) -> str:
        return str(self.training.resource["otelprof.rank"])

    @property
    def run_id(self) -> str:
        return str(self.training.resource["otelprof.run_id"])

    @property
    def traces_file(self) -> Path:
        return self.collector.debug_dir / "traces.jsonl"

    def stop(self) -> None:
        for stop in (self.prometheus.stop, self.collector.stop, self.tempo.stop):
            with contextlib.suppress(Exception):
                stop()


def training_loop(
    prof: Any, *, steps: int | None = None, should_stop: Any = None, pause_s: float = 0.02
) -> list[float]:
    """A real CPU training loop instrumented with otelprof's public API.

    Every step opens the six Determined timings inside the step span; the model, loss,
    optimizer and scheduler are ordinary PyTorch. Runs `steps` steps, or until
    `should_stop()` is true; returns each step's wall time (seconds).
    """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import otelprof

    torch.manual_seed(0)
    batch = 32
    data = TensorDataset(torch.randn(64 * batch, 64), torch.randint(0, 8, (64 * batch,)))
    loader = DataLoader(data, batch_size=batch, shuffle=True, drop_last=True)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    loss_fn = nn.CrossEntropyLoss()
    # the usual estimate of a training step's FLOPs: 6 x parameters x samples
    step_flops = 6 * sum(p.numel() for p in model.parameters()) * batch
    device = torch.device("cpu")
    step_times: list[float] = []
    losses: list[torch.Tensor] = []
    batches = iter(loader)
    while (steps is None or len(step_times) < steps) and not (should_stop and should_stop()):
        t0 = time.perf_counter()
        with otelprof.timing("dataloader_next"):
            try:
                x, y = next(batches)
            except StopIteration:  # next epoch
                batches = iter(loader)
                x, y = next(batches)
        with otelprof.timing("to_device"):
            x, y = x.to(device), y.to(device)
        with otelprof.timing("train_batch"):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
        with otelprof.timing("step_lr_schedulers"):
            scheduler.step()
        with otelprof.timing("from_device"):
            losses.append(loss.detach().to("cpu"))
            del losses[:-10]
        with otelprof.timing("reduce_metrics"):
            float(torch.stack(losses).mean())
        otelprof.step_work(samples=batch, tokens=batch * 64, flops=step_flops)
        otelprof.step()
        step_times.append(time.perf_counter() - t0)
        if pause_s:
            time.sleep(pause_s)  # a few steps per gauge interval, like a real job's cadence
    return step_times


def train(
    endpoint: str,
    *,
    steps: int,
    service_name: str,
    interval_s: float = 0.5,
    pause_s: float = 0.15,
) -> TrainingResult:
    """`training_loop` under `otelprof.instrument(endpoint=...)` (attached mode, OTLP gRPC).

    The pause between steps spreads the run over several span batches, span_metrics flushes
    and scrapes (40 steps: ~6 s), so that rate() windows see the counters grow, as they
    would in a long job; without it the whole run fits in one flush.
    """
    import otelprof

    otelprof.set_peak_flops(1e12)  # a declared peak: MFU on a CPU
    prof = otelprof.instrument(endpoint=endpoint, interval=interval_s, service_name=service_name)
    try:
        step_times = training_loop(prof, steps=steps, pause_s=pause_s)
    finally:
        resource = dict(prof.resource.attributes)
        prof.shutdown()
        otelprof.set_peak_flops(None)
    return TrainingResult(len(step_times), step_times, prof.stats(), resource)


class SyntheticGpuFeed:
    """otelprof's GPU gauges over a scripted NVML driver, exported OTLP gRPC to a collector.

    Synthetic on purpose (no GPU here); the values follow the training run's cadence:
    utilization 35-95 %, memory used rising, power and temperature varying.
    """

    def __init__(self, endpoint: str, resource: dict[str, Any], interval_s: float = 0.5) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource

        from otelprof.system import SystemMetricsSettings, register_system_metrics
        from tests.fake_nvml import NVML_ERROR_NOT_SUPPORTED, FakeGpu, FakeNvml

        self.gpus = [
            FakeGpu(
                uuid=f"GPU-{i}{i}{i}{i}5e7e-0000-4000-8000-00000000000{i}",
                memory_total=80 * 2**30,
                # no sample buffer: the sampler falls back to nvmlDeviceGetUtilizationRates
                errors={"nvmlDeviceGetSamples": NVML_ERROR_NOT_SUPPORTED},
                gpm_supported=True,  # Hopper-like: SM/tensor activity, bandwidth, PCIe, NVLink
                processes=[(os.getpid(), (2 + i) * 2**30)],  # this job's share of the GPU
            )
            for i in range(SYNTHETIC_GPUS)
        ]
        attributes = dict(resource)
        attributes["service.instance.id"] = f"{resource.get('service.instance.id')}-fake-nvml"
        attributes["otelprof.synthetic"] = "fake-nvml"
        self.provider = MeterProvider(
            resource=Resource.create(attributes),
            metric_readers=[
                PeriodicExportingMetricReader(
                    OTLPMetricExporter(endpoint=endpoint, insecure=True),
                    export_interval_millis=int(interval_s * 1000),
                )
            ],
        )
        self.handle = register_system_metrics(
            self.provider.get_meter("otelprof"),
            SystemMetricsSettings(
                interval_s=interval_s,
                host_metrics=False,
                gpus="all",
                process_metrics=False,
                torch_cuda_memory=False,
            ),
            nvml=FakeNvml(self.gpus),
            env={},
            training=_job_training,  # the job's steps and phase, as the Profiler hands them
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drive, name="fake-nvml", daemon=True)
        self._thread.start()

    def _drive(self) -> None:
        tick = 0
        while not self._stop.wait(0.2):
            tick += 1
            for i, gpu in enumerate(self.gpus):
                gpu.utilization_rate = 35 + (tick * 7 + i * 20) % 61
                gpu.memory_used = min(gpu.memory_total, (8 + i * 4) * 2**30 + tick * 2**26)
                gpu.power_mw = 150_000 + gpu.utilization_rate * 2_500
                gpu.temperature_c = 45 + gpu.utilization_rate // 4
                gpu.energy_mj += gpu.power_mw // 5
                u = gpu.utilization_rate
                gpu.run(
                    0.2,
                    **{
                        f"m{GPM_SM}": u * 0.8,
                        f"m{GPM_OCCUPANCY}": u * 0.4,
                        f"m{GPM_TENSOR}": u * 0.5,
                        f"m{GPM_DRAM}": u * 0.6,
                        f"m{GPM_PCIE_TX}": 100.0 + u,
                        f"m{GPM_PCIE_RX}": 400.0 + u,
                        f"m{GPM_NVLINK_TX}": 2000.0 + 10 * u,
                        f"m{GPM_NVLINK_RX}": 2000.0 + 10 * u,
                    },
                )

    @property
    def uuids(self) -> list[str]:
        return [gpu.uuid for gpu in self.gpus]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.provider.force_flush()
        self.handle.close()
        self.provider.shutdown()


def _job_training() -> tuple[int, str] | None:
    """(steps completed, phase) of the job's running profiler, for the GPU per-step and
    idle-by-phase figures (what `_Session` passes its own GPU sampler)."""
    from otelprof._profiler import active_profiler

    prof = active_profiler()
    return prof._session._training_progress() if prof is not None else None


@contextlib.contextmanager
def rank_environment() -> Iterator[None]:
    import os

    saved = {k: os.environ.get(k) for k in RANK_ENV}
    os.environ.update(RANK_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_pipeline(workdir: Path, *, steps: int = 40, timeout_s: float = 180.0) -> PipelineRun:
    """Start the services, train, feed synthetic GPU gauges, wait until Prometheus has it all.

    The caller must call `.stop()` on the result (the fixture and the script do).
    """
    service_name = f"e2e-{uuid.uuid4().hex[:8]}"
    tempo = OtlpSink().start()
    collector = start_collector(
        workdir / "otelcol",
        traces_exporters=["span_metrics", "otlp_grpc/tempo", "file/traces"],
        metrics_exporters=["prometheus"],
        extra_env={
            "OTELCOL_TEMPO_ENDPOINT": f"127.0.0.1:{tempo.port}",
            # the tests query this run's series at "now", minutes after it ended; the
            # shipped expiry (a finished job leaves the dashboards) has a test of its own
            "OTELCOL_METRIC_EXPIRATION": "1h",
        },
    )
    prometheus: Prometheus | None = None
    try:
        prometheus = start_prometheus(workdir / "prometheus", collector=collector)
        started = time.time()
        with rank_environment():
            from otelprof.config import Settings
            from otelprof.resource import build_resource

            resource = dict(
                build_resource(Settings.from_options(service_name=service_name)).attributes
            )
        gpu_feed = SyntheticGpuFeed(collector.otlp_endpoint, resource)
        try:
            with rank_environment():
                training = train(collector.otlp_endpoint, steps=steps, service_name=service_name)
            time.sleep(1.0)  # a couple more GPU samples after the last step
        finally:
            gpu_feed.stop()
        run = PipelineRun(
            collector=collector,
            prometheus=prometheus,
            tempo=tempo,
            training=training,
            service_name=service_name,
            gpu_uuids=gpu_feed.uuids,
            started=started,
            finished=time.time(),
        )
        wait_until_complete(run, timeout_s)
        return run
    except BaseException:
        if prometheus is not None:
            prometheus.stop()
        collector.stop()
        tempo.stop()
        raise


def wait_until_complete(run: PipelineRun, timeout_s: float) -> None:
    """Wait until Prometheus counts every step of every timing (the last flush arrived)."""
    names = "|".join((*DETERMINED_TIMINGS, STEP_SPAN))
    query = (
        f'sum by (span_name) (traces_span_metrics_calls_total{{service_name="{run.service_name}",'
        f'span_name=~"{names}"}})'
    )

    def complete() -> bool:
        counts = {
            s["metric"]["span_name"]: float(s["value"][1]) for s in run.prometheus.query(query)
        }
        return len(counts) == len(DETERMINED_TIMINGS) + 1 and all(
            v >= run.steps for v in counts.values()
        )

    wait_for(
        complete,
        timeout_s=timeout_s,
        what=f"Prometheus to count {run.steps} calls of every timing ({query})",
        interval_s=0.5,
        on_timeout=lambda: run.collector.process.log_tail() if run.collector.process else "",
    )
    # and the last gauge samples of both feeds: a scrape taken after the run finished, of
    # every synthetic GPU and of the training process's host gauges
    selector = f'service_name="{run.service_name}"'
    feeds = {
        f'timestamp(hw_gpu_utilization_ratio{{{selector},otelprof_synthetic="fake-nvml"}})': (
            SYNTHETIC_GPUS
        ),
        f"timestamp(system_cpu_utilization_ratio{{{selector}}})": 1,
    }

    def scraped_after_the_run() -> float | None:
        stamps = []
        for query, series in feeds.items():
            found = [float(s["value"][1]) for s in run.prometheus.query(query)]
            if len(found) < series or min(found) < run.finished:
                return None
            stamps.extend(found)
        return max(stamps)

    run.complete_at = wait_for(
        scraped_after_the_run,
        timeout_s=timeout_s,
        what=f"Prometheus to scrape both feeds of {run.service_name} after the run",
        interval_s=0.5,
    )
