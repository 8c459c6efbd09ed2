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
from typing import Any

import pytest
from memory_formula import (
    BOOKKEEPING_BYTES_PER_ITEM,
    DEFAULT_CHUNK_BYTES,
    SHARDED_SCRATCH_TILES,
    chunk_bound,
    gathered_bytes_received,
    ring_bytes_received,
)

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
COMMITTED = (BENCHMARKS / "RESULTS.md", BENCHMARKS / "scaling.png")

SECTIONS = (
    "## Dense workload",
    "## Flat workload",
    "## Embedding workload",
    "## Small updates",
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
    "torchmetrics RetrievalHitRate(top_k=10).update",
    "RetrievalRecallAtK, dense [Q] index target",
    "RetrievalRecallAtK, dense [Q, G] mask target",
    "RetrievalRecallAtK, flat (preds, target, indexes)",
)
TARGETS = 15  # rows of the acceptance targets table
EVERY_CORE = os.cpu_count() or 1


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


@pytest.mark.ddp
@pytest.mark.slow
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
    # By default every workload runs at 1 thread and at every core, side by side.
    counts = [1] if EVERY_CORE == 1 else [1, EVERY_CORE]
    labels = [
        f"{n} thread{'' if n == 1 else 's'}{' (every core)' if n == EVERY_CORE else ''}"
        for n in counts
    ]
    head = targets.split("\n")[2]
    assert head.count("| measured, ") == len(counts), head
    for label in labels:
        assert f"measured, {label} | result" in head, head
        if len(counts) > 1:
            for section in ("dense", "flat", "embedding", "small", "scaling"):
                body = text.split(f"<!-- {section}:start -->")[1].split(f"<!-- {section}:end")[0]
                assert f"### {label}\n" in body, (section, label)
    distributed = text.split("<!-- distributed:start -->")[1].split("<!-- distributed:end")[0]
    assert "### " not in distributed  # one torch thread a process, run once


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_threads_all_runs_at_every_core_only(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    _run("--tiny", "--only", "small", "--threads", "all", "--results", str(results), timeout=280)
    text = results.read_text()
    label = f"{EVERY_CORE} thread{'' if EVERY_CORE == 1 else 's'} (every core)"
    targets = text.split("## Acceptance targets")[1].split("<!--")[0]
    assert f"measured, {label} | result" in targets
    assert targets.count("| measured, ") == 1
    assert targets.count("\n| small |") == 3  # one row per small-update target
    assert "### " not in text  # one thread count: no sub-headings
    assert f"runs at {label}" in text


def test_thread_counts_parse() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        run = importlib.import_module("run")
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert run.thread_counts("1,all") == ([1] if EVERY_CORE == 1 else [1, EVERY_CORE])
    assert run.thread_counts("all") == [EVERY_CORE]
    assert run.thread_counts("2, 1,2") == [2, 1]
    for bad in ("0", "many", "1,", "-1"):
        with pytest.raises(Exception, match="thread counts are positive ints or 'all'"):
            run.thread_counts(bad)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_writes_outside_the_committed_results() -> None:
    """``--quick`` writes under ``out/quick``; ``--tiny`` takes the same line to ``out/tiny``
    (``test_run_tiny_writes_every_table`` runs it)."""
    mode = "quick"
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
    import measure

    slow_peer = importlib.import_module("slow_peer")
    # The safety net kills a child process that runs past its timeout.
    assert measure.call(slow_peer.nap, {"seconds": 30}, timeout=0.5) is None
    # A slow peer (one that states the memory it needs) stops at the time bound.
    nap = measure.Contestant("slow peer", lambda probe: time.sleep(30), need=0)
    (slow,) = measure.compare([nap], "cpu", time_limit=0.5)
    assert slow.at_least and slow.seconds == 0.5
    ours = measure.Measurement("ours", 0.01, 1024)
    columns = [measure.TIME_COLUMN, measure.time_ratio_column("time / this metric", ours)]
    text = measure.contestant_table([ours, slow], [*columns, ("note", lambda row: row.note)])
    line = next(line for line in text.splitlines() if line.startswith("| slow peer"))
    assert "> 500.0 ms" in line
    assert ">= 50.00x" in line
    assert "did not finish within the time bound of 500.0 ms" in line
    # A peer that would need more than the memory bound is not started; its row says so.
    (huge,) = measure.compare([measure.Contestant("huge", nap.run, need=2**60)], "cpu")
    assert huge.seconds is None and huge.note.startswith("not run: needs about")


def _scale() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("scale")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_scale_says_why_a_configuration_is_not_projected() -> None:
    scale = _scale()
    rows = [{"num": 200, "config": "sharded", "peak": 1, "received": 1}]
    text = scale.projection_text(rows)
    assert "Sharded: not projected (measured at one size)." in text
    assert "Gathered: not projected (not measured)." in text


@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scale_runs_every_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny size through ``main``: the rows, the table, the figure, the results section;
    each process counts the embedding bytes it receives. Two processes a configuration,
    not the script's four: the same code, half the processes to start (each imports
    torch, torchmetrics and the package, seconds of CPU)."""
    scale = _scale()
    measured: list[list[dict[str, Any]]] = []
    original = scale.measure

    def measure(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        measured.append(original(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(scale, "measure", measure)
    world = 2
    configs = {
        "single": scale.CONFIGS["single"],
        "gathered": scale.Config(f"{world} processes, gathered", world, False),
        "sharded": scale.Config(f"{world} processes, sharded", world, True),
    }
    monkeypatch.setattr(scale, "CONFIGS", configs)
    results = tmp_path / "RESULTS.md"
    args = ["--sizes", "400", "--configs", "single,gathered,sharded", "--results", str(results)]
    scale.main(args)
    (rows,) = measured
    assert [(r["config"], r["sharded"]) for r in rows] == [
        ("single", None),
        ("gathered", False),
        ("sharded", True),
    ]
    single, gathered, sharded = rows
    assert single["received"] == 0 and single["received_other"] == 0
    expected = gathered_bytes_received(400, scale.DIM, world)  # every other process's rows
    assert expected <= gathered["received"] <= expected * 1.05, gathered
    for row in (gathered, sharded):
        assert row["same"] and row["as_single"], row
    text = results.read_text()
    assert "<!-- scale:start -->\n## Large galleries" in text
    assert f"Command: `python benchmarks/scale.py {' '.join(args)}`" in text
    assert (tmp_path / "scale.png").stat().st_size > 0
    assert "![compute() time and memory against N](scale.png)" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| N | configuration | compute() time | time / pair")
    assert len(table) == 4
    for line, label in zip(table[1:], ("one process", "gathered", "sharded"), strict=True):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[0] == "400" and cells[1].endswith(label), cells
        assert cells[2].endswith(" s") and cells[3].endswith(" ns"), cells
        assert cells[-1] == "yes", cells  # every process returns the one-process values
    # one size: nothing to fit a projection to
    assert "Gathered: not projected (measured at one size)." in text
    assert "Sharded: not projected (measured at one size)." in text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scale_runs_as_the_script_its_results_name(tmp_path: Path) -> None:
    """``python benchmarks/scale.py ...``, the command its section prints: its workers
    run in child processes that import the script by name, not as ``__main__``."""
    results = tmp_path / "RESULTS.md"
    args = ["--sizes", "200", "--configs", "single", "--results", str(results)]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "scale.py"), *args],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| 200 | one process |" in results.read_text()


def test_scale_projection_uses_the_fitted_bytes_per_item() -> None:
    """The projection from made-up rows: gathered, a copy of every item plus
    ``chunk_bytes`` (which holds the bookkeeping, or the least that does); sharded, a copy
    of a process's share plus the bookkeeping per item and its tiles."""
    scale = _scale()
    dim = scale.DIM
    per_item = BOOKKEEPING_BYTES_PER_ITEM
    rows = []
    for num in (1000, 3000):
        base = {"num": num, "available": True, "received_other": 0}
        others = num - num // 4
        rows.append({**base, "config": "gathered", "world": 4,
                     "peak": (dim * 4 + per_item) * num + 5_000_000,
                     "received": others * dim * 4})  # fmt: skip
        rows.append({**base, "config": "sharded", "world": 4,
                     "peak": (dim * 4 // 4 + per_item) * num + 5_000_000,
                     "received": 2 * others * dim * 4})  # fmt: skip
    gathered = scale.project(rows, "gathered")
    sharded = scale.project(rows, "sharded")
    assert gathered.bytes_per_item == pytest.approx(dim * 4 + per_item)
    assert gathered.copies == pytest.approx(1.0)  # of every item's embeddings
    assert sharded.copies == pytest.approx(1.0)  # of a process's share
    items, width, world = scale.TARGET_ITEMS, scale.TARGET_DIM, scale.TARGET_WORLD
    copy = items * width * 4
    want = chunk_bound(copy, DEFAULT_CHUNK_BYTES, items, width)
    assert gathered.added == pytest.approx(want, rel=1e-6)
    tiles = SHARDED_SCRATCH_TILES * DEFAULT_CHUNK_BYTES
    assert sharded.added == pytest.approx(copy / world + per_item * items + tiles, rel=1e-6)
    assert gathered.total == pytest.approx(gathered.added + items // world * width * 4)
    assert gathered.received == pytest.approx(gathered_bytes_received(items, width, world))
    assert sharded.received == pytest.approx(ring_bytes_received(items, width, world))
    text = scale.projection_text(rows)
    assert f"{gathered.total / 1e9:.1f} GB with the stored share" in text
    assert f"receives {sharded.received / 1e9:.1f} GB of embeddings" in text
