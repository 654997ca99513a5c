"""The record_function bridge: every Python `record_function` range also becomes a span.

We wrap `__enter__`/`__exit__` on torch's `record_function` class itself, so every alias
(`torch.profiler.record_function`, `torch.autograd.profiler.record_function`, names a library
imported earlier) and both uses (context manager, decorator) are covered, and torch's own
methods still run first/last, so a torch.profiler session sees every range as before.
`uninstall()` puts back exactly the attributes that were there.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from otelprof._patch import Patches
from otelprof._timings import _recorder as rec

_log = logging.getLogger("otelprof")
_METHODS = ("__enter__", "__exit__")


class Bridge:
    """Installed wrappers on the record_function class(es), and what they replaced."""

    def __init__(self) -> None:
        self._classes: list[type] = []  # the distinct classes behind torch's public names
        for module_name in ("torch.profiler", "torch.autograd.profiler"):
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            cls = getattr(module, "record_function", None)
            if isinstance(cls, type) and cls not in self._classes:
                self._classes.append(cls)
        self._patches = Patches()
        self.installed = False

    def install(self) -> None:
        for cls in self._classes:
            target: Any = cls
            if any(getattr(getattr(cls, n), "_otelprof_bridge", False) for n in _METHODS):
                raise RuntimeError(
                    f"{cls.__module__}.{cls.__qualname__} is already bridged by another "
                    "otelprof engine; shut that one down first"
                )
            enter, exit_ = rec.bridged_methods(target.__enter__, target.__exit__)
            self._patches.patch(cls, "__enter__", enter)
            self._patches.patch(cls, "__exit__", exit_)
            self.installed = True

    def uninstall(self) -> None:
        """Restore each class attribute exactly (or leave a later patch in place, warning)."""
        self._patches.restore()
        self.installed = False
