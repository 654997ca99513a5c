"""The metrics file's closing record: the run's end and drop counts, in the data file itself.

Why: run.json is rewritten at the end of a run to say how it ended and what was lost. When
that rewrite fails (a read-only remount, a full disk, a replaced directory), the report
could not tell a clean close from a SIGKILL and the drop counts vanished. So, after the
last export, `shutdown()` appends one more OTLP JSON line to the metrics file (before it
rewrites run.json): a gauge `otelprof.run.end` = 1 whose point carries the end record
(`otelprof.end`, JSON) and the run's counts (`otelprof.stats`, JSON). It is ordinary OTLP
(the collector's otlpjsonfile receiver and `replay` pass it on as a gauge), written whole
or not at all, and never past the metrics file's size cap. The reading side (which the
report uses to fill an unfinalized run.json) is otelprof/_run/closing_record.py.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from otelprof._run.closing_record import CLOSING_METRIC
from otelprof.export._appendfile import WRITTEN, WholeRecordFile
from otelprof.export._spanlines import encode_attributes

_log = logging.getLogger("otelprof.export")


def closing_line(
    resource: Mapping[str, Any], end: Mapping[str, Any], stats: Mapping[str, int]
) -> bytes:
    """The closing record as one OTLP JSON line (ExportMetricsServiceRequest)."""
    point_attrs = encode_attributes(
        {
            "otelprof.end": json.dumps(dict(end), default=str, sort_keys=True),
            "otelprof.stats": json.dumps(dict(stats), sort_keys=True),
        }
    )
    metric = (
        f'{{"name":"{CLOSING_METRIC}","unit":"1","description":"The run ended: how, and what '
        f'telemetry it lost (written at shutdown)","gauge":{{"dataPoints":[{{"asInt":"1",'
        f'"timeUnixNano":"{time.time_ns()}","attributes":[{point_attrs}]}}]}}}}'
    )
    line = (
        f'{{"resourceMetrics":[{{"resource":{{"attributes":[{encode_attributes(resource)}]}},'
        f'"scopeMetrics":[{{"scope":{{"name":"otelprof"}},"metrics":[{metric}]}}]}}]}}\n'
    )
    return line.encode("utf-8")


def write_closing_record(
    path: Path,
    resource: Mapping[str, Any],
    end: Mapping[str, Any],
    stats: Mapping[str, int],
    *,
    compress: bool = False,
    max_bytes: int | None = None,
) -> bool:
    """Append the closing record to the metrics file `path`; False (logged) if it could not."""
    data = closing_line(resource, end, stats)
    if compress:
        data = gzip.compress(data, compresslevel=6)
    out = WholeRecordFile(path)
    try:
        out.open()
        if max_bytes is not None and out.size + len(data) > max_bytes:
            _log.warning("otelprof: no closing record in %s: it is at its size cap", path)
            return False
        outcome = out.append(data)
    except OSError as error:
        outcome, out.last_error = "write_error", error
    finally:
        with contextlib.suppress(OSError):
            out.close()
    if outcome != WRITTEN:
        _log.warning(
            "otelprof: cannot write the closing record to %s (%s)", path, out.last_error or outcome
        )
        return False
    return True
