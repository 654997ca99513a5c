"""Shared pytest fixtures: the real collector build, Prometheus, and one full pipeline run.

Real components only. A missing collector build or Prometheus fails the test with the
command that provides it (`make collector`, `make prometheus`); nothing is skipped.

    def test_x(collector, prometheus):          # fresh pair per test, default switches
        ...
    def test_y(collector_factory, tmp_path):    # custom switches / env / started later
        c = collector_factory(traces_exporters=["span_metrics", "file/traces"])
    def test_z(pipeline_run):                   # one shared attached-mode run (session)
        pipeline_run.prometheus.query(...)

Markers are set here, from what a test uses, never from a list of files: a test that uses
the collector or Prometheus (any fixture of `SERVICE_FIXTURES`) is `e2e`; one that starts
another process (directly, through a fixture or a helper of this package) or imports a
training framework is `slow`. `make test-fast` runs the rest: `-m "not e2e and not slow"`.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
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


# ---- markers from what a test uses --------------------------------------------------------

SERVICE_FIXTURES = frozenset(
    {
        "collector_binary",
        "prometheus_binary",
        "collector_factory",
        "collector",
        "prometheus_factory",
        "prometheus",
        "pipeline_run",
    }
)
"""Fixtures that start (or need) the real collector or Prometheus: their tests are `e2e`."""

_STARTS_A_PROCESS = re.compile(
    r"\bsubprocess\.|\bPopen\(|\bsys\.executable\b|\bmultiprocessing\b|\bos\.fork\(|"
    r"\bmp\.spawn\(|\btorchrun\b"
)
_FRAMEWORK_IMPORT = re.compile(r"^\s*(?:import|from) (?:lightning|transformers|accelerate)\b", re.M)
_NAME = re.compile(r"\b[A-Za-z_]\w*\b")


TESTS = Path(__file__).resolve().parent


@functools.cache
def _in_tests(module_name: str) -> bool:
    """Whether a module is one of the tests' own (a test module or a helper beside them)."""
    path = getattr(sys.modules.get(module_name), "__file__", None)
    return path is not None and Path(path).resolve().is_relative_to(TESTS)


@functools.cache
def _source(module_name: str) -> str:
    path = getattr(sys.modules[module_name], "__file__", None)
    return Path(path).read_text() if path else ""


@functools.cache
def _definitions(module_name: str) -> dict[str, str]:
    """A module's top-level functions and classes: name -> source (one parse per module)."""
    source = _source(module_name)
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {
        node.name: ast.get_source_segment(source, node) or ""
        for node in ast.parse(source).body
        if isinstance(node, kinds)
    }


def _starts_a_process(source: str, module_name: str, seen: set[tuple[str, str]]) -> bool:
    """Whether code starts another process, itself or through a helper it names that is
    defined in the tests (followed transitively)."""
    if _STARTS_A_PROCESS.search(source):
        return True
    module = sys.modules[module_name]
    for name in set(_NAME.findall(source)):
        ref = getattr(module, name, None)
        if isinstance(ref, ModuleType):
            if not _in_tests(ref.__name__):
                continue
            used = set(re.findall(rf"\b{name}\.(\w+)", source))
            helpers = [(ref.__name__, n) for n in _definitions(ref.__name__) if n in used]
        elif inspect.isfunction(ref) or inspect.isclass(ref):
            owner = getattr(ref, "__module__", "") or ""
            helpers = [(owner, ref.__name__)] if _in_tests(owner) else []
        else:
            helpers = []
        for key in helpers:
            if key in seen:
                continue
            seen.add(key)
            helper = _definitions(key[0]).get(key[1])
            if helper is not None and _starts_a_process(helper, key[0], seen):
                return True
    return False


def _is_slow(item: pytest.Function) -> bool:
    module_name = item.module.__name__ if item.module else ""
    if module_name and _FRAMEWORK_IMPORT.search(_source(module_name)):
        return True
    seen: set[tuple[str, str]] = set()
    functions = [item.function]
    for name in item.fixturenames:
        for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):
            func = getattr(definition, "func", None)
            if func is not None and _in_tests(getattr(func, "__module__", "") or ""):
                functions.append(func)
    for func in functions:
        try:
            source = inspect.getsource(func)
        except (OSError, TypeError):
            continue
        if _starts_a_process(source, func.__module__, seen):
            return True
    return False


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help="unit and recorder tests only (`make test-fast`): no e2e or slow test, and test "
        "modules that import a training framework are not even imported",
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With --fast, a test module that imports a framework is not imported at all (importing
    transformers alone takes seconds); its tests would all be `slow` anyway."""
    if not config.getoption("--fast") or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return bool(_FRAMEWORK_IMPORT.search(collection_path.read_text())) or None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`e2e` for tests of the collector and Prometheus, `slow` for tests that start processes
    or frameworks (see the module's docstring); --fast deselects both."""
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        if SERVICE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.e2e)
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
    if config.getoption("--fast"):
        kept = [i for i in items if not i.get_closest_marker("e2e")]
        kept = [i for i in kept if not i.get_closest_marker("slow")]
        kept_ids = {id(i) for i in kept}
        dropped = [i for i in items if id(i) not in kept_ids]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
