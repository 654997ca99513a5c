"""What a master's answer means for a report: delivered, retry, or never (by its message).

A real 0.38.1 master answers permanent refusals (a stale run id, a key conflict, a missing
stepsCompleted...) and a database outage alike with HTTP 500 (reference §0), so the
master's message, not the status, tells "try again later" from "never". A 500 recognised
as neither is `UNKNOWN`: retried a bounded number of times by the deliverer, then moved
aside like a permanent refusal.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Outcome(enum.Enum):
    OK = "ok"
    RETRY = "retry"  # transient: the report stays queued and is retried with backoff
    REJECTED = "rejected"  # permanent: the master will never take this report
    UNKNOWN = "unknown"  # an unrecognised 500: retried a few times, then moved aside


@dataclass(frozen=True)
class PostResult:
    outcome: Outcome
    status: int | None
    message: str
    # The master may hold the report although no success came back (lost response): ask
    # it before sending again, as profiling groups have no idempotency.
    maybe_stored: bool = False
    # The failure is the master's (down, database gone), not this report's: pause
    # delivery of every trial, not just this one.
    master_wide: bool = False


# Messages of the real master's refusals that no retry can change (reference §0).
PERMANENT_MESSAGES = re.compile(
    r"invalid run id|conflicting key|overwriting existing metric keys is not supported"
    r'|overwriting batch metrics is not supported|null value in column "total_batches"'
    r"|violates check constraint|violates not-null constraint|cannot add metric with non numeric"
    r"|nil pointer dereference|metric group cannot contain|invalid input syntax"
)

# A 500 that says the database (not the report) is the problem: PostgreSQL's connection
# and availability SQLSTATE classes 08/53/57, serialization failures 40001/40P01, and the
# Go driver's words for an unreachable server.
TRANSIENT_MESSAGES = re.compile(
    r"SQLSTATE (08|53|57|40001|40P01)|terminating connection|failed to connect to"
    r"|connection refused|connection reset by peer|broken pipe|too many clients"
    r"|the database system is (starting up|shutting down|in recovery mode)"
    r"|conn closed|closed pool|unexpected EOF|i/o timeout|context deadline exceeded"
    r"|deadlock detected|could not serialize access"
)

_RETRY_STATUSES = {408, 429, 502, 503, 504}
# A proxy in front of the master answers these after forwarding: the master may have it.
_MAYBE_FORWARDED = {502, 504}


def classify_answer(status: int, message: str) -> PostResult:
    """Classify a non-2xx HTTP answer (status plus the master's message)."""
    if status in _RETRY_STATUSES:
        return PostResult(
            Outcome.RETRY, status, message,
            maybe_stored=status in _MAYBE_FORWARDED, master_wide=True,
        )  # fmt: skip
    if PERMANENT_MESSAGES.search(message):
        return PostResult(Outcome.REJECTED, status, message)
    if status >= 500:
        if TRANSIENT_MESSAGES.search(message):
            return PostResult(Outcome.RETRY, status, message, master_wide=True)
        return PostResult(Outcome.UNKNOWN, status, message)
    return PostResult(Outcome.REJECTED, status, message)


def classify_transport_error(exc: BaseException, message: str) -> PostResult:
    """No answer: retry. If the request may have reached the master, say so."""
    import httpx

    never_sent = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)
    return PostResult(
        Outcome.RETRY, None, message,
        maybe_stored=not never_sent, master_wide=never_sent,
    )  # fmt: skip
