"""The one restore rule every otelprof monkeypatch follows (otelprof/_patch.py)."""

from __future__ import annotations

import logging
import types

import pytest

from otelprof._patch import Patch, Patches


class Base:
    def method(self) -> str:
        return "base"


class Own(Base):
    def method(self) -> str:
        return "own"


class Inherits(Base):
    pass


def test_restoring_puts_back_the_owners_own_attribute_exactly() -> None:
    original = Own.__dict__["method"]
    patch = Patch(Own, "method", lambda self: "patched")
    assert Own().method() == "patched"
    assert patch.restore()
    assert Own.__dict__["method"] is original


def test_restoring_an_inherited_attribute_deletes_ours_instead_of_copying_the_parents() -> None:
    Patch(Inherits, "method", lambda self: "patched").restore()
    assert "method" not in Inherits.__dict__
    assert Inherits().method() == "base"


def test_an_attribute_that_was_absent_is_absent_again_on_an_instance_and_a_module() -> None:
    obj = Own()
    Patch(obj, "method", lambda: "patched").restore()
    assert "method" not in vars(obj)
    module = types.ModuleType("m")
    Patch(module, "f", len).restore()
    assert not hasattr(module, "f")


def test_a_later_patch_is_left_in_place_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    class Target(Base):
        def method(self) -> str:
            return "own"

    patch = Patch(Target, "method", lambda self: "ours")

    def theirs(self: Target) -> str:
        return "theirs"

    Target.method = theirs  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="otelprof"):
        assert not patch.restore()
    assert Target.__dict__["method"] is theirs
    assert "Target.method was re-patched by someone else" in caplog.text


def test_patches_restore_in_reverse_order_so_stacked_patches_of_one_name_unwind() -> None:
    module = types.ModuleType("m")
    module.f = "original"  # type: ignore[attr-defined]
    patches = Patches()
    patches.patch(module, "f", "first")
    patches.patch(module, "f", "second")
    assert module.f == "second"  # type: ignore[attr-defined]
    patches.restore()
    assert module.f == "original"  # type: ignore[attr-defined]
    patches.restore()  # nothing left to undo
    assert module.f == "original"  # type: ignore[attr-defined]
