"""The Profiler: the composition root that builds every part of a run and owns its lifecycle.

The only place where sources and exporters both are visible; parts are handed their
collaborators, and only the public functions read the running profiler. Nothing here lets
an exception reach training code. Design: ARCHITECTURE.md, "The composition root".
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider

from otelprof import _limits
from otelprof._run.claim import RunClaim
from otelprof._run.end import DeferredSignals, EndRecord, RunEndWatcher
from otelprof._run.layout import RunLayout
from otelprof._run.shutdown import finish_run
from otelprof._schema import (
    ATTR_ATTEMPT,
    ATTR_RANK,
    ATTR_REASON,
    ATTR_SOURCE,
    ATTR_WORLD_SIZE,
    PHASE_TRAIN,
    RUN_ENDED,
    SCOPE,
    TELEMETRY_DROPPED,
)
from otelprof._throughput import ThroughputTracker
from otelprof._timings._targets import SpanTargets
from otelprof.config import ConfigError, Settings
from otelprof.export.counters import ExportCounters
from otelprof.export.counters import is_loss as _is_loss
from otelprof.export.wiring import build_pipelines
from otelprof.resource import build_resource

_log = logging.getLogger("otelprof")
_lock = threading.RLock()
_active: Profiler | None = None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("otelprof")
    except PackageNotFoundError:
        return "0"


class _Identity:
    """Who this process is in its job, computed once per session: the settings and the
    environment they came from, the resource, and the layout of its files on disk."""

    def __init__(self, settings: Settings, env: dict[str, str], settled: bool) -> None:
        self.settings = settings
        self.env = env
        self.settled = settled
        """The ranks came from a process group and are final."""
        self.resource: Resource = build_resource(settings, env)
        attrs = self.resource.attributes
        self.world_size = _int_attribute(attrs.get(ATTR_WORLD_SIZE), 1)
        self.rank = _int_attribute(attrs.get(ATTR_RANK), 0)
        attempt = attrs.get(ATTR_ATTEMPT)
        self.attempt = attempt if isinstance(attempt, int) else None
        self.rank_known = settled or bool(env.get("RANK"))
        """A process group or the launcher gave the rank (else rank 0 is a guess)."""
        self.layout = RunLayout.of(
            settings,
            world_size=self.world_size,
            rank=self.rank,
            attempt=self.attempt,
            rank_known=self.rank_known,
        )
        """Where its files are (detached mode); the names may still be taken (`claim`)."""


class _Session:
    """One identity's parts, built in dependency order (exporters, providers, sources) and
    shut down once."""

    def __init__(
        self,
        identity: _Identity,
        *,
        layout: RunLayout | None,
        claim: RunClaim | None,
        end_run: Callable[[EndRecord], None],
        on_new_identity: Callable[[], None],
        named: Path | None = None,
        carried: Mapping[str, int] | None = None,
        started_ns: int | None = None,
    ) -> None:
        """`layout`/`claim`: the run's files and this process's claim on them (released when
        the session ends); `end_run`: what a run end (exit, exception, SIGTERM) calls;
        `on_new_identity`: what a later process group calls; `named`, `carried`,
        `started_ns`: the directory already named, the losses and the start of the sessions
        of this run before this one."""
        self.identity = identity
        settings = self.settings = identity.settings
        self.resource = identity.resource
        self.layout = layout
        self._claim = claim
        # run.json has two writers that a frozen file system can make meet: the flush thread
        # (the end, before flushing) and the end recorded after it; one writes at a time, and
        # a state older than the one on disk is not written over it
        self._run_info_lock = threading.Lock()
        self._run_info_order = itertools.count(1)
        self._run_info_written = 0
        self.counters = ExportCounters()
        self._carried = dict(carried or {})
        self.closed = False
        self.started_ns = started_ns or time.time_ns()
        self.pipelines = build_pipelines(settings, self.counters, layout=layout)
        self.meter_provider = MeterProvider(
            resource=self.resource, metric_readers=self.pipelines.metric_readers
        )
        # the builder hands recorded ranges to these, encoded for the trace file's writer
        self.span_targets = SpanTargets()
        for processor in self.pipelines.span_processors:
            self.span_targets.add_span_processor(
                processor, self.pipelines.frame_sinks.get(processor)
            )
        # string attributes cut at the OTel value length limit, counted (otelprof/_limits.py)
        self._truncated_before = _limits.truncated
        # ... and the attributes alive at once bounded in bytes, what passes it counted
        _limits.budget.limit = settings.max_attribute_bytes
        self._over_budget_before = _limits.budget.over
        self.tracer_provider = TracerProvider(
            resource=self.resource,
            active_span_processor=self.span_targets,
            span_limits=SpanLimits(max_attribute_length=_limits.refresh()),
        )
        self._meter = self.meter_provider.get_meter(SCOPE, _version())
        self._throughput: ThroughputTracker | None = None
        self._aggregate_metrics: Any = None
        self.timings: Any = None
        self.memory_peaks: Any = None
        if settings.memory_peaks and settings.timings:
            from otelprof.system.memory_peaks import PhasePeaks

            self.memory_peaks = PhasePeaks()
        self.system = _degrade("system metrics", self._start_system_metrics)
        self.timings = _degrade("timings", self._start_timings)
        self.modules: Any = None
        if self.timings is not None:
            if self.memory_peaks is not None:
                _degrade("memory peaks", lambda: self.memory_peaks.attach(self.timings))
            if settings.module_timings:
                self.modules = _degrade("module timings", self._start_module_timings)
        self.distributed = _degrade(
            "distributed hooks", lambda: self._start_distributed(on_new_identity)
        )
        self._register_self_telemetry()
        if settings.grafana_url and identity.rank == 0:  # a Determined trial's Grafana link
            _degrade("the Determined trial's Grafana link", self._start_trial_link)
        if self.timings is not None:  # what profiling costs, in the same dashboards
            from otelprof._overhead import OverheadGauges

            _degrade("overhead gauges", lambda: OverheadGauges(self._meter, self.timings))
        self._end: EndRecord | None = None
        self.announced = named is not None and named == settings.run_dir
        """The run directory was named on the console (or must never be: it moves)."""
        if settings.detached:
            self._write_run_info()
            if identity.settled or not _may_join_a_group(identity.env):
                self.announce()  # else once the directory is final (or at shutdown)
        self.run_end = RunEndWatcher(end_run, self._mark_end, settings.export_timeout_s)
        _degrade("run-end recording", self.run_end.install)

    def announce(self) -> None:
        """Name the run directory once, and only one that will hold the data (a process that
        may still join a process group waits until its ranks settle)."""
        if self.announced or not self.settings.detached:
            return
        self.announced = True
        # At warning level so it shows with logging unconfigured: where to find the run.
        _log.warning(
            "otelprof: writing run files to %s (summarize: otelprof report %s)",
            self.settings.run_dir,
            self.settings.run_dir,
        )

    def throughput(self) -> ThroughputTracker | None:
        """This run's throughput tracker, made on first use (a step listener costs every
        step something, so none is added before `step_work()` is called)."""
        tracker = self._throughput
        if tracker is not None or self.timings is None:
            return tracker
        with _lock:
            if self._throughput is None:
                self._throughput = ThroughputTracker(
                    self.timings, self.meter_provider, configured_peak=self.settings.peak_flops
                )
            return self._throughput

    def stats(self) -> dict[str, int]:
        counts = self.counters.snapshot()
        if self.timings is not None:
            with contextlib.suppress(Exception):
                for key, value in self.timings.stats().items():
                    counts[f"timings.{key}"] = int(value)
        counts["timings.attributes_truncated"] = _limits.truncated - self._truncated_before
        counts["timings.attributes_dropped_over_budget"] = (
            _limits.budget.over - self._over_budget_before
        )
        counts["timings.attribute_bytes_held"] = _limits.budget.held_bytes()
        for key, value in self._carried.items():  # sessions of this run before this one
            counts[key] = counts.get(key, 0) + value
        counts["dropped_total"] = sum(v for k, v in counts.items() if _is_loss(k))
        return counts

    def losses(self) -> dict[str, int]:
        """The loss counts so far (what a next session of this run carries on)."""
        return {k: v for k, v in self.stats().items() if _is_loss(k) and k != "dropped_total"}

    def shutdown(self, end: EndRecord, *, final: bool = True) -> None:
        """Record how the run ended, flush and stop everything, once, within a bound
        (ARCHITECTURE.md, "Shutdown"). Not `final`: a new identity goes on with the run, so
        no end is recorded."""
        with DeferredSignals() as deferred:
            with _lock:
                if self.closed:
                    return
                self.closed = True
            if final:
                with contextlib.suppress(Exception):
                    self.announce()
            with contextlib.suppress(Exception):
                self.run_end.uninstall(deferred)
            finish_run(self, end, deferred, final=final)  # otelprof/_run/shutdown.py

    def flush_all(self, end: EndRecord, final: bool = True) -> None:
        """Shutdown's work, on its own thread (otelprof/_run/shutdown.py bounds it)."""
        # the ending first: a SIGKILL during the flush below must not leave the run looking
        # unfinished
        if final:
            with contextlib.suppress(Exception):
                self._mark_end(end)
        # Exports still retrying after one export timeout (a collector that is down) are
        # abandoned and what they held is counted as dropped.
        watchdog = threading.Timer(self.settings.export_timeout_s, self.pipelines.abandon_exports)
        watchdog.daemon = True
        watchdog.start()
        steps: list[tuple[str, Any]] = [
            ("distributed hooks", self.distributed.remove if self.distributed else None),
            ("module timings", self.modules.close if self.modules else None),
            ("memory peaks", self.memory_peaks.close if self.memory_peaks else None),
            ("timings", self.timings.shutdown if self.timings else None),
            ("timing histograms", self._final_aggregates if self.timings else None),
            ("traces", self.tracer_provider.shutdown),
            ("system metrics final sample", self.system.final_sample if self.system else None),
            ("throughput totals", self._throughput.finish if self._throughput else None),
            ("metrics", self.meter_provider.shutdown),
            ("system metrics", self.system.close if self.system else None),
            ("exporter resources", self.pipelines.close),
        ]
        for what, action in steps:
            if action is None:
                continue
            try:
                action()
            except Exception as error:
                _log.warning("otelprof: shutting down %s raised %r", what, error)
        watchdog.cancel()

    # -- parts --------------------------------------------------------------------------

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
            training=self._training_progress,
            memory_peaks=self.memory_peaks,
        )

    def _training_progress(self) -> tuple[int, str] | None:
        """(training steps completed, phase) for the GPU per-step metrics, while the timings
        engine runs (read off the training thread, never written)."""
        engine = self.timings
        if engine is None or not engine.running:
            return None
        return int(engine.step_number), str(engine.phase)

    def _start_timings(self) -> Any:
        if not self.settings.timings:
            return None
        from otelprof._overhead import calibrate_range_cost
        from otelprof._timings._engine import TimingsEngine

        engine = TimingsEngine(
            self.span_targets,
            self.resource,
            self.settings,
            calibrate=calibrate_range_cost,
            version=_version(),
        )
        engine.start()
        from otelprof.export._aggregates import AggregateMetrics

        # every range's duration, as histograms in every metrics export (traces are sampled)
        self._aggregate_metrics = AggregateMetrics(engine.aggregates, self.resource, _version())
        self.counters.add_metric_extra(self._aggregate_metrics.merge)
        return engine

    def _start_module_timings(self) -> Any:
        import torch

        from otelprof._module_timings import ModuleTimings

        modules = ModuleTimings(self.settings.module_timings, torch)
        modules.start()
        return modules

    def _start_distributed(self, on_new_identity: Callable[[], None]) -> Any:
        from otelprof._distributed.hooks import DistributedHooks

        return DistributedHooks.start(self._meter, on_new_identity)

    def _final_aggregates(self) -> None:
        """The builder has drained: the last metrics export carries the final histograms."""
        if self._aggregate_metrics is not None:
            self._aggregate_metrics.final = True

    def _register_self_telemetry(self) -> None:
        """Expose drops as a metric too, so they show up wherever the data goes."""

        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            for key, value in self.stats().items():
                if not _is_loss(key) or key == "dropped_total":
                    continue
                source, _, reason = key.partition(".")
                yield Observation(value, {ATTR_SOURCE: source, ATTR_REASON: reason})

        self._meter.create_observable_counter(
            TELEMETRY_DROPPED,
            callbacks=[observe],
            unit="{item}",
            description="Telemetry items otelprof dropped (queue full, failed export, overflow)",
        )
        self._meter.create_observable_gauge(
            RUN_ENDED,
            callbacks=[lambda _o: [Observation(0 if getattr(self, "_end", None) is None else 1)]],
            description="1 once the run's end is recorded (its last exports), 0 while it runs",
        )

    def _start_trial_link(self) -> Any:
        from otelprof.determined.links import start_trial_link

        assert self.settings.grafana_url is not None
        return start_trial_link(
            self.settings.grafana_url,
            self.resource.attributes,
            add_stats=self.counters.add_source,
            add_closer=self.pipelines.closers.append,
            timeout_s=self.settings.export_timeout_s,
        )

    def _mark_end(self, end: EndRecord | None) -> None:
        """Write how the run is ending before flushing, so a kill mid-flush keeps it
        (None: a SIGTERM the program survived was not its end after all)."""
        self._end = end
        if self.settings.detached:
            self._write_run_info()

    def record_end(self, end: EndRecord, stats: dict[str, int], final: bool = True) -> None:
        """The run's end and final stats: the metrics file's closing record, then run.json,
        then the claim goes (not `final`: the files are only closed). Run off the caller's
        thread, bounded, by otelprof/_run/shutdown.py."""
        try:
            if not final:
                self.pipelines.end_files()
            elif self.layout is not None:
                self.pipelines.end_files(dict(self.resource.attributes), end, stats)
                self._end = end
                self._write_run_info(stats)
        finally:
            if self._claim is not None:
                self._claim.release()

    def _write_run_info(self, stats: dict[str, int] | None = None) -> None:
        layout = self.layout
        if layout is None:
            return
        s = self.settings
        info: dict[str, Any] = {
            "run_id": s.run_id,
            "started_unix_nano": self.started_ns,
            "resource": {k: v for k, v in self.resource.attributes.items()},
            "interval_s": s.interval_s,
            "endpoint": s.endpoint,
            "files": {k: p.name for k, p in layout.files.items()},
        }
        if self.identity.attempt is not None:
            info["attempt"] = self.identity.attempt  # elastic restart
        if self._end is not None:
            info["end"] = self._end
        if stats is not None:
            info["finished_unix_nano"] = time.time_ns()
            info["stats"] = stats
        order = next(self._run_info_order)
        with self._run_info_lock:
            if order < self._run_info_written:
                return  # a later state is on disk already
            try:
                layout.write_run_info(info)
            except OSError as error:
                self.counters.warn_once(
                    "run_json.write_error",
                    "otelprof: cannot write %s (%s); the run's end and drop counts go to the "
                    "metrics file's closing record instead, which `otelprof report` reads",
                    layout.run_info,
                    error,
                )
            else:
                self._run_info_written = order


