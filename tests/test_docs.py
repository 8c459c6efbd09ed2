"""Every code example of README.md and docs/*.md runs, so none can drift from the package.

Each ```python block is one test case, named ``FILE:LINE`` (the line of its opening
fence), and runs as written in a fresh namespace; each ```pycon block is one case too,
run as a doctest (the ```pycon blocks of one file share one namespace, as a doctest of
the whole file would). A block that needs data, a model or a ``Trainer`` names what it needs
in a marker on the line before its fence, ``<!-- docs-test: NAME ... -->``; the names
are documented in ``tests/docs_fixtures.py``. A new block is picked up by itself: it
needs a marker only if it uses names it does not define.

A ```python block that is a ``--8<--`` line, lines ``examples/NAME.py:SECTION`` and a
``--8<--`` line shows sections of examples (the site's build puts them in, from the
lines between ``# --8<-- [start:SECTION]`` and ``# --8<-- [end:SECTION]``; ruff's
formatter leaves this form alone): the examples run in ``tests/test_examples.py``, so
here the case checks that each section exists.
"""

from __future__ import annotations

import doctest
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest
from docs_fixtures import FIXTURES, class_body, fit_and_check, step_body

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w+)[^\n]*$")
MARKER = re.compile(r"^<!-- docs-test: ([\w\- ]+) -->$")
INCLUDE = re.compile(r"^(examples/\w+\.py):(\w+)$")
WRAPPERS = {"class-body": class_body, "step-body": step_body}
TRAINERS = {"trainer": False, "trainer-flat": True}
FLAGS = {"continue", *WRAPPERS, *TRAINERS}


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    names: list[str] = field(default_factory=list)
    previous: Block | None = None  # the previous block of the same file, same language

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """The ```python and ```pycon blocks of one Markdown file, with their markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        end = next(j for j in range(index + 1, len(lines)) if lines[j].startswith("```"))
        language = match.group(1)
        if language in ("python", "pycon"):
            marker = MARKER.match(lines[index - 1]) if index else None
            names = marker.group(1).split() if marker else []
            code = "\n".join(lines[index + 1 : end]) + "\n"
            same = [b for b in found if b.language == language]
            found.append(Block(path, index + 1, language, code, names, same[-1] if same else None))
        index = end + 1
    return found


BLOCKS = [block for path in FILES for block in blocks_of(path)]
_NAMESPACES: dict[str, dict[str, Any]] = {}  # block id -> the namespace it ran in


def test_blocks_are_found_and_markers_known() -> None:
    assert any(b.path.name == "README.md" for b in BLOCKS)
    assert {b.path.name for b in BLOCKS} >= {"README.md", "index.md", "input-forms.md"}
    for block in BLOCKS:
        unknown = set(block.names) - FLAGS - set(FIXTURES)
        assert not unknown, f"{block.id}: unknown docs-test names {sorted(unknown)}"
        if "continue" in block.names:
            assert block.previous is not None, f"{block.id}: nothing to continue"


def test_every_marker_is_before_a_block() -> None:
    """A marker that is not right before a fence would silently do nothing."""
    for path in FILES:
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines[:-1]):
            if MARKER.match(line):
                assert FENCE.match(lines[number + 1]), f"{path.name}:{number + 1}"


def _continues(block: Block) -> bool:
    """Whether the block runs in its predecessor's namespace: marked ``continue``, or a
    ```pycon block after another in the same file (one doctest session a file)."""
    return "continue" in block.names or (block.language == "pycon" and block.previous is not None)


def _namespace(block: Block) -> dict[str, Any]:
    if _continues(block):
        assert block.previous is not None
        if block.previous.id not in _NAMESPACES:
            _run(block.previous, None)  # run alone (-k): its namespace is needed here
        namespace = _NAMESPACES[block.previous.id]
    else:
        namespace = {"__name__": f"docs_block_{block.line}"}
    for name in block.names:
        if name in FIXTURES:
            namespace.update(FIXTURES[name]())
    return namespace


def _included_sections(block: Block) -> list[tuple[str, str]]:
    """``(path, section)`` of each section the block includes, if it is such a block."""
    lines = block.code.strip().splitlines()
    if "--8<--" not in lines:
        return []
    assert len(lines) > 2 and lines[0] == lines[-1] == "--8<--", f"{block.id}: {lines}"
    matches = [INCLUDE.match(line) for line in lines[1:-1]]
    assert all(matches), f"{block.id}: one examples/NAME.py:SECTION a line"
    return [(match.group(1), match.group(2)) for match in matches if match]


def _check_sections(block: Block) -> None:
    for path, section in _included_sections(block):
        lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
        for edge in ("start", "end"):
            marker = f"# --8<-- [{edge}:{section}]"
            found = [line for line in lines if line.strip() == marker]
            assert len(found) == 1, f"{block.id}: {path} needs one line {marker!r}"


def _run(block: Block, tmp_path: Path | None) -> None:
    if _included_sections(block):
        _check_sections(block)
        return
    namespace = _namespace(block)
    code = block.code
    for name, wrap in WRAPPERS.items():
        if name in block.names:
            code = wrap(code)
    if block.language == "pycon":
        test = doctest.DocTestParser().get_doctest(code, namespace, block.id, block.id, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        report: list[str] = []
        failed = runner.run(test, out=report.append, clear_globs=False).failed
        assert failed == 0, "".join(report)
        namespace = test.globs
    else:
        exec(compile(code, block.id, "exec"), namespace)
    _NAMESPACES[block.id] = namespace
    for name, flat in TRAINERS.items():
        if name in block.names and tmp_path is not None:
            with warnings.catch_warnings():
                # Lightning's advice for small CPU runs (workers, batch sizes, logging).
                warnings.filterwarnings("ignore", module="lightning")
                warnings.filterwarnings("ignore", module="lightning_fabric")
                fit_and_check(namespace, tmp_path, flat=flat)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a block that writes a file writes it there
    try:
        _run(block, tmp_path)
    finally:
        plt.close("all")


def test_the_quickstart_ci_runs_against_the_wheel_is_one_of_these_blocks() -> None:
    """``.ci/run`` runs ``scripts/readme_quickstart.py``'s block against the installed
    wheel, outside the repository; here it runs like every other block."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "readme_quickstart", ROOT / "scripts" / "readme_quickstart.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = module.quickstart((ROOT / "README.md").read_text(encoding="utf-8"))
    assert code in [block.code for block in BLOCKS if block.path.name == "README.md"]
