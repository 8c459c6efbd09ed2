"""Every example runs (so none can rot) and prints what it promises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Extra arguments that keep a test run short, and a string the output must contain.
# Examples run with the test's tmp_path as working directory: relative paths land there.
RUNS: dict[str, tuple[list[str], str]] = {
    "quickstart.py": ([], "recall@10:"),
    "embedding_recall.py": ([], "random projection (16-d)"),
    "lightning_digits.py": (
        ["--epochs", "1", "--plot", "curve.png"],
        "saved the Recall@K curve to curve.png",
    ),
    "cross_modal.py": ([], "with ids, the result equals each image added once by hand: True"),
    "reid_protocol.py": ([], "4. Market-1501: + skip queries w/o a match"),
    "torchmetrics_collection.py": ([], "recall@K equals torchmetrics' hit rate@K: True"),
    "compare_models.py": (
        ["--plot", "compare.png"],
        "the Wilson intervals of A and B overlap at every K: True\n"
        "yet the paired test tells them apart at K = 1: True\n"
        "saved both CMC curves to compare.png",
    ),
}
TABLE_HEADER = "epoch  train loss     val R@1     val R@5    val R@10"


def _run(name: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # One thread a process: the examples are small, and on a busy or shared CI machine
    # more threads only contend (this made some runs several times slower).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def test_every_example_is_run_by_a_test() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_runs(name: str, tmp_path: Path) -> None:
    args, expected = RUNS[name]
    done = _run(name, args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert expected in done.stdout, done.stdout[-3000:]
    if name == "lightning_digits.py":
        _check_digits_run(done.stdout, epochs=1)
        assert (tmp_path / "curve.png").stat().st_size > 0
    if name == "compare_models.py":
        assert (tmp_path / "compare.png").stat().st_size > 0
        for key in ("recall@1", "recall@5", "recall@10"):
            assert key in done.stdout


def _table_rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if TABLE_HEADER in line) + 1
    rows = []
    for line in lines[start:]:
        cells = line.split()
        if len(cells) != 5 or not cells[0].isdigit():
            break
        rows.append(cells)
    return rows


def _check_digits_run(stdout: str, epochs: int) -> None:
    """One table, printed by one process, one row per epoch, recalls that make sense."""
    assert stdout.count(TABLE_HEADER) == 1, stdout
    rows = _table_rows(stdout)
    assert [row[0] for row in rows] == [str(e) for e in range(1, epochs + 1)], stdout
    for row in rows:
        recalls = [float(cell) for cell in row[2:]]
        assert 0.5 < recalls[0] <= recalls[1] <= recalls[2] <= 1.0, stdout


@pytest.mark.ddp
def test_lightning_digits_runs_with_ddp_on_cpu(tmp_path: Path) -> None:
    """``--devices 2``: two CPU processes (gloo); the first prints the table and the plot."""
    done = _run(
        "lightning_digits.py", ["--devices", "2", "--epochs", "1", "--plot", "ddp.png"], tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _check_digits_run(done.stdout, epochs=1)
    assert "saved the Recall@K curve to ddp.png" in done.stdout
    assert (tmp_path / "ddp.png").stat().st_size > 0
