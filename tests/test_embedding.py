"""EmbeddingRecallAtK against a literal brute-force reference (every route and chunk size), re-ID
CMC, and its torchmetrics behaviour. (Processes: test_distributed.py; errors: test_errors.py.)
"""

from __future__ import annotations

import copy
import math
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from embedding_reference import (
    KS,
    ROUTES,
    SCENARIOS,
    Batch,
    cross_modal,
    gen,
    leave_one_out_continuous,
    leave_one_out_tied_cosine,
    query_gallery_same_group,
    reference_embedding_recall,
    run_metric,
)
from helpers import TIES
from torch import Tensor
from torchmetrics import MetricCollection

from recall_at_k import EmbeddingRecallAtK

# One value below a single row of scores (one query a tile), a few rows, everything.
CHUNKS = (8, 1000, 256 * 2**20)


def _reference_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in ("chunk_bytes",)}


# ---------------------------------------------------------------- reference agreement


@pytest.mark.parametrize("ties", TIES)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_matches_brute_force_reference(scenario: str, ties: str) -> None:
    batches, kwargs = SCENARIOS[scenario]()
    expected = reference_embedding_recall(batches, KS, ties=ties, **_reference_kwargs(kwargs))
    assert not all(v in (0.0, 1.0) for v in expected.values())  # a scenario that tells
    # Every way the engine walks the gallery (squares, CPU panels, whole rows as on a
    # GPU) at several sizes, and the metric itself at chunks from below one row up.
    for route in ROUTES:
        got = run_metric(batches, ties=ties, route=route, **kwargs)
        assert got == pytest.approx(expected, abs=1e-6, nan_ok=True), route
    for chunk in CHUNKS:
        got = run_metric(batches, ties=ties, chunk_bytes=chunk, **kwargs)
        assert got == pytest.approx(expected, abs=1e-6, nan_ok=True), chunk


@pytest.mark.parametrize("action", ("neg", "pos", "skip"))
@pytest.mark.parametrize("scenario", ("query_gallery_junk", "leave_one_out_continuous"))
def test_empty_target_actions_match_reference(scenario: str, action: str) -> None:
    batches, kwargs = SCENARIOS[scenario]()
    expected = reference_embedding_recall(
        batches, KS, empty_target_action=action, **_reference_kwargs(kwargs)
    )
    got = run_metric(batches, empty_target_action=action, chunk_bytes=8, **kwargs)
    assert got == pytest.approx(expected, abs=1e-6)


def test_skip_every_query_warns_and_returns_nan() -> None:
    metric = EmbeddingRecallAtK((1, 5), empty_target_action="skip")
    metric.update(torch.randn(3, 4), torch.tensor([0, 1, 2]))
    with pytest.warns(UserWarning, match="No query was counted"):
        result = metric.compute()
    assert isinstance(result, dict)
    assert all(math.isnan(float(v)) for v in result.values())


# ---------------------------------------------------------------- self-exclusion, dedupe


def test_self_is_excluded_by_position_not_by_dropping_the_first_neighbour() -> None:
    # A and B are identical, so B ties with A's self-match; C (A's class) comes next.
    emb = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])
    labels = torch.tensor([0, 1, 0, 1])
    metric = EmbeddingRecallAtK(1, ties="optimistic")
    metric.update(emb, labels)
    # A: B (negative, 1.0) before C (positive, 0.8): miss. B: A (negative) first: miss.
    # C: A (positive, 0.8) and B (negative, 0.8) tie: optimistic hit. D: C (0.6) before
    # B (0.0): miss. Dropping "the first neighbour" would instead drop B for A (or A for B).
    assert float(metric.compute()) == pytest.approx(0.25)


def test_repeated_ids_within_a_role_count_once() -> None:
    g = gen(12)
    emb = torch.randn(20, 6, generator=g)
    labels = torch.randint(0, 3, (20,), generator=g)
    ids = torch.arange(20)
    plain = run_metric([Batch(emb, labels, ids=ids)])
    padded = run_metric([Batch(emb, labels, ids=ids), Batch(emb[:5], labels[:5], ids=ids[:5])])
    assert padded == plain
    # Without ids the repeats are other samples: each original now has its twin, ranked
    # first, as a positive.
    assert run_metric([Batch(emb, labels), Batch(emb[:5], labels[:5])]) != plain


