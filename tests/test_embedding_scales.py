"""Recall@K of embeddings does not depend on their scale: scaling every embedding by a
power of two scales every canonical score exactly (float64 holds the products of
float32 values from 2**-298 to 2**256), so the ranking, hence Recall@K, is unchanged.

The fast float32 product does not scale that way: below float32's smallest normal
number (2**-126) products round in absolute steps of 2**-149, not relatively, and
above about 2**64 they overflow. Each case here is checked against the canonical brute
force (:func:`embedding_reference.canonical_embedding_recall`) on every route, for
leave-one-out and query/gallery, for the metric and the one-shot function.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from embedding_reference import (
    ROUTES,
    Batch,
    canonical_embedding_recall,
    fast_and_canonical,
    run_metric,
)
from torch import Tensor

from recall_at_k import EmbeddingRecallAtK
from recall_at_k.functional import embedding_recall_at_k
from recall_at_k.ranking import blocks as _blocks
from recall_at_k.ranking import score as _score

# Sweeps over scales and similarities: `-m slow` runs them, as CI does.
pytestmark = pytest.mark.slow

KS = (1, 2, 5, 10)
SIMILARITIES = ("cosine", "dot", "euclidean")
LAYOUTS = ("leave-one-out", "query-gallery")
# 2**-74: float32 products near 2**-148, subnormal; 2**-100: products underflow to 0;
# 2**-115: cosine rows of norm below 1e-12 stay unnormalised (x / 1e-12), products
# subnormal again, and some stored values are subnormal themselves; 2**40: products
# near 2**80; 2**62: float32 products could overflow (the float64 fallback).
EXPONENTS = (0, 40, 62, -74, -100, -115)


def _data() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(71)
    embeddings = torch.randn(120, 16, generator=generator)
    labels = torch.randint(0, 12, (120,), generator=generator)
    return embeddings, labels


def _batches(exponent: int, layout: str) -> list[Batch]:
    embeddings, labels = _data()
    scaled = embeddings * 2.0**exponent
    if layout == "leave-one-out":
        return [Batch(scaled[:70], labels[:70]), Batch(scaled[70:], labels[70:])]
    return [
        Batch(scaled[:40], labels[:40], role="query"),
        Batch(scaled[40:], labels[40:], role="gallery"),
    ]


@functools.cache
def _canonical(similarity: str, exponent: int, layout: str, ties: str) -> dict[str, float]:
    return canonical_embedding_recall(
        _batches(exponent, layout), KS, similarity=similarity, ties=ties
    )


def _functional(batches: list[Batch], **kwargs: Any) -> dict[str, float]:
    if len(batches) == 2 and batches[0].role == "query":
        query, gallery = batches
        result = embedding_recall_at_k(
            query.embeddings, query.labels, gallery.embeddings, gallery.labels, KS, **kwargs
        )
    else:
        embeddings = torch.cat([b.embeddings for b in batches])
        labels = torch.cat([b.labels for b in batches])
        result = embedding_recall_at_k(embeddings, labels, k=KS, **kwargs)
    assert isinstance(result, dict)
    return {key: float(value) for key, value in result.items()}


def _check_every_route(similarity: str, exponent: int, layout: str) -> None:
    batches = _batches(exponent, layout)
    for ties in ("pessimistic", "optimistic"):
        expected = _canonical(similarity, exponent, layout, ties)
        for route in ROUTES:
            got = run_metric(batches, KS, route, similarity=similarity, ties=ties)
            assert got == pytest.approx(expected, abs=1e-6), (ties, route)
        got = _functional(batches, similarity=similarity, ties=ties)
        assert got == pytest.approx(expected, abs=1e-6), (ties, "functional")


@pytest.mark.parametrize("exponent", EXPONENTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("similarity", SIMILARITIES)
def test_scaling_by_a_power_of_two_keeps_the_canonical_ranking(
    similarity: str, layout: str, exponent: int
) -> None:
    _check_every_route(similarity, exponent, layout)
    # As narrow a band at every scale: about one item a query (its best positive) is
    # re-scored canonically (the float64 fast path where float32 products would be
    # subnormal; in float32 their absolute rounding would put every item in the band).
    metric = EmbeddingRecallAtK(KS, similarity=similarity)
    for batch in _batches(exponent, layout):
        metric.update(batch.embeddings, batch.labels, **batch.kwargs())
    metric.compute()
    queries = 120 if layout == "leave-one-out" else 40
    assert metric.last_compute_rescored["q2g"] <= queries + queries // 10
    embeddings = _data()[0]
    exact = torch.equal(embeddings * 2.0**exponent * 2.0**-exponent, embeddings)
    # Unnormalised cosine rows (norm below the 1e-12 clamp) rank by their dot product.
    clamped = similarity == "cosine" and 2.0**exponent * float(embeddings.norm(dim=1).min()) < 1e-12
    if exact and not clamped:
        for ties in ("pessimistic", "optimistic"):
            assert _canonical(similarity, exponent, layout, ties) == _canonical(
                similarity, 0, layout, ties
            )


def _float32_products_only(
    largest: float, dim: int, dtype: torch.dtype, similarity: Any
) -> torch.dtype:
    """``fast_dtype`` without its underflow rule: the float32 fast path on tiny values,
    where only the bound's absolute part keeps the ranking exact."""
    if callable(similarity) or dtype != torch.float32 or similarity == "cosine":
        return dtype
    return torch.float64 if _score.overflows(largest, dim, dtype) else dtype


