"""Reading the metrics file's closing record (written by otelprof/export/_metriclines.py).

Why: when run.json's final rewrite fails, the report still has to tell a clean close from
a kill and show what was dropped: the last line of the metrics file, a gauge
`otelprof.run.end` carrying the end record and the counts, tells it. Standard library only,
so the readers (`report`, `trace`) import it without the exporters.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from otelprof._schema import ATTR_END, ATTR_STATS, CLOSING_RECORD

TAIL_BYTES = 1 << 20
"""A plain metrics file's closing record is looked for in its last MiB (it is ~1-3 KB)."""


def is_closing_request(request: Any) -> bool:
    """Whether a parsed metrics line is a closing record (one resource, scope and metric:
    `otelprof.run.end`). `replay` leaves it out: a live run never sends it."""
    try:
        (rm,) = request["resourceMetrics"]
        (sm,) = rm["scopeMetrics"]
        (metric,) = sm["metrics"]
    except (KeyError, TypeError, ValueError):
        return False
    return isinstance(metric, dict) and metric.get("name") == CLOSING_RECORD


def _last_line(path: Path) -> bytes | None:
    """The last line in the file's last TAIL_BYTES (a gzip file is read through in chunks of
    that size: no line, however long, is held whole)."""
    try:
        if path.name.endswith(".gz"):
            tail = b""
            with gzip.open(path, "rb") as handle:
                while chunk := handle.read(TAIL_BYTES):
                    tail = (tail + chunk)[-TAIL_BYTES:]
        else:
            with path.open("rb") as handle:
                size = handle.seek(0, 2)
                handle.seek(max(0, size - TAIL_BYTES))
                tail = handle.read()
        lines = [line for line in tail.splitlines() if line.strip()]
        return lines[-1] if lines else None
    except (OSError, EOFError, ValueError):  # damaged or unreadable: no closing record
        return None


def read_closing_record(path: Path) -> dict[str, Any] | None:
    """{"end", "stats", "time_unix_nano"} from the last line of a metrics file, if it is a
    closing record; None otherwise (a killed run has none)."""
    line = _last_line(path)
    if line is None or CLOSING_RECORD.encode() not in line:
        return None
    try:
        request = json.loads(line)
        metric = request["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][0]
        if metric.get("name") != CLOSING_RECORD:
            return None
        point = metric["gauge"]["dataPoints"][0]
        attrs = {a["key"]: a["value"].get("stringValue") for a in point["attributes"]}
        end = json.loads(attrs[ATTR_END])
        stats = json.loads(attrs[ATTR_STATS])
        when = int(point["timeUnixNano"])
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    if not isinstance(end, dict) or not isinstance(stats, dict):
        return None
    return {"end": end, "stats": stats, "time_unix_nano": when}


def completed_by_closing_record(info: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """run.json `info` as it would have been finalized, when its own rewrite failed but the
    metrics file carries a closing record; `info` unchanged otherwise."""
    if "finished_unix_nano" in info:
        return info
    files = info.get("files")
    name = files.get("metrics") if isinstance(files, dict) else None
    if not isinstance(name, str) or "/" in name or name.startswith("."):
        return info
    record = read_closing_record(run_dir / name)
    if record is None:
        return info
    return {
        **info,
        "end": record["end"],
        "stats": record["stats"],
        "finished_unix_nano": record["time_unix_nano"],
        "finalized_by": "closing record (run.json could not be rewritten)",
    }
