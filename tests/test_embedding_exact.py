"""EmbeddingRecallAtK gives one answer for one input: the ranking by canonical scores.

The canonical score is computed here literally, one pair at a time in Python floats
(float64), summing over d = 0..D-1 in order on the prepared float32 vectors; the ranking
on those scores is decided by the brute-force reference. The metric must equal it on
data whose real scores tie (quantised and 1-decimal embeddings), and give bit-identical
results for every tile size, route, thread count and number of processes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from embedding_reference import (
    ROUTES,
    Batch,
    canonical_score,
    engine_recall,
    fast_and_canonical,
    ignored,
    items_of,
    members,
    prepared_row,
    reference_embedding_recall,
)
from helpers import run_distributed
from reference import reference_recall
from torch import Tensor

from recall_at_k import EmbeddingRecallAtK
from recall_at_k.ranking import budget as _budget
from recall_at_k.ranking import score as _score

# The exactness sweeps (routes, tilings, threads, processes): `-m slow` runs them, as CI does.
pytestmark = pytest.mark.slow

TIES = ("pessimistic", "optimistic", "expected")
KS = (1, 2, 5, 10)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _quantised(n: int, d: int, seed: int) -> Tensor:
    """Values in {-1, 0, 1}: real scores tie everywhere, float32 products round."""
    return torch.randint(-1, 2, (n, d), generator=_gen(seed)).float()


def _one_decimal(n: int, d: int, seed: int) -> Tensor:
    return torch.randn(n, d, generator=_gen(seed)).round(decimals=1)


# name -> (embeddings, labels, similarity); small enough for a Python reference.
DATA: dict[str, tuple[Tensor, Tensor, str]] = {
    "quantised8-cosine": (_quantised(150, 8, 1), torch.arange(150) % 9, "cosine"),
    "quantised24-cosine": (_quantised(150, 24, 2), torch.arange(150) % 7, "cosine"),
    "quantised8-dot": (_quantised(150, 8, 3), torch.arange(150) % 9, "dot"),
    "quantised24-dot": (_quantised(150, 24, 4), torch.arange(150) % 11, "dot"),
    "decimal-dot": (_one_decimal(150, 16, 5), torch.arange(150) % 13, "dot"),
    "decimal-cosine": (_one_decimal(150, 16, 6), torch.arange(150) % 13, "cosine"),
    "decimal-euclidean": (_one_decimal(150, 16, 7), torch.arange(150) % 13, "euclidean"),
}
LAYOUTS = ("leave-one-out", "query-gallery")


def _batches(name: str, layout: str, num: int = 150) -> list[Batch]:
    embeddings, labels = DATA[name][0][:num], DATA[name][1][:num]
    half, third = num // 2, num // 3
    if layout == "leave-one-out":
        return [Batch(embeddings[:half], labels[:half]), Batch(embeddings[half:], labels[half:])]
    return [
        Batch(embeddings[:third], labels[:third], role="query"),
        Batch(embeddings[third:], labels[third:], role="gallery"),
    ]


# ------------------------------------------------------------------ the reference


@functools.cache
def canonical_reference(name: str, layout: str, ties: str) -> dict[str, float]:
    _, _, similarity = DATA[name]
    items = items_of(_batches(name, layout))
    queries = members(items, ("query", "both"))
    gallery = members(items, ("gallery", "both"))
    rows = {item.position: prepared_row(item.embedding, similarity) for item in items}
    scores = [
        [canonical_score(rows[q.position], rows[g.position], similarity) for g in gallery]
        for q in queries
    ]
    relevant = [[q.label == g.label for g in gallery] for q in queries]
    ignore = [[ignored(q, g, "none") for g in gallery] for q in queries]
    if ties != "expected":
        values = reference_recall(scores, relevant, ignore, KS, ties, "neg")
    else:
        values = [_expected_recall(scores, relevant, ignore, k) for k in KS]
    return {f"recall@{k}": value for k, value in zip(KS, values, strict=True)}


def _expected_recall(
    scores: list[list[float]], relevant: list[list[bool]], ignore: list[list[bool]], k: int
) -> float:
    """Mean of 1 - C(e, m) / C(e + p, m), m = k - g_>, in exact integers per query (the
    reference's enumeration of placements is too slow for blocks of quantised ties)."""
    total = 0.0
    for row, rel, ign in zip(scores, relevant, ignore, strict=True):
        items = [(s, r) for s, r, i in zip(row, rel, ign, strict=True) if not i]
        positives = [s for s, r in items if r]
        if not positives:
            continue
        best = max(positives)
        greater = sum(1 for s, r in items if not r and s > best)
        e = sum(1 for s, r in items if not r and s == best)
        p = sum(1 for s, r in items if r and s == best)
        m = k - greater
        if m <= 0:
            continue
        total += 1.0 if m > e else 1 - math.comb(e, m) / math.comb(e + p, m)
    return total / len(scores)


# --------------------------------------------------------------------- the metric


@contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _metric(
    batches: Sequence[Batch], **kwargs: Any
) -> tuple[dict[str, float], EmbeddingRecallAtK[Any]]:
    metric = EmbeddingRecallAtK(KS, **kwargs)
    for batch in batches:
        metric.update(batch.embeddings, batch.labels, **batch.kwargs())
    return {key: float(value) for key, value in metric.compute().items()}, metric


def _chunks(num_gallery: int) -> tuple[int, ...]:
    """1 byte (one query a tile), 7 rows' worth, 64 KiB, 1 GiB. The first runs at one
    thread only: tiles that small take no worker thread (a worker's least share is a MiB:
    tests/test_threads.py::test_small_tiles_stay_on_the_calling_thread), so a second
    thread would rerun the same walk of thousands of steps."""
    return (1, 7 * num_gallery * 4, 2**16, 2**30)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ties", TIES)
@pytest.mark.parametrize("name", sorted(DATA))
def test_equals_the_ranking_by_canonical_scores(name: str, ties: str, layout: str) -> None:
    similarity = DATA[name][2]
    got, metric = _metric(_batches(name, layout), similarity=similarity, ties=ties)
    assert got == pytest.approx(canonical_reference(name, layout, ties), abs=1e-6)
    if name.startswith("quantised"):  # negatives tie s* exactly: decided on canonical scores
        assert metric.last_compute_rescored["q2g"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(DATA))
def test_bit_identical_over_tiles_routes_and_threads(name: str, layout: str) -> None:
    similarity = DATA[name][2]
    batches = _batches(name, layout, 90)
    num_gallery = 90 if layout == "leave-one-out" else 60
    for ties in TIES:
        first = None
        for threads in (1, 2):
            with _threads(threads):
                for route in ROUTES:
                    got = engine_recall(batches, KS, route, similarity=similarity, ties=ties)
                    first = got if first is None else first
                    assert got == first, (ties, threads, route)
                for chunk in _chunks(num_gallery)[threads - 1 :]:  # see _chunks
                    got = _metric(batches, similarity=similarity, ties=ties, chunk_bytes=chunk)[0]
                    assert got == first, (ties, threads, chunk)


def test_issue_examples_do_not_depend_on_the_tiling() -> None:
    """Data on which the fast float32 product alone gave different answers per tiling."""
    embeddings = _quantised(400, 8, 0)
    labels = torch.randint(0, 40, (400,), generator=_gen(1))
    batches = [Batch(embeddings, labels)]
    results = {}
    for threads in (1, 2):
        with _threads(threads):
            for chunk in (1, 7 * 400 * 4, 256 * 2**20)[threads - 1 :]:  # as _chunks
                results[threads, chunk] = _metric(batches, chunk_bytes=chunk)[0]
    assert len({tuple(r.values()) for r in results.values()}) == 1, results
    decimal = [Batch(_one_decimal(1200, 16, 2), torch.randint(0, 100, (1200,)))]
    values = {
        chunk: _metric(decimal, similarity="dot", ties="expected", chunk_bytes=chunk)[0]
        for chunk in (2**14, 2**16, 256 * 2**20)
    }
    assert len({tuple(v.values()) for v in values.values()}) == 1, values


# -------------------------------------------------------------------- processes


def _cases() -> list[dict[str, Any]]:
    """Bit-for-bit cases for 1, 2 and 3 processes: each process adds every
    ``world``-th item (with ids), the states are gathered, the result compared."""
    big = _quantised(1203, 24, 9)
    big_labels = torch.randint(0, 150, (1203,), generator=_gen(10))
    cases = [
        {"embeddings": big, "labels": big_labels, "kwargs": {"ties": ties, "k": (1, 5)}}
        for ties in ("pessimistic", "expected")
    ]
    for name in ("quantised8-dot", "decimal-dot", "decimal-euclidean"):
        embeddings, labels, similarity = DATA[name]
        for ties in ("pessimistic", "expected"):
            kwargs = {"similarity": similarity, "ties": ties, "k": KS, "chunk_bytes": 2**12}
            cases.append({"embeddings": embeddings, "labels": labels, "kwargs": kwargs})
    return cases


def _run_case(case: dict[str, Any], rank: int, world: int) -> dict[str, float]:
    kwargs = dict(case["kwargs"])
    metric = EmbeddingRecallAtK(kwargs.pop("k"), **kwargs)
    ids = torch.arange(case["embeddings"].shape[0])
    mine = ids[rank::world]
    metric.update(case["embeddings"][mine], case["labels"][mine], ids=mine)
    return {key: float(value) for key, value in metric.compute().items()}


def _distributed_worker(rank: int, world: int, cases: list[dict[str, Any]]) -> list[Any]:
    torch.set_num_threads(2)
    return [_run_case(case, rank, world) for case in cases]


@pytest.mark.ddp
@pytest.mark.parametrize("world", [2, 3])
def test_processes_equal_one_process_bit_for_bit(world: int) -> None:
    cases = _cases()
    with _threads(2):
        expected = [_run_case(case, 0, 1) for case in cases]
    results = run_distributed(_distributed_worker, world_size=world, payload=cases)
    for rank in range(world):
        assert results[rank] == expected, rank
    one = run_distributed(_distributed_worker, world_size=1, payload=cases) if world == 2 else []
    assert all(r == expected for r in one)


# -------------------------------------------------------------------- euclidean


@pytest.mark.parametrize("offset", [0.0, 1e3, 3e3, 1e4])
def test_euclidean_ignores_a_common_offset(offset: float) -> None:
    """Equal to the float64 brute force on the stored float32 inputs at every offset."""
    base = torch.randn(240, 16, generator=_gen(21))
    labels = torch.randint(0, 12, (240,), generator=_gen(22))
    batches = [Batch(base + offset, labels)]
    expected = reference_embedding_recall(batches, KS, similarity="euclidean")
    for ties in TIES:
        got = _metric(batches, similarity="euclidean", ties=ties)[0]
        assert got == pytest.approx(expected, abs=1e-6), (offset, ties)
    # The product of centred vectors: few items need the canonical score.
    metric = _metric(batches, similarity="euclidean")[1]
    assert metric.last_compute_rescored["q2g"] < 3 * 240


@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
def test_continuous_data_equals_the_float64_brute_force(similarity: str) -> None:
    embeddings = torch.randn(200, 12, generator=_gen(31)) * 3
    labels = torch.randint(0, 10, (200,), generator=_gen(32))
    batches = [
        Batch(embeddings[:60], labels[:60], role="query"),
        Batch(embeddings[60:], labels[60:], role="both"),
    ]
    for ties in TIES:
        expected = reference_embedding_recall(
            batches, KS, similarity=similarity, ties=ties, bidirectional=True
        )
        for route in ROUTES:
            got = engine_recall(
                batches, KS, route, similarity=similarity, ties=ties, bidirectional=True
            )
            assert got == pytest.approx(expected, abs=1e-6), (ties, route)
        got, metric = _metric(batches, similarity=similarity, ties=ties, bidirectional=True)
        assert got == pytest.approx(expected, abs=1e-6), ties
        # Continuous scores hardly ever fall in a band: with no negative there, a query's
        # positives are not re-scored either (200 queries, then 140 the other way).
        rescored = metric.last_compute_rescored
        assert rescored["q2g"] <= 10 and rescored["g2q"] <= 10, rescored


# ------------------------------------------------------------------ the certificate


def _adversarial() -> Iterator[tuple[str, Tensor, str]]:
    g = _gen(41)
    yield "random", torch.randn(90, 64, generator=g), "cosine"
    yield "random", torch.randn(90, 64, generator=g), "dot"
    yield "random", torch.randn(90, 64, generator=g), "euclidean"
    # Same-sign values: every product adds up, the accumulated rounding is largest.
    positive = torch.rand(60, 512, generator=g) + 1.0
    for similarity in ("cosine", "dot", "euclidean"):
        yield "positive", positive, similarity
    # A wide dynamic range: a few huge coordinates beside tiny ones.
    wide = torch.randn(60, 96, generator=g) * 10.0 ** torch.randint(-4, 5, (60, 96), generator=g)
    for similarity in ("cosine", "dot", "euclidean"):
        yield "wide", wide, similarity
    # Near-orthogonal rows of large norm: q.g nearly cancels.
    base = torch.randn(60, 128, generator=g)
    for similarity in ("dot", "euclidean"):
        yield "cancelling", torch.cat([base * 1e3, -base * 1e3 + 1e-2]), similarity
    # A common offset: the centred euclidean product.
    for offset in (1e3, 1e4):
        yield f"offset {offset}", torch.randn(80, 32, generator=g) + offset, "euclidean"


@pytest.mark.parametrize("shape", [(1, 1, 0), (7, 13, 0), (7, 13, 2**20), (64, 4096, 0)])
def test_fast_scores_stay_within_the_certified_bound(
    shape: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiles of ``shape[0]`` rows, panels of ``shape[1]`` columns, in tiles of
    ``shape[2]`` bytes: where those hold more than a panel, each product is widened to a
    multiple of ``PRODUCT_COLUMNS`` columns (at the gallery's end, by columns before the
    panel's first) and must still return the scores of the panel's own columns."""
    widths: list[int] = []

    def recorded(original: Any) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            widths.append(kwargs["out"].shape[1] if "out" in kwargs else -1)
            return original(*args, **kwargs)

        return record

    for name in ("matmul", "addmm"):
        monkeypatch.setattr(torch, name, recorded(getattr(torch, name)))
    for name, embeddings, similarity in _adversarial():
        error, bound, _ = fast_and_canonical(embeddings, similarity, *shape)
        worst = float((error / bound.clamp_min(1e-300)).max())
        assert bool((error <= bound).all()), (name, similarity, worst)
    if shape[2]:  # every product widened (13 columns: 16)
        assert widths and all(width % _budget.PRODUCT_COLUMNS == 0 for width in widths), widths


def test_cosine_normalisation_is_per_row() -> None:
    embeddings = torch.randn(50, 33, generator=_gen(51)) * 7
    whole = _score.prepare_rows(embeddings, "cosine", torch.float32)
    for i in range(0, 50, 7):
        alone = _score.prepare_rows(embeddings[i : i + 1], "cosine", torch.float32)
        assert torch.equal(whole[i : i + 1], alone)
    with _threads(2):
        assert torch.equal(_score.prepare_rows(embeddings, "cosine", torch.float32), whole)
    zero = _score.prepare_rows(torch.zeros(2, 4), "cosine", torch.float32)
    assert torch.equal(zero, torch.zeros(2, 4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_cpu_and_cuda_agree_bit_for_bit(precision: str) -> None:  # pragma: no cover - GPU
    """The same canonical ranking on both devices, TF32 products included (their wider
    rounding bound only widens the band)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        for name in ("quantised24-cosine", "decimal-dot", "decimal-euclidean"):
            embeddings, labels, similarity = DATA[name]
            for ties in TIES:
                metric = EmbeddingRecallAtK(KS, similarity=similarity, ties=ties)
                cpu = _metric([Batch(embeddings, labels)], similarity=similarity, ties=ties)[0]
                metric = metric.cuda()
                metric.update(embeddings.cuda(), labels.cuda())
                cuda = {key: float(value) for key, value in metric.compute().items()}
                assert cuda == cpu, (name, ties, precision)
    finally:
        torch.set_float32_matmul_precision(before)
