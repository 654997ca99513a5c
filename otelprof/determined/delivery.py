"""Delivery to the master: one queue per (trial, group), a lane, so a failing or unanswered
report never delays another lane.

A lane is answered in order (stepsCompleted only grows; a group's rows are charted in
arrival order); a few workers take the head of any ready lane, and a failed lane waits out
its own backoff. The master's answer (`classify.py`) decides the rest: accepted is acked in
the spool; refused for good is moved into the spool's refused store, counted and logged
once per kind of message; a master-wide failure (unreachable, 502/503/504, database down)
pauses every lane under one shared backoff with jitter, so an outage costs one probe; a
failure of this report backs off its lane alone; an unrecognised 500 is retried
`max_unknown_attempts` times, then moved aside.

Exactly once: a report that may have reached the master without its answer reaching us (a
timeout after sending, a proxy's 502/504, a crash between POST and answer) is looked up on
the master (`DeterminedClient.already_stored`) before it is sent again.
"""

from __future__ import annotations

import heapq
import logging
import random
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from otelprof.determined.client import DeterminedClient, Outcome, PostResult
from otelprof.determined.spool import DiskSpool, Item, MemorySpool

log = logging.getLogger("otelprof.determined")

_MAX_LOGGED = 1000  # distinct refusal messages remembered for "log once"
_GROUP_CLAUSE = re.compile(r"\(add trial metrics [^)]*\)")
_NUMBER = re.compile(r"\d+")


def _kind(message: str) -> str:
    """A refusal message without its group and numbers (trial, run ids, steps)."""
    return _NUMBER.sub("N", _GROUP_CLAUSE.sub("", message))


Lane = tuple[int, str]  # (trial id, group): reports of a lane are answered in order


@dataclass
class DeliveryStats:
    delivered: int = 0
    rejected: int = 0  # refused by the master for good (moved aside, kept)
    gave_up: int = 0  # unrecognised 500s moved aside after their bounded retries
    retries: int = 0
    found_stored: int = 0  # in flight at a crash, found on the master after the restart
    found_stored_after_lost_response: int = 0  # a lost answer, yet the master had it


@dataclass
class _TrialState:
    queue: deque[Item] = field(default_factory=deque)
    delay: float = 0.0  # current backoff of this trial (0: none)
    ready_at: float = 0.0
    unknown_attempts: int = 0
    maybe_sent: set[tuple[int, int]] = field(default_factory=set)
    busy: bool = False
    scheduled: bool = False  # in the ready deque or the backoff heap


