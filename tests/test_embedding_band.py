"""The band is as wide as the certificate says: any fast product within B of the
canonical score gives the canonical ranking.

The fast score of a pair may be anywhere within ``B`` of its canonical score (``B`` as
:mod:`recall_at_k.ranking.score` states it, computed here from that formula, not by the
package's code), so a query's
band around its best positive's fast score s*_f must reach ``2B`` on both sides. These
tests replace the fast product, on every route, by the worst one the certificate
allows: every score pushed by ``B`` (the largest float32 value within it) from the
canonical score, positives one way and negatives the other, so that items tied with
or just above s* look below it, or items just below look above. A band narrower than
``2B``, or a bound smaller than the documented one, gives a wrong Recall@K here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from embedding_reference import ROUTES, Batch, canonical_embedding_recall, run_metric
from helpers import run_distributed
from torch import Tensor

from recall_at_k import EmbeddingRecallAtK
from recall_at_k._kernel import Workspace
from recall_at_k.functional import embedding_recall_at_k
from recall_at_k.ranking import blocks as _blocks
from recall_at_k.ranking import engine as _engine
from recall_at_k.ranking import score as _score
from recall_at_k.ranking.blocks import Gallery

KS = (1, 2, 3, 5)
DIM = 8
SIMILARITIES = ("cosine", "dot", "euclidean")
LAYOUTS = ("leave-one-out", "query-gallery")
TIES = ("pessimistic", "optimistic")
# Positives pushed up and negatives down (a negative tied with or just above s* looks
# below s*), or the reverse (one tied or just below looks above).
PUSHES = {"positives-up": 1.0, "positives-down": -1.0}


def _data() -> tuple[Tensor, Tensor]:
    """120 distinct +-1 rows (60 and their negations: the mean of each half of the
    rows, a "euclidean" gallery below, is exactly 0, so centring is exact) of equal
    norm: scores tie everywhere and every query has the same bound."""
    generator = torch.Generator().manual_seed(81)
    codes = torch.randperm(2 ** (DIM - 1), generator=generator)[:60]
    bits = (codes.unsqueeze(1) >> torch.arange(DIM - 1)) & 1
    half = torch.cat([torch.ones(60, 1), 2.0 * bits.float() - 1], dim=1)
    rows = torch.cat([half[:20], -half[:20], half[20:], -half[20:]])
    labels = torch.randint(0, 8, (120,), generator=generator)
    return rows, labels


def _batches(layout: str) -> list[Batch]:
    rows, labels = _data()
    if layout == "leave-one-out":
        return [Batch(rows[:50], labels[:50]), Batch(rows[50:], labels[50:])]
    # Queries: the first 40 rows; gallery: the other 80 (40 rows and their negations).
    return [
        Batch(rows[:40], labels[:40], role="query"),
        Batch(rows[40:], labels[40:], role="gallery"),
    ]


@functools.cache
def _canonical(similarity: str, layout: str, ties: str) -> dict[str, float]:
    return canonical_embedding_recall(_batches(layout), KS, similarity=similarity, ties=ties)


def _gamma(terms: int, unit: float) -> float:
    return terms * unit / (1 - terms * unit)


def documented_bound(similarity: str, query_norms: Tensor, largest: float) -> Tensor:
    """The documented B for float32 embeddings on CPU, from exact norms (float64):
    ``2 (gamma32_D + gamma64_D) |q| max |g|`` (cosine, dot) or ``2 (2 gamma32_{D+1} +
    5 u32 + gamma64_{D+3}) (|q'| + max |g'|)^2`` (euclidean), and the absolute part
    ``2 k D eta (1 + gamma32_{D+3})`` (``eta = 2**-150``, ``k`` 1 or 4), taken down by
    2**-20 of itself for the float64 rounding of this formula."""
    u32, u64 = 2.0**-24, 2.0**-53
    eta = 2.0**-150
    if similarity == "euclidean":
        relative = 2 * (2 * _gamma(DIM + 1, u32) + 5 * u32 + _gamma(DIM + 3, u64))
        bound = relative * (query_norms + largest) ** 2
        absolute = 2 * 4 * DIM * eta * (1 + _gamma(DIM + 3, u32))
    else:
        relative = 2 * (_gamma(DIM, u32) + _gamma(DIM, u64))
        bound = relative * query_norms * largest
        absolute = 2 * DIM * eta * (1 + _gamma(DIM + 3, u32))
    return (bound + absolute) * (1 - 2.0**-20)


class Seam:
    """The fast product replaced by the certificate's worst case: each score moved from
    the canonical score by ``push * B`` (positives) or ``-push * B`` (negatives), then
    rounded to the float32 value nearest to that within B of the canonical score."""

    def __init__(self, original: Callable[..., Tensor], similarity: str, push: float) -> None:
        self.original, self.similarity, self.push = original, similarity, push
        rows, labels = _data()
        prepared = _score.prepare_rows(rows, similarity, torch.float32)  # type: ignore[arg-type]
        self.largest = float(prepared.double().norm(dim=1).max())
        self.labels = {
            row.numpy().tobytes(): int(label) for row, label in zip(prepared, labels, strict=True)
        }
        assert len(self.labels) == rows.shape[0]  # rows are distinct: a row gives its label
        self.calls = 0
        self.pushed = 0

    def __call__(
        self,
        queries: Tensor,
        gallery: Gallery,
        first: int,
        stop: int,
        workspace: Workspace,
        tile_bytes: int = 0,
    ) -> Tensor:
        out = self.original(queries, gallery, first, stop, workspace, tile_bytes)
        if gallery.centre is not None:  # the queries and gallery are as stored
            assert not bool(gallery.centre.any())
        items = gallery.fast[first:stop]
        canonical = self.canonical(queries, items)
        row_labels = torch.tensor([self.labels[row.numpy().tobytes()] for row in queries])
        positive = row_labels.unsqueeze(1) == gallery.labels[first:stop].unsqueeze(0)
        # Each pair's bound: the smaller of its two items' (either may be the query:
        # the squares are read both ways); every row has the same norm.
        largest = self.largest
        query_norms = queries.double().norm(dim=1, keepdim=True)
        item_norms = items.double().norm(dim=1).unsqueeze(0)
        bound = documented_bound(self.similarity, torch.minimum(query_norms, item_norms), largest)
        sign = torch.where(positive, self.push, -self.push)
        fast = (canonical + sign * bound).to(torch.float32)
        beyond = (fast.double() - canonical).abs() > bound
        fast = torch.where(beyond, torch.nextafter(fast, canonical.float()), fast)
        assert bool(((fast.double() - canonical).abs() <= bound).all())
        out.copy_(fast)
        self.calls += 1
        self.pushed += int((fast.double() != canonical).sum())
        return out

    def canonical(self, queries: Tensor, items: Tensor) -> Tensor:
        """The canonical scores (the float64 sum over d in order), ``[T, W]``."""
        q, g = queries.double(), items.double()
        total = torch.zeros(q.shape[0], g.shape[0], dtype=torch.float64)
        for d in range(q.shape[1]):
            if self.similarity == "euclidean":
                total += (q[:, d : d + 1] - g[:, d]).square()
            else:
                total += q[:, d : d + 1] * g[:, d]
        return -total if self.similarity == "euclidean" else total


def _install(monkeypatch: pytest.MonkeyPatch, similarity: str, push: float) -> Seam:
    """Every module that computes fast products gets the seam."""
    seam = Seam(_blocks.product, similarity, push)
    for module in (_blocks, _engine):
        monkeypatch.setattr(module, "product", seam)
    return seam


@pytest.mark.parametrize("push", sorted(PUSHES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("similarity", SIMILARITIES)
def test_fast_scores_anywhere_within_the_bound_give_the_canonical_ranking(
    similarity: str, layout: str, push: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seam = _install(monkeypatch, similarity, PUSHES[push])
    batches = _batches(layout)
    for ties in TIES:
        expected = _canonical(similarity, layout, ties)
        for route in ROUTES:
            seam.calls = 0
            got = run_metric(batches, KS, route, similarity=similarity, ties=ties)
            assert seam.calls > 0, route  # the ranking went through the seam
            assert got == pytest.approx(expected, abs=1e-6), (ties, route)
        got = run_metric(batches, KS, similarity=similarity, ties=ties)  # the metric
        assert got == pytest.approx(expected, abs=1e-6), (ties, "metric")
        if layout == "leave-one-out":
            rows, labels = _data()
            result = embedding_recall_at_k(rows, labels, k=KS, similarity=similarity, ties=ties)
            assert isinstance(result, dict)
            got = {key: float(value) for key, value in result.items()}
            assert got == pytest.approx(expected, abs=1e-6), (ties, "functional")
    assert seam.pushed > 0


@pytest.mark.parametrize("similarity", SIMILARITIES)
def test_the_worst_case_product_changes_the_float32_ranking(
    similarity: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pushes matter: ranked on the pushed fast scores alone (no band), R@1
    (pessimistic, optimistic) differs from the canonical one for both pushes, so a band
    too narrow to reach the tied items gives a wrong answer above."""
    rows, labels = _data()
    prepared = _score.prepare_rows(rows, similarity, torch.float32)  # type: ignore[arg-type]
    for push in PUSHES.values():
        seam = Seam(lambda *args: torch.empty(0), similarity, push)
        canonical = seam.canonical(prepared, prepared)
        positive = labels.unsqueeze(1) == labels.unsqueeze(0)
        norms = prepared.double().norm(dim=1, keepdim=True)
        bound = documented_bound(similarity, norms, float(norms.max()))
        fast = canonical + torch.where(positive, push, -push) * bound
        hits = []
        for scores in (canonical, fast):
            scores = scores.clone().fill_diagonal_(-math.inf)
            best = torch.where(positive, scores, -math.inf).amax(dim=1, keepdim=True)
            above = ((scores > best) & ~positive).sum(dim=1)  # optimistic rank - 1
            tied = ((scores >= best) & ~positive).sum(dim=1)  # pessimistic rank - 1
            hits.append((float((tied == 0).double().mean()), float((above == 0).double().mean())))
        assert hits[0] != hits[1], (similarity, push, hits)


