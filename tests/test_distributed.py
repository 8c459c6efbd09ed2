"""Real gloo processes: a synced result equals the single-process result, for every form.

Each world size spawns its processes once: one worker (:func:`_worker`) runs every
scenario of that size in the same process group and returns each scenario's results
under its name; the tests below assert per scenario on them (the module-scoped ``runs``
fixture spawns a world size the first time a test asks for it).

- 1 and 2 processes: the result does not depend on the number of processes;
- 2 processes: the dense form (uneven shards, a rank with none, the state restored after
  compute), the flat form (a query split over both, a rank with none, flat beside dense),
  dense rows with ``query_ids`` under DistributedSampler padding, EmbeddingRecallAtK
  (padded ids, an empty rank, bidirectional, positions; errors on one or every process);
- 3 processes, the faults: a process that never updates, flat items of one query over
  all three, a process group of two, ``sync_on_compute=False`` with an explicit sync, a
  state_dict saved on rank 0, compute twice and after reset, ``merge_state`` of metrics
  filled on different processes.
"""

from __future__ import annotations

import math
import random
import re
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from embedding_reference import (
    KS,
    Batch,
    cross_modal,
    gen,
    leave_one_out_padded_ids,
    leave_one_out_tied_cosine,
    query_gallery_junk,
    run_metric,
    small_ints,
)
from helpers import (
    TIES,
    Item,
    assert_recall_close,
    compute_or_error,
    flat_tensors,
    run_distributed,
    tied_rows,
)
from reference import reference_flat_recall
from torch import Tensor

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK
from recall_at_k.functional import retrieval_recall_at_k

pytestmark = pytest.mark.ddp