class Profiler:
    """A running otelprof session. Use `otelprof.instrument()` to get one.

    Also a context manager: leaving the `with` block shuts it down. A nested or repeated
    `instrument()` returns a handle that shares the running profiler's session but does not
    own it: its `shutdown()` and `with` exit leave the profiler running.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        env: dict[str, str] | None = None,
        options: dict[str, Any] | None = None,
        settled: bool = False,
        _owner: Profiler | None = None,
    ) -> None:
        """`env`/`options`: what the settings were resolved from (ranks of a process group
        included); `settled`: the ranks came from a process group and are final.
        `_owner`: make a borrowed handle on that running profiler instead."""
        if _owner is not None:
            self._owner: Profiler = _owner._owner
            return
        if settings is None:
            raise TypeError("Profiler needs settings; use otelprof.instrument()")
        self._owner = self
        self._options = dict(options or {})
        self._current = self._new_session(
            _Identity(settings, dict(os.environ) if env is None else env, settled)
        )

    def _new_session(
        self,
        identity: _Identity,
        *,
        named: Path | None = None,
        before: _Session | None = None,
    ) -> _Session:
        """Claim the identity's run files (detached mode), move into them what the session
        `before` wrote (a process group appeared later), and start the session on them."""
        layout = claim = None
        carried = before.losses() if before is not None else {}
        if identity.settings.detached:
            layout, claim = _claim_or_stay(identity, before)
            if before is not None and before.layout is not None and before.layout != layout:
                moved = layout.relocate_from(before.layout, identity.resource.attributes)
                if moved.lost:
                    carried["relocation.lines_dropped"] = moved.lost
                if moved.error is not None:
                    _log.warning(
                        "otelprof: moving this process's early lines into %s: %r (%d moved, "
                        "%d lost and counted)",
                        layout.run_dir,
                        moved.error,
                        moved.lines,
                        moved.lost,
                    )
        try:
            return _Session(
                identity,
                layout=layout,
                claim=claim,
                end_run=self._end_run,
                on_new_identity=self._new_identity,
                named=named,
                carried=carried,
                started_ns=before.started_ns if before is not None else None,
            )
        except BaseException:
            if claim is not None:
                claim.release()
            raise

    @property
    def _session(self) -> _Session:
        return self._owner._current

    @property
    def _borrowed(self) -> bool:
        return self._owner is not self

    # -- public -------------------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        """The resolved configuration of this run."""
        return self._session.settings

    @property
    def resource(self) -> Resource:
        """The OTel resource every metric and span of this run carries."""
        return self._session.resource

    @property
    def tracer_provider(self) -> TracerProvider:
        """The SDK tracer provider, to add your own spans to the same pipeline."""
        return self._session.tracer_provider

    @property
    def meter_provider(self) -> MeterProvider:
        """The SDK meter provider, to add your own instruments to the same pipeline."""
        return self._session.meter_provider

    @property
    def run_dir(self) -> Path | None:
        """Directory of this run's OTLP JSON Lines files (detached mode), else None."""
        layout = self._session.layout
        return layout.run_dir if layout is not None else None

    @property
    def files(self) -> dict[str, Path]:
        """{"metrics": path, "traces": path} of the detached-mode files."""
        return dict(self._session.pipelines.files)

    def step(self) -> None:
        """Deprecated: `otelprof.step()`, the one way to mark a step boundary."""
        _deprecated("Profiler.step()", "otelprof.step()")
        timings = self._session.timings
        if timings is not None:
            timings.step()

    def set_epoch(self, epoch: int | None) -> None:
        """Deprecated: `otelprof.set_epoch(epoch)`."""
        _deprecated("Profiler.set_epoch()", "otelprof.set_epoch()")
        timings = self._session.timings
        if timings is not None:
            timings.set_epoch(epoch)

    def set_phase(self, phase: str) -> str:
        """Deprecated: `with otelprof.phase(name):`."""
        _deprecated("Profiler.set_phase()", "with otelprof.phase(name):")
        from otelprof._timings._engine import check_phase

        check_phase(phase)
        timings = self._session.timings
        return PHASE_TRAIN if timings is None else str(timings.set_phase(phase))

    def timing(self, name: str, **attributes: Any) -> Any:
        """Deprecated: `otelprof.timing(name)`."""
        _deprecated("Profiler.timing()", "otelprof.timing()")
        from otelprof._timings._recorder import timing

        return timing(name, **attributes)

    def stats(self) -> dict[str, int]:
        """Counts of what was exported, dropped or failed, per exporter and per source.

        `dropped_total` sums every item lost anywhere (queue full, failed export,
        recorder overflow), so a single number tells whether the data is complete.
        """
        return self._session.stats()

    def shutdown(self) -> None:
        """Flush every exporter and stop every thread; idempotent, never raises. A
        borrowed handle's does nothing: the profiler belongs to the call that created it."""
        if self._borrowed:
            _log.debug(
                "otelprof: shutdown() of a nested instrument() ignored; the outer one owns it"
            )
            return
        self._end_run(self._session.run_end.end_record("shutdown"))

    def __enter__(self) -> Profiler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._borrowed:
            self.shutdown()
            return
        self._end_run(self._session.run_end.end_record("context exit", exc))

    def __repr__(self) -> str:
        if self._borrowed:
            return f"<otelprof profiler {self.settings.run_id} (nested instrument())>"
        return object.__repr__(self)

    # -- internal -----------------------------------------------------------------------

    @property
    def _timings(self) -> Any:
        """The timings engine (None without timings), for tests."""
        return self._session.timings

    def _end_run(self, end: EndRecord, final: bool = True) -> None:
        """Shut the current session down and stop being the active profiler (not `final`:
        for a new session of the same run, `_new_identity`)."""
        global _active
        with _lock:
            if _active is self and not self._session.closed:
                _active = None
        self._session.shutdown(end, final=final)

    def _new_identity(self) -> None:
        """A process group appeared after `instrument()`: restart under its ranks (see
        otelprof/_distributed/identity.py) if they differ from the ones this run started with."""
        global _active
        from otelprof._distributed import identity

        session = self._session
        old = session.identity
        if old.settled or session.closed:
            return
        # rank 0 proposes the run id it already has: a directory it named stays the job's
        env, options, settled = identity.resolve(self._options, old.env, run_id=old.settings.run_id)
        same_run = options.get("run_id", old.settings.run_id) == old.settings.run_id
        if not settled or (same_run and not identity.differs(old.resource.attributes, env)):
            old.settled = settled
            if settled:
                session.announce()
            return
        _log.info("otelprof: process group found; restarting as rank %s of %s",
                  env.get("RANK"), env.get("WORLD_SIZE"))  # fmt: skip
        named = session.settings.run_dir if session.announced else None
        session.announced = True  # unnamed yet: its files move to the group's, never name it
        self._end_run(session.run_end.end_record("new identity"), final=False)
        new = _Identity(Settings.from_options(env=env, **options), env, settled=True)
        with _lock:
            self._current = self._new_session(new, named=named, before=session)
            _active = self


