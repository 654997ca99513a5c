"""An idle span builder wakes up less often (its wake-ups are background CPU a training
loop pays for), and comes back to its interval as soon as there is work."""

from __future__ import annotations

import threading

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan

from otelprof._timings import _builder
from otelprof._timings._builder import Clock, SpanBuilder
from otelprof._timings._targets import SpanTargets


class _SleepsRecorded:
    """The builder's wake-up, standing in for one that always times out: it records how
    long each sleep would have been, submits a job during the 5th and stops the builder
    during the 8th."""

    def __init__(self, builder: SpanBuilder, ran: list[str]) -> None:
        self.builder = builder
        self.ran = ran
        self.sleeps: list[float] = []

    def set(self) -> None:
        pass

    def job(self) -> list[ReadableSpan]:
        self.ran.append("job")
        return []

    def wait(self, timeout_s: float) -> bool:
        self.sleeps.append(timeout_s)
        if len(self.sleeps) == 5:
            self.builder.submit(self.job)
        if len(self.sleeps) == 8:
            self.builder._stop.set()
        return False


def test_an_idle_builder_sleeps_longer_each_time_and_work_brings_back_its_interval() -> None:
    builder = SpanBuilder(SpanTargets(), Resource({"service.name": "t"}), Clock(), interval_s=0.2)
    ran: list[str] = []
    wakeup = _SleepsRecorded(builder, ran)
    builder._wake = wakeup  # type: ignore[assignment]
    builder._run()  # the builder thread's loop, here on the test's thread
    assert _builder.IDLE_INTERVAL_S == 1.0
    assert wakeup.sleeps == [0.2, 0.4, 0.8, 1.0, 1.0, 0.2, 0.4, 0.8]
    assert ran == ["job"]  # the job found during the 5th sleep ran right after it


def test_the_wakeup_wakes_one_sleep_however_often_it_is_set() -> None:
    wakeup = _builder._Wakeup()
    assert wakeup.wait(0.001) is False  # nothing set: the sleep times out
    threads = [threading.Thread(target=wakeup.set) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wakeup.wait(10.0) is True  # set (eight times) before the sleep: no sleep
    assert wakeup.wait(0.001) is False  # the wake-up was consumed
