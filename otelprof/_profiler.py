"""The Profiler: builds the OTel providers, wires sources to exporters, owns the lifecycle.

Sources (system gauges, timing spans) never know about exporters and exporters never
sample; this module is the only place both are visible. Everything after `instrument()`
returns runs on background threads, and nothing here lets an exception reach training code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import SpanLimits, TracerProvider

from otelprof import _limits
from otelprof._run_end import DeferredSignals, EndRecord, RunEndWatcher
from otelprof._shutdown import finish_run
from otelprof.config import Settings
from otelprof.export import ExportCounters, build_pipelines
from otelprof.export.counters import is_loss as _is_loss
from otelprof.resource import build_resource

_log = logging.getLogger("otelprof")
_lock = threading.RLock()
_active: Profiler | None = None

SCOPE_NAME = "otelprof"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("otelprof")
    except PackageNotFoundError:
        return "0"


class Profiler:
    """A running otelprof session. Use `otelprof.instrument()` to get one.

    Also a context manager: leaving the `with` block shuts it down.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        env: dict[str, str] | None = None,
        options: dict[str, Any] | None = None,
        settled: bool = False,
    ) -> None:
        """`env`/`options`: what the settings were resolved from (ranks of a process group
        included); `settled`: the ranks came from a process group and are final."""
        self.settings = settings
        self._env = dict(os.environ) if env is None else env
        self._options = dict(options or {})
        self._settled = settled
        self.resource = build_resource(settings, self._env)
        self._counters = ExportCounters()
        self._shutdown_done = False
        self._started_ns = time.time_ns()
        attrs = self.resource.attributes
        world_size = _int_attribute(attrs.get("otelprof.world_size"), 1)
        rank = _int_attribute(attrs.get("otelprof.rank"), 0)
        attempt = attrs.get("otelprof.attempt")
        self._pipelines = build_pipelines(
            settings,
            self._counters,
            world_size=world_size,
            rank=rank,
            attempt=attempt if isinstance(attempt, int) else None,
            local_rank=_int_attribute(attrs.get("otelprof.local_rank"), 0),
        )
        self.meter_provider = MeterProvider(
            resource=self.resource, metric_readers=self._pipelines.metric_readers
        )
        # string attributes cut at the OTel value length limit, counted (otelprof/_limits.py)
        self._truncated_before = _limits.truncated
        limit = _limits.refresh()
        self.tracer_provider = TracerProvider(
            resource=self.resource, span_limits=SpanLimits(max_attribute_length=limit)
        )
        for processor in self._pipelines.span_processors:
            self.tracer_provider.add_span_processor(processor)
        self._meter = self.meter_provider.get_meter(SCOPE_NAME, _version())
        self._system = _degrade("system metrics", self._start_system_metrics)
        self._timings = _degrade("timings", self._start_timings)
        self._distributed = _degrade("distributed hooks", self._start_distributed)
        self._register_self_telemetry()
        if self._timings is not None:  # what profiling costs, in the same dashboards
            from otelprof._overhead import OverheadGauges

            self._overhead = _degrade(
                "overhead gauges", lambda: OverheadGauges(self._meter, self._timings)
            )
        self._end: EndRecord | None = None
        if settings.detached:
            self._write_run_info()
            # At warning level so it shows with logging unconfigured: where to find the run.
            _log.warning(
                "otelprof: writing run files to %s (summarize: otelprof report %s)",
                settings.run_dir,
                settings.run_dir,
            )
        self._run_end = RunEndWatcher(self._shutdown, self._mark_end, settings.export_timeout_s)
        _degrade("run-end recording", self._run_end.install)

    # -- public -------------------------------------------------------------------------

    @property
    def run_dir(self) -> Path | None:
        """Directory of this run's OTLP JSON Lines files (detached mode), else None."""
        return self.settings.run_dir if self.settings.detached else None

    @property
    def files(self) -> dict[str, Path]:
        """{"metrics": path, "traces": path} of the detached-mode files."""
        return dict(self._pipelines.files)

    @property
    def prometheus_port(self) -> int | None:
        """The port the Prometheus /metrics endpoint listens on (pull mode), else None."""
        return self._pipelines.prometheus_port

    def step(self) -> None:
        """Mark a training-step boundary (like `torch.profiler.profile.step()`)."""
        if self._timings is not None:
            self._timings.step()

    def set_epoch(self, epoch: int | None) -> None:
        """Tag the following steps' spans with `otelprof.epoch`."""
        if self._timings is not None:
            self._timings.set_epoch(epoch)

    def set_phase(self, phase: str) -> str:
        """Enter a phase ("train", "validation", "checkpoint"); returns the previous one
        (see `otelprof.phase`)."""
        if self._timings is None:
            from otelprof.timings._engine import check_phase

            check_phase(phase)
            return "train"
        return self._timings.set_phase(phase)

    def timing(self, name: str, **attributes: Any) -> Any:
        """A timing span around a block or function (see `otelprof.timing`)."""
        if self._timings is None:
            return contextlib.nullcontext()
        return self._timings.timing(name, **attributes)

    def stats(self) -> dict[str, int]:
        """Counts of what was exported, dropped or failed, per exporter and per source.

        `dropped_total` sums every item lost anywhere (queue full, failed export,
        recorder overflow), so a single number tells whether the data is complete.
        """
        counts = self._counters.snapshot()
        if self._timings is not None:
            with contextlib.suppress(Exception):
                for key, value in self._timings.stats().items():
                    counts[f"timings.{key}"] = int(value)
        counts["timings.attributes_truncated"] = _limits.truncated - self._truncated_before
        counts["dropped_total"] = sum(v for k, v in counts.items() if _is_loss(k))
        return counts

    def shutdown(self) -> None:
        """Flush every exporter and stop every thread; idempotent, never raises."""
        self._shutdown(self._run_end.end_record("shutdown"))

    def _shutdown(self, end: EndRecord) -> None:
        """Flush and stop everything, then write the run's end; returns within the export
        timeout + SHUTDOWN_MARGIN_S whatever hangs (otelprof/_shutdown.py). A SIGTERM or
        SIGINT meanwhile waits until the end is written (DeferredSignals), then acts."""
        global _active
        with DeferredSignals() as deferred:
            with _lock:
                if self._shutdown_done:
                    return
                self._shutdown_done = True
                if _active is self:
                    _active = None
            with contextlib.suppress(Exception):
                self._run_end.uninstall(deferred)
            finish_run(self, end, deferred)  # otelprof/_shutdown.py

    def _flush_all(self, end: EndRecord) -> None:
        """Shutdown's work, on its own thread (otelprof/_shutdown.py bounds it)."""
        # the ending first: a SIGKILL during the flush below must not leave the run looking
        # unfinished
        with contextlib.suppress(Exception):
            self._mark_end(end)
        # Exports still retrying after one export timeout (a collector that is down) are
        # abandoned and what they held is counted as dropped.
        watchdog = threading.Timer(self.settings.export_timeout_s, self._pipelines.abandon_exports)
        watchdog.daemon = True
        watchdog.start()
        steps: list[tuple[str, Any]] = [
            ("distributed hooks", self._distributed.remove if self._distributed else None),
            ("timings", self._timings.shutdown if self._timings else None),
            ("timing histograms", self._final_aggregates if self._timings else None),
            ("traces", self.tracer_provider.shutdown),
            ("system metrics final sample", self._system.final_sample if self._system else None),
            ("metrics", self.meter_provider.shutdown),
            ("system metrics", self._system.close if self._system else None),
            ("exporter resources", self._pipelines.close),
        ]
        for what, action in steps:
            if action is None:
                continue
            try:
                action()
            except Exception as error:
                _log.warning("otelprof: shutting down %s raised %r", what, error)
        watchdog.cancel()

    def __enter__(self) -> Profiler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._shutdown(self._run_end.end_record("context exit", exc))

    # -- wiring -------------------------------------------------------------------------

    def _start_system_metrics(self) -> Any:
        from otelprof.system import SystemMetricsSettings, register_system_metrics

        s = self.settings
        if not (s.host_metrics or s.gpus != "none" or s.process_metrics):
            return None
        return register_system_metrics(
            self._meter,
            SystemMetricsSettings(
                interval_s=s.interval_s,
                host_metrics=s.host_metrics,
                gpus=s.gpus,
                process_metrics=s.process_metrics,
                torch_cuda_memory=s.process_metrics,
            ),
        )

    def _start_timings(self) -> Any:
        if not self.settings.timings:
            return None
        from otelprof.timings import TimingsEngine

        engine = TimingsEngine(self.tracer_provider, self.settings)
        engine.start()
        from otelprof.export._aggregates import AggregateMetrics

        # every range's duration, as histograms in every metrics export (traces are sampled)
        self._aggregate_metrics = AggregateMetrics(engine.aggregates, self.resource, _version())
        self._counters.add_metric_extra(self._aggregate_metrics.merge)
        registry = self._pipelines.prometheus_registry
        if registry is not None:  # and on the pull endpoint, at each scrape
            from otelprof.export._prom_histograms import register

            _degrade(
                "timing histograms on the Prometheus endpoint",
                lambda: register(registry, engine.aggregates, self.resource.attributes, _version()),
            )
        return engine

    def _start_distributed(self) -> Any:
        from otelprof._distributed.hooks import DistributedHooks

        return DistributedHooks.start(self, self._meter)

    def _reidentify(self) -> None:
        """A process group appeared after `instrument()`: restart under its ranks (see
        otelprof/_distributed/identity.py) if they differ from the ones this run started with."""
        global _active
        from otelprof._distributed import identity

        if self._settled or self._shutdown_done:
            return
        env, options, settled = identity.resolve(self._options, self._env)
        same_run = options.get("run_id", self.settings.run_id) == self.settings.run_id
        if not settled or (same_run and not identity.differs(self.resource.attributes, env)):
            self._settled = settled
            return
        _log.info("otelprof: process group found; restarting as rank %s of %s",
                  env.get("RANK"), env.get("WORLD_SIZE"))  # fmt: skip
        old_files = dict(self._pipelines.files)
        self.shutdown()
        settings = Settings.from_options(env=env, **options)
        resource = build_resource(settings, env)
        world = _int_attribute(resource.attributes.get("otelprof.world_size"), 1)
        rank = _int_attribute(resource.attributes.get("otelprof.rank"), 0)
        attempt = resource.attributes.get("otelprof.attempt")
        if settings.detached:
            from otelprof.export.wiring import file_names

            metrics, traces = file_names(world, rank, attempt if isinstance(attempt, int) else None)
            new_files = {"metrics": settings.run_dir / metrics, "traces": settings.run_dir / traces}
            identity.relocate(old_files, new_files, resource.attributes)
        with _lock:
            self.__init__(settings, env=env, options=self._options, settled=True)  # type: ignore[misc]
            _active = self

    def _final_aggregates(self) -> None:
        """The builder has drained: the last metrics export carries the final histograms."""
        aggregate_metrics = getattr(self, "_aggregate_metrics", None)
        if aggregate_metrics is not None:
            aggregate_metrics.final = True

    def _register_self_telemetry(self) -> None:
        """Expose drops as a metric too, so they show up wherever the data goes."""

        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            for key, value in self.stats().items():
                if not _is_loss(key) or key == "dropped_total":
                    continue
                source, _, reason = key.partition(".")
                yield Observation(value, {"otelprof.source": source, "otelprof.reason": reason})

        self._meter.create_observable_counter(
            "otelprof.telemetry.dropped",
            callbacks=[observe],
            unit="{item}",
            description="Telemetry items otelprof dropped (queue full, failed export, overflow)",
        )

    def _mark_end(self, end: EndRecord | None) -> None:
        """Write how the run is ending before flushing, so a kill mid-flush keeps it
        (None: a SIGTERM the program survived was not its end after all)."""
        self._end = end
        if self.settings.detached:
            self._write_run_info()

    def _write_run_info(self, stats: dict[str, int] | None = None) -> None:
        s = self.settings
        info: dict[str, Any] = {
            "run_id": s.run_id,
            "started_unix_nano": self._started_ns,
            "resource": {k: v for k, v in self.resource.attributes.items()},
            "interval_s": s.interval_s,
            "endpoint": s.endpoint,
            "files": {k: p.name for k, p in self._pipelines.files.items()},
        }
        if isinstance(self.resource.attributes.get("otelprof.attempt"), int):
            info["attempt"] = self.resource.attributes["otelprof.attempt"]  # elastic restart
        if self._end is not None:
            info["end"] = self._end
        if stats is not None:
            info["finished_unix_nano"] = time.time_ns()
            info["stats"] = stats
        from otelprof.export.wiring import file_suffix

        res = info["resource"]
        attempt = res.get("otelprof.attempt")
        suffix = file_suffix(
            _int_attribute(res.get("otelprof.world_size"), 1),
            _int_attribute(res.get("otelprof.rank"), 0),
            attempt if isinstance(attempt, int) else None,
        )
        path = s.run_dir / f"run{suffix}.json"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(info, indent=2, default=str) + "\n")
            tmp.replace(path)
        except OSError as error:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._counters.warn_once(
                "run_json.write_error",
                "otelprof: cannot write %s (%s); the run's end and drop counts go to the "
                "metrics file's closing record instead, which `otelprof report` reads",
                path,
                error,
            )


