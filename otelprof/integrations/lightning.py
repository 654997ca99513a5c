"""Lightning: `Trainer(callbacks=[OtelprofCallback()])` and nothing else.

What it records is in docs/guide/frameworks.md. How: the callback wraps `trainer.profiler`
(a pass-through by default) for the run and passes every call on, so `profiler="simple"`/
`"pytorch"` keep working. Lightning runs `training_step` and `backward` inside torch's
`Optimizer.step#...` range (the closure): that range and Lightning's own profiler ranges
are forgotten (`_common.forget_ranges_above`), so the named spans are the step's direct
children and the breakdown is not "optimizer bound" by construction.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import PassThroughProfiler, Profiler

import otelprof
from otelprof import _steps
from otelprof._patch import Patch
from otelprof._schema import (
    BACKWARD,
    DATALOADER_NEXT,
    FORWARD,
    OPTIMIZER_STEP,
    PHASE_CHECKPOINT,
    PHASE_TRAIN,
    PHASE_VALIDATION,
    STEP_LR_SCHEDULERS,
    TO_DEVICE,
)
from otelprof._timings import _recorder as rec
from otelprof.integrations import _common as common

_log = logging.getLogger("otelprof")

PHASE_TEST = "test"
PHASE_PREDICT = "predict"
ZERO_GRAD = "zero_grad"

# Lightning profiler action names (suffix after the class name) -> otelprof timing names
_STRATEGY_ACTIONS = {
    "batch_to_device": TO_DEVICE,
    "training_step": FORWARD,
    "validation_step": FORWARD,
    "test_step": FORWARD,
    "predict_step": FORWARD,
    "backward": BACKWARD,
}
_MODULE_ACTIONS = {
    "optimizer_zero_grad": ZERO_GRAD,
    "lr_scheduler_step": STEP_LR_SCHEDULERS,
}


_IGNORED, _TIMED, _OPTIMIZER_STEP, _CHECKPOINT = range(4)


def _timing_name(action: str) -> str | None:
    if action.endswith(("_dataloader_next", "].val_next", "].test_next", "].predict_next")):
        return DATALOADER_NEXT
    if action.startswith("[Strategy]"):
        return _STRATEGY_ACTIONS.get(action.rsplit(".", 1)[-1])
    if action.startswith("[LightningModule]"):
        return _MODULE_ACTIONS.get(action.rsplit(".", 1)[-1])
    return None


class _Profiled:
    """`profile()` for any other action: `start()` on entry, `stop()` on exit, exceptions
    included (what the base class's try/yield/finally does, without a generator)."""

    __slots__ = ("action", "owner")

    def __init__(self, owner: _OtelprofProfiler, action: str) -> None:
        self.owner = owner
        self.action = action

    def __enter__(self) -> str:
        self.owner.start(self.action)
        return self.action

    def __exit__(self, *_exc: object) -> None:
        self.owner.stop(self.action)


class _Timed:
    """`profile()` for a timed action under a pass-through inner profiler: one object per
    action name opening its timing directly, not through `start()`/`_start()`/`_kind()`.
    It shares the action's stack in `_open` with `start()`/`stop()`, so a range opened one
    way is closed the other."""

    __slots__ = ("action", "forward", "name", "owner", "stack")

    def __init__(self, owner: _OtelprofProfiler, action: str, name: str) -> None:
        self.owner = owner
        self.action = action
        self.name = name
        self.forward = name == FORWARD
        self.stack = owner._open.setdefault(action, [])

    def open(self) -> None:
        """The action's timing opens (what `start()` does for it too)."""
        depth = self.owner._opt_depth
        if depth is not None and self.forward:
            # inside the closure: torch's Optimizer.step#... range encloses it; forget it
            common.forget_ranges_above(depth)
        timing = otelprof.timing(self.name)
        timing.__enter__()
        self.stack.append((timing, None))

    def close(self) -> None:
        """The action's latest open timing closes (what `stop()` does for it too)."""
        stack = self.stack
        if stack:
            stack.pop()[0].__exit__(None, None, None)

    def __enter__(self) -> str:
        try:
            self.open()
        except Exception as error:
            common.warn_once("lightning-start", "otelprof: Lightning action failed: %r", error)
        return self.action

    def __exit__(self, *_exc: object) -> None:
        try:
            self.close()
        except Exception as error:
            common.warn_once("lightning-stop", "otelprof: Lightning action failed: %r", error)


class _OtelprofProfiler(Profiler):
    """Lightning's profiler interface around the trainer's own profiler: every action is
    passed on, and the ones that are Determined-style phases become otelprof spans."""

    def __init__(self, inner: Profiler) -> None:
        super().__init__()
        self.inner = inner
        # Lightning calls the profiler around every hook (dozens per batch): decisions are
        # cached per action name, and a pass-through inner profiler (the default) opens no
        # range, so there is nothing to forget around its calls.
        self._passthrough = type(inner) is PassThroughProfiler
        self._kinds: dict[str, tuple[int, str | None]] = {}
        # Under a pass-through profiler, a shared do-nothing `profile()` per untimed action
        # instead of the generator Lightning's base class builds per call (BENCHMARKS.md,
        # "Framework integrations and collectives")
        self._ignored: dict[str, contextlib.nullcontext[str]] = {}
        self._timed: dict[str, _Timed] = {}  # and for the timed ones
        self._open: dict[str, list[tuple[Any, Any]]] = {}
        self._opt_depth: int | None = None  # stack depth at `optimizer_step` start
        self._opt_frame: Any = None  # the optimizer_step leaf span, begun after the closure
        self._checkpoint: list[str] = []

    # ---- otelprof side ----
    def _kind(self, action: str) -> tuple[int, str | None]:
        kind = self._kinds.get(action)
        if kind is None:
            if action.startswith("[LightningModule]") and action.endswith(".optimizer_step"):
                kind = (_OPTIMIZER_STEP, None)
            elif action == "save_checkpoint":
                kind = (_CHECKPOINT, None)
            else:
                name = _timing_name(action)
                kind = (_IGNORED, None) if name is None else (_TIMED, name)
            if len(self._kinds) < 4096:
                self._kinds[action] = kind
                if kind[0] == _IGNORED and self._passthrough:
                    self._ignored[action] = contextlib.nullcontext(action)
                elif kind[0] == _TIMED and self._passthrough and kind[1] is not None:
                    self._timed[action] = _Timed(self, action, kind[1])
        return kind

    def _start(self, action: str) -> None:
        kind, name = self._kind(action)
        if kind == _IGNORED:
            return
        if kind == _OPTIMIZER_STEP:
            self._opt_depth = rec.recorder.depth()
            self._opt_frame = None
            return
        if kind == _CHECKPOINT:
            self._checkpoint.append(_steps.set_phase(PHASE_CHECKPOINT))
            return
        assert name is not None
        self._timed_action(action, name).open()

    def _stop(self, action: str) -> None:
        kind, name = self._kind(action)
        if kind == _IGNORED:
            return
        if kind == _OPTIMIZER_STEP:
            self._opt_depth = None
            frame, self._opt_frame = self._opt_frame, None
            if frame is not None:
                rec.recorder.end_leaf(frame)
            return
        if kind == _CHECKPOINT:
            if self._checkpoint:
                _steps.set_phase(self._checkpoint.pop())
            return
        assert name is not None
        self._timed_action(action, name).close()

    def _timed_action(self, action: str, name: str) -> _Timed:
        """The action's shared `_Timed` (made by `_kind()` under a pass-through profiler),
        else one over the same stack in `_open`."""
        timed = self._timed.get(action)
        return timed if timed is not None else _Timed(self, action, name)

    def closure_done(self) -> None:
        """`on_before_optimizer_step`: the closure (forward, backward) has run; the update
        begins, so the optimizer_step span does."""
        if self._opt_depth is not None and self._opt_frame is None:
            common.forget_ranges_above(self._opt_depth)
            self._opt_frame = rec.recorder.begin_leaf(OPTIMIZER_STEP)

    # ---- Lightning's interface ----
    def start(self, action_name: str) -> None:
        if action_name in self._ignored:  # (a pass-through inner profiler's only)
            return
        try:
            self._start(action_name)
        except Exception as error:
            common.warn_once("lightning-start", "otelprof: Lightning action failed: %r", error)
        if self._passthrough:
            return
        depth = rec.recorder.depth()
        self.inner.start(action_name)
        common.forget_ranges_above(depth)  # the inner profiler's own range, if any

    def stop(self, action_name: str) -> None:
        if action_name in self._ignored:  # (a pass-through inner profiler's only)
            return
        if not self._passthrough:
            depth = rec.recorder.depth()
            self.inner.stop(action_name)  # the PyTorch profiler opens `ProfilerStep#N` here
            common.forget_ranges_above(depth)
        try:
            self._stop(action_name)
        except Exception as error:
            common.warn_once("lightning-stop", "otelprof: Lightning action failed: %r", error)

    def profile(self, action_name: str) -> Any:
        """Lightning's `Profiler.profile`: the shared `_ignored`/`_timed` one when there is
        one, else one calling `start()`/`stop()`."""
        known = self._ignored.get(action_name) or self._timed.get(action_name)
        return known if known is not None else _Profiled(self, action_name)

    def summary(self) -> str:
        return self.inner.summary()

    def describe(self) -> None:
        self.inner.describe()

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        self.inner.setup(stage, local_rank, log_dir)

    def teardown(self, stage: str | None) -> None:
        self.inner.teardown(stage)

    def __del__(self) -> None:
        """Nothing: the trainer owns the inner profiler. Lightning's `Profiler.__del__` would
        tear it down when the callback drops the wrapper, before the trainer's `describe()`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)


class OtelprofCallback(Callback):
    """Profile a Lightning run with otelprof: `Trainer(callbacks=[OtelprofCallback()])`.

    `samples` / `tokens`: per-batch amounts, a number or a function of the batch (default:
    the batch's first dimension; tokens from `input_ids`/`attention_mask`). `flops`: FLOPs
    per training batch, a number, "auto" (counted once with FlopCounterMode, the default) or
    None (no MFU). `peak_flops`: one device's peak FLOP/s for MFU (default: see
    `otelprof.set_peak_flops`). `instrument_options`: passed to `otelprof.instrument()` when
    no profiler runs yet.
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
            "OtelprofCallback", samples, tokens, flops, peak_flops, instrument_options
        )
        self._handle: Any = None
        self._profiler: _OtelprofProfiler | None = None
        self._profiler_patch: Patch | None = None
        self._phases: list[str] = []

    # ---- lifecycle ----
    @common.safe
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        precision = common.precision_of(getattr(trainer, "precision", None))
        self._handle = self.work.begin(self._handle, precision)
        inner = getattr(trainer, "profiler", None)
        if not isinstance(inner, Profiler):
            common.warn_once(
                "lightning-profiler",
                "otelprof: this Lightning version has no trainer.profiler (%s); steps, epochs, "
                "phases and throughput are recorded, dataloader_next/forward/backward are not",
                pl.__version__,
            )
            return
        if not isinstance(inner, _OtelprofProfiler):
            self._profiler = _OtelprofProfiler(inner)
            self._profiler_patch = Patch(trainer, "profiler", self._profiler)

    @common.safe
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.work.counter.abandon()
        patch, self._profiler_patch = self._profiler_patch, None
        if patch is not None:
            patch.restore()
        self._profiler = None
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.shutdown()

    # ---- training ----
    @common.safe
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        otelprof.set_epoch(int(trainer.current_epoch))

    @common.safe
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.work.counts_flops:
            self.work.counter.start()

    @common.safe
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self._profiler is not None:
            self._profiler.closure_done()

    @common.safe
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        try:
            _steps.step_work(*self.work.of_batch(batch), self.work.step_flops())
        finally:
            otelprof.step()  # the step boundary even when counting the work failed

    # ---- validation ----
    @common.safe
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phases.append(_steps.set_phase(PHASE_VALIDATION))

    @common.safe
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        try:
            _steps.step_work(*self.work.of_batch(batch), None)
        finally:
            otelprof.step()

    @common.safe
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _steps.set_phase(self._phases.pop() if self._phases else PHASE_TRAIN)

    # ---- test and predict: phases of their own, one trace per batch ----
    @common.safe
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phases.append(_steps.set_phase(PHASE_TEST))

    @common.safe
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phases.append(_steps.set_phase(PHASE_PREDICT))

    on_test_batch_end = on_predict_batch_end = on_validation_batch_end
    on_test_end = on_predict_end = on_validation_end

    @common.safe
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.work.counter.abandon()