@pytest.mark.parametrize("exponent", [-74, -115])
@pytest.mark.parametrize("similarity", SIMILARITIES)
def test_tiny_values_on_the_float32_fast_path(
    similarity: str, exponent: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The float64 fast path is only faster on tiny values: in float32 the bound's
    absolute part (subnormal products) gives the same ranking."""
    monkeypatch.setattr(_blocks, "fast_dtype", _float32_products_only)
    _check_every_route(similarity, exponent, "leave-one-out")


def _two_items(far: bool) -> list[Batch]:
    """A query, its positive and a negative, all near 2**-75: canonically the positive
    scores 1.8 * 2**-150 and the negative 1.1 * 2**-150, but in float32 each product
    of the positive (0.9 * 2**-150) rounds to 0 and the negative's to 2**-149. With
    ``far``, a gallery item of norm 1 far below both keeps the fast path in float32."""
    a = 2.0**-75
    gallery = [[0.9 * a, 0.9 * a], [1.1 * a, 0.0]] + ([[-1.0, -1.0]] if far else [])
    return [
        Batch(torch.tensor([[a, a]]), torch.tensor([0]), role="query"),
        Batch(torch.tensor(gallery), torch.tensor([0, 1, 2][: len(gallery)]), role="gallery"),
    ]


@pytest.mark.parametrize("far", [False, True])
def test_two_items_whose_float32_products_are_subnormal(far: bool) -> None:
    batches = _two_items(far)
    assert canonical_embedding_recall(batches, (1,), similarity="dot") == {"recall@1": 1.0}
    for similarity in ("dot", "euclidean"):
        expected = canonical_embedding_recall(batches, (1,), similarity=similarity)
        for route in ROUTES:
            assert run_metric(batches, (1,), route, similarity=similarity) == expected, route
        assert _functional(batches, similarity=similarity)["recall@1"] == expected["recall@1"]


def _rows_of_every_scale() -> Tensor:
    """Rows of random data, each scaled by its own power of two: norms from 4 down to
    2**-100 (whose squares underflow float32), in one gallery."""
    generator = torch.Generator().manual_seed(73)
    rows = torch.randn(84, 24, generator=generator)
    exponents = torch.tensor([0, -20, -40, -60, -70, -74, -80, -90, -100, -110, -115, 8])
    return rows * (2.0 ** exponents.repeat(7)).unsqueeze(1)


@pytest.mark.parametrize("similarity", SIMILARITIES)
@pytest.mark.parametrize("scale", [1.0, 2.0**-60, 2.0**62])
def test_fast_scores_stay_within_the_bound_at_every_scale(similarity: str, scale: float) -> None:
    """|fast - canonical| <= B for every pair, on the fast path the ranking takes
    (float32, or float64 where float32 could overflow or underflow), queries of every
    norm against a gallery of every norm."""
    rows = _rows_of_every_scale() * scale
    error, bound, _ = fast_and_canonical(rows, similarity, rows.shape[0], rows.shape[0])
    worst = (error - bound).max()
    assert bool((error <= bound).all()), float(worst)
