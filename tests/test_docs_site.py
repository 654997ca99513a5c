"""The documentation site builds in strict mode, and its generated reference covers the code:
every option, every command-line flag and every public name appears on the built site.

`mkdocs build --strict` (mkdocs.yml) fails on a broken link or anchor, a page missing from
the navigation and a snippet that cannot be included; the reference pages are generated at
build time from the code (docs/hooks/reference.py), so this test also fails when a
generator can no longer read what it documents.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest

import otelprof
from otelprof.cli import build_parser
from otelprof.config import OPTIONS, Settings
from tests.docs_pages import ROOT


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.fail(
            "mkdocs and mkdocs-material are not installed in this environment: "
            "`make venv` installs the dev extra, which pins them",
            pytrace=False,
        )
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-5000:]}"
    return out


def _text(site: Path, page: str) -> str:
    """A built page's article as plain text."""
    raw = (site / page).read_text(encoding="utf-8")
    raw = raw[raw.find("<article") : raw.find("</article>")]
    return html.unescape(re.sub(r"<[^>]+>", " ", raw))


def _words(markdown: str) -> str:
    """Text to compare Markdown with its rendering: no code or emphasis marks, no spaces."""
    return re.sub(r"[\s`*]", "", markdown)


def _flags(parser: argparse.ArgumentParser, prefix: str = "otelprof") -> Iterator[tuple[str, str]]:
    """(command, flag) of every option string in the argparse tree (not a hidden one, such
    as a removed flag that only answers with an error)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _flags(sub, f"{prefix} {name}")
        elif action.help != argparse.SUPPRESS:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    yield prefix, flag


def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    for page in ("index.html", "getting-started.html", "reference/options.html",
                 "guide/reading-the-report.html", "benchmarks-history.html"):  # fmt: skip
        assert (site / page).is_file(), page
    assert "verdict: data-loader bound" in _text(site, "getting-started.html")  # README snippet


def test_every_option_and_its_variables_are_on_the_options_page(site: Path) -> None:
    text = _text(site, "reference/options.html")
    for f in fields(Settings):
        option = OPTIONS[f.name]
        assert option.help and option.parse.describe, f.name
        for word in (f.name if option.keyword else "", *option.aliases, *option.env):
            assert word in text, f"{word} ({f.name}) is not on the options page"
        assert _words(option.help)[:40] in _words(text), f.name


def test_every_command_line_flag_is_on_the_cli_page(site: Path) -> None:
    text = _text(site, "reference/cli.html")
    flags = list(_flags(build_parser()))
    assert len(flags) > 40
    for command, flag in flags:
        assert command in text, command
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"{command} {flag}"


def test_every_public_name_is_rendered_from_its_docstring(site: Path) -> None:
    text = _text(site, "reference/api.html")
    for name in otelprof.__all__:
        assert f"otelprof.{name}" in text, name
        doc = (getattr(otelprof, name).__doc__ or "").strip().split("\n")[0]
        assert doc and _words(doc)[:30] in _words(text), name
