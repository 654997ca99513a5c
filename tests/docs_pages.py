"""The documentation's Markdown, for the tests that run or check what it shows: README.md and
every page of the site (docs/**/*.md).

The benchmarks' history page is left out: it is lab notes kept as written, with no block to
run. Blocks keep the README's conventions everywhere: a Python block that cannot run alone
starts with a `# fragment: ...` line saying what it needs.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_RUN = ("docs/benchmarks-history.md",)
"""Pages whose blocks are records, not instructions."""
_SITE = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))
PAGES = ("README.md", *(p for p in _SITE if p not in NOT_RUN))
"""Every page with blocks to run or check, as paths from the repository's root."""
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)
HEADING = re.compile(r"^(#{1,6}) (.+)$", re.M)


@dataclass(frozen=True)
class Block:
    page: str
    lang: str
    code: str

    @property
    def id(self) -> str:
        first = self.code.strip().splitlines()[0] if self.code.strip() else "empty"
        return f"{Path(self.page).stem}:" + re.sub(r"\W+", "_", first)[:40]


def page(path: str) -> str:
    """One page's Markdown (a path from the repository's root)."""
    return (ROOT / path).read_text(encoding="utf-8")


def all_text() -> str:
    """Every page's Markdown, README first."""
    return "\n".join(page(p) for p in PAGES)


def blocks(pages: tuple[str, ...] = PAGES) -> list[Block]:
    """The fenced code blocks of the pages, dedented, in page order."""
    return [
        Block(path, m.group(2), textwrap.dedent(m.group(3)))
        for path in pages
        for m in FENCE.finditer(page(path))
    ]


def section(path: str, heading: str) -> str:
    """The text under a page's heading (any level, matched from its start), up to the next
    heading of the same or a higher level (headings inside code blocks are not headings)."""
    text = page(path)
    fenced = [m.span() for m in FENCE.finditer(text)]
    found = [m for m in HEADING.finditer(text) if not any(a <= m.start() < b for a, b in fenced)]
    for i, m in enumerate(found):
        if m.group(2).startswith(heading):
            level = len(m.group(1))
            end = next((n.start() for n in found[i + 1 :] if len(n.group(1)) <= level), len(text))
            return text[m.end() : end]
    raise AssertionError(f"{path} has no heading starting with {heading!r}")