def test_result_does_not_depend_on_item_order() -> None:
    batches, kwargs = leave_one_out_tied_cosine()
    emb = torch.cat([b.embeddings for b in batches])
    labels = torch.cat([b.labels for b in batches])
    perm = torch.randperm(emb.shape[0], generator=gen(13))
    for ties in TIES:
        a = run_metric([Batch(emb, labels)], ties=ties, **kwargs)
        b = run_metric([Batch(emb[perm], labels[perm])], ties=ties, **kwargs)
        assert a == pytest.approx(b, abs=1e-12)


def test_collapsed_model_scores_zero_pessimistically() -> None:
    metric = EmbeddingRecallAtK((1, 5))
    metric.update(torch.ones(10, 3), torch.arange(10) % 2)
    assert metric.compute() == {"recall@1": torch.tensor(0.0), "recall@5": torch.tensor(0.0)}
    optimistic = EmbeddingRecallAtK((1, 5), ties="optimistic")
    optimistic.update(torch.ones(10, 3), torch.arange(10) % 2)
    assert float(optimistic.compute()["recall@1"]) == 1.0


# ---------------------------------------------------------------- re-ID (Market-1501 rules)


def _market_cmc(
    q_feat: np.ndarray,
    q_pid: np.ndarray,
    q_cam: np.ndarray,
    g_feat: np.ndarray,
    g_pid: np.ndarray,
    g_cam: np.ndarray,
    max_rank: int,
) -> np.ndarray:
    """The Market-1501 evaluation, literally: sort by distance, drop the junk (same
    identity seen by the same camera), skip queries without a good match, average CMC."""
    cmc_sum = np.zeros(max_rank)
    valid = 0
    for i in range(len(q_feat)):
        dist = ((g_feat - q_feat[i]) ** 2).sum(axis=1)
        order = np.argsort(dist, kind="stable")
        junk = (g_pid[order] == q_pid[i]) & (g_cam[order] == q_cam[i])
        good = (g_pid[order] == q_pid[i]) & (g_cam[order] != q_cam[i])
        kept_good = good[~junk]
        if not kept_good.any():
            continue
        first = int(np.flatnonzero(kept_good)[0])
        cmc = np.zeros(max_rank)
        cmc[first:] = 1
        cmc_sum += cmc
        valid += 1
    return cmc_sum / valid


def test_reid_equals_market1501_cmc() -> None:
    g = gen(14)
    identities, cameras, dim = 15, 4, 16
    centres = torch.randn(identities, dim, generator=g)

    def shots(n: int) -> tuple[Tensor, Tensor, Tensor]:
        pid = torch.randint(0, identities, (n,), generator=g)
        cam = torch.randint(0, cameras, (n,), generator=g)
        feat = centres[pid] + 0.9 * torch.randn(n, dim, generator=g)
        return feat.double(), pid, cam

    q_feat, q_pid, q_cam = shots(40)
    g_feat, g_pid, g_cam = shots(120)
    # An identity seen by the query's camera only: that query has no valid match.
    q_pid[0], q_cam[0] = identities, 0
    g_feat = torch.cat([g_feat, q_feat[:1] + 0.01])
    g_pid, g_cam = torch.cat([g_pid, q_pid[:1]]), torch.cat([g_cam, q_cam[:1]])
    ks = tuple(range(1, 21))
    cmc = _market_cmc(
        q_feat.numpy(),
        q_pid.numpy(),
        q_cam.numpy(),
        g_feat.numpy(),
        g_pid.numpy(),
        g_cam.numpy(),
        len(ks),
    )
    assert 0.1 < cmc[0] < 0.9
    metric = EmbeddingRecallAtK(
        ks,
        similarity="euclidean",
        exclude="same_label_and_group",
        empty_target_action="skip",
        chunk_bytes=4096,
    )
    metric.set_dtype(torch.float64)
    metric.update(g_feat[:70], g_pid[:70], role="gallery", groups=g_cam[:70])
    metric.update(q_feat, q_pid, role="query", groups=q_cam)
    metric.update(g_feat[70:], g_pid[70:], role="gallery", groups=g_cam[70:])
    result = metric.compute()
    assert isinstance(result, dict)
    np.testing.assert_allclose([float(v) for v in result.values()], cmc, atol=1e-12)


# ---------------------------------------------------------------- torchmetrics behaviour


