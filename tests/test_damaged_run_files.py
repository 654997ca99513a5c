"""`report`, `trace` and `replay` survive any damaged run file: a fuzzer over the OTLP JSON.

Wrong types at every level, truncation, deep nesting and gzip damage are each skipped with a
warning naming file and line (or file, for gzip), never a traceback; the tables name the cases
the issue found (`scopeSpans`/`spans`/`dataPoints`/`attributes` not lists, a non-numeric
`intValue`, an attribute without a key, an `arrayValue` that is not an object).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from otelprof.cli import main as cli_main
from tests.otlp_sink import OtlpSink
from tests.run_generators import RunSpec, write_sdk_run

WRONG: list[Any] = [0, -1, "x", "12x", [], {}, None, True, 1.5, float("inf"), {"x": [1]}, [[]]]
DEEP = 50_000  # deeper than the interpreter's recursion limit


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sdk_run(tmp_path_factory.mktemp("base") / "run", RunSpec(steps=4, epochs=1))


@pytest.fixture(scope="module")
def sink() -> Iterator[OtlpSink]:
    s = OtlpSink().start()
    yield s
    s.stop()


def _copy(base: Path, dest: Path) -> Path:
    shutil.copytree(base, dest)
    return dest


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def _run_all(run: Path, sink: OtlpSink, capsys: pytest.CaptureFixture[str]) -> str:
    """report, trace and replay on `run`: each returns an exit code, none raises; their
    stderr (the warnings) comes back."""
    codes = [
        cli_main(["report", str(run)]),
        cli_main(["report", "--json", str(run)]),
        cli_main(["trace", str(run), "-o", str(run.parent / "trace.json")]),
        cli_main(["replay", str(run), "--endpoint", sink.endpoint, "--timeout", "5"]),
    ]
    out = capsys.readouterr()
    assert all(isinstance(code, int) for code in codes)
    assert "Traceback" not in out.err + out.out
    return out.err


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a value inside a JSON document."""
    if isinstance(node, dict):
        items: Any = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return
    for key, value in items:
        yield (*prefix, key)
        yield from _paths(value, (*prefix, key))


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _damage_line(path: Path, number: int, change: Callable[[Any], None]) -> None:
    lines = _lines(path)
    body = json.loads(lines[number - 1])
    change(body)
    deep = '{"arrayValue": {"values": [' * 400 + '{"stringValue": "leaf"}' + "]}}" * 400
    lines[number - 1] = json.dumps(body).replace('"<deep>"', deep) + "\n"
    path.write_text("".join(lines))


def _first(body: Any, key: str) -> Any:
    """The first dict in `body` that has `key` (depth first)."""
    if isinstance(body, dict):
        if key in body:
            return body
        children: Any = body.values()
    elif isinstance(body, list):
        children = body
    else:
        return None
    for child in children:
        found = _first(child, key)
        if found is not None:
            return found
    return None


def _span(body: Any) -> Any:
    return body["resourceSpans"][0]["scopeSpans"][0]["spans"][0]


def _point(body: Any) -> Any:
    return _first(body, "dataPoints")["dataPoints"][0]


def _replace(
    key: str, value: Any, within: Callable[[Any], Any] = lambda body: body
) -> Callable[[Any], None]:
    def change(body: Any) -> None:
        _first(within(body), key)[key] = value

    return change


def _add_span_attribute(value: Any) -> Callable[[Any], None]:
    def change(body: Any) -> None:
        _span(body)["attributes"].append({"key": "otelprof.bad", "value": value})

    return change


def _span_attribute_without_key(body: Any) -> None:
    _span(body)["attributes"].append({"value": {"stringValue": "no key"}})


def _point_attribute_without_key(body: Any) -> None:
    _point(body).setdefault("attributes", []).append({"value": {"intValue": "1"}})


NAMED_DAMAGE: list[tuple[str, str, Callable[[Any], None]]] = [
    ("traces", "scopeSpans not a list", _replace("scopeSpans", 7)),
    ("traces", "spans not a list", _replace("spans", 5)),
    ("traces", "span attributes not a list", _replace("attributes", 5, _span)),
    ("traces", "span attribute without a key", _span_attribute_without_key),
    ("traces", "non-numeric intValue", _add_span_attribute({"intValue": "twelve"})),
    ("traces", "arrayValue not an object", _add_span_attribute({"arrayValue": "x"})),
    (
        "traces",
        "kvlist entry without a key",
        _add_span_attribute({"kvlistValue": {"values": [{}]}}),
    ),
    ("traces", "deeply nested arrayValue", _add_span_attribute("<deep>")),
    ("traces", "start time infinite", _replace("startTimeUnixNano", float("inf"))),
    ("metrics", "scopeMetrics not a list", _replace("scopeMetrics", 3)),
    ("metrics", "metrics not a list", _replace("metrics", 3)),
    ("metrics", "dataPoints not a list", _replace("dataPoints", 3)),
    ("metrics", "point attributes not a list", _replace("attributes", True, _point)),
    ("metrics", "point attribute without a key", _point_attribute_without_key),
    ("metrics", "point time infinite", _replace("timeUnixNano", float("inf"))),
]


