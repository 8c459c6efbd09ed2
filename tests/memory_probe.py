"""The memory that ``EmbeddingRecallAtK.compute()`` adds, measured as the benchmarks do.

On CPU: the resident-set high-water mark after ``compute()`` minus the resident set
before it (Linux ``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``), in a
process started with ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed buffers leave the
resident set at once. A first ``compute()`` of a small metric of the same options runs
before, so that code pages touched for the first time are not counted. On CUDA:
``torch.cuda.max_memory_allocated()`` minus the memory allocated before.

``python tests/memory_probe.py '<json list of cases>'`` prints one JSON line per case:
``{"case": ..., "peak": bytes, "stored": bytes, "tile": bytes, "items": N}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

# One implementation of the probe: the benchmarks' (benchmarks/measure.py).
from measure import LIVE_MEMORY_MMAP_THRESHOLD, peak_since, start_peak
from memory_formula import CPU_TILE_BYTES

ENV = {"MALLOC_MMAP_THRESHOLD_": str(LIVE_MEMORY_MMAP_THRESHOLD), "OMP_NUM_THREADS": "1"}
"""The environment of a measuring process."""

start = start_peak
"""Start a window; the baseline in bytes (then :func:`peak_since`)."""

__all__ = ["CPU_TILE_BYTES", "ENV", "fill", "items", "measure", "peak_since", "start"]


def items(num: int, dim: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``num`` random float32 embeddings of ``dim`` and labels of ``num // 10`` classes."""
    gen = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(num, dim, generator=gen).to(device)
    labels = torch.randint(0, max(1, num // 10), (num,), generator=gen).to(device)
    return embeddings, labels


def fill(metric: Any, protocol: str, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
    """Add the items in batches of 1,000: leave-one-out (``"loo"``), or half queries
    and half gallery (``"qg"``, also for ``"bidirectional"``), with ids."""
    num = embeddings.shape[0]
    ids = torch.arange(num, device=embeddings.device)
    half = num // 2
    for first, stop in ((0, half), (half, num)):
        role = "both" if protocol == "loo" else ("query" if first == 0 else "gallery")
        for start_row in range(first, stop, 1000):
            rows = slice(start_row, min(stop, start_row + 1000))
            metric.update(embeddings[rows], labels[rows], role=role, ids=ids[rows])


def measure(case: dict[str, Any]) -> dict[str, Any]:
    """The peak that ``compute()`` (then ``protocol_report()``) adds for one case."""
    from recall_at_k import EmbeddingRecallAtK

    device = case.get("device", "cpu")
    options = {
        "similarity": case["similarity"],
        "chunk_bytes": case["chunk_bytes"],
        "bidirectional": case["protocol"] == "bidirectional",
        "near_duplicate": case.get("near_duplicate"),
    }
    warm = EmbeddingRecallAtK((1, 5, 10), **options)
    fill(warm, case["protocol"], *items(600, case["dim"], 1, device))
    warm.compute()
    metric = EmbeddingRecallAtK((1, 5, 10), **options)
    embeddings, labels = items(case["num"], case["dim"], 0, device)
    fill(metric, case["protocol"], embeddings, labels)
    stored = embeddings.numel() * embeddings.element_size()
    del embeddings, labels, warm
    baseline = start(device)
    metric.compute()
    metric.protocol_report()
    peak = peak_since(device, baseline)
    tile = case["chunk_bytes"] if device == "cuda" else min(case["chunk_bytes"], CPU_TILE_BYTES)
    return {"case": case, "peak": peak, "stored": stored, "tile": tile, "items": case["num"]}


def main() -> None:
    torch.set_num_threads(1)
    for case in json.loads(sys.argv[1]):
        print(json.dumps(measure(case)), flush=True)


if __name__ == "__main__":
    main()
