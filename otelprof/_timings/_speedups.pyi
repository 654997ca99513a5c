from collections.abc import Callable
from types import TracebackType
from typing import Any

FRAME_LAYOUT: dict[str, int]
BINDINGS: dict[str, tuple[str, ...]]
CPYTHON_CHECKED: str
VERSION_TAGS: int

def bind(
    recorder: Any,
    sampler: Any,
    classes: tuple[type, ...],
    template: Any,
    python: tuple[Callable[..., Any], ...],
    constants: tuple[Any, ...],
) -> None: ...
def method(function: Callable[..., Any]) -> Any: ...
def timing_enter(self: Any) -> Any: ...
def timing_exit(
    self: Any,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> None: ...
def bridge_enter(original_enter: Callable[[Any], Any], self: Any) -> Any: ...
def bridge_exit(
    python_exit: Callable[..., Any],
    original_exit: Callable[..., Any],
    self: Any,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> Any: ...
def begin_step(
    self: Any, step: int, epoch: int | None, start_ns: int, trim_start: bool, phase: str
) -> Any: ...
def end_step(self: Any, ctx: Any, end_ns: int) -> Any: ...