@pytest.mark.parametrize(
    ("signal", "what", "change"), NAMED_DAMAGE, ids=[what for _, what, _ in NAMED_DAMAGE]
)
def test_a_wrong_typed_field_is_skipped_naming_file_and_line(
    tmp_path: Path,
    base_run: Path,
    sink: OtlpSink,
    capsys: pytest.CaptureFixture[str],
    signal: str,
    what: str,
    change: Callable[[Any], None],
) -> None:
    run = _copy(base_run, tmp_path / "run")
    target = next(run.glob(f"{signal}*.jsonl"))
    _damage_line(target, 1, change)
    err = _run_all(run, sink, capsys)
    assert f"{target}:1:" in err, err[-2000:]


def test_a_deeply_nested_line_is_skipped_naming_file_and_line(
    tmp_path: Path, base_run: Path, sink: OtlpSink, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(base_run, tmp_path / "run")
    for name in ("traces.jsonl", "metrics.jsonl"):
        path = run / name
        lines = _lines(path)
        lines.insert(1, '{"resourceSpans": ' + "[" * DEEP + "]" * DEEP + "}\n")
        path.write_text("".join(lines))
    err = _run_all(run, sink, capsys)
    assert f"{run / 'traces.jsonl'}:2:" in err and f"{run / 'metrics.jsonl'}:2:" in err


def test_a_self_looping_symlink_is_reported_not_skipped_silently(
    tmp_path: Path, base_run: Path, sink: OtlpSink, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(base_run, tmp_path / "run")
    os.symlink("loop.jsonl", run / "loop.jsonl")
    err = _run_all(run, sink, capsys)
    assert f"{run / 'loop.jsonl'}" in err and "symbolic link" in err


@pytest.mark.parametrize("seed", range(12))
def test_fuzzed_wrong_types_at_every_level_never_crash_a_reader(
    tmp_path: Path,
    base_run: Path,
    sink: OtlpSink,
    capsys: pytest.CaptureFixture[str],
    seed: int,
) -> None:
    rng = random.Random(seed)
    run = _copy(base_run, tmp_path / "run")
    for path in sorted(run.glob("*.jsonl")):
        lines = _lines(path)
        for index in rng.sample(range(len(lines)), k=min(4, len(lines))):
            body = json.loads(lines[index])
            paths = list(_paths(body))
            for where in rng.sample(paths, k=min(3, len(paths))):
                try:
                    _set(body, where, rng.choice(WRONG))
                except (KeyError, IndexError, TypeError):
                    continue  # an earlier change removed this path
            lines[index] = json.dumps(body) + "\n"
        path.write_text("".join(lines))
    _run_all(run, sink, capsys)


@pytest.mark.parametrize("seed", range(6))
def test_truncated_and_gzip_damaged_files_never_crash_a_reader(
    tmp_path: Path,
    base_run: Path,
    sink: OtlpSink,
    capsys: pytest.CaptureFixture[str],
    seed: int,
) -> None:
    rng = random.Random(seed)
    run = _copy(base_run, tmp_path / "run")
    traces, metrics = run / "traces.jsonl", run / "metrics.jsonl"
    data = traces.read_bytes()
    traces.write_bytes(data[: rng.randrange(1, len(data))])  # cut mid-line
    packed = bytearray(gzip.compress(metrics.read_bytes()))
    metrics.unlink()
    for _ in range(3):  # flip bytes inside the deflate stream
        packed[rng.randrange(10, len(packed) - 8)] ^= 1 << rng.randrange(8)
    if seed % 2:
        packed = packed[: rng.randrange(12, len(packed))]  # and cut it short
    (run / "metrics.jsonl.gz").write_bytes(bytes(packed))
    err = _run_all(run, sink, capsys)
    assert str(run / "metrics.jsonl.gz") in err or "metrics" in err


def _run_json(run: Path) -> dict[str, Any]:
    info = {
        "run_id": "r", "started_unix_nano": 1, "finished_unix_nano": 2,
        "resource": {"otelprof.rank": 0, "otelprof.world_size": 2, "host.name": "h"},
        "interval_s": 1.0, "endpoint": None, "files": {"metrics": "metrics.jsonl"},
        "end": {"how": "clean"}, "stats": {"files.spans_dropped": 1, "dropped_total": 1},
    }  # fmt: skip
    path = run / "run.json"
    if path.exists() and path.read_text().strip():
        info.update(json.loads(path.read_text()))
    return info


@pytest.mark.parametrize("seed", range(12))
def test_a_run_json_with_wrong_types_never_crashes_a_reader(
    tmp_path: Path,
    base_run: Path,
    sink: OtlpSink,
    capsys: pytest.CaptureFixture[str],
    seed: int,
) -> None:
    rng = random.Random(seed)
    run = _copy(base_run, tmp_path / "run")
    info = _run_json(run)
    paths = list(_paths(info))
    for where in rng.sample(paths, k=min(4, len(paths))):
        try:
            _set(info, where, rng.choice(WRONG))
        except (KeyError, IndexError, TypeError):
            continue
    (run / "run.json").write_text(json.dumps(info))
    (run / "run.rank1.json").write_text(json.dumps(rng.choice(WRONG)))
    _run_all(run, sink, capsys)
