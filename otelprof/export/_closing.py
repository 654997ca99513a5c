"""The metrics file's closing record: the run's end and drop counts, in the data file itself.

Why: run.json is rewritten at the end of a run to say how it ended and what was lost. When
that rewrite fails (a read-only remount, a full disk, a replaced directory), the report
could not tell a clean close from a SIGKILL and the drop counts vanished. So, after the
last export, `shutdown()` appends one more OTLP JSON line to the metrics file (before it
rewrites run.json), through the descriptor the file's writer has held since the run began
(so a directory remounted read-only or made unwritable since does not stop it): a gauge
`otelprof.run.end` = 1 whose point carries the end record (`otelprof.end`, JSON) and the
run's counts (`otelprof.stats`, JSON). It is ordinary OTLP
(the collector's otlpjsonfile receiver and `replay` pass it on as a gauge), written whole
or not at all, and never past the metrics file's size cap. The reading side (which the
report uses to fill an unfinalized run.json) is otelprof/_run/closing_record.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from otelprof._run.closing_record import CLOSING_METRIC
from otelprof.export._appendfile import GONE, WRITE_ERROR, WRITTEN
from otelprof.export._metriclines import SIZE_CAP, MetricLineStream
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
    stream: MetricLineStream,
    resource: Mapping[str, Any],
    end: Mapping[str, Any],
    stats: Mapping[str, int],
) -> bool:
    """Append the closing record through the metrics file's own descriptor and close it;
    False (logged with the reason) if it could not be written."""
    outcome = stream.end(closing_line(resource, end, stats))
    if outcome == WRITTEN:
        return True
    if outcome == SIZE_CAP:
        why = "it is at its size cap"
    elif outcome == GONE:
        why = "the file is gone (its run directory removed)"
    elif outcome == WRITE_ERROR:
        why = str(stream.last_error or "write error")
    else:
        why = f"the file was {outcome} before"
    _log.warning(
        "otelprof: cannot write the closing record (the run's end and drop counts) to %s: %s",
        stream.path,
        why,
    )
    return False
