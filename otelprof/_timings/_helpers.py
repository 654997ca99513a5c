"""The per-step helpers without a Python frame of their own, while a profiler runs.

`otelprof.timing`, `train_batch`, `reduce_metrics`, `to_device` and `from_device` run every
step. As Python functions each costs two interpreter frames (itself and torch.compile's
`is_dynamo_compiling` check) between torch's operators, about 0.2 µs each on a step's cold
caches. While a profiler runs with the compiled hot path, `HelperSwap` puts compiled
equivalents (`_speedups`) in the `otelprof` namespace, and `uninstall()` puts back what was
there (the instrumentor pattern). torch.compile cannot trace into C, so the Python helpers
are registered as what it traces in their place (`torch.compiler.substitute_in_graph`, torch
2.5 and later; with an older torch nothing is swapped): once `torch._dynamo` is loaded, or at
once when it already is. A name imported before the swap (`from otelprof import timing`)
stays the Python helper, which records the same spans.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from otelprof._patch import Patches
from otelprof._timings import _recorder as rec

_log = logging.getLogger("otelprof")

HELPERS = ("timing", "train_batch", "reduce_metrics", "to_device", "from_device")
DYNAMO = "torch._dynamo"

_namespace: ModuleType | None = None
"""The public namespace (`otelprof`), as it introduced itself (`provide`)."""
_python: dict[str, Callable[..., Any]] = {}
"""Its Python helpers by name: what torch.compile traces, and what the swap puts back."""

_registered = False
"""Whether the Python helpers are torch.compile's stand-ins for the compiled ones (for the
process's life: dynamo refuses a second registration)."""


def provide(namespace: ModuleType, helpers: Mapping[str, Callable[..., Any]]) -> None:
    """The public namespace and its Python helpers (`otelprof/__init__.py`, at import: this
    layer does not import the one above it)."""
    global _namespace
    _namespace = namespace
    _python.update((name, helpers[name]) for name in HELPERS)


def register_stand_ins() -> None:
    """Make torch.compile trace each Python helper where user code calls its compiled twin."""
    global _registered
    if _registered or rec.speedups is None:
        return
    import torch

    substitute = torch.compiler.substitute_in_graph
    for name in HELPERS:
        substitute(getattr(rec.speedups, name), skip_signature_check=True)(_python[name])
    _registered = True


def _register_or_warn() -> bool:
    """`register_stand_ins()`; False, with a warning, where it fails (then torch.compile
    would graph-break on the compiled helpers, so they must not be in use)."""
    try:
        register_stand_ins()
    except Exception as error:
        _log.warning("otelprof: torch.compile cannot trace otelprof's helpers: %r", error)
        return False
    return True


def can_substitute() -> bool:
    """Whether this torch lets torch.compile trace a stand-in for a C function."""
    torch = sys.modules.get("torch")
    compiler = getattr(torch, "compiler", None)
    return callable(getattr(compiler, "substitute_in_graph", None))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `callback` right after the module `name` has been executed (first import)."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback
        self._finding = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenCall(spec.loader, self._loaded)
        return spec

    def _loaded(self) -> None:
        self.remove()
        self.callback()

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class _ThenCall(importlib.abc.Loader):
    """A module's own loader, then a call once the module is executed."""

    def __init__(self, loader: Any, then: Callable[[], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create: Any = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader  # source look-ups (inspect) ask the real loader
        self._loader.exec_module(module)
        self._then()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class HelperSwap:
    """The compiled helpers in the public namespace while installed."""

    def __init__(self) -> None:
        self._patches = Patches()
        self._waiting: _AfterImport | None = None

    def install(self) -> None:
        speedups, namespace = rec.speedups, _namespace
        if speedups is None or namespace is None or not rec.compiled or self._patches:
            return
        if not can_substitute():
            return
        if DYNAMO in sys.modules:
            if not _register_or_warn():
                return
        else:  # (registering needs dynamo loaded: nothing is registered yet)
            self._waiting = _AfterImport(DYNAMO, self._dynamo_loaded)
            sys.meta_path.insert(0, self._waiting)
        for name in HELPERS:
            if getattr(namespace, name, None) is _python[name]:
                self._patches.patch(namespace, name, getattr(speedups, name))

    def _dynamo_loaded(self) -> None:
        self._waiting = None
        if not _register_or_warn():
            self._patches.restore()

    def uninstall(self) -> None:
        if self._waiting is not None:
            self._waiting.remove()
            self._waiting = None
        self._patches.restore()
