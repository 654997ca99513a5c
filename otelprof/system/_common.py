"""Small pieces every sampler shares: a reading, and a log-once helper."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

AttrValue = str | int
Attributes = dict[str, AttrValue]

logger = logging.getLogger("otelprof.system")


@dataclass(frozen=True)
class Reading:
    """One observation of one instrument: sampled once, handed to every reader.

    `time_ns`: the monotonic instant of the read (`_stamps`); `start_ns`: the start of the
    window a rate averages over (None for levels).
    """

    name: str
    value: float
    attributes: Attributes = field(default_factory=dict)
    time_ns: int | None = None
    start_ns: int | None = None


class LogOnce:
    """Logs each distinct problem once, so a refused metric does not flood the log."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, key: str, level: int, message: str, *args: object) -> bool:
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
        logger.log(level, message, *args)
        return True

    def error(self, key: str, exc: BaseException, doing: str, outcome: str = "omitted") -> None:
        """A WARNING once per `key` and kind of error: "<doing> (<error>); <outcome>"."""
        key = f"{key}:{type(exc).__name__}"
        self(key, logging.WARNING, "%s (%s); %s", doing, describe(exc), outcome)


def describe(exc: BaseException) -> str:
    """An error in words: its type, and its text when it has one."""
    try:
        text = str(exc)
    except Exception:
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
