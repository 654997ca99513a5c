"""Serialize a gauge point's start time, which the SDK's OTLP encoders leave out.

otelprof sets a rate gauge's `start_time_unix_nano` (optional for gauges in OTLP) to its
window's start (`_stamps`); the SDK's protobuf and JSON encoders (1.45) copy it only for
sums and histograms. `install()` wraps whichever of them are loaded; a point without a
start time (every one the SDK makes itself) encodes exactly as before. Reference counted:
the last `uninstall()` restores the originals.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from otelprof._otel_compat import GAUGE_ENCODERS
from otelprof._patch import Patch

(_PROTO, _PROTO_ENCODE), (_JSON, _JSON_ENCODE) = GAUGE_ENCODERS

_lock = threading.Lock()
_users = 0
_patches: dict[str, Patch] = {}


def _proto_encode_metric(original: Callable[..., Any]) -> Callable[..., Any]:
    def encode_metric(metric: Any, pb2_metric: Any) -> Any:
        result = original(metric, pb2_metric)
        if type(metric.data).__name__ == "Gauge":
            encoded = pb2_metric.gauge.data_points
            for point, pb2_point in zip(metric.data.data_points, encoded, strict=False):
                if point.start_time_unix_nano:
                    pb2_point.start_time_unix_nano = point.start_time_unix_nano
        return result

    return encode_metric


def _json_encode_gauge_point(original: Callable[..., Any]) -> Callable[..., Any]:
    def encode_gauge_data_point(data_point: Any) -> Any:
        encoded = original(data_point)
        if data_point.start_time_unix_nano:
            encoded.start_time_unix_nano = data_point.start_time_unix_nano
        return encoded

    return encode_gauge_data_point


_TARGETS = (
    (_PROTO, _PROTO_ENCODE, _proto_encode_metric),
    (_JSON, _JSON_ENCODE, _json_encode_gauge_point),
)


def install() -> None:
    """Wrap the gauge encoders of the loaded OTLP encoder modules (reference counted)."""
    global _users
    with _lock:
        _users += 1
        for module_name, attribute, wrap in _TARGETS:
            if module_name in _patches:
                continue
            module = sys.modules.get(module_name)
            original = getattr(module, attribute, None)
            if module is None or original is None:
                continue  # exporter not in use, or an SDK that no longer has the function
            _patches[module_name] = Patch(module, attribute, wrap(original))


def uninstall() -> None:
    """The last user gone: put the original encoder functions back."""
    global _users
    with _lock:
        _users = max(0, _users - 1)
        if _users:
            return
        for patch in _patches.values():
            patch.restore()
        _patches.clear()