def test_forward_returns_the_batch_value_and_accumulates() -> None:
    batches, kwargs = leave_one_out_continuous()
    metric = EmbeddingRecallAtK(KS, **kwargs)
    for batch in batches[::2]:
        value = metric(batch.embeddings, batch.labels)
        assert {k: float(v) for k, v in value.items()} == run_metric([batch], **kwargs)
    expected = run_metric(batches[::2], **kwargs)
    assert {k: float(v) for k, v in metric.compute().items()} == expected


def test_forward_of_a_batch_without_gallery_is_nan() -> None:
    metric = EmbeddingRecallAtK((1, 2))
    value = metric(torch.randn(3, 4), torch.tensor([0, 1, 0]), role="query")
    assert all(math.isnan(float(v)) for v in value.values())
    metric.update(torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 1]), role="gallery")
    assert all(not math.isnan(float(v)) for v in metric.compute().values())


def test_single_k_is_a_scalar_and_bidirectional_keys() -> None:
    metric = EmbeddingRecallAtK(5)
    metric.update(torch.randn(8, 3), torch.arange(8) % 2)
    assert metric.compute().shape == ()
    both = EmbeddingRecallAtK(5, bidirectional=True, directions=("i2t", "t2i"), key="r{k}")
    both.update(torch.randn(8, 3), torch.arange(8) % 2)
    assert list(both.compute()) == ["i2t/r5", "t2i/r5"]


# compute() after reset(): torchmetrics warns beside our NaN warning (expected here).
@pytest.mark.filterwarnings(
    "ignore:The ``compute`` method of metric .* called before the ``update``"
)
def test_reset_merge_pickle_and_collection() -> None:
    batches, kwargs = query_gallery_same_group()
    expected = run_metric(batches, **kwargs)
    first = EmbeddingRecallAtK(KS, **kwargs)
    second = EmbeddingRecallAtK(KS, **kwargs)
    for i, batch in enumerate(batches):
        (first if i % 2 else second).update(batch.embeddings, batch.labels, **batch.kwargs())
    second.merge_state(first)
    assert {k: float(v) for k, v in second.compute().items()} == expected
    restored = pickle.loads(pickle.dumps(second))
    assert {k: float(v) for k, v in restored.compute().items()} == expected
    clone = copy.deepcopy(second)
    clone.reset()
    with pytest.warns(UserWarning, match="No query was counted"):
        assert all(math.isnan(float(v)) for v in clone.compute().values())
    collection = MetricCollection(
        {
            "dot": EmbeddingRecallAtK(KS, **kwargs),
            "cos": EmbeddingRecallAtK(KS, exclude="same_group", similarity="cosine"),
        }
    )
    for batch in batches:
        collection.update(batch.embeddings, batch.labels, **batch.kwargs())
    out = collection.compute()
    assert {k[len("dot_") :]: float(v) for k, v in out.items() if k.startswith("dot_")} == expected
    cos_kwargs = {"exclude": "same_group", "similarity": "cosine"}
    cos = {k[len("cos_") :]: float(v) for k, v in out.items() if k.startswith("cos_")}
    assert cos == run_metric(batches, **cos_kwargs)


def test_dtypes_and_counts_of_ranked_queries() -> None:
    emb = torch.randn(12, 5, generator=gen(16))
    labels = torch.arange(12) % 3
    metric = EmbeddingRecallAtK(KS)
    metric.update(emb.to(torch.bfloat16), labels)
    metric.update(emb.double(), labels.to(torch.int32), ids=torch.arange(12, 24))
    metric.compute()
    assert metric.last_compute_num_queries_ranked == {"q2g": 24}
    # Each batch in the wider of float32 and its own dtype; set_dtype changes neither.
    assert [v.dtype for v in metric.embedding_values] == [torch.float32, torch.float64]
    wide = EmbeddingRecallAtK(KS).set_dtype(torch.float64)
    wide.update(emb, labels)
    assert wide.embedding_values[0].dtype == torch.float32


def test_validate_args_false_skips_value_checks() -> None:
    metric = EmbeddingRecallAtK(1, validate_args=False)
    metric.update(torch.tensor([[float("nan"), 1.0], [0.0, 1.0]]), torch.tensor([0, 0]))


