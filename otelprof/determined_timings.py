"""Determined's timing names as helpers, for code written against its PyTorchTrial profiler.

    from otelprof.determined_timings import from_device, reduce_metrics, to_device, train_batch

Each opens a span with Determined's name, as `otelprof.timing(<name>)` would:
`train_batch` and `reduce_metrics` are exactly that; `to_device` and `from_device` also move
the tensors of a batch (nested lists, tuples, dicts, named tuples and dataclasses) inside
their span; `instrument_lr_scheduler` times `scheduler.step()` as `step_lr_schedulers`.
`otelprof.timed_dataloader` (`dataloader_next`) and `otelprof.instrument_optimizer`
(`optimizer_step`) are otelprof's own. Every helper still does its work when no profiler
runs.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from otelprof._patch import Patch
from otelprof._schema import (
    DATALOADER_NEXT,
    FROM_DEVICE,
    REDUCE_METRICS,
    STEP_LR_SCHEDULERS,
    TO_DEVICE,
    TRAIN_BATCH,
)
from otelprof._timings._api import HookHandle
from otelprof._timings._recorder import Timing, timing

__all__ = [
    "DETERMINED_TIMINGS",
    "from_device",
    "instrument_lr_scheduler",
    "reduce_metrics",
    "to_device",
    "train_batch",
]

DETERMINED_TIMINGS = (
    DATALOADER_NEXT,
    TO_DEVICE,
    TRAIN_BATCH,
    STEP_LR_SCHEDULERS,
    FROM_DEVICE,
    REDUCE_METRICS,
)
"""The timing names of Determined's PyTorchTrial profiler, in the order a step runs them."""

T = TypeVar("T")


def train_batch(**attributes: Any) -> Timing:
    """`with train_batch():` — the `train_batch` span (forward, backward, optimizer)."""
    return timing(TRAIN_BATCH, **attributes)


def reduce_metrics(**attributes: Any) -> Timing:
    """`with reduce_metrics():` — the `reduce_metrics` span."""
    return timing(REDUCE_METRICS, **attributes)


def to_device(data: T, device: Any, non_blocking: bool = False) -> T:
    """Move every tensor in `data` to `device` under a `to_device` span."""
    with timing(TO_DEVICE):
        tensor: Any = _tensor_class or _tensor_type()
        batch: Any = data
        kind: Any = type(batch)
        if kind is tuple or kind is list:  # a flat batch (nearly every one): no call per item
            moved = []
            for value in batch:
                if not isinstance(value, tensor):
                    value = _map_tensors(value, _mover(device, non_blocking))
                elif non_blocking:
                    value = value.to(device, non_blocking=True)
                else:
                    value = value.to(device)
                moved.append(value)
            return moved if kind is list else tuple(moved)  # type: ignore[return-value]
        return _map_tensors(batch, _mover(device, non_blocking))


def from_device(data: T) -> T:
    """Detach every tensor in `data` and copy it to the host under a `from_device` span."""
    with timing(FROM_DEVICE):
        value: Any = data
        tensor: Any = _tensor_class or _tensor_type()
        if isinstance(value, tensor):  # a loss, a metric: the usual case
            return value.detach().cpu()
        return _map_tensors(value, _to_host)


def instrument_lr_scheduler(scheduler: Any, name: str = STEP_LR_SCHEDULERS) -> HookHandle:
    """Time `scheduler.step()` as a `step_lr_schedulers` span (schedulers have no hooks, so
    the instance's `step` is wrapped; `remove()` restores it)."""
    original = getattr(scheduler, "step", None)
    if not callable(original):
        raise TypeError(
            f"instrument_lr_scheduler needs an object with a step() method, "
            f"got {type(scheduler).__name__}"
        )

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        with timing(name):
            return original(*args, **kwargs)

    return HookHandle(Patch(scheduler, "step", timed_step).restore)


def _to_host(tensor: Any) -> Any:
    return tensor.detach().cpu()


def _mover(device: Any, non_blocking: bool) -> Callable[[Any], Any]:
    if non_blocking:
        return lambda tensor: tensor.to(device, non_blocking=True)
    return lambda tensor: tensor.to(device)


def _map_tensors(data: Any, move: Callable[[Any], Any]) -> Any:
    """`move` applied to every tensor in nested tuples, lists, dicts, other mappings, named
    tuples and dataclasses; anything else is returned as it is.

    Plain code rather than torch's tree utilities: `torch.utils._pytree` is private (and
    knows no dataclasses), and a batch is nearly always a tuple, list or dict of tensors,
    which the first branches move without a call per tensor."""
    tensor = _tensor_class or _tensor_type()
    kind: Any = type(data)
    if kind is tuple or kind is list:
        moved = [move(v) if isinstance(v, tensor) else _map_tensors(v, move) for v in data]
        return moved if kind is list else tuple(moved)
    if kind is dict:
        return {
            key: move(v) if isinstance(v, tensor) else _map_tensors(v, move)
            for key, v in data.items()
        }
    if isinstance(data, tensor):
        return move(data)
    if isinstance(data, Mapping):
        items = {key: _map_tensors(value, move) for key, value in data.items()}
        try:
            return kind(items)
        except Exception:
            return items
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a named tuple
        return kind(*(_map_tensors(value, move) for value in data))
    if isinstance(data, (list, tuple)):
        return kind(_map_tensors(value, move) for value in data)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        changes = {
            f.name: _map_tensors(getattr(data, f.name), move)
            for f in dataclasses.fields(data)
            if f.init
        }
        return dataclasses.replace(data, **changes)
    return data


class _NoTensor:
    """Stands for `torch.Tensor` until torch is imported: nothing is an instance of it."""


_tensor_class: type | None = None


def _tensor_type() -> type:
    """`torch.Tensor` once torch is imported (data holding tensors means it is)."""
    global _tensor_class
    torch = sys.modules.get("torch")
    if torch is None:
        return _NoTensor
    _tensor_class = torch.Tensor
    return _tensor_class
