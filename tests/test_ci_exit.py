"""``.ci/run``'s exit trap: the status CI reports is the script's own.

The trap stops the background installs still running and removes the work folder. When
none is running, ``kill`` with no process fails (status 2); under ``set -e`` that status
became the script's, and a run whose every leg passed exited 2.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _trap_line() -> str:
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if re.match(r"trap .* EXIT$", line)]
    assert len(lines) == 1, f"expected one EXIT trap in .ci/run, found {lines}"
    return lines[0]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ("true", 0),  # every leg passed, the background installs already done
        ("sleep 0.05 & wait $!", 0),
        # An install still running is stopped (its output is not the test's pipes, which
        # a process that outlived the script would hold open).
        ("sleep 30 >/dev/null 2>&1 & true", 0),
        ("false", 1),  # a failure keeps its own status
        ("sleep 30 >/dev/null 2>&1 & exit 3", 3),
    ],
)
def test_the_exit_status_is_the_scripts_own(tmp_path: Path, body: str, status: int) -> None:
    work = tmp_path / "work"
    work.mkdir()
    script = f'set -euo pipefail\nwork="{work}"\n{_trap_line()}\n{body}\n'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == status, done.stderr
    assert not work.exists(), "the trap did not remove the work folder"
