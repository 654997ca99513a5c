"""Time spent in collectives, per rank: the signal that finds stragglers in synchronous jobs.

In synchronous training every rank's step lasts as long as the slowest's; what differs is
that fast ranks wait in the next collective. Python-level `torch.distributed` collectives
become spans `dist.<name>` (one nested in another counted once); DDP's gradient all-reduce
is timed by a comm hook registered at the model's first forward (unless the user registered
one first), span `ddp.allreduce` from this rank's last ready bucket to the reduced
gradients. The seconds add up in `totals`, read by the counter `otelprof.collective.duration`.
`async_op=True` collectives are timed to the call's return, not to `wait()`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

from otelprof._patch import Patches
from otelprof._schema import ATTR_COLLECTIVE, DDP_COLLECTIVE, DDP_SPAN
from otelprof._schema import COLLECTIVE_SPAN_PREFIX as SPAN_PREFIX
from otelprof._timings import _recorder as rec

_log = logging.getLogger("otelprof")

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
)

# op -> [nanoseconds, calls]; written from the training thread and DDP's comm threads
# (dict/list updates under the GIL), read by the metric callback.
totals: dict[str, list[int]] = {}
_enabled = False


class _Inside(threading.local):
    depth = 0


_inside = _Inside()


def _add(op: str, ns: int) -> None:
    entry = totals.get(op)
    if entry is None:
        entry = totals.setdefault(op, [0, 0])
    entry[0] += ns
    entry[1] += 1


def snapshot() -> dict[str, tuple[float, int]]:
    """{operation: (seconds, calls)} since the process started timing collectives."""
    return {op: (ns / 1e9, calls) for op, (ns, calls) in list(totals.items())}


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    span_name = SPAN_PREFIX + name

    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if not _enabled or _inside.depth:
            return fn(*args, **kwargs)
        _inside.depth += 1
        start = perf_counter_ns()
        try:
            with rec.Timing(span_name, {ATTR_COLLECTIVE: name}):
                return fn(*args, **kwargs)
        finally:
            _add(name, perf_counter_ns() - start)
            _inside.depth -= 1

    return collective


class HookState:
    """State of otelprof's DDP hook: the model's process group, and the user's own hook when
    they register one after otelprof did (it is called instead of DDP's all-reduce)."""

    def __init__(self, process_group: Any) -> None:
        self.process_group = process_group
        self.user: tuple[Any, Any] | None = None  # (state, hook)


def timed_allreduce_hook(state: HookState, bucket: Any) -> Any:
    """DDP's default all-reduce (or the user's hook), timed from this rank's last ready
    bucket to the end."""
    _inside.depth += 1  # its all_reduce call is this span, not one of its own
    try:
        if state.user is not None:
            future = state.user[1](state.user[0], bucket)
        else:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            future = allreduce_hook(state.process_group, bucket)
    finally:
        _inside.depth -= 1
    if not _enabled or not bucket.is_last():
        return future
    start = perf_counter_ns()
    ctx, parent, thread = rec.recorder.position()

    def done(fut: Any) -> Any:  # a range measured across threads
        with contextlib.suppress(Exception):  # telemetry never breaks training
            end = perf_counter_ns()
            _add(DDP_COLLECTIVE, end - start)
            if ctx is not None:
                attributes = {ATTR_COLLECTIVE: DDP_COLLECTIVE}
                rec.recorder.enqueue_measured(DDP_SPAN, attributes, start, end, ctx, parent, thread)
        return fut.value()

    return future.then(done)


def install(dist: Any, patches: Patches) -> None:
    """Time torch.distributed's collectives and DDP's all-reduce until `patches` is restored
    (which also puts `_enabled` back)."""
    c10d = dist.distributed_c10d
    for name in COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is not None:
            patches.patch_where((dist, c10d), name, original, _timed(name, original))
    _patch_ddp(patches)
    patches.patch(sys.modules[__name__], "_enabled", True)


def _patch_ddp(patches: Patches) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    original = DDP.__dict__["forward"]

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_otelprof_hook_checked", False):
            _register_hook(self)
        return original(self, *args, **kwargs)

    patches.patch(DDP, "forward", forward)
    original_register = DDP.__dict__["register_comm_hook"]

    @functools.wraps(original_register)
    def register_comm_hook(self: Any, state: object, hook: Any) -> None:
        ours: HookState | None = getattr(self, "_otelprof_hook_state", None)
        if ours is None or ours.user is not None:
            return original_register(self, state, hook)  # DDP's own checks and errors
        # otelprof's hook came first (DDP takes one): it calls the user's from now on
        if hasattr(self, "_check_comm_hook"):
            self._check_comm_hook(hook)
        ours.user = (state, hook)
        return None

    patches.patch(DDP, "register_comm_hook", register_comm_hook)


def _register_hook(model: Any) -> None:
    """Time DDP's all-reduce unless the user registered a hook of their own."""
    try:
        model._otelprof_hook_checked = True
        if getattr(model, "_comm_hooks", None):
            _log.info("otelprof: DDP model has its own comm hook; its all-reduce is not timed")
            return
        import torch
        import torch.distributed as dist

        # DDP checks the hook's annotations against the real types (strings here otherwise)
        timed_allreduce_hook.__annotations__.update(
            state=HookState,
            bucket=dist.GradBucket,
            **{"return": torch.futures.Future[torch.Tensor]},
        )
        state = HookState(model.process_group)
        model.register_comm_hook(state, timed_allreduce_hook)
        model._otelprof_hook_state = state
    except Exception as error:
        _log.info("otelprof: could not time DDP's all-reduce: %r", error)
