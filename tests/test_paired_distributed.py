"""``query_outcomes()`` and ``paired_comparison`` over two real gloo processes equal one
process: dense rows with ``query_ids`` (uneven shares, padded repeats on the other
process, a process without data), flat items of one query on both processes, and
``EmbeddingRecallAtK`` (each process ranks its share of the queries; the outcomes are
gathered, with each query's label), under every tie policy. One spawn runs every scenario.
"""

from __future__ import annotations

import re
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from embedding_reference import Batch, cross_modal, gen, small_ints
from helpers import TIES, run_distributed
from torch import Tensor

from recall_at_k import (
    EmbeddingRecallAtK,
    QueryOutcomes,
    RetrievalRecallAtK,
    paired_comparison,
)

pytestmark = pytest.mark.ddp

# ------------------------------------------------------------------- the data


def _dense_batches(seed: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(scores, target, query_ids) batches with heavy ties; ids 0..49 once each."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    out, start = [], 0
    for size in (11, 20, 4, 15):
        scores = torch.randint(0, 3, (size, 5), generator=g).float()
        target = torch.randint(-1, 5, (size,), generator=g)
        out.append((scores, target, ids[start : start + size]))
        start += size
    return out


# Which batches each process adds, per scenario; "padded" repeats batch 0 on rank 1.
DENSE_SHARES = {"uneven": ([0, 1, 2], [3, 0]), "one_empty": ([0, 1, 2, 3], [])}


def _flat_items(seed: int) -> list[tuple[int, float, int]]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for query in range(12):
        for _ in range(int(torch.randint(1, 7, (1,), generator=g))):
            score = float(torch.randint(0, 3, (1,), generator=g))
            items.append((query * 5 - 20, score, int(torch.rand(1, generator=g) < 0.3)))
    return items


def _loo_batches(seed: int, with_ids: bool) -> list[Batch]:
    g = gen(seed)
    emb = small_ints(33, 3, g)
    labels = torch.randint(0, 4, (33,), generator=g)
    ids = torch.arange(33) * 2 + 7 if with_ids else None
    return [
        Batch(emb[a:b], labels[a:b], ids=None if ids is None else ids[a:b])
        for a, b in ((0, 14), (14, 26), (26, 33))
    ]


# Embedding batches per process: uneven (2 + 1), and a process without data.
EMBEDDING_SHARES = {"uneven": ([0, 1], [2]), "one_empty": ([0, 1, 2], [])}


def _fill_dense(metric: RetrievalRecallAtK[Any], batches: list[Any], which: list[int]) -> None:
    for index in which:
        scores, target, ids = batches[index]
        metric.update(scores, target, query_ids=ids)


def _fill_embedding(
    metric: EmbeddingRecallAtK[Any], batches: list[Batch], which: list[int]
) -> None:
    for index in which:
        batch = batches[index]
        metric.update(batch.embeddings, batch.labels, **batch.kwargs())


def _plain(outcomes: Any) -> Any:
    if isinstance(outcomes, QueryOutcomes):
        labels = None if outcomes.labels is None else outcomes.labels.tolist()
        return (
            outcomes.ids.tolist(),
            outcomes.hits.tolist(),
            outcomes.first_hit_rank.tolist(),
            labels,
        )
    return {key: _plain(value) for key, value in outcomes.items()}


# --------------------------------------------------------------- the scenarios


def _dense(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model_a, model_b = _dense_batches(1), _dense_batches(2)
    for scenario, shares in DENSE_SHARES.items():
        for ties in TIES:
            metric = RetrievalRecallAtK(k=(1, 2, 4), ties=ties)
            _fill_dense(metric, model_a, shares[rank])
            out[f"{scenario}/{ties}"] = _plain(metric.query_outcomes())
        a, b = RetrievalRecallAtK(k=(1, 3)), RetrievalRecallAtK(k=(1, 3))
        _fill_dense(a, model_a, shares[rank])
        _fill_dense(b, model_b, shares[1 - rank])  # the other split for model B
        out[f"{scenario}/paired"] = paired_comparison(a, b)
    return out


def _flat(rank: int, world: int) -> dict[str, Any]:
    items = _flat_items(3)
    mine = items[rank::2] if rank == 0 else items[1::2]  # queries split over both
    out = {}
    for ties in TIES:
        metric = RetrievalRecallAtK(k=(1, 2), ties=ties)
        for start in range(0, len(mine), 5):
            chunk = mine[start : start + 5]
            metric.update(
                torch.tensor([s for _, s, _ in chunk]),
                torch.tensor([t for _, _, t in chunk]),
                torch.tensor([q for q, _, _ in chunk]),
            )
        out[ties] = _plain(metric.query_outcomes())
    return out


def _embedding(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scenario, shares in EMBEDDING_SHARES.items():
        for ties in TIES:
            for with_ids in (True, False):
                metric = EmbeddingRecallAtK(k=(1, 3), similarity="dot", ties=ties, chunk_bytes=64)
                _fill_embedding(metric, _loo_batches(4, with_ids), shares[rank])
                out[f"{scenario}/{ties}/{with_ids}"] = _plain(metric.query_outcomes())
        a = EmbeddingRecallAtK(k=(1, 3), similarity="dot")
        b = EmbeddingRecallAtK(k=(1, 3), similarity="euclidean")
        _fill_embedding(a, _loo_batches(4, True), shares[rank])
        _fill_embedding(
            b, _loo_batches(4, True), shares[1 - rank] if scenario == "uneven" else shares[rank]
        )
        out[f"{scenario}/paired"] = paired_comparison(a, b)
    batches, options = cross_modal()
    metric = EmbeddingRecallAtK(k=(1, 2), **options)
    for batch in batches[rank::2]:  # images on rank 0, captions on rank 1
        metric.update(batch.embeddings, batch.labels, **batch.kwargs())
    out["cross_modal"] = _plain(metric.query_outcomes())
    return out


def _fails_on_rank_1(queries: Tensor, gallery: Tensor) -> Tensor:
    if torch.distributed.get_rank() == 1:
        raise ValueError("this similarity fails on rank 1")
    return queries @ gallery.T


def _nan_on_rank_1(queries: Tensor, gallery: Tensor) -> Tensor:
    scores = queries @ gallery.T
    if torch.distributed.get_rank() == 1:
        scores[0, 0] = float("nan")
    return scores


def _errors(rank: int, world: int) -> dict[str, Any]:
    """A failure on one process raises on both (neither waits forever)."""
    out = {}
    for name, similarity in (("fails", _fails_on_rank_1), ("nan", _nan_on_rank_1)):
        metric = EmbeddingRecallAtK(k=1, similarity=similarity)
        _fill_embedding(metric, _loo_batches(4, True), EMBEDDING_SHARES["uneven"][rank])
        try:
            metric.query_outcomes()
            out[name] = "no error"
        except (ValueError, RuntimeError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


SCENARIOS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "dense": _dense,
    "flat": _flat,
    "embedding": _embedding,
    "errors": _errors,
}


def _worker(rank: int, world: int, payload: Any) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, scenario in SCENARIOS.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                results[name] = scenario(rank, world)
        except Exception:
            results[name] = {"failed": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_distributed(_worker, world_size=2)


def _on_both(two: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """A scenario's results, the same on both processes (its traceback if it failed)."""
    for rank, result in enumerate(two):
        if "failed" in result[name]:
            raise AssertionError(f"{name} failed on rank {rank}:\n{result[name]['failed']}")
    assert two[0][name] == two[1][name]
    result: dict[str, Any] = two[0][name]
    return result


# ------------------------------------------------------------------- the tests


def test_dense_outcomes_of_two_processes_equal_one(two: list[dict[str, Any]]) -> None:
    got = _on_both(two, "dense")
    model_a, model_b = _dense_batches(1), _dense_batches(2)
    for scenario in DENSE_SHARES:
        for ties in TIES:
            metric = RetrievalRecallAtK(k=(1, 2, 4), ties=ties)
            _fill_dense(metric, model_a, [0, 1, 2, 3])
            assert got[f"{scenario}/{ties}"] == _plain(metric.query_outcomes()), (scenario, ties)
        a, b = RetrievalRecallAtK(k=(1, 3)), RetrievalRecallAtK(k=(1, 3))
        _fill_dense(a, model_a, [0, 1, 2, 3])
        _fill_dense(b, model_b, [3, 2, 1, 0])
        assert got[f"{scenario}/paired"] == paired_comparison(a, b)
    assert len(got["uneven/pessimistic"][0]) == 50  # the padded repeats counted once


def test_flat_outcomes_of_two_processes_equal_one(two: list[dict[str, Any]]) -> None:
    got = _on_both(two, "flat")
    items = _flat_items(3)
    for ties in TIES:
        metric = RetrievalRecallAtK(k=(1, 2), ties=ties)
        metric.update(
            torch.tensor([s for _, s, _ in items]),
            torch.tensor([t for _, _, t in items]),
            torch.tensor([q for q, _, _ in items]),
        )
        assert got[ties] == _plain(metric.query_outcomes()), ties


def test_embedding_outcomes_of_two_processes_equal_one(two: list[dict[str, Any]]) -> None:
    got = _on_both(two, "embedding")
    for scenario in EMBEDDING_SHARES:
        for ties in TIES:
            for with_ids in (True, False):
                metric = EmbeddingRecallAtK(k=(1, 3), similarity="dot", ties=ties)
                _fill_embedding(metric, _loo_batches(4, with_ids), [0, 1, 2])
                expected = _plain(metric.query_outcomes())
                assert got[f"{scenario}/{ties}/{with_ids}"] == expected, (scenario, ties)
        a = EmbeddingRecallAtK(k=(1, 3), similarity="dot")
        b = EmbeddingRecallAtK(k=(1, 3), similarity="euclidean")
        _fill_embedding(a, _loo_batches(4, True), [0, 1, 2])
        _fill_embedding(b, _loo_batches(4, True), [2, 0, 1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            assert got[f"{scenario}/paired"] == paired_comparison(a, b), scenario


def test_bidirectional_outcomes_of_two_processes_equal_one(two: list[dict[str, Any]]) -> None:
    got = _on_both(two, "embedding")["cross_modal"]
    batches, options = cross_modal()
    metric = EmbeddingRecallAtK(k=(1, 2), **options)
    for batch in [*batches[0::2], *batches[1::2]]:  # the gathered order: rank 0's, then 1's
        metric.update(batch.embeddings, batch.labels, **batch.kwargs())
    assert got == _plain(metric.query_outcomes())
    assert list(got) == ["i2t", "t2i"]


def test_an_error_on_one_process_raises_on_both(two: list[dict[str, Any]]) -> None:
    rank0, rank1 = two[0]["errors"], two[1]["errors"]
    assert re.fullmatch(
        r"RuntimeError: .*query_outcomes\(\) failed on another process.*", rank0["fails"]
    )
    assert rank1["fails"] == "ValueError: this similarity fails on rank 1"
    for result in (rank0, rank1):
        assert re.match(r"ValueError: `similarity` returned NaN scores for 1 query", result["nan"])
