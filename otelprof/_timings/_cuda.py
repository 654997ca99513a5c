"""Device-side durations from CUDA events, read back off the training thread.

The training thread only records an event at enter and exit (no sync);
the builder thread polls `event.query()` and reads `elapsed_time` once the exit event has
completed. `sync=True` reproduces Determined's synchronized timings instead: a
`torch.cuda.synchronize()` before the span's end timestamp, so the host duration includes
the GPU work queued inside the range.
"""

from __future__ import annotations

from collections import deque
from typing import Any

EVENT_POOL_SIZE = 1024


class CudaTimer:
    """Enter/exit hooks for timing spans on a CUDA process; events are pooled and reused."""

    def __init__(self, torch: Any, *, events: bool, sync: bool) -> None:
        self._torch = torch
        self._events = events
        self._sync = sync
        self._pool: deque[Any] = deque()
        self._is_initialized = torch.cuda.is_initialized

    def _event(self) -> Any:
        try:
            return self._pool.pop()
        except IndexError:
            return self._torch.cuda.Event(enable_timing=True)

    def enter(self) -> list[Any] | None:
        """Record the start event; None when CUDA is not in use by this process (yet)."""
        if not self._is_initialized():
            return None
        if not self._events:
            return [None, None]
        start = self._event()
        start.record()
        return [start, None]

    def exit(self, pair: list[Any]) -> None:
        if self._sync:
            self._torch.cuda.synchronize()
        if pair[0] is not None:
            end = self._event()
            end.record()
            pair[1] = end

    def ready(self, pair: list[Any]) -> bool:
        """True once the device-side duration can be read without blocking."""
        end = pair[1]
        return end is None or bool(end.query())

    def release(self, pair: list[Any]) -> None:
        """A range's events, read or never to be (its step was sampled out), go back to
        the pool: creating CUDA events costs the training thread more than reusing them
        (recording an event again just replaces what it captured)."""
        for event in pair:
            if event is not None and len(self._pool) < EVENT_POOL_SIZE:
                self._pool.append(event)
        pair[0] = pair[1] = None

    def elapsed_s(self, pair: list[Any]) -> float | None:
        """Device-side seconds between the two events, then recycle them."""
        start, end = pair
        if start is None or end is None:
            return None
        try:
            seconds = float(start.elapsed_time(end)) / 1000.0
        except Exception:
            seconds = None
        self.release(pair)
        return seconds
