"""The report's single pass in worker processes: one pass per file, merged in file order.

Why: decoding JSON is all of a large report's time and each file can be read on its own. A
summary is the merge, in file order, of one `summary._FilePass` per file, so the workers'
result is the serial one (figures, warnings, read statistics). Workers are forked, or
spawned where this process runs other threads (a fork copies them mid-lock) or fork does not
exist. A task is a few consecutive files (`BATCH_BYTES`, `BATCH_FILES`), not one a file.

Bounded: a worker holds one task's aggregates, and at most `2 * jobs` finished tasks wait to
be merged. Nothing waits forever: a worker that dies breaks the pool, one that stops stops
its heartbeat (`STALLED_AFTER_S`) and the workers are killed; either way the files not
merged yet are read in this process, with a warning.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Protocol, TypeVar

from otelprof.analysis.reader import ReadPlan, RunFiles, Warn, file_size

MAX_DEFAULT_JOBS = 8
"""Workers by default at most: each holds its own interpreter and one file's aggregates."""

PARALLEL_FROM_BYTES = 64 << 20
"""Below this much to read, one process reads faster than it starts workers."""

BATCH_BYTES = 4 << 20
"""A worker's task is consecutive files up to this much to read (a larger file alone)."""
BATCH_FILES = 256
"""... and at most this many files (each one's aggregates travel back on their own)."""

HEARTBEAT_S = 0.5
"""How often a worker's heartbeat thread ticks."""
STALLED_AFTER_S = 30.0
"""A worker whose heartbeat is this old is stalled (stopped, not scheduled): the report
stops waiting for it. A busy worker ticks too (the thread runs between its bytecodes), so
this is not a limit on how long a file may take."""


class FilePass(Protocol):
    """What a worker runs per file and the caller merges (`summary._FilePass`)."""

    def read_file(self, path: Path, plan: ReadPlan, warn: Warn) -> None: ...

    def merge(self, other: Any) -> None: ...


P = TypeVar("P", bound=FilePass)


def default_jobs(files: RunFiles, read_budget: int | None) -> int:
    """Worker processes for reading `files` within `read_budget`: one per CPU this process
    may run on (at most MAX_DEFAULT_JOBS) when there is enough to read, else 1 (in-process)."""
    size = files.total_bytes
    to_read = size if read_budget is None else min(size, read_budget)
    if len(files.jsonl) < 2 or to_read < PARALLEL_FROM_BYTES:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_DEFAULT_JOBS))


Task = list[tuple[Path, ReadPlan]]


def _read_task(make: Callable[[], FilePass], task: Task) -> list[tuple[FilePass, list[str]]]:
    """A worker's task: each file's aggregates, with the warnings reading it gave, in order."""
    out = []
    for path, plan in task:
        said: list[str] = []
        part = make()
        part.read_file(path, plan, said.append)
        out.append((part, said))
    return out


def _tasks(paths: Sequence[Path], plan: ReadPlan, jobs: int) -> Iterator[Task]:
    """Consecutive files, batched up to BATCH_BYTES to read and BATCH_FILES files, and to
    at most a quarter of a worker's share of the files (a run of a few files: one a task)."""
    most = max(1, min(BATCH_FILES, len(paths) // (4 * jobs)))
    task: Task = []
    size = 0
    for path in paths:
        windows = plan.windows.get(path)
        size += sum(b - a for a, b in windows) if windows else file_size(path)
        task.append((path, plan.for_file(path)))
        if size >= BATCH_BYTES or len(task) >= most:
            yield task
            task, size = [], 0
    if task:
        yield task


def _context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _heartbeat(beats: Any, pids: Any, slots: Any) -> None:
    """A worker's initializer: take a slot, then tick its time every HEARTBEAT_S from a
    thread (it stops when the process is stopped)."""
    with slots.get_lock():
        slot = slots.value
        slots.value += 1
    if slot >= len(beats):
        return  # a worker started in place of another (not this Python's pool): unwatched
    beats[slot] = time.monotonic()
    pids[slot] = os.getpid()

    def tick() -> None:
        while True:
            beats[slot] = time.monotonic()
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=tick, name="otelprof-heartbeat", daemon=True).start()


class _Stalled(Exception):
    """A worker's heartbeat stopped (its pid the argument); its workers are killed."""


class _Watch:
    """The workers' heartbeats, seen from the report process."""

    def __init__(self, context: Any, jobs: int, stalled_after_s: float) -> None:
        self.beats = context.Array("d", jobs, lock=False)
        self.pids = context.Array("i", jobs, lock=False)
        self.slots = context.Value("i", 0)
        self.stalled_after_s = stalled_after_s

    def result(self, future: Future[Any]) -> Any:
        """The future's result, or _Stalled once a worker's heartbeat is too old (every
        worker then killed, so the pool's shutdown does not wait for a stopped one)."""
        poll = min(1.0, self.stalled_after_s / 4)
        checked = time.monotonic()
        while True:
            try:
                return future.result(timeout=poll)
            except FutureTimeout:
                now = time.monotonic()
                late, checked = now - checked, now
                if late > 2 * poll + HEARTBEAT_S:
                    continue  # this process was not running (stopped with its workers)
                started = [
                    (pid, beat) for pid, beat in zip(self.pids, self.beats, strict=True) if pid
                ]
                stalled = [pid for pid, beat in started if now - beat > self.stalled_after_s]
                if stalled:
                    for pid, _beat in started:
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGKILL)
                    raise _Stalled(stalled[0]) from None


def read_in_workers(
    files: Sequence[Path],
    plan: ReadPlan,
    warn: Warn,
    jobs: int,
    make: Callable[[], P],
    stalled_after_s: float = STALLED_AFTER_S,
) -> P:
    """Every file's pass (`make()`, picklable: a class or a partial of one) from `jobs`
    worker processes, merged in file order into a pass of its own (a dead or stalled
    worker: see the module docstring)."""
    total = make()
    paths = list(files)
    merged = 0
    context = _context()
    jobs = min(jobs, len(paths))
    watch = _Watch(context, jobs, stalled_after_s)
    try:
        with ProcessPoolExecutor(
            jobs,
            mp_context=context,
            initializer=_heartbeat,
            initargs=(watch.beats, watch.pids, watch.slots),
        ) as pool:
            tasks = _tasks(paths, plan, jobs)
            waiting: deque[Future[list[tuple[FilePass, list[str]]]]] = deque(
                pool.submit(_read_task, make, task) for task in itertools.islice(tasks, 2 * jobs)
            )
            while waiting:
                parts = watch.result(waiting.popleft())
                task = next(tasks, None)
                if task is not None:  # keep the workers busy while this task merges
                    waiting.append(pool.submit(_read_task, make, task))
                for part, said in parts:
                    for message in said:
                        warn(message)
                    total.merge(part)
                    merged += 1
    except (_Stalled, BrokenProcessPool) as exc:
        if isinstance(exc, _Stalled):
            why = f"(pid {exc}) made no progress for {stalled_after_s:g} s (stopped?)"
        else:
            why = f"ended abruptly ({exc})"
        warn(
            f"a report worker process {why}; reading the other {len(paths) - merged} files in "
            "this process"
        )
        read_serially(paths[merged:], plan, warn, total, make)
    return total


def read_serially(
    files: Sequence[Path], plan: ReadPlan, warn: Warn, total: P, make: Callable[[], P]
) -> P:
    """Every file's pass, one after another in this process, merged in file order into
    `total` (the workers' result, read here)."""
    for path in files:
        part = make()
        part.read_file(path, plan.for_file(path), warn)
        total.merge(part)
    return total
