"""Per-module forward and backward ranges of PyTorch models (`module_timings=<depth>`).

Why: "which part of my model is slow" with no change to the training loop, for any
`nn.Module`. What a user sees (how models are found, the depth, the range names) is
docs/guide/timings.md, "Per-module times and memory by phase". For maintainers: the two
global module hooks go as soon as an outermost module (a model, a loss) is called a second
time, so module calls take torch's fast path again; at most `MAX_MODULES` get hooks. A
backward range runs from its outputs' first autograd node to its inputs' producers
(`Node.register_prehook`), or to the engine's final callback when no input needs a
gradient; one whose inputs' gradients never come is not recorded. Ranges are leaves
(`begin_leaf`/`end_leaf`), so the program's own ranges nest as without them. `close()`
removes every hook; hooks never raise into the model.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from otelprof import _torch_compat
from otelprof._schema import MODULE_BACKWARD_PREFIX, MODULE_FORWARD_PREFIX
from otelprof._timings import _recorder

_log = logging.getLogger("otelprof")

MAX_MODULES = 256
"""Modules hooked per process: each adds two span names (the names a process exports are
bounded, `_timings/_names.py`) and a cost per call (BENCHMARKS.md, "Per-module times and
memory peaks by phase")."""
_WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")
_CONTAINERS = ("ModuleList", "ModuleDict", "ParameterList", "ParameterDict")
_MAX_OPEN = 256  # forward calls open at once on one thread (nesting depth)
_MAX_OPEN_BACKWARD = 4 * MAX_MODULES  # backward ranges awaiting a pass's end
_MAX_TENSORS = 64  # tensors looked at in one call's inputs or outputs


class ModuleTimings:
    """The hooks of one profiler session; `start()` begins discovery, `close()` undoes all."""

    def __init__(self, depth: int, torch: Any) -> None:
        self.depth = depth
        self._torch = torch
        self._rec = _recorder.recorder
        self._compiling: Callable[[], bool] = getattr(
            getattr(torch, "compiler", None), "is_compiling", lambda: False
        )
        self._tensor = torch.Tensor
        self._global: list[Any] = []
        self._handles: list[Any] = []
        self.models: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._roots: weakref.WeakSet[Any] = weakref.WeakSet()  # modules called outside any
        self.hooked = 0
        self._lock = threading.Lock()
        self._per_thread = threading.local()
        self._open_backward: dict[int, _BackwardCall] = {}
        self._callback_queued = False
        self._closed = False

    # ---- lifecycle ----
    def start(self) -> None:
        module = self._torch.nn.modules.module
        self._global = [
            module.register_module_forward_pre_hook(self._discover_pre),
            module.register_module_forward_hook(self._discover_post, always_call=True),
        ]

    def close(self) -> None:
        """Remove every hook added (global and per module); idempotent."""
        self._closed = True
        for handle in self._global + self._handles:
            handle.remove()
        self._global = []
        self._handles = []
        with self._lock:
            self._open_backward.clear()

    # ---- discovery (global hooks, until a model is called twice) ----
    def _discover_pre(self, module: Any, _args: Any) -> None:
        try:
            local = self._per_thread
            depth = getattr(local, "depth", 0)
            local.depth = depth + 1
            if depth == 0 and not self._compiling():
                self._root_called(module)
        except Exception as error:  # never into the model
            _log.debug("otelprof: module timings discovery failed: %r", error)

    def _discover_post(self, _module: Any, _args: Any, _result: Any) -> None:
        local = self._per_thread
        local.depth = max(0, getattr(local, "depth", 1) - 1)

    def _root_called(self, module: Any) -> None:
        if module in self._roots:  # a second iteration: the loop's models are known
            self._end_discovery()
            return
        self._roots.add(module)
        model = _unwrap(module)
        if model is None or model in self.models:
            return
        if next(model.parameters(), None) is None:
            return  # a loss or a transform, not a model
        self._instrument(model)

    def _end_discovery(self) -> None:
        """torch copies its hook lists before calling them, so removing is safe here."""
        for handle in self._global:
            handle.remove()
        self._global = []

    def _instrument(self, model: Any) -> None:
        base = type(model).__name__
        self.models[model] = base
        for path, child in _submodules(model, self.depth):
            if self._closed:
                return
            if self.hooked >= MAX_MODULES:
                _log.warning(
                    "otelprof: module timings hook at most %d modules; %s and later ones "
                    "are not timed (a smaller module_timings depth shows fewer)",
                    MAX_MODULES,
                    f"{base}.{path}",
                )
                return
            self._hook(child, f"{base}.{path}")

    def _hook(self, module: Any, qualified: str) -> None:
        forward = MODULE_FORWARD_PREFIX + qualified
        backward = MODULE_BACKWARD_PREFIX + qualified
        self._handles.append(
            module.register_forward_pre_hook(functools.partial(self._forward_begin, forward))
        )
        self._handles.append(
            module.register_forward_hook(
                functools.partial(self._forward_end, backward), always_call=True
            )
        )
        self.hooked += 1

    # ---- per call ----
    def _forward_begin(self, name: str, module: Any, _args: Any) -> None:
        try:
            frame = None if self._compiling() else self._rec.begin_leaf(name)
            stack = self._stack()
            if len(stack) >= _MAX_OPEN:
                stack.clear()  # ends that never came (a torch without always_call)
            stack.append((module, frame))
        except Exception as error:
            _log.debug("otelprof: module forward hook failed: %r", error)

    def _forward_end(self, backward: str, module: Any, args: Any, result: Any) -> None:
        try:
            stack = self._stack()
            for i in range(len(stack) - 1, -1, -1):
                if stack[i][0] is module:
                    frame = stack.pop(i)[1]
                    break
            else:
                return
            if frame is None:
                return
            self._rec.end_leaf(frame)
            if self._torch.is_grad_enabled():
                self._watch_backward(backward, args, result)
        except Exception as error:
            _log.debug("otelprof: module forward hook failed: %r", error)

    def _stack(self) -> list[tuple[Any, Any]]:
        local = self._per_thread
        stack: list[tuple[Any, Any]] | None = getattr(local, "stack", None)
        if stack is None:
            stack = local.stack = []
        return stack

    def _watch_backward(self, name: str, args: Any, result: Any) -> None:
        """Hooks on the autograd nodes of this call: its outputs' (the first to run begins
        the range) and its inputs' producers (run once every gradient of the inputs is in:
        the last ends it). Node hooks die with the graph; leaves get none."""
        outputs = _grad_nodes(self._tensor, result)
        if not outputs:
            return
        call = _BackwardCall(self, name)
        for node in outputs:
            node.register_prehook(call.begin)
        inputs = _grad_nodes(self._tensor, args)
        call.pending = len(inputs)
        for node in inputs:
            node.register_prehook(call.end)

    def _opened(self, call: _BackwardCall) -> None:
        """A backward range began that no input's gradient will end: the pass's end does."""
        with self._lock:
            if len(self._open_backward) >= _MAX_OPEN_BACKWARD:  # passes that never ended
                self._open_backward.clear()
                self._callback_queued = False
            self._open_backward[id(call)] = call
            queue = not self._callback_queued
            self._callback_queued = True
        if queue and not _torch_compat.queue_backward_callback(self._torch, self._pass_ended):
            with self._lock:
                self._callback_queued = False

    def _pass_ended(self) -> None:
        with self._lock:
            still_open = list(self._open_backward.values())
            self._open_backward.clear()
            self._callback_queued = False
        for call in still_open:
            call.finish()


class _BackwardCall:
    """One forward call's backward range: begun when the first of its outputs' nodes runs,
    ended when its inputs' producers are about to run (or when the backward pass ends)."""

    __slots__ = ("done", "frame", "name", "owner", "pending")

    def __init__(self, owner: ModuleTimings, name: str) -> None:
        self.owner = owner
        self.name = name
        self.frame: Any = None
        self.pending = 0
        self.done = False

    def begin(self, _grads: Any) -> None:
        try:
            owner = self.owner
            if self.frame is not None or self.done or owner._closed:
                return
            self.frame = owner._rec.begin_leaf(self.name)
            if self.frame is not None and not self.pending:  # no input to end it
                owner._opened(self)
        except Exception as error:
            _log.debug("otelprof: module backward hook failed: %r", error)

    def end(self, _grads: Any) -> None:
        try:
            self.pending -= 1
            if self.pending <= 0 and self.frame is not None:
                self.finish()
        except Exception as error:
            _log.debug("otelprof: module backward hook failed: %r", error)

    def finish(self) -> None:
        frame, self.frame = self.frame, None
        self.done = True
        if frame is not None:
            self.owner._rec.end_leaf(frame)


def _unwrap(module: Any) -> Any:
    """The model inside DDP-style wrappers; None for a torch.compile'd one."""
    for _ in range(4):
        if getattr(module, "_orig_mod", None) is not None:
            return None
        inner = getattr(module, "module", None)
        if type(module).__name__ in _WRAPPERS and inner is not None:
            module = inner
            continue
        break
    return module


def _submodules(model: Any, depth: int, prefix: str = "", level: int = 1) -> Iterator[Any]:
    """(path, module) of the modules down to `depth`, containers looked through."""
    for name, child in model.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if type(child).__name__ in _CONTAINERS:
            yield from _submodules(child, depth, path, level)
            continue
        yield path, child
        if level < depth:
            yield from _submodules(child, depth, path, level + 1)


def _grad_nodes(tensor: Any, value: Any) -> list[Any]:
    """The distinct autograd nodes that made the tensors in a call's arguments or result
    (tuples, lists, dicts such as Hugging Face's ModelOutput; at most `_MAX_TENSORS`
    tensors looked at). Tensors that need no gradient, and leaves, have none."""
    if type(value) is tuple and len(value) == 1:  # a forward's usual arguments: (x,)
        value = value[0]
    if type(value) is tensor:  # the usual result, and argument
        node = value.grad_fn
        return [] if node is None else [node]
    nodes: list[Any] = []
    budget = [_MAX_TENSORS]
    _collect(tensor, value, nodes, budget)
    return nodes


def _collect(tensor: Any, value: Any, nodes: list[Any], budget: list[int]) -> None:
    if budget[0] <= 0:
        return
    if isinstance(value, tensor):
        budget[0] -= 1
        node = value.grad_fn
        if node is not None and all(node is not seen for seen in nodes):
            nodes.append(node)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect(tensor, item, nodes, budget)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(tensor, item, nodes, budget)
