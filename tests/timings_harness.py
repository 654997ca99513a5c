"""A real span pipeline for the timings tests: engine -> BatchSpanProcessor -> JSON Lines file.

The spans are read back with the tests' own OTLP reader (`tests/otlp_files.py`), so what the
tests check is what reached the detached file, not what the engine kept in memory. While a
run is up, `otelprof.step()`, `otelprof.set_epoch()` and `otelprof.phase()` act on its engine,
as they do on a running profiler's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry.exporter.otlp.json.file import FileSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from otelprof import _profiler
from otelprof._timings._engine import TimingsEngine
from otelprof._timings._targets import SpanTargets
from otelprof.config import Settings
from tests.otlp_files import Span, read_spans


class _Session:
    """What the public per-step functions act on (`_profiler.running_session`)."""

    def __init__(self, engine: TimingsEngine) -> None:
        self.timings = engine

    def throughput(self) -> None:
        return None


class _RunningProfiler:
    """Stands for the running profiler: its session's engine is the run's."""

    def __init__(self, engine: TimingsEngine) -> None:
        self._current = _Session(engine)


@dataclass
class TimingsRun:
    engine: TimingsEngine
    provider: TracerProvider
    path: Path
    settings: Settings

    def finish(self) -> list[Span]:
        """Shut the engine and provider down (flushing everything) and read the file."""
        self.engine.shutdown()
        self.provider.shutdown()
        if isinstance(_profiler._active, _RunningProfiler):
            _profiler._active = None
        return read_spans(self.path) if self.path.exists() else []


def start_run(tmp_path: Path, start: bool = True, **options: Any) -> TimingsRun:
    settings = Settings.from_options(output_dir=str(tmp_path), run_id="run", env={}, **options)
    tmp_path.mkdir(parents=True, exist_ok=True)  # validating settings creates nothing
    path = tmp_path / "traces.jsonl"
    targets = SpanTargets()  # as the Profiler builds it: the provider's active processor
    provider = TracerProvider(
        resource=Resource.create({"service.name": "timings-test", "otelprof.rank": 3}),
        active_span_processor=targets,
    )
    provider.add_span_processor(BatchSpanProcessor(FileSpanExporter(str(path))))
    engine = TimingsEngine(targets, provider.resource, settings)
    if start:
        engine.start()
    _profiler._active = _RunningProfiler(engine)  # type: ignore[assignment]
    return TimingsRun(engine, provider, path, settings)


def by_name(spans: list[Span], name: str) -> list[Span]:
    return [s for s in spans if s.name == name]


def one(spans: list[Span], name: str) -> Span:
    found = by_name(spans, name)
    assert len(found) == 1, (
        f"expected one {name!r} span, got {len(found)}: {[s.name for s in spans]}"
    )
    return found[0]
