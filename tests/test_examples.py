"""Every example runs (so none can rot) and prints what it promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Extra arguments that keep a test run short, and a string the output must contain.
RUNS: dict[str, tuple[list[str], str]] = {
    "quickstart.py": ([], "recall@10:"),
}


def test_every_example_is_run_by_a_test() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_runs(name: str, tmp_path: Path) -> None:
    args, expected = RUNS[name]
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert expected in done.stdout
