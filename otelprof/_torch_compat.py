"""Every use of PyTorch's private parts, in one place (never imports torch by itself).

Each function takes the module the caller already has and names the version it was
checked against; where the private part is gone it returns None or a safe answer and the
caller degrades rather than fails. The hot path reads torch's profiler flag itself, from
the namespace and key `profiler_flag` hands it.
"""

from __future__ import annotations

from typing import Any

CHECKED = "2.5-2.9"
"""The torch versions these private parts were checked against."""

PROFILE_START = "_prepare_trace"
"""The method of `torch.autograd.profiler.profile` every profiler start goes through."""


PROFILER_FLAG = "_is_profiler_enabled"
"""The global of `torch.autograd.profiler` every Python-level torch profiler
(torch.profiler.profile, autograd.profiler.profile, emit_nvtx/itt) sets while it records."""


def profiler_flag(torch: Any) -> tuple[dict[str, Any], str] | None:
    """(namespace, key) of torch's profiler flag, `namespace[key]` true while a torch
    profiler records (a dict read, cheaper than calling torch.autograd._profiler_enabled()), or
    None when this torch has no such flag."""
    module = getattr(getattr(torch, "autograd", None), "profiler", None)
    namespace: dict[str, Any] = getattr(module, "__dict__", None) or {}
    return (namespace, PROFILER_FLAG) if PROFILER_FLAG in namespace else None


def record_function_ops(torch: Any) -> tuple[Any, Any] | None:
    """(enter, exit) ops that open and close a torch.profiler range without a
    `record_function` object, or None when this torch lacks them."""
    try:
        ops = torch.ops.profiler
        return ops._record_function_enter_new, ops._record_function_exit._RecordFunction
    except Exception:
        return None


def profiler_enabled(torch: Any) -> bool:
    """Whether any torch profiler (Python or C++ side) is running now; True when this torch
    cannot tell (never risk a second profiler)."""
    try:
        autograd = torch.autograd
        return bool(getattr(autograd.profiler, PROFILER_FLAG) or autograd._profiler_enabled())
    except Exception:
        return True


def profile_class(torch: Any) -> Any:
    """`torch.autograd.profiler.profile` if it still starts through `PROFILE_START`."""
    cls = getattr(getattr(getattr(torch, "autograd", None), "profiler", None), "profile", None)
    return cls if callable(getattr(cls, PROFILE_START, None)) else None


def default_store(dist: Any) -> Any:
    """The default process group's key-value store, or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def queue_backward_callback(torch: Any, callback: Any) -> bool:
    """Run `callback` when the backward pass now running ends (the autograd engine's final
    callbacks, which DDP uses too); False when this torch has no such queue. Call it only
    from inside a backward pass (a gradient hook)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
        return True
    except Exception:
        return False
