"""transformers: `Trainer(..., callbacks=[OtelprofTrainerCallback()])` and nothing else.

One otelprof step per Trainer step (one optimizer update), as `state.global_step` counts;
what is recorded: docs/guide/frameworks.md. The Trainer opens no `record_function` ranges
and its callbacks see neither forward nor backward, so while training runs
`Trainer.compute_loss`, `.evaluate`, `._save_checkpoint`, `.get_eval_dataloader` and
`Accelerator.backward` are wrapped at class level, acting only for Trainers holding this
callback, and restored at `on_train_end`. A method a version lacks is logged once, not timed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from transformers import Trainer, TrainerCallback

import otelprof
from otelprof import _steps, determined_timings
from otelprof._patch import Patches
from otelprof._schema import (
    BACKWARD,
    FORWARD,
    PHASE_CHECKPOINT,
    PHASE_VALIDATION,
    STEP_LR_SCHEDULERS,
)
from otelprof.integrations import _common as common
from otelprof.integrations.accelerate import instrument_wrapped_optimizer, register_loader

_lock = threading.Lock()
_active: list[OtelprofTrainerCallback] = []  # callbacks whose Trainer is training
_installed = Patches()  # what _install() patched


def _ours(trainer: Any) -> OtelprofTrainerCallback | None:
    handler = getattr(trainer, "callback_handler", None)
    for callback in getattr(handler, "callbacks", ()):
        if isinstance(callback, OtelprofTrainerCallback) and callback in _active:
            return callback
    return None


def _inside(
    context: Callable[[], Any], acts: Callable[[Any], bool] = lambda self: _ours(self) is not None
) -> Callable[[Any], Any]:
    """A wrapper of a method that runs it inside `context()` (a timing, a phase) when `acts`
    (by default: for Trainers that hold this callback); otherwise it runs as it is."""

    def wrap(original: Any) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not acts(self):
                return original(self, *args, **kwargs)
            with context():
                return original(self, *args, **kwargs)

        return method

    return wrap


_wrap_compute_loss = _inside(lambda: otelprof.timing(FORWARD))
_wrap_evaluate = _inside(lambda: _steps.phase(PHASE_VALIDATION))
_wrap_save = _inside(lambda: _steps.phase(PHASE_CHECKPOINT))
# Accelerator.backward: while any Trainer with this callback trains
_wrap_backward = _inside(lambda: otelprof.timing(BACKWARD), lambda _accelerator: bool(_active))


def _wrap_eval_loader(original: Any) -> Any:
    def get_eval_dataloader(self: Any, *args: Any, **kwargs: Any) -> Any:
        loader = original(self, *args, **kwargs)
        callback = _ours(self)
        if callback is not None:
            callback._register_loader(loader)
        return loader

    return get_eval_dataloader


def _patches() -> list[tuple[type, str, Callable[[Any], Any]]]:
    from accelerate import Accelerator

    return [
        (Trainer, "compute_loss", _wrap_compute_loss),
        (Trainer, "evaluate", _wrap_evaluate),
        (Trainer, "_save_checkpoint", _wrap_save),
        (Trainer, "get_eval_dataloader", _wrap_eval_loader),
        (Accelerator, "backward", _wrap_backward),
    ]


def _install() -> None:
    for cls, name, wrap in _patches():
        original = getattr(cls, name, None)
        if original is None:
            common.warn_once(
                f"transformers:{name}",
                "otelprof: this %s has no %s(); that part of the step is not timed",
                cls.__name__,
                name,
            )
            continue
        _installed.patch(cls, name, wrap(original))


class _LoaderHooks:
    """Per-batch work of the batches a registered DataLoader yields."""

    def __init__(self, callback: OtelprofTrainerCallback) -> None:
        self.callback = callback
        self.removed = False

    def before_batch(self) -> None:
        pass

    @common.safe
    def after_batch(self, batch: Any) -> None:
        _steps.step_work(*self.callback.work.of_batch(batch), None)


class OtelprofTrainerCallback(TrainerCallback):
    """Profile a transformers Trainer with otelprof: `callbacks=[OtelprofTrainerCallback()]`.

    `samples` / `tokens`: per-batch amounts, a number or a function of the batch (default:
    `input_ids` rows; non-padding tokens). `flops`: FLOPs per Trainer step, "auto" (counted
    once with FlopCounterMode, the default), a number, or None. `peak_flops`: one device's
    peak FLOP/s. `instrument_options`: for `otelprof.instrument()` when no profiler runs.
    """

    def __init__(
        self,
        *,
        samples: common.Amount = None,
        tokens: common.Amount = None,
        flops: float | str | None = "auto",
        peak_flops: float | None = None,
        **instrument_options: Any,
    ) -> None:
        self.work = common.Work(
            "OtelprofTrainerCallback", samples, tokens, flops, peak_flops, instrument_options
        )
        self._handle: Any = None
        self._undo: list[Any] = []
        self._hooks = _LoaderHooks(self)
        self._epoch = -1

    def _register_loader(self, loader: Any) -> None:
        if loader is not None and hasattr(loader, "base_dataloader"):
            self._undo.append(register_loader(loader, self._hooks))

    @common.safe
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        half = getattr(args, "bf16", False) or getattr(args, "fp16", False)
        self._handle = self.work.begin(self._handle, "16-bit" if half else "32-bit")
        with _lock:
            if not _active:
                _install()
            _active.append(self)
        self._hooks.removed = False
        self._register_loader(kwargs.get("train_dataloader"))
        optimizer = kwargs.get("optimizer")
        if optimizer is not None:
            self._undo.extend(instrument_wrapped_optimizer(optimizer))
        scheduler = kwargs.get("lr_scheduler")
        if scheduler is not None:
            inner = getattr(scheduler, "scheduler", scheduler)
            self._undo.append(
                determined_timings.instrument_lr_scheduler(inner, STEP_LR_SCHEDULERS).remove
            )

    @common.safe
    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._epoch += 1
        otelprof.set_epoch(self._epoch)

    @common.safe
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.work.counts_flops:
            self.work.counter.start()

    @common.safe
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        try:
            flops = self.work.step_flops()
            if flops is not None:
                _steps.step_work(None, None, flops)
        finally:
            otelprof.step()

    @common.safe
    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if _steps.current_phase() == PHASE_VALIDATION:
            otelprof.step()  # one trace per evaluation batch

    @common.safe
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.work.counter.abandon()
        self._hooks.removed = True
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        with _lock:
            if self in _active:
                _active.remove(self)
            if not _active:
                _installed.restore()
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.shutdown()
