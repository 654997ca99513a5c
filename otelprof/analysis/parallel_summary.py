"""The report's single pass in worker processes: one file per task, merged in file order.

Why: decoding JSON and aggregating spans is all of a large report's time, each file can be
read on its own, and a machine has more than one core. A summary is the merge, in file
order, of one `_FilePass` per file (summary.py), so the workers' result is the serial one:
the same figures, warnings and read statistics. Workers are forked (they start in
milliseconds and need no imports); where the process already runs other threads, which a
fork would copy mid-lock, or where fork does not exist, they are spawned instead.

Memory stays bounded: a worker holds one file's aggregates at a time (a read plan bounds
what it reads of a large run; the step and straggler windows close at each file's end), and
at most `2 * jobs` finished files' aggregates wait to be merged.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Protocol, TypeVar

from otelprof.analysis.reader import ReadPlan, RunFiles, Warn

MAX_DEFAULT_JOBS = 8
"""Workers by default at most: each holds its own interpreter and one file's aggregates."""

PARALLEL_FROM_BYTES = 64 << 20
"""Below this much to read, one process reads faster than it starts workers."""


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


def _read_one(
    task: tuple[Callable[[], FilePass], Path, ReadPlan],
) -> tuple[FilePass, list[str]]:
    """A worker's task: one file's aggregates, and the warnings reading it gave, in order."""
    make, path, plan = task
    said: list[str] = []
    part = make()
    part.read_file(path, plan, said.append)
    return part, said


def _context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def read_in_workers(
    files: Sequence[Path], plan: ReadPlan, warn: Warn, jobs: int, make: Callable[[], P]
) -> P:
    """Every file's pass (`make()`, picklable: a class or a partial of one) from `jobs`
    worker processes, merged in file order into a pass of its own. A worker that dies (the
    kernel's out-of-memory killer, a signal) does not hang the report: the files not merged
    yet are read in this process, with a warning."""
    total = make()
    paths = list(files)
    merged = 0
    try:
        with ProcessPoolExecutor(min(jobs, len(paths)), mp_context=_context()) as pool:
            waiting: deque[Future[tuple[FilePass, list[str]]]] = deque()
            for path in paths[: 2 * jobs]:
                waiting.append(pool.submit(_read_one, (make, path, plan.for_file(path))))
            while waiting:
                part, said = waiting.popleft().result()
                queued = merged + len(waiting) + 1
                if queued < len(paths):  # keep the workers busy while this file merges
                    path = paths[queued]
                    waiting.append(pool.submit(_read_one, (make, path, plan.for_file(path))))
                for message in said:
                    warn(message)
                total.merge(part)
                merged += 1
    except BrokenProcessPool as exc:
        warn(
            f"a report worker process ended abruptly ({exc}); reading the other "
            f"{len(paths) - merged} files in this process"
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
