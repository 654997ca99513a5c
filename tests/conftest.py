"""Shared pytest fixtures: the real collector build, Prometheus, and one full pipeline run.

Real components only. A missing collector build or Prometheus fails the test with the
command that provides it (`make collector`, `make prometheus`); nothing is skipped.

    def test_x(collector, prometheus):          # fresh pair per test, default switches
        ...
    def test_y(collector_factory, tmp_path):    # custom switches / env / started later
        c = collector_factory(traces_exporters=["span_metrics", "file/traces"])
    def test_z(pipeline_run):                   # one shared attached-mode run (session)
        pipeline_run.prometheus.query(...)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Test modules import helpers as `tests.<module>`: make the repository root importable even
# when pytest runs as `.venv/bin/pytest` (which puts only tests/ on sys.path).
_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from tests.services import (  # noqa: E402
    Collector,
    MissingComponent,
    Prometheus,
    require_collector,
    require_prometheus,
    start_collector,
    start_prometheus,
)


@pytest.fixture(scope="session")
def collector_binary() -> Path:
    """Path of otelcol-otelprof ($OTELPROF_COLLECTOR or the `make collector` cache)."""
    try:
        return require_collector()
    except MissingComponent as error:
        pytest.fail(str(error), pytrace=False)


@pytest.fixture(scope="session")
def prometheus_binary() -> Path:
    """Path of the prometheus binary (Debian's package, `make prometheus`)."""
    try:
        return require_prometheus()
    except MissingComponent as error:
        pytest.fail(str(error), pytrace=False)


@pytest.fixture
def collector_factory(collector_binary: Path, tmp_path: Path) -> Iterator[Callable[..., Collector]]:
    """Start collectors with chosen switches (see services.start_collector); all are stopped."""
    made: list[Collector] = []

    def make(**kwargs: Any) -> Collector:
        workdir = tmp_path / f"otelcol-{len(made)}"
        collector = start_collector(workdir, **kwargs)
        made.append(collector)
        return collector

    yield make
    for collector in made:
        collector.stop()


@pytest.fixture
def collector(collector_factory: Callable[..., Collector]) -> Collector:
    """A running collector with the shipped config: span_metrics on, prometheus exporter."""
    return collector_factory()


@pytest.fixture
def prometheus_factory(
    prometheus_binary: Path, tmp_path: Path
) -> Iterator[Callable[..., Prometheus]]:
    """Start private Prometheus instances (see services.start_prometheus); all are stopped."""
    made: list[Prometheus] = []

    def make(**kwargs: Any) -> Prometheus:
        prom = start_prometheus(tmp_path / f"prometheus-{len(made)}", **kwargs)
        made.append(prom)
        return prom

    yield make
    for prom in made:
        prom.stop()


@pytest.fixture
def prometheus(prometheus_factory: Callable[..., Prometheus], collector: Collector) -> Prometheus:
    """A private Prometheus scraping the `collector` fixture (honor_labels, 1 s interval)."""
    return prometheus_factory(collector=collector)


@pytest.fixture(scope="session")
def pipeline_run(
    collector_binary: Path, prometheus_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """One attached-mode training run through collector → Prometheus (tests/pipeline_run.py).

    Shared by the end-to-end and dashboard tests, so the run happens once per session.
    """
    from tests.pipeline_run import run_pipeline

    run = run_pipeline(tmp_path_factory.mktemp("pipeline"))
    try:
        yield run
    finally:
        run.stop()