Runs = Callable[[int], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def runs() -> Runs:
    """``runs(world)``: every rank's results for that world size, spawned once."""
    cache: dict[int, list[dict[str, Any]]] = {}

    def get(world: int) -> list[dict[str, Any]]:
        if world not in cache:
            cache[world] = run_distributed(_worker, world_size=world)
        return cache[world]

    return get


def _scenario(runs: Runs, world: int, name: str) -> list[Any]:
    """One scenario's result on each rank (its traceback raised if it failed)."""
    results = []
    for rank, result in enumerate(runs(world)):
        outcome = result[name]
        if isinstance(outcome, dict) and "failed" in outcome:
            raise AssertionError(f"scenario {name} failed on rank {rank}:\n{outcome['failed']}")
        results.append(outcome)
    return results


# ------------------------------------------------------------- dense, two processes


def _dense_batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for q in (5, 17, 1, 9, 12):
        scores = torch.randint(0, 4, (q, 6), generator=g).float()  # heavy ties
        target = torch.randint(-1, 6, (q,), generator=g)
        out.append((scores, target))
    return out


# Which batches each rank receives, per scenario: uneven shards, and a rank with none.
DENSE_SHARDS = {"uneven": ([0, 1, 2, 3], [4]), "one_rank_empty": ([0, 1, 2, 3, 4], [])}


def _dense(rank: int, world: int) -> dict[str, Any]:
    batches = _dense_batches()
    out: dict[str, Any] = {}
    for scenario, shards in DENSE_SHARDS.items():
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


def test_dense_two_processes_equal_one_process(runs: Runs) -> None:
    results = _scenario(runs, 2, "dense")
    for ties in TIES:
        single = RetrievalRecallAtK(k=(1, 2, 4), ties=ties)
        for batch in _dense_batches():
            single.update(*batch)
        want = single.compute()
        for scenario in DENSE_SHARDS:
            for rank, result in enumerate(results):
                assert result[f"{scenario}/{ties}"] == want, (scenario, ties, rank)
                assert result[f"{scenario}/{ties}/restored"], (scenario, ties, rank)


# -------------------------------------------------------------- flat, two processes

FLAT_IGNORE = -1


def _flat_items() -> list[Item]:
    rng = random.Random(99)
    items = [
        (q, float(rng.randint(0, 4)), rng.choice([0, 0, 0, 1, FLAT_IGNORE]))
        for q in range(12)
        for _ in range(8)
    ]
    rng.shuffle(items)
    return items


def _flat_shards(items: list[Item]) -> dict[str, tuple[list[Item], list[Item]]]:
    # "split": every query (query 3 in particular) has items on both processes, unevenly.
    query_3 = [it for it in items if it[0] == 3]
    rest = [it for it in items if it[0] != 3]
    split = (rest[:30] + query_3[:3], rest[30:] + query_3[3:])
    return {"split": split, "one_rank_empty": (items, [])}


def _flat_dense_rows() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    dense_scores = torch.randint(0, 4, (5, 6), generator=g).float()
    dense_target = torch.randint(-1, 6, (5,), generator=g)
    return dense_scores, dense_target


def _flat(rank: int, world: int) -> dict[str, Any]:
    items = _flat_items()
    dense_scores, dense_target = _flat_dense_rows()
    out: dict[str, Any] = {}
    for scenario, shards in _flat_shards(items).items():
        for ties in TIES:
            metric = RetrievalRecallAtK(k=(1, 2, 4), ties=ties, ignore_index=FLAT_IGNORE)
            if shards[rank]:
                preds, target, indexes = flat_tensors(shards[rank])
                metric.update(preds, target, indexes=indexes)
            before = [block.clone() for block in getattr(metric, metric._flat_name)]
            out[f"{scenario}/{ties}"] = compute_or_error(metric)
            after = getattr(metric, metric._flat_name)
            out[f"{scenario}/{ties}/restored"] = len(before) == len(after) and all(
                torch.equal(x, y) for x, y in zip(before, after, strict=True)
            )
    # Mixed: rank 0 holds flat data only, rank 1 dense rows only.
    metric = RetrievalRecallAtK(k=(1, 2, 4), ignore_index=FLAT_IGNORE)
    if rank == 0:
        preds, target, indexes = flat_tensors(items)
        metric.update(preds, target, indexes=indexes)
    else:
        metric.update(dense_scores, dense_target)
    out["mixed"] = compute_or_error(metric)
    return out


def test_flat_two_processes_equal_one_process(runs: Runs) -> None:
    results = _scenario(runs, 2, "flat")
    items = _flat_items()
    for ties in TIES:
        want = reference_flat_recall(items, (1, 2, 4), ties, "neg", ignore_index=FLAT_IGNORE)
        for scenario in ("split", "one_rank_empty"):
            for rank, result in enumerate(results):
                assert_recall_close(
                    result[f"{scenario}/{ties}"], want, where=(scenario, ties, rank)
                )
                assert result[f"{scenario}/{ties}/restored"], (scenario, ties, rank)
    dense_scores, dense_target = _flat_dense_rows()
    single = RetrievalRecallAtK(k=(1, 2, 4), ignore_index=FLAT_IGNORE)
    preds, target, indexes = flat_tensors(items)
    single.update(preds, target, indexes=indexes)
    single.update(dense_scores, dense_target)
    for result in results:
        assert_recall_close(result["mixed"], compute_or_error(single), where="mixed")


# --------------------------------------------------- query_ids, padded, two processes


def _padded_shards(num: int, world: int) -> list[Tensor]:
    """DistributedSampler(shuffle=False, drop_last=False): repeat the first ids to pad."""
    total = -(-num // world) * world
    ids = torch.cat([torch.arange(num), torch.arange(total - num)])
    return [ids[rank::world] for rank in range(world)]


def _query_ids(rank: int, world: int) -> dict[str, Any]:
    scores, target = tied_rows()
    shard = _padded_shards(len(scores), world)[rank]
    out: dict[str, Any] = {}
    for ties in TIES:
        with_ids = RetrievalRecallAtK((1, 2, 4), ties=ties)
        without = RetrievalRecallAtK((1, 2, 4), ties=ties)
        for rows in shard.split(4):
            with_ids.update(scores[rows], target[rows], query_ids=rows)
            without.update(scores[rows], target[rows])
        out[ties] = (with_ids.compute(), without.compute())
    # A process that never called update, beside one that did.
    lonely = RetrievalRecallAtK((1, 2, 4))
    if rank == 0:
        lonely.update(scores, target, query_ids=torch.arange(len(scores)))
    out["lonely"] = lonely.compute()
    return out


def test_padded_distributed_sampler_counts_once_across_processes(runs: Runs) -> None:
    results = _scenario(runs, 2, "query_ids")
    scores, target = tied_rows()
    for ties in TIES:
        want = retrieval_recall_at_k(scores, target, (1, 2, 4), ties=ties)
        for result in results:
            with_ids, without = result[ties]
            assert with_ids == want, ties
            assert without != want, ties  # the padded repeat changes the number
    for result in results:
        assert result["lonely"] == retrieval_recall_at_k(scores, target, (1, 2, 4))


# --------------------------------------------------------- embedding, two processes


def _embedding_shards(batches: list[Batch], cuts: list[list[int]]) -> list[list[Batch]]:
    return [[batches[i] for i in cut] for cut in cuts]


def _embedding_cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    # Leave-one-out with ids; rank 1 also holds padded repeats of rank 0's items.
    batches, kwargs = leave_one_out_padded_ids()
    g = gen(15)
    emb, labels, ids = (
        small_ints(37, 4, g),
        torch.randint(0, 5, (37,), generator=g),
        torch.arange(37),
    )
    pad = [0, 1, 2]
    rank0 = [
        Batch(emb[:12], labels[:12], ids=ids[:12]),
        Batch(emb[12:22], labels[12:22], ids=ids[12:22]),
    ]
    rank1 = [
        Batch(emb[22:], labels[22:], ids=ids[22:]),
        Batch(emb[pad], labels[pad], ids=ids[pad]),
    ]
    for ties in ("pessimistic", "expected"):
        cases.append(
            {
                "name": f"padded-{ties}",
                "shards": [rank0, rank1],
                "single": [Batch(emb, labels, ids=ids)],
                "kwargs": {"similarity": "dot", "ties": ties, "chunk_bytes": 64},
                "queries": {"q2g": 37},
            }
        )
    # Query/gallery re-ID rules, everything on rank 0: rank 1 received nothing.
    batches, kwargs = query_gallery_junk()
    cases.append(
        {
            "name": "rank1-empty",
            "shards": [batches, []],
            "single": batches,
            "kwargs": {**kwargs, "ties": "optimistic", "chunk_bytes": 100},
            "queries": {"q2g": 22},
        }
    )
    # Bidirectional cross-modal, uneven, and leave-one-out by position without ids.
    batches, kwargs = cross_modal()
    cases.append(
        {
            "name": "cross-modal",
            "shards": _embedding_shards(batches, [[0, 1, 2], [3]]),
            "single": batches,
            "kwargs": {**kwargs, "ties": "expected"},
            "queries": {"i2t": 8, "t2i": 40},
        }
    )
    batches, kwargs = leave_one_out_tied_cosine()
    cases.append(
        {
            "name": "positions",
            "shards": [[batches[1]], [batches[0]]],
            "single": [batches[1], batches[0]],
            "kwargs": {**kwargs, "ties": "pessimistic", "chunk_bytes": 8},
            "queries": {"q2g": 36},
        }
    )
    return cases


def _outcome(metric: EmbeddingRecallAtK, batches: list[Batch]) -> Any:
    """The result as floats, or the ValueError's text."""
    for batch in batches:
        metric.update(batch.embeddings, batch.labels, **batch.kwargs())
    try:
        result = metric.compute()
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    assert isinstance(result, dict)
    return {key: float(v) for key, v in result.items()}


def _outcome_in_context(metric: EmbeddingRecallAtK, batches: list[Batch]) -> Any:
    """The result of ``compute()`` within the user's own ``sync_context()`` (with
    ``sync_on_compute=False``: torchmetrics' way to compute on gathered states once)."""
    for batch in batches:
        metric.update(batch.embeddings, batch.labels, **batch.kwargs())
    with metric.sync_context():
        result = metric.compute()
    assert isinstance(result, dict)
    return {key: float(v) for key, v in result.items()}


def _fails_on_rank_one(queries: Tensor, gallery: Tensor) -> Tensor:
    if torch.distributed.get_rank() == 1:
        raise ValueError("similarity failed on rank 1")
    return queries @ gallery.T


def _embedding(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in _embedding_cases():
        for sync in (True, False):
            metric = EmbeddingRecallAtK(KS, sync_on_compute=sync, **case["kwargs"])
            value = _outcome(metric, case["shards"][rank])
            out[f"{case['name']}-sync{sync}"] = (
                value,
                dict(metric.last_compute_num_queries_ranked),
            )
        metric = EmbeddingRecallAtK(KS, sync_on_compute=False, **case["kwargs"])
        out[f"{case['name']}-context"] = _outcome_in_context(metric, case["shards"][rank])
    # A direction without gallery must raise on every process (no hang in all_reduce).
    only_queries = [Batch(torch.randn(3, 2), torch.tensor([0, 1, 0]), "query")]
    out["no-gallery"] = _outcome(EmbeddingRecallAtK(KS), only_queries if rank == 0 else [])
    # A failure while ranking one process's share must not leave the other one waiting.
    items = [Batch(torch.randn(4, 2), torch.tensor([0, 1, 0, 1]))]
    out["one-fails"] = _outcome(EmbeddingRecallAtK(KS, similarity=_fails_on_rank_one), items)
    # A state corrupted on one process: every process raises, naming both counts.
    corrupted = EmbeddingRecallAtK(KS)
    corrupted.update(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))
    if rank == 1:
        corrupted.embedding_values.append(torch.zeros(1))
    out["corrupted"] = _outcome(corrupted, [])
    return out


# A case without queries on one process returns NaN there, with our warning.
@pytest.mark.filterwarnings("ignore:No query was counted for Recall@K")
def test_embedding_two_processes_equal_one_process(runs: Runs) -> None:
    results = _scenario(runs, 2, "embedding")
    cases = _embedding_cases()
    for case in cases:
        expected = run_metric(case["single"], **case["kwargs"])
        exact = case["kwargs"].get("ties") != "expected"
        for rank in range(2):
            got, ranked = results[rank][f"{case['name']}-syncTrue"]
            if exact:
                assert got == expected, (case["name"], rank)
            else:
                assert got == pytest.approx(expected, abs=1e-12), (case["name"], rank)
            # Each process ranked its half of the queries, not all of them.
            for direction, total in case["queries"].items():
                share = total * (rank + 1) // 2 - total * rank // 2
                assert ranked[direction] == share, (case["name"], rank, direction)
            # Within the user's own sync_context (which once failed: "the state holds
            # 0 values"), the gathered result.
            in_context = results[rank][f"{case['name']}-context"]
            if exact:
                assert in_context == expected, (case["name"], rank)
            else:
                assert in_context == pytest.approx(expected, abs=1e-12), (case["name"], rank)
            # sync_on_compute=False: every process on its own data alone.
            got, ranked = results[rank][f"{case['name']}-syncFalse"]
            local = _outcome(EmbeddingRecallAtK(KS, **case["kwargs"]), case["shards"][rank])
            if isinstance(local, str):
                assert got == local
            else:
                assert got == pytest.approx(local, abs=1e-12, nan_ok=True), (case["name"], rank)
    # A process without data, computing on its own: NaN, as RetrievalRecallAtK.
    assert all(math.isnan(v) for v in results[1]["rank1-empty-syncFalse"][0].values())
    for rank in range(2):
        assert "direction 'q2g' (query -> gallery) has no gallery" in results[rank]["no-gallery"]
    assert results[0]["one-fails"] == (
        "RuntimeError: EmbeddingRecallAtK.compute() failed on another process; see its error"
    )
    assert results[1]["one-fails"] == "ValueError: similarity failed on rank 1"
    corrupted = (
        r"ValueError: `embeddings`: the processes hold \[12, 13\] values for \[4, 4\] items"
        r" of width 3; the state was corrupted"
    )
    for rank in range(2):
        assert re.fullmatch(corrupted, results[rank]["corrupted"]), results[rank]["corrupted"]


# ------------------------------------------------------------ faults, three processes

FAULT_KS = (1, 2, 5)


def _fault_batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (
            torch.randint(0, 4, (q, 7), generator=g).float(),
            torch.randint(-1, 7, (q,), generator=g),
        )
        for q in (4, 9, 2, 6, 5, 8)
    ]


def _fault_flat_items() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(6)
    indexes = torch.randint(0, 12, (90,), generator=g)
    preds = torch.randint(0, 5, (90,), generator=g).float()
    target = torch.rand(90, generator=g) < 0.2
    return preds, target, indexes


def _single(batches: list[int], flat: bool = False, ties: str = "pessimistic") -> Any:
    metric = RetrievalRecallAtK(FAULT_KS, ties=ties)
    data = _fault_batches()
    for i in batches:
        metric.update(*data[i])
    if flat:
        preds, target, indexes = _fault_flat_items()
        metric.update(preds, target, indexes=indexes)
    return metric.compute()


def _faults(rank: int, world: int) -> dict[str, Any]:
    data = _fault_batches()
    shards = {0: [0, 1, 2], 1: [3, 4], 2: []}  # rank 2 never calls update
    out: dict[str, Any] = {}

    for ties in ("pessimistic", "expected"):
        metric = RetrievalRecallAtK(FAULT_KS, ties=ties)
        for i in shards[rank]:
            metric.update(*data[i])
        out[f"never_updated/{ties}"] = metric.compute()

    # Flat items of one query split over the three processes (round robin).
    preds, target, indexes = _fault_flat_items()
    flat = RetrievalRecallAtK(FAULT_KS)
    for i in shards[rank]:
        flat.update(*data[i])
    mine = torch.arange(len(preds)) % world == rank
    flat.update(preds[mine], target[mine], indexes=indexes[mine])
    out["flat"] = flat.compute()

    # A process group that covers only ranks 0 and 1 (rank 2 is outside it).
    group = dist.new_group([0, 1])
    if rank in (0, 1):
        partial = RetrievalRecallAtK(FAULT_KS, process_group=group)
        for i in shards[rank]:
            partial.update(*data[i])
        out["subgroup"] = partial.compute()

    # sync_on_compute=False: local values until an explicit sync().
    manual = RetrievalRecallAtK(FAULT_KS, sync_on_compute=False)
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
    # ... or compute() within the user's own sync_context().
    in_context = RetrievalRecallAtK(FAULT_KS, sync_on_compute=False)
    for i in shards[rank]:
        in_context.update(*data[i])
    with in_context.sync_context():
        out["manual/context"] = in_context.compute()
    out["manual/after_context"] = in_context.query_counts.clone()

    # compute() twice, and after reset() only what came later counts.
    again = RetrievalRecallAtK(FAULT_KS)
    for i in shards[rank]:
        again.update(*data[i])
    out["twice"] = (again.compute(), again.compute())
    again.reset()
    again.update(*data[5])
    out["after_reset"] = again.compute()

    # merge_state across processes: ship each process's metric to the parent.
    shipped = RetrievalRecallAtK(FAULT_KS)
    for i in shards[rank]:
        shipped.update(*data[i])
    out["shipped"] = shipped
    return out


def test_fault_cases_across_three_processes(runs: Runs) -> None:
    results = _scenario(runs, 3, "faults")
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
        assert result["manual/context"] == _single(everything)
        assert result["twice"][0] == result["twice"][1] == _single(everything)
        assert result["after_reset"] == _single([5, 5, 5])  # each of 3 processes added it
        sizes = sum(len(_fault_batches()[i][1]) for i in shard)
        assert int(result["manual/after_unsync"].sum()) == sizes
        assert int(result["manual/after_context"].sum()) == sizes

    # state_dict saved on process 0 after a sync, loaded into a new single-process metric
    fresh = RetrievalRecallAtK(FAULT_KS)
    fresh.load_state_dict(results[0]["manual/state_dict"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fresh.compute() == _single(everything)

    # merge_state of metrics filled on different processes
    merged = results[0]["shipped"]
    for other in results[1:]:
        merged.merge_state(other["shipped"])
    assert merged.compute() == _single(everything)


# ------------------------------------------------------- one process against two


def _count(rank: int, world: int) -> Any:
    data = _fault_batches()
    metric = RetrievalRecallAtK(FAULT_KS, ties="expected")
    for i in [i for i in range(6) if i % world == rank]:
        metric.update(*data[i])
    preds, target, indexes = _fault_flat_items()
    mine = torch.arange(len(preds)) % world == rank
    metric.update(preds[mine], target[mine], indexes=indexes[mine])
    return metric.compute()


@pytest.mark.parametrize("world", [1, 2])
def test_result_does_not_depend_on_the_number_of_processes(runs: Runs, world: int) -> None:
    for result in _scenario(runs, world, "count"):
        assert result == _single(list(range(6)), flat=True, ties="expected")


# -------------------------------------------------------------------- the worker

SCENARIOS: dict[int, dict[str, Callable[[int, int], Any]]] = {
    1: {"count": _count},
    2: {
        "dense": _dense,
        "flat": _flat,
        "query_ids": _query_ids,
        "embedding": _embedding,
        "count": _count,
    },
    3: {"faults": _faults},
}


def _worker(rank: int, world: int, payload: Any) -> dict[str, Any]:
    """Every scenario of this world size, in order, in one process group.

    A scenario that raises is reported under its name (the others still run); each
    scenario handles its own expected errors, so no process is left waiting in a
    collective call when another reports a failure here.
    """
    out: dict[str, Any] = {}
    for name, scenario in SCENARIOS[world].items():
        torch.manual_seed(0)  # each scenario starts from the same seed
        try:
            out[name] = scenario(rank, world)
        except Exception:
            out[name] = {"failed": traceback.format_exc()}
    return out
