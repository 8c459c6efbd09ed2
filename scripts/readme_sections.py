"""Sections of README.md that the docs site shows too, so that each text has one source.

The README is one page (what and why, the differences from torchmetrics'
``RetrievalHitRate``, the two commands, the tested versions, a quickstart and links into
the site); the site holds the rest. What both show is written once, in the README:
``differences``, ``two-commands`` and ``tested-versions`` (all three in ``docs/index.md``).

In README.md a shared text is marked ``<!-- readme:NAME:start -->`` ...
``<!-- readme:NAME:end -->`` (lines of their own; neither GitHub nor the site shows
them). In a docs page the line ``<!-- readme:NAME -->`` is replaced by that text when
the site is built (``scripts/mkdocs_hooks.py``), adapted to the site:

- a section that is one bullet of a list (``- **Name** ...``) becomes a paragraph;
- links are rewritten: ``docs/PAGE.md`` (and its anchors) to ``PAGE.md``, and with
  :data:`LINKS` (repository files that have a page on the site); any other relative link
  becomes its text, since the site has no copy of the repository's files.

A name that README.md does not mark is an error (the build fails).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PLACEHOLDER = re.compile(r"^<!-- readme:([\w-]+) -->$", re.MULTILINE)
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
LINKS = {"benchmarks/RESULTS.md": "benchmarks.md"}


def sections(readme: str) -> dict[str, str]:
    """Every marked section of the README, by name, as the site shows it."""
    found = {}
    pattern = r"^<!-- readme:([\w-]+):start -->\n(.*?)^<!-- readme:\1:end -->$"
    for match in re.finditer(pattern, readme, re.MULTILINE | re.DOTALL):
        found[match.group(1)] = for_the_site(match.group(2))
    return found


def for_the_site(text: str) -> str:
    if text.startswith("- "):  # one bullet of a list: a paragraph on the site
        first, _, rest = text[2:].partition("\n")
        text = first + "\n" + textwrap.dedent(rest)
    return LINK.sub(_link, text).strip("\n")


def _link(match: re.Match[str]) -> str:
    label, target = match.group(1), match.group(2)
    if target.startswith(("http://", "https://")):
        return match.group(0)
    if target in LINKS:
        return f"[{label}]({LINKS[target]})"
    if target.startswith("docs/") and target.partition("#")[0].endswith(".md"):
        return f"[{label}]({target.removeprefix('docs/')})"
    return label


def fill(page: str, readme: str | None = None) -> str:
    """``page`` with every ``<!-- readme:NAME -->`` line replaced by its section."""
    shared = sections(README.read_text(encoding="utf-8") if readme is None else readme)

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in shared:
            raise KeyError(f"README.md has no section <!-- readme:{name}:start/end -->")
        return shared[name]

    return PLACEHOLDER.sub(replace, page)
