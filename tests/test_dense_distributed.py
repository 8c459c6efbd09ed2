"""Two real gloo processes: synced results equal the single-process result."""

from __future__ import annotations

from typing import Any

import torch
from helpers import TIES, run_distributed

from recall_at_k import RetrievalRecallAtK


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for q in (5, 17, 1, 9, 12):
        scores = torch.randint(0, 4, (q, 6), generator=gen).float()  # heavy ties
        target = torch.randint(-1, 6, (q,), generator=gen)
        out.append((scores, target))
    return out


# Which batches each rank receives, per scenario: uneven shards, and a rank with none.
SHARDS = {"uneven": ([0, 1, 2, 3], [4]), "one_rank_empty": ([0, 1, 2, 3, 4], [])}


def _worker(rank: int, world_size: int, payload: Any) -> dict[str, Any]:
    batches = _batches()
    out: dict[str, Any] = {}
    for scenario, shards in SHARDS.items():
        for ties in TIES:
            metric = RetrievalRecallAtK(k=(1, 2, 4), ties=ties)
            for index in shards[rank]:
                metric.update(*batches[index])
            local_before = metric.rank_histogram.clone(), metric.query_counts.clone()
            out[f"{scenario}/{ties}"] = metric.compute()
            # compute() syncs, then restores this process's own state
            restored = torch.equal(metric.rank_histogram, local_before[0]) and torch.equal(
                metric.query_counts, local_before[1]
            )
            out[f"{scenario}/{ties}/restored"] = restored
    return out


def test_two_processes_equal_one_process() -> None:
    results = run_distributed(_worker, world_size=2)
    for ties in TIES:
        single = RetrievalRecallAtK(k=(1, 2, 4), ties=ties)
        for batch in _batches():
            single.update(*batch)
        want = single.compute()
        for scenario in SHARDS:
            for rank, result in enumerate(results):
                assert result[f"{scenario}/{ties}"] == want, (scenario, ties, rank)
                assert result[f"{scenario}/{ties}/restored"], (scenario, ties, rank)