class _BorrowedProfiler(Profiler):
    """The running profiler as seen by a nested or repeated `instrument()` call.

    Everything is the running profiler's, except that leaving a `with` block or calling
    `shutdown()` does not tear down a profiler this caller did not create (a callback, a
    library that calls `instrument()` itself). `otelprof.uninstrument()` still stops it.
    """

    def __init__(self, owner: Profiler) -> None:
        # Profiler.__init__ is skipped on purpose: every attribute is the owner's.
        object.__setattr__(self, "_owner", owner)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_owner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_owner"), name, value)

    def shutdown(self) -> None:
        """No-op: the profiler belongs to the `instrument()` call that created it."""
        _log.debug("otelprof: shutdown() of a nested instrument() ignored; the outer one owns it")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<otelprof profiler {self.settings.run_id} (nested instrument())>"


def _degrade(what: str, start: Any) -> Any:
    """Start a source; if it breaks, profile without it rather than fail the training job."""
    try:
        return start()
    except Exception:
        _log.exception("otelprof: could not start %s; continuing without them", what)
        return None


def _int_attribute(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def instrument(**options: Any) -> Profiler:
    """Start profiling this process and return the running `Profiler`.

    Options are validated before anything starts (`otelprof.ConfigError`). A second call
    while a profiler is running returns a handle on that profiler instead of doubling every
    gauge; leaving that handle's `with` block (or its `shutdown()`) leaves the profiler running.
    """
    global _active
    with _lock:
        if _active is not None:
            if options:
                _log.warning(
                    "otelprof: instrument() called again while running; options %s ignored",
                    sorted(options),
                )
            return _BorrowedProfiler(_active)
        from otelprof._distributed.identity import resolve

        env, resolved, settled = resolve(options)
        settings = Settings.from_options(env=env, **resolved)
        _active = Profiler(settings, env=env, options=options, settled=settled)
        return _active


def uninstrument() -> None:
    """Shut down the running profiler, restoring everything it patched."""
    with _lock:
        profiler = _active
    if profiler is not None:
        profiler.shutdown()


def active_profiler() -> Profiler | None:
    """The running profiler, if any."""
    return _active
