"""Every monkeypatch otelprof makes, with one restore rule.

A `Patch` remembers what the owner itself held under the name, so `restore()` puts back
exactly that (deleting an attribute that was inherited or absent). A later patch of the same
attribute by someone else (another profiler, a test's mock) is left in place, with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

_log = logging.getLogger("otelprof")
_MISSING = object()


def _own(owner: Any, name: str) -> Any:
    """What `owner` itself holds under `name` (not what it inherits), or _MISSING."""
    return getattr(owner, "__dict__", {}).get(name, _MISSING)


class Patch:
    """`owner.name` replaced by `replacement` until `restore()`."""

    __slots__ = ("_saved", "name", "owner", "replacement")

    def __init__(self, owner: Any, name: str, replacement: Any) -> None:
        self.owner = owner
        self.name = name
        self.replacement = replacement
        self._saved = _own(owner, name)
        setattr(owner, name, replacement)

    def restore(self) -> bool:
        """Put back what was there; False (and a warning) if a later patch is left in place."""
        if _own(self.owner, self.name) is not self.replacement:
            owner = getattr(self.owner, "__qualname__", None) or getattr(
                self.owner, "__name__", type(self.owner).__qualname__
            )
            _log.warning(
                "otelprof: %s.%s was re-patched by someone else; leaving it", owner, self.name
            )
            return False
        if self._saved is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self._saved)
        return True


class Patches:
    """Patches made together, restored together in reverse order."""

    def __init__(self) -> None:
        self._patches: list[Patch] = []

    def patch(self, owner: Any, name: str, replacement: Any) -> Patch:
        patch = Patch(owner, name, replacement)
        self._patches.append(patch)
        return patch

    def patch_where(
        self, owners: tuple[Any, ...], name: str, original: Any, replacement: Any
    ) -> None:
        """Patch `name` on each of `owners` that holds `original` under it (a function a
        package re-exports from a submodule is seen under both names)."""
        for owner in owners:
            if getattr(owner, name, None) is original:
                self.patch(owner, name, replacement)

    def restore(self) -> None:
        while self._patches:
            self._patches.pop().restore()
