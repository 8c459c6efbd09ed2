"""The benchmark suite runs end to end (at a tiny size) and keeps a row for a stopped peer.

``benchmarks/run.py --tiny`` runs every benchmark, every peer included, at sizes that
take seconds, and writes its results to a temporary file: the committed
``benchmarks/RESULTS.md`` is never touched.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

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
)


@pytest.mark.timeout(300)
def test_run_tiny_writes_every_table(tmp_path: Path) -> None:
    committed = BENCHMARKS / "RESULTS.md"
    before = committed.read_bytes() if committed.exists() else None
    results = tmp_path / "RESULTS.md"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run.py"), "--tiny", "--results", str(results)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    text = results.read_text()
    for heading in SECTIONS:
        assert heading in text, heading
        assert heading in done.stdout, heading
    for row in ROWS:
        assert f"| {row}" in text, row
    assert text.count("|---") >= 9  # dense, flat, embedding, 3 scaling, distributed, targets
    assert f"Command: `python benchmarks/run.py --tiny --results {results}`" in text
    assert "Machine: CPU " in text and "torch " in text and "device cpu" in text
    assert "did not finish" not in text  # tiny sizes finish within every bound
    assert (tmp_path / "scaling.png").stat().st_size > 0
    after = committed.read_bytes() if committed.exists() else None
    assert after == before


def test_a_peer_past_its_time_bound_keeps_its_row(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from measure import Measurement, measure_bounded, run_child, table
    finally:
        sys.path.remove(str(BENCHMARKS))
    script = tmp_path / "slow.py"
    script.write_text("import time\ntime.sleep(30)\nprint('{}')\n")
    assert run_child(script, [], timeout=0.5) is None  # the safety net kills the child
    slow = measure_bounded("slow peer", lambda: time.sleep(30), time_limit=0.5)
    assert slow.at_least and slow.seconds == 0.5
    text = table([Measurement("ours", 0.01, 1024), slow], reference="ours")
    line = next(line for line in text.splitlines() if line.startswith("| slow peer"))
    assert "> 500.0 ms" in line
    assert ">= 50.00x" in line
    assert "did not finish within the time bound of 500.0 ms" in line