def _claim_or_stay(identity: _Identity, before: _Session | None) -> tuple[RunLayout, RunClaim]:
    """The identity's files, claimed; past raising (a session `before` this one), files of
    its own where another live process holds the names, or the files it began in where the
    directory cannot be made."""
    # past raising (a process group's hook), or a rank that was only guessed (a child of
    # mp.spawn before its group: its siblings guessed the same names)
    guessed = not identity.rank_known and _may_join_a_group(identity.env)
    try:
        layout, claim = identity.layout.claim(
            identity.settings.run_id, own_files_if_taken=before is not None or guessed
        )
    except ConfigError as error:
        if before is None or before.layout is None:
            raise
        _log.warning("otelprof: %s; this process's files stay in %s", error, before.layout.run_dir)
        return before.layout.claim(identity.settings.run_id, own_files_if_taken=True)
    if layout != identity.layout and before is not None:  # settled ranks: said, and flagged
        _log.warning(  # by the report (a guessed rank's own files are expected: said at INFO)
            "otelprof: %s (rank %s) is being written by another live process; this one writes "
            "%s instead (two runs with one run id?)",
            identity.layout.run_info,
            identity.rank,
            layout.run_info.name,
        )
    return layout, claim


def _degrade(what: str, start: Any) -> Any:
    """Start a source; if it breaks, profile without it rather than fail the training job."""
    try:
        return start()
    except Exception:
        _log.exception("otelprof: could not start %s; continuing without them", what)
        return None


def _may_join_a_group(env: Mapping[str, str]) -> bool:
    """Whether this process may still start torch.distributed (a launcher's variables, or a
    child of mp.spawn), and so restart under the group's run directory."""
    import multiprocessing

    launched = any(k in env for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"))
    return launched or multiprocessing.parent_process() is not None


def _int_attribute(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _deprecated(old: str, new: str) -> None:
    """A DeprecationWarning naming the replacement (shown once per calling line)."""
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)


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
            return Profiler(_owner=_active)
        from otelprof._distributed.identity import resolve

        env, resolved, settled = resolve(options)
        settings = Settings.from_options(env=env, **resolved)
        # the run's files are claimed first: a ConfigError if another run has them
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


def running_session() -> _Session | None:
    """The running profiler's session (its timings engine, its throughput tracker), if any:
    what the public per-step functions act on (`otelprof._steps`)."""
    profiler = _active
    return None if profiler is None else profiler._current