def test_plot_draws_one_curve_per_direction() -> None:
    metric = EmbeddingRecallAtK((1, 2, 3), bidirectional=True)
    metric.update(torch.randn(6, 3), torch.arange(6) % 2)
    _fig, ax = metric.plot()
    assert [line.get_label() for line in ax.get_lines()] == ["q2g", "g2q"]
    value = metric.compute()
    _fig, ax = metric.plot([value, value])
    assert len(ax.get_lines()) == 4
    single = EmbeddingRecallAtK(2)
    single.update(torch.randn(6, 3), torch.arange(6) % 2)
    _fig, ax = single.plot()
    assert len(ax.get_lines()) == 1


def test_every_walk_of_the_gallery_gives_the_reference() -> None:
    """Leave-one-out (the squares, each score once for both items), query/gallery and
    two wide classes (labels of half the gallery) give the reference's values whichever
    way the engine walks the gallery."""
    emb = torch.randn(300, 8, generator=gen(18))
    labels = torch.arange(300) % 12
    cases = [
        [Batch(emb, labels)],
        [Batch(emb[:100], labels[:100], role="query"), Batch(emb[100:], labels[100:], "gallery")],
        [Batch(emb[:30], torch.arange(30) % 2)],
    ]
    for batches in cases:
        expected = reference_embedding_recall(batches, KS)
        for route in ROUTES:
            assert run_metric(batches, route=route) == pytest.approx(expected, abs=1e-6), route


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runs_on_the_embeddings_device() -> None:  # pragma: no cover - GPU machines
    batches, kwargs = cross_modal()
    metric = EmbeddingRecallAtK(KS, **kwargs).cuda()
    for batch in batches:
        args = {k: (v.cuda() if isinstance(v, Tensor) else v) for k, v in batch.kwargs().items()}
        metric.update(batch.embeddings.cuda(), batch.labels.cuda(), **args)
    result = metric.compute()
    assert all(v.device.type == "cuda" for v in result.values())
    assert {k: float(v) for k, v in result.items()} == run_metric(batches, **kwargs)


# ---------------------------------------------------------------- errors


def test_scores_past_the_float32_range_are_ranked() -> None:
    """Dot products that overflow float32 are ranked (in float64), not an error."""
    embeddings = torch.tensor([[1e20, 1e20], [1e20, -1e20], [1.0, 0.0]])
    labels = torch.tensor([0, 1, 0])
    metric = EmbeddingRecallAtK(KS, similarity="dot")
    metric.update(embeddings, labels)
    expected = reference_embedding_recall([Batch(embeddings, labels)], KS, similarity="dot")
    assert {k: float(v) for k, v in metric.compute().items()} == pytest.approx(expected)


@pytest.mark.parametrize("protocol", ["leave-one-out", "query/gallery", "bidirectional"])
@pytest.mark.parametrize("similarity", ["cosine", "euclidean"])
def test_a_query_that_misses_at_every_k_is_scanned_no_further(
    protocol: str, similarity: str
) -> None:
    """Random continuous embeddings: most queries soon see ``max(k)`` negatives surely
    above their best positive (a miss at every K) and are scanned no further. At every
    ``chunk_bytes`` about one item a query (its best positive) is then re-scored
    canonically; rows that reached a band before such a query stopped and were compared
    after it once counted and re-scored every item above the band (up to 60 times the
    pairs at 64 and 256 KiB), with the same results."""
    gen = torch.Generator().manual_seed(5)
    embeddings = torch.randn(1200, 24, generator=gen)
    labels = torch.randint(0, 120, (1200,), generator=gen)
    results = []
    for chunk_bytes in (2**16, 2**18, 2**28):
        metric = EmbeddingRecallAtK(
            (1, 5, 10),
            similarity=similarity,
            bidirectional=protocol == "bidirectional",
            chunk_bytes=chunk_bytes,
        )
        if protocol == "leave-one-out":
            metric.update(embeddings, labels)
        else:
            metric.update(embeddings[:400], labels[:400], role="query")
            metric.update(embeddings[400:], labels[400:], role="gallery")
        results.append(metric.compute())
        queries = {"q2g": 1200 if protocol == "leave-one-out" else 400, "g2q": 800}
        for direction, rescored in metric.last_compute_rescored.items():
            most = queries[direction] + queries[direction] // 10
            assert rescored <= most, (chunk_bytes, direction, rescored, most)
    assert all(result == results[0] for result in results[1:])
