"""MkDocs hook: the reference pages' tables, generated from the code at every build.

A page asks for a generated part with a line of its own, `<!-- generated: NAME -->`; the
hook replaces it before the page is rendered. The parts are read from the code the
documentation describes, so they cannot drift from it:

- `options`, `environment-only`: `otelprof.config.Settings`' declarations (`opt(...)`:
  variables, aliases, parser and its `describe`, default, `help`);
- `cli`: the `otelprof` command's argparse parsers (`otelprof.cli.build_parser`);
- `api`: mkdocstrings directives for every name in `otelprof.__all__` (rendered from their
  docstrings by the mkdocstrings plugin, which runs after this hook);
- `schema`, `instruments`: `otelprof/_schema.py` and `otelprof/system/names.py`.

An unknown NAME fails the build, so nothing is left silently unfilled. Nothing is written
into the repository.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.M)


def on_page_markdown(markdown: str, page: Any, **_kwargs: Any) -> str:
    """Replace every `<!-- generated: NAME -->` line of a page with its generated Markdown."""

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(
                f"{page.file.src_uri}: unknown generated part {name!r} "
                f"(known: {', '.join(sorted(GENERATORS))})"
            )
        return GENERATORS[name]()

    return MARKER.sub(fill, markdown)


# ---- options, from Settings' declarations ----------------------------------------------------


def _cell(text: str) -> str:
    """A table cell: one line; a `|` would end the cell, so none may come from the code."""
    if "|" in text:
        raise ValueError(f"a `|` in a generated table cell: {text!r}")
    return " ".join(text.split())


def _default(field: Any, option: Any) -> str:
    if option.unset:
        return option.unset
    value = field.default_factory() if field.default is dataclasses.MISSING else field.default
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value is None or value == {}:
        return "none"
    if isinstance(value, int) and field.name.endswith("_bytes") and value >= 1 << 20:
        for unit, shift in (("GiB", 30), ("MiB", 20)):
            if value % (1 << shift) == 0:
                return f"{value >> shift} {unit}"
    return f"`{value}`"


def _options(keyword: bool) -> str:
    from otelprof.config import Settings

    rows = [
        "| option | environment | default | values | meaning |",
        "|---|---|---|---|---|",
    ]
    for field in dataclasses.fields(Settings):
        option = field.metadata["option"]
        if option.keyword is not keyword:
            continue
        names = " ".join(f"`{n}`" for n in (field.name, *option.aliases)) if keyword else ""
        env = ", ".join(f"`{v}`" for v in option.env) or "—"
        cells = (names, env, _default(field, option), option.parse.describe, option.help)
        rows.append("| " + " | ".join(_cell(c) for c in (cells if keyword else cells[1:])) + " |")
    if not keyword:
        rows[0] = "| variable | default | values | meaning |"
        rows[1] = "|---|---|---|---|"
    return "\n".join(rows)


# ---- the command line, from its argparse parsers ---------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def _flag_default(action: argparse.Action) -> str:
    """The parser's default, unless the help already says it in words (`default 512M`)."""
    if action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0:
        return ""
    if "default" in (action.help or ""):
        return ""
    return f"`{action.default}`"


def _cli() -> str:
    from otelprof.cli import build_parser

    parser = build_parser()
    out = []
    for name, sub in _subcommands(parser):
        sub.prog = f"otelprof {name}"
        sub.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=88)
        usage = sub.format_usage().removeprefix("usage: ").strip()
        out += [f"## `otelprof {name}`", "", f"```text\n{usage}\n```", ""]
        if sub.description:
            out += [" ".join(sub.description.split()), ""]
        for group in sub._action_groups:
            actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS]
            actions = [a for a in actions if "-h" not in a.option_strings]
            if not actions:
                continue
            title = group.title or "options"
            out += [f"**{title[0].upper()}{title[1:]}**", ""]
            out += ["| argument | default | meaning |", "|---|---|---|"]
            for action in actions:
                names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
                if action.metavar and action.option_strings:
                    names += f" `{action.metavar}`"
                meaning = (action.help or "") % {"default": action.default, "prog": sub.prog}
                if action.choices and not isinstance(action, argparse._SubParsersAction):
                    meaning += " (one of " + ", ".join(f"`{c}`" for c in action.choices) + ")"
                row = (names, _flag_default(action), " ".join(meaning.split()))
                out.append("| " + " | ".join(_cell(c) for c in row) + " |")
            out.append("")
    return "\n".join(out)


# ---- the Python API: mkdocstrings renders these from the docstrings --------------------------

API_MODULES = (
    "otelprof.determined_timings",
    "otelprof.integrations.lightning.OtelprofCallback",
    "otelprof.integrations.accelerate.instrument_accelerator",
    "otelprof.integrations.transformers.OtelprofTrainerCallback",
)
"""Public beside `otelprof.__all__`: Determined's timing names and the integrations' one line."""


def _api() -> str:
    import otelprof

    blocks = [f"::: otelprof.{name}" for name in otelprof.__all__]
    blocks += [f"::: {path}" for path in API_MODULES]
    return "\n\n".join(blocks)


# ---- telemetry names, from the schema modules ------------------------------------------------


def _schema_entries(path: Path) -> Iterator[tuple[str, str, str, str]]:
    """(section, constant, value, doc) of each top-level string constant, in source order:
    the section from the last `# ---- ... ----` comment, the doc from the string after the
    assignment or the comment line right above it."""
    source = path.read_text()
    lines = source.splitlines()
    body = ast.parse(source).body
    for index, node in enumerate(body):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target, value = node.targets[0], node.value
        if not isinstance(target, ast.Name) or not isinstance(value, ast.Constant):
            continue
        if not isinstance(value.value, str):
            continue
        section = ""
        for line in reversed(lines[: node.lineno - 1]):
            found = re.match(r"# ---- (.+?) ----", line)
            if found:
                section = found.group(1)
                break
        doc = ""
        after = body[index + 1] if index + 1 < len(body) else None
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            doc = str(after.value.value)
        elif lines[node.lineno - 2].startswith("# ") and "----" not in lines[node.lineno - 2]:
            doc = lines[node.lineno - 2][2:]
        yield section, target.id, value.value, " ".join(doc.split())


def _schema() -> str:
    out: list[str] = []
    current = None
    for section, constant, value, doc in _schema_entries(ROOT / "otelprof" / "_schema.py"):
        if section != current:
            current = section
            out += ["", f"### {section[0].upper()}{section[1:]}", ""]
            out += ["| name | constant | what |", "|---|---|---|"]
        out.append("| " + " | ".join(_cell(c) for c in (f"`{value}`", f"`{constant}`", doc)) + " |")
    return "\n".join(out).strip()


def _instruments() -> str:
    from otelprof.system import names

    rows = ["| instrument | unit | kind | what |", "|---|---|---|---|"]
    for instrument in names.ALL:
        cells = (f"`{instrument.name}`", f"`{instrument.unit}`", instrument.kind,
                 instrument.description)  # fmt: skip
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    keys = [
        f"`{value}`"
        for _section, _constant, value, _doc in _schema_entries(
            ROOT / "otelprof" / "system" / "names.py"
        )
        if "." in value
    ]
    return "\n".join([*rows, "", "Their attribute keys: " + ", ".join(keys) + "."])


GENERATORS: dict[str, Callable[[], str]] = {
    "options": lambda: _options(keyword=True),
    "environment-only": lambda: _options(keyword=False),
    "cli": _cli,
    "api": _api,
    "schema": _schema,
    "instruments": _instruments,
}
