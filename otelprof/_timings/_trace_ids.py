"""Step N of every rank in one trace: trace ids and head sampling that all ranks agree on.

Why: a straggler shows only when the ranks' step spans are seen side by side. So a step's
trace id is derived, not drawn, from what every rank of one run attempt shares (run id,
attempt, phase, `StepContext.number`), and head sampling picks steps by the same inputs:
every rank writes the same steps into the same traces, with no communication. Span ids stay
random. Selection is stratified and nested (no aliasing with a loop's period; a rank at a
higher level keeps a subset of another's steps; number 0 is selected at every level, so a
one-batch phase keeps its root span): ARCHITECTURE.md, "Step N of every rank in one trace".
Nothing here runs on the training thread.
"""

from __future__ import annotations

import hashlib
import math

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
MAX_LEVEL = 48
"""Levels above it select nothing (one step in 2**48 is none in practice)."""


def _mix(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that scatters every bit."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def level_for(fraction: float) -> int | None:
    """The level keeping `fraction` of the numbers, rounded down to a power of two (None:
    none)."""
    if not fraction > 0:
        return None
    if fraction >= 1:
        return 0
    level = math.ceil(-math.log2(fraction) - 1e-12)
    return level if level <= MAX_LEVEL else None


class RunTraces:
    """Trace ids and head selection of one run attempt (every rank builds an equal one)."""

    __slots__ = ("_seeds", "attempt", "run_id")

    def __init__(self, run_id: str, attempt: int | None) -> None:
        self.run_id = run_id
        self.attempt = attempt or 0
        self._seeds: dict[str, tuple[int, int]] = {}

    def _seed(self, phase: str) -> tuple[int, int]:
        seed = self._seeds.get(phase)
        if seed is None:
            key = f"otelprof\0{self.run_id}\0{self.attempt}\0{phase}".encode()
            digest = hashlib.blake2b(key, digest_size=16).digest()
            seed = self._seeds[phase] = (
                int.from_bytes(digest[:8], "big"),
                int.from_bytes(digest[8:], "big"),
            )
        return seed

    def trace_id(self, phase: str, number: int) -> int:
        """The trace id of step (batch) `number` of `phase`: distinct for every number of a
        phase (its low half is a bijection of the number), and across phases, attempts and
        runs as random 128-bit ids are."""
        high, low = self._seed(phase)
        lower = _mix(low ^ (number * _GOLDEN))
        return ((_mix(high ^ lower) << 64) | lower) or 1

    def head_number(self, phase: str, block: int, level: int) -> int:
        """The number head sampling selects in block `block` (numbers `block << level` to
        `(block + 1 << level) - 1`) at `level`: chosen top-down, one half per level, so the
        choice at `level` lies in the choice at `level - 1`'s block."""
        if block <= 0:
            return 0  # each phase's first step, at every level (nested: 0 stays chosen)
        high = self._seed(phase)[0]
        number = block << level
        for j in range(level, 0, -1):
            bit = _mix(high ^ _mix((number >> j) * _GOLDEN + j)) & 1
            number |= bit << (j - 1)
        return number

    def head_selected(self, phase: str, number: int, level: int | None) -> bool:
        """Whether head sampling keeps step (batch) `number` of `phase` at `level`."""
        if level is None or number < 0:
            return False
        return self.head_number(phase, number >> level, level) == number

    def head_numbers(self, phase: str, low: int, high: int, level: int | None) -> frozenset[int]:
        """Every number in [low, high) head sampling selects at `level` (for the on-thread sampler:
        `level` hashes per `2**level` numbers)."""
        if level is None or high <= low:
            return frozenset()
        low = max(low, 0)
        found = (
            self.head_number(phase, block, level)
            for block in range(low >> level, ((high - 1) >> level) + 1)
        )
        return frozenset(n for n in found if low <= n < high)