def _sharded_worker(rank: int, world: int, cases: list[tuple[str, str, str]]) -> list[Any]:
    """Each case's result with the gallery sharded over the processes and the seam in
    place of every fast product (each process holds every other batch's items)."""
    out = []
    for similarity, layout, push in cases:
        seam = Seam(_blocks.product, similarity, PUSHES[push])
        _blocks.product, _engine.product = seam, seam  # type: ignore[assignment]
        try:
            for ties in TIES:
                metric = EmbeddingRecallAtK(KS, similarity=similarity, ties=ties, sharded=True)
                for _index, batch in enumerate(_batches(layout)):
                    mine = torch.arange(batch.labels.shape[0]) % world == rank
                    metric.update(batch.embeddings[mine], batch.labels[mine], role=batch.role)
                got = {key: float(value) for key, value in metric.compute().items()}
                out.append((similarity, layout, push, ties, got, seam.calls))
        finally:
            _blocks.product, _engine.product = seam.original, seam.original  # type: ignore[assignment]
    return out


@pytest.mark.ddp
def test_a_sharded_gallery_with_fast_scores_anywhere_within_the_bound() -> None:
    """The same worst-case products on a gallery sharded across two processes: each
    process ranks its queries against the gallery passing by, with the same band."""
    cases = [(s, lay, p) for s in SIMILARITIES for lay in LAYOUTS for p in sorted(PUSHES)]
    results = run_distributed(_sharded_worker, world_size=2, payload=cases)
    for rank_results in results:
        for similarity, layout, push, ties, got, calls in rank_results:
            assert calls > 0
            # The items in rank order, as the sharded metric's gathered state orders them.
            expected = _canonical(similarity, layout, ties)
            assert got == pytest.approx(expected, abs=1e-6), (similarity, layout, push, ties)
