"""Distributed fault cases, each in real gloo processes (three of them)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import run_distributed

from recall_at_k import RetrievalRecallAtK

KS = (1, 2, 5)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [
        (
            torch.randint(0, 4, (q, 7), generator=gen).float(),
            torch.randint(-1, 7, (q,), generator=gen),
        )
        for q in (4, 9, 2, 6, 5, 8)
    ]


def _flat_items() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(6)
    indexes = torch.randint(0, 12, (90,), generator=gen)
    preds = torch.randint(0, 5, (90,), generator=gen).float()
    target = torch.rand(90, generator=gen) < 0.2
    return preds, target, indexes


def _single(batches: list[int], flat: bool = False, ties: str = "pessimistic") -> Any:
    metric = RetrievalRecallAtK(KS, ties=ties)
    data = _batches()
    for i in batches:
        metric.update(*data[i])
    if flat:
        preds, target, indexes = _flat_items()
        metric.update(preds, target, indexes=indexes)
    return metric.compute()


def _worker(rank: int, world: int, payload: Any) -> dict[str, Any]:
    data = _batches()
    shards = {0: [0, 1, 2], 1: [3, 4], 2: []}  # rank 2 never calls update
    out: dict[str, Any] = {}

    for ties in ("pessimistic", "expected"):
        metric = RetrievalRecallAtK(KS, ties=ties)
        for i in shards[rank]:
            metric.update(*data[i])
        out[f"never_updated/{ties}"] = metric.compute()

    # Flat items of one query split over the three processes (round robin).
    preds, target, indexes = _flat_items()
    flat = RetrievalRecallAtK(KS)
    for i in shards[rank]:
        flat.update(*data[i])
    mine = torch.arange(len(preds)) % world == rank
    flat.update(preds[mine], target[mine], indexes=indexes[mine])
    out["flat"] = flat.compute()

    # A process group that covers only ranks 0 and 1 (rank 2 is outside it).
    group = dist.new_group([0, 1])
    if rank in (0, 1):
        partial = RetrievalRecallAtK(KS, process_group=group)
        for i in shards[rank]:
            partial.update(*data[i])
        out["subgroup"] = partial.compute()

    # sync_on_compute=False: local values until an explicit sync().
    manual = RetrievalRecallAtK(KS, sync_on_compute=False)
    for i in shards[rank]:
        manual.update(*data[i])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank 2 computes on nothing: NaN with a warning
        out["manual/local"] = manual.compute()
    manual.persistent(True)
    manual.sync()
    out["manual/state_dict"] = {k: v.clone() for k, v in manual.state_dict().items()}
    out["manual/synced"] = manual.compute()  # and compute() un-syncs afterwards
    out["manual/after_unsync"] = manual.query_counts.clone()

    # compute() twice, and after reset() only what came later counts.
    again = RetrievalRecallAtK(KS)
    for i in shards[rank]:
        again.update(*data[i])
    out["twice"] = (again.compute(), again.compute())
    again.reset()
    again.update(*data[5])
    out["after_reset"] = again.compute()

    # merge_state across processes: ship each process's metric to the parent.
    shipped = RetrievalRecallAtK(KS)
    for i in shards[rank]:
        shipped.update(*data[i])
    out["shipped"] = shipped
    return out


def test_fault_cases_across_three_processes() -> None:
    results = run_distributed(_worker, world_size=3)
    everything = [0, 1, 2, 3, 4]
    for ties in ("pessimistic", "expected"):
        want = _single(everything, ties=ties)
        for result in results:
            assert result[f"never_updated/{ties}"] == want
    for result in results:
        assert result["flat"] == _single(everything, flat=True)
    for rank in (0, 1):
        assert results[rank]["subgroup"] == _single(everything)
    assert "subgroup" not in results[2]
    for rank, shard in enumerate([[0, 1, 2], [3, 4], []]):
        result = results[rank]
        if shard:
            assert result["manual/local"] == _single(shard)
        else:
            assert all(torch.isnan(v) for v in result["manual/local"].values())
        assert result["manual/synced"] == _single(everything)
        assert result["twice"][0] == result["twice"][1] == _single(everything)
        assert result["after_reset"] == _single([5, 5, 5])  # each of 3 processes added it
        assert int(result["manual/after_unsync"].sum()) == sum(len(_batches()[i][1]) for i in shard)

    # state_dict saved on process 0 after a sync, loaded into a new single-process metric
    fresh = RetrievalRecallAtK(KS)
    fresh.load_state_dict(results[0]["manual/state_dict"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fresh.compute() == _single(everything)

    # merge_state of metrics filled on different processes
    merged = results[0]["shipped"]
    for other in results[1:]:
        merged.merge_state(other["shipped"])
    assert merged.compute() == _single(everything)


@pytest.mark.parametrize("world", [1, 2])
def test_result_does_not_depend_on_the_number_of_processes(world: int) -> None:
    def shards(rank: int) -> list[int]:
        return [i for i in range(6) if i % world == rank]

    results = run_distributed(
        _count_worker, world_size=world, payload=[shards(r) for r in range(world)]
    )
    for result in results:
        assert result == _single(list(range(6)), flat=True, ties="expected")


def _count_worker(rank: int, world: int, payload: Any) -> Any:
    data = _batches()
    metric = RetrievalRecallAtK(KS, ties="expected")
    for i in payload[rank]:
        metric.update(*data[i])
    preds, target, indexes = _flat_items()
    mine = torch.arange(len(preds)) % world == rank
    metric.update(preds[mine], target[mine], indexes=indexes[mine])
    return metric.compute()
