"""What every integration needs: safe hooks, work per batch, FLOP counting, range hygiene."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from otelprof import _throughput
from otelprof._timings import _recorder as rec

_log = logging.getLogger("otelprof")
_F = TypeVar("_F", bound=Callable[..., Any])
_warned: set[str] = set()


def warn_once(key: str, message: str, *args: Any) -> None:
    """One log line per problem and process (a version lacking an API, a failing hook)."""
    if key not in _warned:
        _warned.add(key)
        _log.warning(message, *args)


def safe(func: _F) -> _F:
    """A hook that never raises into the framework's loop: telemetry never breaks training."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Exception as error:
            warn_once(
                f"hook:{func.__qualname__}",
                "otelprof: %s failed (%r); training goes on, this hook is skipped",
                func.__qualname__,
                error,
            )
            return None

    return wrapper  # type: ignore[return-value]


def _first_tensor(data: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(data, torch.Tensor):
        return data
    if isinstance(data, Mapping):
        for key in ("input_ids", "inputs", "input", "x", "pixel_values"):
            if isinstance(data.get(key), torch.Tensor):
                return data[key]
        values: Any = data.values()
    elif isinstance(data, (list, tuple)):
        values = data
    else:
        return None
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def batch_samples(batch: Any) -> int | None:
    """Samples in a batch: the first dimension of its (first) input tensor."""
    tensor = _first_tensor(batch)
    if tensor is None or tensor.dim() == 0:
        return None
    return int(tensor.shape[0])


def batch_tokens(batch: Any) -> int | None:
    """Tokens in a batch of token ids (a mapping with `input_ids`): non-padding tokens from
    `attention_mask` when present, else every id. None for other batches."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(batch, Mapping):
        return None
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum().item())
    ids = batch.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return int(ids.numel())
    return None


Amount = int | float | Callable[[Any], "int | float | None"] | None


def amount_of(declared: Amount, auto: Callable[[Any], int | None], batch: Any) -> float | None:
    """The user's declared amount (a number, or a function of the batch), else `auto`."""
    if declared is None:
        value: Any = auto(batch)
    elif callable(declared):
        value = declared(batch)
    else:
        value = declared
    return None if value is None else float(value)


class FlopCounter:
    """Counts one training step's FLOPs with torch.utils.flop_counter.FlopCounterMode
    (forward and backward of every matmul, convolution and attention torch knows the cost
    of). Entered at a step's start, left at its end; counted once, on step 0, whose time
    (warm-up) throughput leaves out anyway."""

    def __init__(self) -> None:
        self.flops: float | None = None
        self._mode: Any = None
        self._done = False

    def start(self) -> None:
        if self._done or self._mode is not None:
            return
        try:
            from torch.utils.flop_counter import FlopCounterMode
        except Exception as error:
            self._done = True
            warn_once(
                "flops", "otelprof: no FLOP counting in this torch (%r); declare flops", error
            )
            return
        self._mode = FlopCounterMode(display=False)
        self._mode.__enter__()

    def stop(self) -> float | None:
        mode, self._mode = self._mode, None
        if mode is None:
            return self.flops
        self._done = True
        try:
            mode.__exit__(None, None, None)
            total = float(mode.get_total_flops())
            self.flops = total if total > 0 else None
            if self.flops is None:
                warn_once("flops0", "otelprof: FlopCounterMode counted no FLOPs; no MFU")
        except Exception as error:
            warn_once("flops", "otelprof: FLOP counting failed (%r); no MFU", error)
        return self.flops

    def abandon(self) -> None:
        """Leave the mode (e.g. the step raised) without counting."""
        mode, self._mode = self._mode, None
        if mode is not None:
            self._done = True
            with contextlib.suppress(Exception):
                mode.__exit__(None, None, None)


class Work:
    """The options every integration takes besides its hooks: the work (`samples`, `tokens`,
    `flops`), checked once and turned into per-batch amounts and per-step FLOPs the same way
    in each framework, one device's peak FLOP/s, and `instrument()`'s options."""

    def __init__(
        self,
        owner: str,
        samples: Amount,
        tokens: Amount,
        flops: float | str | None,
        peak_flops: float | None,
        instrument_options: dict[str, Any],
    ) -> None:
        if not (flops is None or flops == "auto" or isinstance(flops, (int, float))):
            raise ValueError(f"{owner}: flops must be a number, 'auto' or None, got {flops!r}")
        self.samples = samples
        self.tokens = tokens
        self.flops = flops
        self.counter = FlopCounter()
        self.peak_flops = (
            None if peak_flops is None else _throughput.parse_peak(peak_flops, "peak_flops")
        )
        self.instrument_options = instrument_options

    @property
    def counts_flops(self) -> bool:
        """FLOPs are counted with FlopCounterMode rather than declared."""
        return self.flops == "auto"

    def of_batch(self, batch: Any) -> tuple[float | None, float | None]:
        """(samples, tokens) of one batch: declared, or read from the batch."""
        return (
            amount_of(self.samples, batch_samples, batch),
            amount_of(self.tokens, batch_tokens, batch),
        )

    def step_flops(self) -> float | None:
        """FLOPs of the step that just ended: counted ("auto") or declared."""
        if self.flops == "auto":
            return self.counter.stop()
        return None if self.flops is None else float(self.flops)

    def begin(self, handle: Any, precision: str) -> Any:
        """Training begins: `instrument()` unless `handle` already is a running profiler's,
        then the peak FLOP/s and the precision for MFU. Returns the handle."""
        import otelprof

        if handle is None:
            handle = otelprof.instrument(**self.instrument_options)
        if self.peak_flops is not None:
            otelprof.set_peak_flops(self.peak_flops)
        _throughput.set_precision(precision)
        return handle


def forget_ranges_above(depth: int) -> None:
    """Forget ranges opened on this thread above `depth` without emitting them: a
    framework's own ranges that enclose what the integration times more precisely (torch's
    `Optimizer.step#...` around Lightning's closure, a framework profiler's `[Strategy]...`
    ranges). Their record_function exits then find nothing to close; torch still sees them."""
    rec.recorder.forget_above(depth)


def precision_of(setting: Any) -> str:
    """ "32-bit" for full-precision training settings, else "16-bit" (the peak table's columns)."""
    text = str(setting or "").lower()
    if not text or text.startswith(("32", "64", "no", "fp32", "transformer-engine-float32")):
        return "32-bit"
    return "16-bit"
