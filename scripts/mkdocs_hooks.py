"""MkDocs hooks: put the benchmark results into the docs at build time, so they never drift.

- ``benchmarks/scaling.png`` is added to the site as ``scaling.png`` (beside
  ``benchmarks.md``, where the results' own figure link expects it).
- In a page, the line ``<!-- benchmarks:NAME -->`` is replaced by the block of
  ``benchmarks/RESULTS.md`` between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``
  (its own ``##`` heading and run-time line dropped); of the ``header`` block only the
  ``Machine:`` line is kept. A missing file or block fails the build.
- In a page, the line ``<!-- readme:NAME -->`` is replaced by the section of README.md
  marked ``<!-- readme:NAME:start -->`` / ``<!-- readme:NAME:end -->``
  (``scripts/readme_sections.py``), so a text shared by the README and the site has one
  source. A missing section fails the build.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
FIGURE = ROOT / "benchmarks" / "scaling.png"
RUN_TIME = re.compile(r"^\(\w+: [\d.]+ s\)$")  # "(scaling: 12 s)": how long that part ran
PLACEHOLDER = re.compile(r"^<!-- benchmarks:(\w+) -->$", re.MULTILINE)


def _readme_sections() -> Any:
    """``scripts/readme_sections.py`` (hooks are loaded by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(
        "readme_sections", Path(__file__).with_name("readme_sections.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


readme_sections = _readme_sections()


def on_files(files: Files, config: Any) -> Files:
    if not FIGURE.is_file():
        raise PluginError(f"{FIGURE} is missing")
    files.append(File.generated(config, "scaling.png", abs_src_path=str(FIGURE)))
    return files


def results_block(name: str) -> str:
    """The block ``name`` of ``benchmarks/RESULTS.md``, without its ``##`` heading."""
    if not RESULTS.is_file():
        raise PluginError(f"{RESULTS} is missing")
    text = RESULTS.read_text(encoding="utf-8")
    match = re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", text, re.DOTALL)
    if match is None:
        raise PluginError(f"{RESULTS.name} has no block <!-- {name}:start/end -->")
    lines = [
        line
        for line in match.group(1).splitlines()
        if not line.startswith("## ") and not RUN_TIME.match(line)
    ]
    if name == "header":
        lines = [line for line in lines if line.startswith("Machine:")]
    return "\n".join(lines).strip()


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    try:
        markdown = readme_sections.fill(markdown)
    except KeyError as err:
        raise PluginError(f"{page.file.src_path}: {err.args[0]}") from err
    return PLACEHOLDER.sub(lambda match: results_block(match.group(1)), markdown)
