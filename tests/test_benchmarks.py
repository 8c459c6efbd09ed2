"""The benchmark suite runs end to end (at a tiny size) and keeps a row for a stopped peer.

``benchmarks/run.py --tiny`` runs every benchmark, every peer included, at sizes that
take seconds. Neither ``--tiny`` nor ``--quick`` ever touches the committed full-size
results (``benchmarks/RESULTS.md``, ``benchmarks/scaling.png``): they write under the
git-ignored ``benchmarks/out/<mode>/`` unless ``--results`` says otherwise.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
COMMITTED = (BENCHMARKS / "RESULTS.md", BENCHMARKS / "scaling.png")

SECTIONS = (
    "## Dense workload",
    "## Flat workload",
    "## Embedding workload",
    "## Scaling",
    "## Distributed cost",
    "## Acceptance targets",
)
ROWS = (
    "amax floor",
    "torchmetrics RetrievalHitRate x 3",
    "argsort per query (re-ID scripts)",
    "CLIP-benchmark topk over the full matrix",
    "pytorch-metric-learning AccuracyCalculator",
    "matmul floor",
    "full N x N matrix + topk",
    "EmbeddingRecallAtK, leave-one-out",
    "EmbeddingRecallAtK, leave-one-out, near_duplicate = 0.99",
    "EmbeddingRecallAtK, leave-one-out, quantised {-1, 0, 1}^D embeddings",
)
TARGETS = 9  # rows of the acceptance targets table


def _committed() -> list[bytes | None]:
    return [path.read_bytes() if path.exists() else None for path in COMMITTED]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


@pytest.mark.timeout(300)
def test_run_tiny_writes_every_table(tmp_path: Path) -> None:
    before = _committed()
    results = tmp_path / "RESULTS.md"
    done = _run("--tiny", "--results", str(results), timeout=280)
    text = results.read_text()
    for heading in SECTIONS:
        assert heading in text, heading
        assert heading in done.stdout, heading
    for row in ROWS:
        assert f"| {row}" in text, row
    assert text.count("|---") >= 9  # dense, flat, embedding, 3 scaling, distributed, targets
    targets = text.split("## Acceptance targets")[1].split("<!--")[0]
    assert targets.count("\n| ") == TARGETS + 1  # the head and one row a target
    assert "gallery items re-scored a query" in text
    assert f"Command: `python benchmarks/run.py --tiny --results {results}`" in text
    assert "Machine: CPU " in text and "torch " in text and "device cpu" in text
    assert "peak memory" in text
    assert "did not finish" not in text  # tiny sizes finish within every bound
    assert (tmp_path / "scaling.png").stat().st_size > 0
    assert _committed() == before


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["tiny", "quick"])
def test_smaller_modes_write_outside_the_committed_results(mode: str) -> None:
    before = _committed()
    done = _run(f"--{mode}", "--only", "scaling", timeout=280)
    out = BENCHMARKS / "out" / mode
    assert f"wrote {out / 'RESULTS.md'}" in done.stdout
    assert "## Scaling" in (out / "RESULTS.md").read_text()
    assert (out / "scaling.png").stat().st_size > 0
    assert _committed() == before


def test_a_peer_past_its_time_bound_keeps_its_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "slow_peer.py").write_text(
        "import time\n\n\ndef nap(seconds):\n    time.sleep(seconds)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    paths = [str(tmp_path), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
    from measure import (
        TIME_COLUMN,
        Measurement,
        Setup,
        call,
        contestant_table,
        measure_bounded,
        time_ratio_column,
    )

    slow_peer = importlib.import_module("slow_peer")
    # The safety net kills a child process that runs past its timeout.
    assert call(slow_peer.nap, {"seconds": 30}, Setup(), timeout=0.5) is None
    slow = measure_bounded("slow peer", lambda: time.sleep(30), time_limit=0.5)
    assert slow.at_least and slow.seconds == 0.5
    ours = Measurement("ours", 0.01, 1024)
    columns = [TIME_COLUMN, time_ratio_column("time / this metric", ours)]
    text = contestant_table([ours, slow], [*columns, ("note", lambda row: row.note)])
    line = next(line for line in text.splitlines() if line.startswith("| slow peer"))
    assert "> 500.0 ms" in line
    assert ">= 50.00x" in line
    assert "did not finish within the time bound of 500.0 ms" in line
