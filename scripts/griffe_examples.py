"""Griffe extension for the API reference: read Google-style ``Example:`` as ``Examples:``.

Griffe's Google parser turns an ``Examples:`` section into code blocks (the doctests
render as highlighted Python console sessions) but treats ``Example:`` as a plain note,
whose ``>>>`` lines Markdown would show as nested quotes.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
