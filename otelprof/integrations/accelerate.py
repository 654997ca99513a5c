"""Accelerate: `instrument_accelerator(accelerator)` before `accelerator.prepare(...)`.

Accelerate opens no `record_function` ranges, so what `prepare()` returns is timed: each
batch of a prepared DataLoader begins a step (one per micro-batch, as Determined counts
batches), and a batch fetched while every prepared model is in eval mode is a validation
batch; `otelprof.phase(...)` blocks of the user's are left alone. What is recorded:
docs/guide/frameworks.md. `remove()` on the returned handle undoes everything.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

import otelprof
from otelprof import _steps, determined_timings
from otelprof._patch import Patch, Patches
from otelprof._schema import (
    BACKWARD,
    DATALOADER_NEXT,
    FORWARD,
    OPTIMIZER_STEP,
    PHASE_TRAIN,
    PHASE_VALIDATION,
    STEP_LR_SCHEDULERS,
    TO_DEVICE,
)
from otelprof._timings import _recorder as rec
from otelprof._timings._api import (
    HookHandle,
    timed_items,
    unwrap_optimizer,
)
from otelprof.integrations import _common as common

_AUTO_PHASES = (PHASE_TRAIN, PHASE_VALIDATION)

_patch_lock = threading.Lock()
_patched: dict[type, Patch] = {}  # DataLoader class -> its __iter__ patch
_loaders: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_send_patch: Patch | None = None
_send_users = 0


def _timed_iter(original: Any) -> Any:
    def __iter__(self: Any) -> Iterator[Any]:
        inst = _loaders.get(self)
        if inst is None or getattr(inst, "removed", False):
            yield from original(self)
            return
        yield from timed_items(original(self), DATALOADER_NEXT, inst.before_batch, inst.after_batch)

    return __iter__


def _timed_send(original: Any) -> Any:
    def send_to_device(*args: Any, **kwargs: Any) -> Any:
        with otelprof.timing(TO_DEVICE):
            return original(*args, **kwargs)

    return send_to_device


def register_loader(loader: Any, hooks: Any) -> Any:
    """Time the batches of an Accelerate DataLoader (`dataloader_next`, with `to_device`
    inside), calling `hooks.before_batch()` / `hooks.after_batch(batch)` around each fetch.
    The class's `__iter__` is patched (DataLoaderAdapter fakes `__class__`, so the instance
    cannot be given a subclass) and acts only on registered loaders. Returns the undo."""
    global _send_patch, _send_users
    import accelerate.data_loader as data_loader

    cls = type(loader)
    with _patch_lock:
        if cls not in _patched and "__iter__" in vars(cls):
            _patched[cls] = Patch(cls, "__iter__", _timed_iter(vars(cls)["__iter__"]))
        _loaders[loader] = hooks
        if _send_users == 0:
            _send_patch = Patch(
                data_loader, "send_to_device", _timed_send(data_loader.send_to_device)
            )
        _send_users += 1

    def undo() -> None:
        global _send_users, _send_patch
        with _patch_lock:
            _loaders.pop(loader, None)
            _send_users -= 1
            if _send_users == 0 and _send_patch is not None:
                _send_patch.restore()
                _send_patch = None
            if not any(type(other) is cls for other in _loaders):
                patch = _patched.pop(cls, None)
                if patch is not None:
                    patch.restore()

    return undo


def instrument_wrapped_optimizer(wrapped: Any) -> list[Any]:
    """`optimizer_step` spans for the steps the torch optimizer inside `wrapped` really
    takes, as direct children of the step (torch's enclosing `Optimizer.step#...` range is
    not recorded). Returns the undos."""
    torch_optimizer = unwrap_optimizer(wrapped)

    def forget_torch_range(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        top = rec.recorder.top_name()
        if top is not None and str(top).startswith("Optimizer.step#"):
            common.forget_ranges_above(rec.recorder.depth() - 1)

    first = torch_optimizer.register_step_pre_hook(forget_torch_range)
    handle = otelprof.instrument_optimizer(torch_optimizer, OPTIMIZER_STEP)
    return [first.remove, handle.remove]


class _Instrumentation:
    """What instrument_accelerator() did to one Accelerator, and the step bookkeeping."""

    def __init__(self, work: common.Work, handle: Any) -> None:
        self.work = work
        self.handle = handle
        self.removed = False
        self.models: list[Any] = []
        self.undo: list[Any] = []
        self.batch_open = False  # a batch was fetched since the last step boundary
        self.counting = False

    # ---- steps and phases ----
    @common.safe
    def before_batch(self) -> None:
        wanted = PHASE_TRAIN
        if self.models and not any(getattr(m, "training", True) for m in self.models):
            wanted = PHASE_VALIDATION
        current = _steps.current_phase()
        if self.batch_open:
            self._end_step()
        if current != wanted and current in _AUTO_PHASES:
            _steps.set_phase(wanted)
        if (
            self.work.counts_flops
            and wanted == PHASE_TRAIN
            and _steps.timings_running()
            and not self.counting
        ):
            self.counting = True
            self.work.counter.start()

    def _end_step(self) -> None:
        self.batch_open = False
        flops: float | None = None
        if _steps.current_phase() == PHASE_TRAIN:
            flops = self.work.step_flops()
        if flops is not None:
            _steps.step_work(None, None, flops)
        otelprof.step()

    @common.safe
    def after_batch(self, batch: Any) -> None:
        self.batch_open = True
        _steps.step_work(*self.work.of_batch(batch), None)

    # ---- what prepare() returns ----
    def instrument(self, obj: Any) -> None:
        try:
            self._instrument(obj)
        except Exception as error:
            common.warn_once(
                f"accelerate:{type(obj).__name__}",
                "otelprof: could not instrument %s (%r); it is not timed",
                type(obj).__name__,
                error,
            )

    def _instrument(self, obj: Any) -> None:
        import torch

        if isinstance(obj, torch.nn.Module):
            self._model(obj)
        elif isinstance(obj, torch.utils.data.DataLoader) or hasattr(obj, "base_dataloader"):
            self.undo.append(register_loader(obj, self))
        elif hasattr(obj, "optimizer") and hasattr(obj, "step") and hasattr(obj, "zero_grad"):
            self.undo.extend(instrument_wrapped_optimizer(obj))
        elif hasattr(obj, "scheduler") and hasattr(obj, "step"):
            handle = determined_timings.instrument_lr_scheduler(obj.scheduler, STEP_LR_SCHEDULERS)
            self.undo.append(handle.remove)

    def _model(self, model: Any) -> None:
        self.models.append(model)
        timing = otelprof.timing(FORWARD)

        def pre(_module: Any, _args: Any) -> None:
            timing.__enter__()

        def post(_module: Any, _args: Any, _output: Any) -> None:
            timing.__exit__(None, None, None)

        pre_handle = model.register_forward_pre_hook(pre)
        post_handle = model.register_forward_hook(post, always_call=True)
        self.undo += [pre_handle.remove, post_handle.remove]

    def remove(self) -> None:
        if self.removed:
            return
        self.removed = True
        self.work.counter.abandon()
        for undo in reversed(self.undo):
            try:
                undo()
            except Exception as error:
                common.warn_once("accelerate-undo", "otelprof: undo failed: %r", error)
        self.undo.clear()
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.shutdown()


def instrument_accelerator(
    accelerator: Any,
    *,
    samples: common.Amount = None,
    tokens: common.Amount = None,
    flops: float | str | None = "auto",
    peak_flops: float | None = None,
    **instrument_options: Any,
) -> HookHandle:
    """Time an Accelerate training loop: call once, before `accelerator.prepare(...)`.

    Wraps `accelerator.prepare` (what it returns is timed) and `accelerator.backward`.
    `samples`/`tokens`: per-batch amounts, numbers or functions of the batch (default: the
    batch's first dimension; tokens from `input_ids`/`attention_mask`); `flops`: FLOPs per
    training batch, "auto" (FlopCounterMode over the first step), a number or None;
    `peak_flops`: one device's peak FLOP/s. Starts a profiler with `instrument_options`
    when none runs. Returns a handle whose `remove()` undoes it all.
    """
    if not (callable(getattr(accelerator, "prepare", None)) and hasattr(accelerator, "backward")):
        raise TypeError(
            "instrument_accelerator needs an accelerate.Accelerator, got "
            f"{type(accelerator).__name__}"
        )
    work = common.Work(
        "instrument_accelerator", samples, tokens, flops, peak_flops, instrument_options
    )
    precision = common.precision_of(getattr(accelerator, "mixed_precision", None))
    inst = _Instrumentation(work, work.begin(None, precision))
    original_prepare = accelerator.prepare
    original_backward = accelerator.backward

    def prepare(*args: Any, **kwargs: Any) -> Any:
        result = original_prepare(*args, **kwargs)
        if not inst.removed:
            for obj in result if isinstance(result, tuple) else (result,):
                inst.instrument(obj)
        return result

    def backward(*args: Any, **kwargs: Any) -> Any:
        with otelprof.timing(BACKWARD):
            return original_backward(*args, **kwargs)

    patches = Patches()
    patches.patch(accelerator, "prepare", prepare)
    patches.patch(accelerator, "backward", backward)
    inst.undo.insert(0, patches.restore)
    return HookHandle(inst.remove)
