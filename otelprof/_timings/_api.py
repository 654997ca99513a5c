"""Timings without hand-written annotations: each `next()` of a data loader
(`timed_dataloader`, `dataloader_next`) and each optimizer step (`instrument_optimizer`,
`optimizer_step`, through torch's step hooks). Both are cheap no-ops while no profiler runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from otelprof._schema import DATALOADER_NEXT, OPTIMIZER_STEP
from otelprof._timings import _recorder as _rec
from otelprof._timings._recorder import timing

T = TypeVar("T")


class timed_dataloader(Generic[T]):
    """Wrap any iterable (a DataLoader, a generator): each `next()` is a `dataloader_next`
    span. Keeps `len()`, passes every other attribute through to the wrapped object, and
    can be iterated again when the wrapped object can (epochs). The final `next()` that
    finds the iterable exhausted is not a span (nor is the loader's own range inside it)."""

    def __init__(self, iterable: Iterable[T], name: str = DATALOADER_NEXT) -> None:
        self.iterable = iterable
        self.name = name

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        """Everything else is the wrapped loader's (`.sampler.set_epoch()`, `.dataset`,
        `.batch_size`), so the wrapper can replace the loader in existing code."""
        if name == "iterable":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.iterable, name)

    def __iter__(self) -> Iterator[T]:
        return timed_items(iter(self.iterable), self.name)


def timed_items(
    iterator: Iterator[T],
    name: str = DATALOADER_NEXT,
    before: Callable[[], object] | None = None,
    after: Callable[[T], object] | None = None,
) -> Iterator[T]:
    """`iterator`'s items, each `next()` a span named `name`; the `next()` that finds it
    exhausted is no span. `before`/`after` run around every fetch (integrations mark step
    boundaries there)."""
    span = timing(name)  # once, not per item: the cached span (inside compiled code: none)
    while True:
        if before is not None:
            before()
        span.__enter__()
        try:
            item = next(iterator)
        except StopIteration:
            span.cancel()
            return
        except BaseException as error:
            span.__exit__(type(error), error, error.__traceback__)
            raise
        span.__exit__(None, None, None)
        if after is not None:
            after(item)
        yield item


class HookHandle:
    """What `instrument_optimizer` / `instrument_lr_scheduler` return: `remove()` undoes it."""

    def __init__(self, remove: Any) -> None:
        self._remove = remove

    def remove(self) -> None:
        remove, self._remove = self._remove, None
        if remove is not None:
            remove()

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.remove()


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a wrapper (Accelerate's AcceleratedOptimizer, Lightning's
    LightningOptimizer, ...): wrappers subclass torch's Optimizer without its hook state."""
    for _ in range(8):
        if hasattr(optimizer, "_optimizer_step_pre_hooks"):
            break
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def instrument_optimizer(optimizer: Any, name: str = OPTIMIZER_STEP) -> HookHandle:
    """Time `optimizer.step()` through torch's step pre/post hooks (`optimizer_step` span).

    A wrapper (Accelerate's AcceleratedOptimizer, ...) is unwrapped to the torch optimizer
    it holds, so only the steps really taken are timed (not those skipped while gradients
    accumulate).

    If `step()` raises, torch skips the post hook: that occurrence is not a span. The span
    is a leaf (torch's own `Optimizer.step#...` range, bridged too, encloses the hooks).
    """
    optimizer = unwrap_optimizer(optimizer)
    if not (
        hasattr(optimizer, "register_step_pre_hook")
        and hasattr(optimizer, "register_step_post_hook")
        and hasattr(optimizer, "_optimizer_step_pre_hooks")
    ):
        raise TypeError(
            f"instrument_optimizer needs a torch.optim.Optimizer (step hook API), "
            f"got {type(optimizer).__name__}"
        )
    started: list[list[Any]] = []  # at most one: a step that raised never reached `post`

    def pre(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if _rec.compiling():
            return
        started.clear()
        frame = _rec.recorder.begin_leaf(name)
        if frame is not None:
            started.append(frame)

    def post(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if started and not _rec.compiling():
            _rec.recorder.end_leaf(started.pop())

    pre_handle = optimizer.register_step_pre_hook(pre)
    post_handle = optimizer.register_step_post_hook(post)

    def remove() -> None:
        pre_handle.remove()
        post_handle.remove()
        started.clear()

    return HookHandle(remove)