class Deliverer:
    """Drains a spool into a client with `workers` threads, one lane at a time each."""

    workers = 4

    def __init__(
        self,
        spool: DiskSpool | MemorySpool,
        client: DeterminedClient,
        initial_delay_s: float = 0.5,
        max_delay_s: float = 30.0,
        max_unknown_attempts: int = 5,
    ) -> None:
        self.spool = spool
        self.client = client
        self.initial_delay_s = initial_delay_s
        self.max_delay_s = max_delay_s
        self.max_unknown_attempts = max_unknown_attempts
        self.stats = DeliveryStats()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._trials: dict[Lane, _TrialState] = {}
        self._ready: deque[Lane] = deque()
        self._backoff: list[tuple[float, Lane]] = []  # (ready_at, lane) heap
        self._generation = -1
        self._refill = True
        self._busy = 0
        self._queued = 0
        # Master-wide pause (outage): nobody posts before this time.
        self._master_delay = 0.0
        self._master_ready_at = 0.0
        self._outage_since_retries: int | None = None
        self._logged: set[tuple[int | None, str]] = set()
        self._log_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self.workers):
            thread = threading.Thread(
                target=self._run, name=f"otelprof-determined-delivery-{i}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def wake(self) -> None:
        """New reports are in the spool."""
        with self._cond:
            self._idle.clear()
            self._refill = True
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until every spooled report is answered (True) or the timeout passes."""
        return self._idle.wait(timeout_s)

    def unconfirmed(self) -> int:
        """Reports posted whose answer has not come (in flight now, or lost and not yet
        checked): the master may hold them, so they are not counted as dropped."""
        with self._cond:
            return self._busy + sum(len(s.maybe_sent) for s in self._trials.values())

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- scheduling (all under self._cond) ------------------------------------------------------
    def _load_new(self) -> None:
        generation = self.spool.dropped_generation
        if generation != self._generation and self._generation >= 0:
            # The spool dropped its oldest batches (cap): forget what they held.
            for state in self._trials.values():
                kept = deque(i for i in state.queue if self.spool.is_live(i[0]))
                self._queued -= len(state.queue) - len(kept)
                state.queue = kept
        self._generation = generation
        for item in self.spool.take_new():
            trial = (item[2].trial_id, item[2].group)
            state = self._trials.setdefault(trial, _TrialState())
            state.queue.append(item)
            self._queued += 1
            self._schedule(trial, state)
        self._refill = False

    def _schedule(self, trial: Lane, state: _TrialState) -> None:
        if state.busy or state.scheduled or not state.queue:
            return
        state.scheduled = True
        if state.ready_at > time.monotonic():
            heapq.heappush(self._backoff, (state.ready_at, trial))
        else:
            self._ready.append(trial)

    def _take(self) -> tuple[Lane, _TrialState, Item] | None:
        """The head report of the next ready lane, or None after waiting a little."""
        with self._cond:
            if self._refill:
                self._load_new()
            now = time.monotonic()
            while self._backoff and self._backoff[0][0] <= now:
                self._ready.append(heapq.heappop(self._backoff)[1])
            if self._master_ready_at > now:
                self._cond.wait(min(self._master_ready_at - now, 1.0))
                return None
            if self._outage_since_retries is not None and self._busy:
                self._cond.wait(1.0)  # during an outage one report probes the master
                return None
            while self._ready:
                trial = self._ready.popleft()
                state = self._trials[trial]
                state.scheduled = False
                while state.queue and not self.spool.is_live(state.queue[0][0]):
                    state.queue.popleft()  # dropped by the spool's cap
                    self._queued -= 1
                if not state.queue:
                    del self._trials[trial]
                    continue
                state.busy = True
                self._busy += 1
                return trial, state, state.queue[0]
            if self._busy == 0 and self._queued == 0 and not self._refill:
                self._idle.set()
            soonest = self._backoff[0][0] - now if self._backoff else 1.0
            self._cond.wait(min(1.0, max(0.0, soonest)))
            return None

    def _release(self, trial: Lane, state: _TrialState, answered: bool) -> None:
        with self._cond:
            if answered:
                state.queue.popleft()
                self._queued -= 1
            state.busy = False
            self._busy -= 1
            if not state.queue:
                del self._trials[trial]  # no state kept for trials with nothing pending
            else:
                self._schedule(trial, state)
            self._cond.notify_all()

    # -- one report ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            taken = self._take()
            if taken is None:
                continue
            trial, state, item = taken
            answered = False
            try:
                answered = self._deliver(state, item)
            except Exception as exc:  # a bad token file, a bug: keep the report, keep going
                log.error("Determined delivery failed: %s", self.client.redact(str(exc)))
                self._back_off_trial(state)
            finally:
                self._release(trial, state, answered)

    def _deliver(self, state: _TrialState, item: Item) -> bool:
        """Post one report; True when it is answered for good (delivered or moved aside)."""
        window, index, report = item
        key = (window, index)
        crashed = self.spool.maybe_delivered(window, index)
        if crashed or key in state.maybe_sent:
            stored = self.client.already_stored(report)
            if stored:
                # Posted before a crash or a lost answer and taken by the master: do not
                # store it twice.
                log.info("a %s report whose answer was lost was already stored", report.group)
                self.spool.ack(window, index)
                if crashed:
                    self.stats.found_stored += 1
                else:
                    self.stats.found_stored_after_lost_response += 1
                state.maybe_sent.discard(key)
                self._recovered(state)
                return True
            if stored is None and key in state.maybe_sent:
                self._back_off_trial(state)  # cannot tell yet: ask again later
                return False
            state.maybe_sent.discard(key)
        self.spool.mark_inflight(window, index)
        result = self.client.report(report)
        if result.outcome is Outcome.OK:
            self.spool.ack(window, index)
            self.stats.delivered += 1
        elif result.outcome is Outcome.REJECTED:
            self._move_aside(item, result, "")
        elif result.outcome is Outcome.UNKNOWN:
            state.unknown_attempts += 1
            if state.unknown_attempts < self.max_unknown_attempts:
                self.stats.retries += 1
                self._back_off_trial(state)
                return False
            self.stats.gave_up += 1
            self._move_aside(
                item, result, f" (unrecognised error, gave up after {state.unknown_attempts}"
                " attempts)",
            )  # fmt: skip
        else:  # Outcome.RETRY
            self.stats.retries += 1
            if result.maybe_stored:
                state.maybe_sent.add(key)
            if result.master_wide:
                self._back_off_master(result)
            else:
                self._back_off_trial(state)
            return False
        self._recovered(state)
        return True

    def _recovered(self, state: _TrialState) -> None:
        state.delay = 0.0
        state.ready_at = 0.0
        state.unknown_attempts = 0
        with self._cond:
            self._master_delay = 0.0
            if self._outage_since_retries is not None:
                log.warning(
                    "Determined master reachable again after %d retries; delivering %d "
                    "spooled reports",
                    self.stats.retries - self._outage_since_retries,
                    self._queued,
                )
                self._outage_since_retries = None

    def _back_off_trial(self, state: _TrialState) -> None:
        state.delay, state.ready_at = self._next_try(state.delay)

    def _back_off_master(self, result: PostResult) -> None:
        with self._cond:
            if self._master_ready_at > time.monotonic():
                return  # another worker already paused delivery for this outage
            self._master_delay, self._master_ready_at = self._next_try(self._master_delay)
            if self._outage_since_retries is None:
                self._outage_since_retries = self.stats.retries - 1
                log.warning(
                    "Determined master %s unavailable (%s); keeping reports in the spool "
                    "and retrying with backoff up to %g s",
                    self.client.master,
                    f"HTTP {result.status}: {result.message}" if result.status else result.message,
                    self.max_delay_s,
                )

    def _next_try(self, delay: float) -> tuple[float, float]:
        """(the doubled delay, when to try next): equal jitter, half the delay fixed and half
        random, so restarts do not stampede."""
        delay = min(max(delay * 2, self.initial_delay_s), self.max_delay_s)
        return delay, time.monotonic() + delay / 2 + random.uniform(0, delay / 2)

    def _move_aside(self, item: Item, result: PostResult, why: str) -> None:
        window, index, report = item
        self.spool.refuse(window, index, report, result.status, result.message + why)
        self.stats.rejected += 1
        # One line per kind of refusal: the same message for other groups, trials or run
        # ids is only counted (each refused report is in the refused store with its own).
        key = (result.status, _kind(result.message))
        with self._log_lock:
            seen = key in self._logged or len(self._logged) >= _MAX_LOGGED
            if not seen:
                self._logged.add(key)
        if seen:
            log.debug("Determined refused another %s report for trial %d", report.group,
                      report.trial_id)  # fmt: skip
            return
        log.error(
            "Determined master refused a %s report for trial %d (HTTP %s): %s%s — kept in the "
            "spool as refused, not retried; further reports refused this way (any group, "
            "trial or run id) are moved aside and counted without logging",
            report.group,
            report.trial_id,
            result.status,
            result.message,
            why,
        )
