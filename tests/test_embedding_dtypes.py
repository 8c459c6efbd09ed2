"""The dtype EmbeddingRecallAtK stores and ranks embeddings in: one rule, whatever the cast.

- a module dtype cast (``.to(float16)``, ``.half()``, ``bfloat16()``, ``set_dtype``,
  Lightning's ``"16-true"`` / ``"bf16-true"`` precision plugins) never rounds stored
  embeddings, whether it comes before, between or after the updates;
- embeddings are stored in the wider of float32 and their own dtype, and ranked in the
  widest stored: float64 inputs give the same result from the metric and from
  ``embedding_recall_at_k``, on data where rounding to float32 changes the answer;
- under DDP, processes holding float32 and float64 blocks (or none) agree on one dtype
  before the gather, and return the single-process result (two gloo processes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from embedding_reference import leave_one_out_continuous
from helpers import run_distributed
from lightning.pytorch.plugins.precision import HalfPrecision
from torch import Tensor

from recall_at_k import EmbeddingRecallAtK
from recall_at_k.functional import embedding_recall_at_k


class Holder(torch.nn.Module):
    """A module holding the metric, as a LightningModule does."""

    def __init__(self, metric: EmbeddingRecallAtK[Any]) -> None:
        super().__init__()
        self.metric = metric


CASTS: dict[str, Callable[[Holder], Any]] = {
    "module.to(float16)": lambda h: h.to(torch.float16),
    "module.to(bfloat16)": lambda h: h.to(torch.bfloat16),
    "module.half()": lambda h: h.half(),
    "module.bfloat16()": lambda h: h.bfloat16(),
    "module.double()": lambda h: h.double(),
    "set_dtype(float16)": lambda h: h.metric.set_dtype(torch.float16),
    "set_dtype(bfloat16)": lambda h: h.metric.set_dtype(torch.bfloat16),
    "lightning 16-true": lambda h: HalfPrecision("16-true").convert_module(h),
    "lightning bf16-true": lambda h: HalfPrecision("bf16-true").convert_module(h),
}
WHEN = ("before", "between", "after")


def _with_cast(
    cast: str, when: str, updates: list[tuple[Tensor, Tensor, str]], **kwargs: Any
) -> EmbeddingRecallAtK[Any]:
    """A metric that received ``updates``, cast before, between or after them."""
    holder = Holder(EmbeddingRecallAtK(k=1, **kwargs))
    for index, (embeddings, labels, role) in enumerate(updates):
        if (when == "before" and index == 0) or (when == "between" and index == 1):
            CASTS[cast](holder)
        holder.metric.update(embeddings, labels, role=role)
    if when == "after":
        CASTS[cast](holder)
    return holder.metric


# ------------------------------------------------------------------ casts (float32 inputs)

# Gallery scores 1.0002 (the positive) and 1.0 (the negative) are one value in half
# precision: rounded, the query would tie and miss (pessimistic ties).
QUERY = torch.tensor([[1.0, 0.0]])
GALLERY = torch.tensor([[1.0002, 0.0], [1.0, 0.0]])
GALLERY_LABELS = torch.tensor([0, 1])
TIED_IN_HALF = [
    (QUERY, torch.tensor([0]), "query"),
    (GALLERY[:1], GALLERY_LABELS[:1], "gallery"),
    (GALLERY[1:], GALLERY_LABELS[1:], "gallery"),
]


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("cast", list(CASTS))
def test_module_casts_never_round_stored_embeddings(cast: str, when: str) -> None:
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(GALLERY[0].to(dtype), GALLERY[1].to(dtype))  # the data bites
    assert (
        float(
            embedding_recall_at_k(
                QUERY, torch.tensor([0]), GALLERY, GALLERY_LABELS, 1, similarity="dot"
            )
        )
        == 1.0
    )
    metric = _with_cast(cast, when, TIED_IN_HALF, similarity="dot")
    assert all(block.dtype == torch.float32 for block in metric.embedding_values)
    assert float(metric.compute()) == 1.0


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize(
    "cast", ["module.to(float16)", "lightning bf16-true", "set_dtype(float16)"]
)
def test_casts_leave_every_result_of_random_data_unchanged(cast: str, when: str) -> None:
    """Random items close together (1 + 1e-3 noise: half precision rounds many of them
    to ties): the float32 result, whatever the cast."""
    gen = torch.Generator().manual_seed(4)
    embeddings = 1 + 1e-3 * torch.randn(60, 6, generator=gen)
    labels = torch.randint(0, 6, (60,), generator=gen)
    ks = (1, 2, 5)
    want = embedding_recall_at_k(embeddings, labels, k=ks, similarity="dot")
    rounded = embedding_recall_at_k(embeddings.half().float(), labels, k=ks, similarity="dot")
    assert rounded != want  # the data bites
    holder = Holder(EmbeddingRecallAtK(ks, similarity="dot"))
    for index, rows in enumerate(torch.arange(60).split(25)):
        if (when == "before" and index == 0) or (when == "between" and index == 1):
            CASTS[cast](holder)
        holder.metric.update(embeddings[rows], labels[rows])
    if when == "after":
        CASTS[cast](holder)
    assert holder.metric.compute() == want


# ------------------------------------------------------------------ float64 inputs

# Per similarity: a query (label 0), its positive and a negative (label 1) that are one
# vector in float32 but not in float64, where the positive is the better one: ranked in
# float64 the query hits at rank 1; rounded to float32 it ties and misses.
TINY = 2.0**-30
FLOAT64_CASES: dict[str, tuple[list[list[float]], list[list[float]]]] = {
    "dot": ([[1.0, 1.0]], [[1.0 + TINY, 0.0], [1.0, 0.0]]),
    "cosine": ([[1.0, 0.0]], [[1.0, 2.0**-8], [1.0, 2.0**-8 + 2.0**-35]]),
    "euclidean": ([[1.0, 0.0]], [[1.0 + TINY, 0.0], [1.0 + 2 * TINY, 0.0]]),
}


def _float64_case(similarity: str) -> tuple[Tensor, Tensor]:
    query, gallery = FLOAT64_CASES[similarity]
    return torch.tensor(query, dtype=torch.float64), torch.tensor(gallery, dtype=torch.float64)


@pytest.mark.parametrize("similarity", list(FLOAT64_CASES))
def test_float64_inputs_rank_alike_in_the_metric_and_the_function(similarity: str) -> None:
    query, gallery = _float64_case(similarity)
    assert torch.equal(gallery[0].float(), gallery[1].float())  # the data bites
    labels = torch.tensor([0])
    want = embedding_recall_at_k(query, labels, gallery, GALLERY_LABELS, 1, similarity=similarity)
    rounded = embedding_recall_at_k(
        query.float(), labels, gallery.float(), GALLERY_LABELS, 1, similarity=similarity
    )
    assert (float(want), float(rounded)) == (1.0, 0.0)
    metric = EmbeddingRecallAtK(1, similarity=similarity)
    metric.update(query, labels, role="query")
    metric.update(gallery, GALLERY_LABELS, role="gallery")
    assert float(metric.compute()) == float(want)
    # Leave-one-out over the same three items.
    items, item_labels = torch.cat([query, gallery]), torch.tensor([0, 0, 1])
    loo = EmbeddingRecallAtK((1, 2), similarity=similarity)
    loo.update(items, item_labels)
    assert loo.compute() == embedding_recall_at_k(
        items, item_labels, k=(1, 2), similarity=similarity
    )


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("cast", list(CASTS))
def test_float64_inputs_survive_module_casts(cast: str, when: str) -> None:
    query, gallery = _float64_case("dot")
    updates = [
        (query, torch.tensor([0]), "query"),
        (gallery[:1], GALLERY_LABELS[:1], "gallery"),
        (gallery[1:], GALLERY_LABELS[1:], "gallery"),
    ]
    metric = _with_cast(cast, when, updates, similarity="dot")
    assert all(block.dtype == torch.float64 for block in metric.embedding_values)
    assert float(metric.compute()) == 1.0


@pytest.mark.parametrize("similarity", list(FLOAT64_CASES))
def test_mixed_batches_are_ranked_in_the_widest_stored_dtype(similarity: str) -> None:
    """float32 queries and a float64 gallery (or half and float64 batches): stored as
    given (float32 at least), ranked together in float64, as the function ranks them."""
    query, gallery = _float64_case(similarity)
    labels = torch.tensor([0])
    for query_dtype in (torch.float32, torch.float16):
        narrow = query.to(query_dtype)
        want = embedding_recall_at_k(
            narrow, labels, gallery, GALLERY_LABELS, 1, similarity=similarity
        )
        assert float(want) == 1.0
        metric = EmbeddingRecallAtK(1, similarity=similarity)
        metric.update(narrow, labels, role="query")
        metric.update(gallery, GALLERY_LABELS, role="gallery")
        assert [v.dtype for v in metric.embedding_values] == [torch.float32, torch.float64]
        assert float(metric.compute()) == 1.0


def test_random_float64_data_equal_the_function_for_every_tile_size() -> None:
    batches, _ = leave_one_out_continuous()
    embeddings = torch.cat([b.embeddings for b in batches]).double() / 3  # inexact in float32
    labels = torch.cat([b.labels for b in batches])
    for similarity in ("cosine", "dot", "euclidean"):
        want = embedding_recall_at_k(embeddings, labels, k=(1, 2, 5), similarity=similarity)
        for chunk_bytes in (64, 2**20):
            metric = EmbeddingRecallAtK((1, 2, 5), similarity=similarity, chunk_bytes=chunk_bytes)
            for rows in torch.arange(labels.shape[0]).split(7):
                metric.update(embeddings[rows], labels[rows])
            assert metric.compute() == want, (similarity, chunk_bytes)


# ------------------------------------------------------------------ two processes


def _distributed(rank: int, world: int, payload: Any) -> dict[str, Any]:
    query, gallery = _float64_case("dot")
    out: dict[str, Any] = {}
    # float32 queries on rank 0, the float64 gallery on rank 1; rank 0's module is cast
    # to half first, rank 1's metric to bfloat16.
    holder = Holder(EmbeddingRecallAtK(1, similarity="dot"))
    if rank == 0:
        holder.half()
        holder.metric.update(query.float(), torch.tensor([0]), role="query")
    else:
        holder.metric.set_dtype(torch.bfloat16)
        holder.metric.update(gallery, GALLERY_LABELS, role="gallery")
    out["mixed"] = float(holder.metric.compute())
    # The gather left the local state as it was.
    out["local dtypes"] = [str(v.dtype) for v in holder.metric.embedding_values]
    # Everything (float64) on rank 0; rank 1, cast to half, holds nothing.
    metric = EmbeddingRecallAtK(1, similarity="dot")
    if rank == 0:
        metric.update(query, torch.tensor([0]), role="query")
        metric.update(gallery, GALLERY_LABELS, role="gallery")
    else:
        Holder(metric).half()
    out["one empty"] = float(metric.compute())
    # Random data, float32 batches on rank 0 and float64 batches on rank 1.
    batches, kwargs = leave_one_out_continuous()
    mine = EmbeddingRecallAtK((1, 2, 5), **kwargs)
    for index, batch in enumerate(batches):
        if index % 2 == rank:
            embeddings = batch.embeddings.double() / 3 if rank else batch.embeddings / 3
            mine.update(embeddings, batch.labels, **batch.kwargs())
    out["random"] = {key: float(value) for key, value in mine.compute().items()}
    return out


@pytest.mark.ddp
def test_processes_with_float32_and_float64_blocks_agree_on_one_dtype() -> None:
    results = run_distributed(_distributed, world_size=2)
    batches, kwargs = leave_one_out_continuous()
    single = EmbeddingRecallAtK((1, 2, 5), **kwargs)
    for rank in range(2):  # in the order the two processes' states are gathered
        for index, batch in enumerate(batches):
            if index % 2 == rank:
                embeddings = batch.embeddings.double() / 3 if rank else batch.embeddings / 3
                single.update(embeddings, batch.labels, **batch.kwargs())
    expected = {key: float(value) for key, value in single.compute().items()}
    assert [v.dtype for v in single.embedding_values][-1] == torch.float64
    for rank, result in enumerate(results):
        assert result["mixed"] == 1.0, rank
        assert result["local dtypes"] == ["torch.float32" if rank == 0 else "torch.float64"]
        assert result["one empty"] == 1.0, rank
        assert result["random"] == expected, rank
