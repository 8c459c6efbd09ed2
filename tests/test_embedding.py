"""EmbeddingRecallAtK against a literal brute-force reference, re-ID CMC, DDP and errors."""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from embedding_reference import Batch, reference_embedding_recall
from helpers import run_distributed
from torch import Tensor
from torchmetrics import MetricCollection

from recall_at_k import EmbeddingRecallAtK, _embedding
from recall_at_k._embedding import Route

TIES = ("pessimistic", "optimistic", "expected")
KS = (1, 2, 5, 10)
# One value below a single row of scores (one query a tile), a few rows, everything.
CHUNKS = (8, 1000, 256 * 2**20)
# Every way of counting a tile: the automatic choice, dense masks, whole tiles through
# label blocks (as on a GPU), and CPU panels of the default size and of one column.
ROUTES = (
    Route(),
    Route("dense"),
    Route("tiles"),
    Route("panels"),
    Route("panels", panel_bytes=1),
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _signs(n: int, d: int, g: torch.Generator) -> Tensor:
    """+-1 vectors of width 16: every cosine is a multiple of 1/16, exact in float32."""
    return torch.randint(0, 2, (n, d), generator=g).float() * 2 - 1


def _small_ints(n: int, d: int, g: torch.Generator) -> Tensor:
    """Small integers: dot products and squared distances are exact and often tie.

    No row is all zeros (its dot products would all tie, and the brute-force "expected"
    enumeration of a tie block that large would take hours).
    """
    values = torch.randint(-1, 3, (n, d), generator=g).float()
    values[(values == 0).all(dim=1), 0] = 1.0
    return values


def _split(emb: Tensor, labels: Tensor, sizes: list[int], **extra: Any) -> list[Batch]:
    batches, start = [], 0
    for size in sizes:
        part = {
            k: (v[start : start + size] if isinstance(v, Tensor) else v) for k, v in extra.items()
        }
        batches.append(Batch(emb[start : start + size], labels[start : start + size], **part))
        start += size
    return batches


# ---------------------------------------------------------------- scenarios


def leave_one_out_continuous() -> tuple[list[Batch], dict[str, Any]]:
    g = _gen(1)
    emb = torch.randn(48, 8, generator=g)
    labels = torch.randint(0, 5, (48,), generator=g)
    labels[47] = 9  # a class of one: that query has no positive
    return _split(emb, labels, [20, 1, 27]), {"similarity": "cosine"}


def leave_one_out_tied_cosine() -> tuple[list[Batch], dict[str, Any]]:
    g = _gen(2)
    emb = _signs(36, 16, g)
    emb[30:] = emb[:6]  # exact duplicates (different samples: no ids)
    labels = torch.randint(0, 4, (36,), generator=g)
    return _split(emb, labels, [17, 19]), {"similarity": "cosine"}


def leave_one_out_tied_dot() -> tuple[list[Batch], dict[str, Any]]:
    g = _gen(3)
    emb = _small_ints(40, 4, g)
    labels = torch.randint(0, 5, (40,), generator=g)
    return _split(emb, labels, [25, 15]), {"similarity": "dot"}


def leave_one_out_tied_euclidean() -> tuple[list[Batch], dict[str, Any]]:
    g = _gen(4)
    emb = _small_ints(40, 3, g)
    labels = torch.randint(0, 3, (40,), generator=g)
    return _split(emb, labels, [40]), {"similarity": "euclidean"}


def leave_one_out_padded_ids() -> tuple[list[Batch], dict[str, Any]]:
    """DistributedSampler-style padding: the first items again, with their ids."""
    g = _gen(5)
    emb = _small_ints(30, 4, g)
    labels = torch.randint(0, 4, (30,), generator=g)
    ids = torch.arange(100, 130)
    pad = [0, 3, 7, 11]
    emb = torch.cat([emb, emb[pad]])
    labels = torch.cat([labels, labels[pad]])
    ids = torch.cat([ids, ids[pad]])
    return _split(emb, labels, [16, 18], ids=ids), {"similarity": "dot"}


def _query_gallery(exclude: str, seed: int) -> tuple[list[Batch], dict[str, Any]]:
    g = _gen(seed)
    q_emb, g_emb = _small_ints(22, 4, g), _small_ints(44, 4, g)
    q_lab = torch.randint(0, 7, (22,), generator=g)  # labels 6 never in the gallery
    g_lab = torch.randint(0, 6, (44,), generator=g)
    q_grp, g_grp = torch.randint(0, 3, (22,), generator=g), torch.randint(0, 3, (44,), generator=g)
    batches = [
        Batch(q_emb[:9], q_lab[:9], "query", q_grp[:9]),
        Batch(g_emb[:30], g_lab[:30], "gallery", g_grp[:30]),
        Batch(q_emb[9:], q_lab[9:], "query", q_grp[9:]),
        Batch(g_emb[30:], g_lab[30:], "gallery", g_grp[30:]),
    ]
    return batches, {"similarity": "dot", "exclude": exclude}


def query_gallery_same_group() -> tuple[list[Batch], dict[str, Any]]:
    return _query_gallery("same_group", 6)


def query_gallery_junk() -> tuple[list[Batch], dict[str, Any]]:
    return _query_gallery("same_label_and_group", 7)


def leave_one_out_same_group() -> tuple[list[Batch], dict[str, Any]]:
    g = _gen(8)
    emb = _signs(40, 16, g)
    labels = torch.randint(0, 5, (40,), generator=g)
    groups = torch.randint(0, 4, (40,), generator=g)
    return _split(emb, labels, [13, 27], groups=groups), {"exclude": "same_group"}


def cross_modal() -> tuple[list[Batch], dict[str, Any]]:
    """Eight images, five captions each; the dataset yields the image once per caption."""
    g = _gen(9)
    images = _small_ints(8, 4, g)
    image_ids = torch.arange(8).repeat_interleave(5)
    captions = images[image_ids] + torch.randint(-1, 2, (40, 4), generator=g).float()
    repeated = images[image_ids]
    batches = [
        Batch(repeated[:15], image_ids[:15], "query", ids=image_ids[:15]),
        Batch(captions[:15], image_ids[:15], "gallery"),
        Batch(repeated[15:], image_ids[15:], "query", ids=image_ids[15:]),
        Batch(captions[15:], image_ids[15:], "gallery"),
    ]
    kwargs = {"similarity": "dot", "bidirectional": True, "directions": ("i2t", "t2i")}
    return batches, kwargs


def mixed_roles_with_ids() -> tuple[list[Batch], dict[str, Any]]:
    """Roles mixed; a query and a gallery item sharing an id are one sample."""
    g = _gen(10)
    emb = _small_ints(30, 4, g)
    labels = torch.randint(0, 4, (30,), generator=g)
    ids = torch.arange(30)
    ids[20:25] = ids[:5]  # gallery items 20..24 are the queries 0..4 again
    batches = [
        Batch(emb[:10], labels[:10], "query", ids=ids[:10]),
        Batch(emb[10:20], labels[10:20], "both", ids=ids[10:20]),
        Batch(emb[20:], labels[20:], "gallery", ids=ids[20:]),
        Batch(emb[25:28], labels[25:28], "both"),  # without ids: samples of their own
    ]
    return batches, {"similarity": "euclidean", "bidirectional": True}


def _tanh_similarity(q: Tensor, g: Tensor) -> Tensor:
    return torch.tanh(q @ g.T / 4).round(decimals=1)


def callable_similarity() -> tuple[list[Batch], dict[str, Any]]:
    g = _gen(11)
    emb = _small_ints(30, 4, g)
    labels = torch.randint(0, 4, (30,), generator=g)
    return _split(emb, labels, [30]), {"similarity": _tanh_similarity}


SCENARIOS: dict[str, Callable[[], tuple[list[Batch], dict[str, Any]]]] = {
    f.__name__: f
    for f in (
        leave_one_out_continuous,
        leave_one_out_tied_cosine,
        leave_one_out_tied_dot,
        leave_one_out_tied_euclidean,
        leave_one_out_padded_ids,
        leave_one_out_same_group,
        query_gallery_same_group,
        query_gallery_junk,
        cross_modal,
        mixed_roles_with_ids,
        callable_similarity,
    )
}


def run_metric(
    batches: list[Batch], ks: Any = KS, route: Route | None = None, **kwargs: Any
) -> dict[str, float]:
    metric = EmbeddingRecallAtK(ks, **kwargs)
    if route is not None:
        metric._route = route
    for batch in batches:
        metric.update(batch.embeddings, batch.labels, **batch.kwargs())
    result = metric.compute()
    assert isinstance(result, dict)
    return {key: float(value) for key, value in result.items()}


def _reference_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in ("chunk_bytes",)}


# ---------------------------------------------------------------- reference agreement


@pytest.mark.parametrize("ties", TIES)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_matches_brute_force_reference(scenario: str, ties: str) -> None:
    batches, kwargs = SCENARIOS[scenario]()
    expected = reference_embedding_recall(batches, KS, ties=ties, **_reference_kwargs(kwargs))
    assert not all(v in (0.0, 1.0) for v in expected.values())  # a scenario that tells
    # Routes: dense masks or label blocks; on CPU the blocks by panels of columns (of
    # the default size, and of one column each) or, as on a GPU, in whole tiles.
    for route in ROUTES:
        for chunk in CHUNKS:
            got = run_metric(batches, ties=ties, chunk_bytes=chunk, route=route, **kwargs)
            where = (route, chunk)
            assert got == pytest.approx(expected, abs=1e-6, nan_ok=True), where


@pytest.mark.parametrize("action", ("neg", "pos", "skip"))
@pytest.mark.parametrize("scenario", ("query_gallery_junk", "leave_one_out_continuous"))
def test_empty_target_actions_match_reference(scenario: str, action: str) -> None:
    batches, kwargs = SCENARIOS[scenario]()
    expected = reference_embedding_recall(
        batches, KS, empty_target_action=action, **_reference_kwargs(kwargs)
    )
    got = run_metric(batches, empty_target_action=action, chunk_bytes=8, **kwargs)
    assert got == pytest.approx(expected, abs=1e-6)


def test_empty_target_action_error_says_how_many() -> None:
    batches, kwargs = query_gallery_junk()
    with pytest.raises(ValueError, match=r"\d+ quer(y|ies) had no valid positive"):
        run_metric(batches, empty_target_action="error", **kwargs)


def test_empty_target_action_error_names_the_direction() -> None:
    emb = torch.eye(4)
    metric = EmbeddingRecallAtK(1, bidirectional=True, empty_target_action="error")
    metric.update(emb[:2], torch.tensor([0, 1]), role="query")
    metric.update(emb[2:], torch.tensor([0, 0]), role="gallery")  # label 1 has no match
    with pytest.raises(ValueError, match=r"direction 'q2g': 1 query had no valid positive"):
        metric.compute()


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
    g = _gen(12)
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
    perm = torch.randperm(emb.shape[0], generator=_gen(13))
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
    g = _gen(14)
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


# ---------------------------------------------------------------- distributed


def _shards(batches: list[Batch], cuts: list[list[int]]) -> list[list[Batch]]:
    return [[batches[i] for i in cut] for cut in cuts]


def _distributed_cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    # Leave-one-out with ids; rank 1 also holds padded repeats of rank 0's items.
    batches, kwargs = leave_one_out_padded_ids()
    g = _gen(15)
    emb, labels, ids = (
        _small_ints(37, 4, g),
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
            "shards": _shards(batches, [[0, 1, 2], [3]]),
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


def _distributed_worker(rank: int, world_size: int, cases: list[dict[str, Any]]) -> Any:
    out: dict[str, Any] = {}
    for case in cases:
        for sync in (True, False):
            metric = EmbeddingRecallAtK(KS, sync_on_compute=sync, **case["kwargs"])
            value = _outcome(metric, case["shards"][rank])
            out[f"{case['name']}-sync{sync}"] = (
                value,
                dict(metric.last_compute_num_queries_ranked),
            )
    # A direction without gallery must raise on every process (no hang in all_reduce).
    only_queries = [Batch(torch.randn(3, 2), torch.tensor([0, 1, 0]), "query")]
    out["no-gallery"] = _outcome(EmbeddingRecallAtK(KS), only_queries if rank == 0 else [])
    # A failure while ranking one process's share must not leave the other one waiting.
    items = [Batch(torch.randn(4, 2), torch.tensor([0, 1, 0, 1]))]
    out["one-fails"] = _outcome(EmbeddingRecallAtK(KS, similarity=_fails_on_rank_one), items)
    return out


def _fails_on_rank_one(queries: Tensor, gallery: Tensor) -> Tensor:
    if torch.distributed.get_rank() == 1:
        raise ValueError("similarity failed on rank 1")
    return queries @ gallery.T


def test_two_gloo_processes_equal_one_process() -> None:
    cases = _distributed_cases()
    results = run_distributed(_distributed_worker, world_size=2, payload=cases)
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
    emb = torch.randn(12, 5, generator=_gen(16))
    labels = torch.arange(12) % 3
    metric = EmbeddingRecallAtK(KS)
    metric.update(emb.to(torch.bfloat16), labels)
    metric.update(emb.double(), labels.to(torch.int32), ids=torch.arange(12, 24))
    metric.compute()
    assert metric.last_compute_num_queries_ranked == {"q2g": 24}
    assert all(v.dtype == torch.float32 for v in metric.embedding_values)
    wide = EmbeddingRecallAtK(KS).set_dtype(torch.float64)
    wide.update(emb, labels)
    assert wide.embedding_values[0].dtype == torch.float64


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


def test_wide_label_blocks_take_the_dense_route(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = _embedding._dense_band

    def spy(*args: Any) -> Any:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(_embedding, "_dense_band", spy)
    emb = torch.randn(30, 4, generator=_gen(17))
    batches = [Batch(emb, torch.arange(30) % 2)]  # two classes: blocks of half the gallery
    expected = reference_embedding_recall(batches, KS)
    assert run_metric(batches) == pytest.approx(expected, abs=1e-6)
    assert calls
    calls.clear()
    many = [Batch(emb, torch.arange(30) % 10)]
    assert run_metric(many) == pytest.approx(reference_embedding_recall(many, KS), abs=1e-6)
    assert not calls


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


def _raises(match: str, fn: Callable[[], object]) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


def test_update_errors() -> None:
    m = EmbeddingRecallAtK()
    emb, labels = torch.randn(3, 2), torch.tensor([0, 1, 0])
    shape_msg = r"`embeddings` must be a floating point tensor of shape \[B, D\], got shape"
    _raises(shape_msg + r" \[3\]", lambda: m.update(torch.randn(3), labels))
    _raises(shape_msg + r" \[3, 2\] and dtype torch.int64", lambda: m.update(emb.long(), labels))
    _raises(r"`embeddings` must be a torch.Tensor, got list", lambda: m.update([[1.0]], labels))
    one_per = r"must be an integer \(int64\) tensor of shape \[3\], one entry per row"
    _raises(r"`labels` " + one_per + r".*shape \[2\]", lambda: m.update(emb, labels[:2]))
    _raises(r"`labels` " + one_per + r".*torch.float32", lambda: m.update(emb, labels.float()))
    _raises(r"`groups` " + one_per, lambda: m.update(emb, labels, groups=labels[:1]))
    _raises(
        r"`ids` " + one_per, lambda: m.update(emb, labels, ids=torch.zeros(4, dtype=torch.long))
    )
    _raises(
        r"`ids` " + one_per + r".*torch.float32", lambda: m.update(emb, labels, ids=labels.float())
    )
    _raises(
        r"`role` must be one of 'query', 'gallery', 'both', got 'queries'",
        lambda: m.update(emb, labels, role="queries"),
    )
    _raises(r"`labels` is on device meta", lambda: m.update(emb, labels.to("meta")))
    _raises(
        r"`embeddings` must be finite, found 1 NaN and 1 infinite",
        lambda: m.update(torch.tensor([[float("nan"), float("inf")]]), labels[:1]),
    )
    m.update(emb, labels, role="query")
    _raises(
        r"`embeddings` of role 'gallery' have width 3, but earlier embeddings \(role 'query'\)"
        r" have width 2",
        lambda: m.update(torch.randn(2, 3), labels[:2], role="gallery"),
    )
    grouped = EmbeddingRecallAtK(exclude="same_label_and_group")
    _raises(
        r"`groups` are required with exclude='same_label_and_group'",
        lambda: grouped.update(emb, labels),
    )


def test_constructor_errors() -> None:
    _raises(
        r"`similarity` must be one of 'cosine', 'dot', 'euclidean', got 'l2'",
        lambda: EmbeddingRecallAtK(similarity="l2"),
    )
    _raises(
        r"`exclude` must be one of 'none', 'same_group', 'same_label_and_group', got 'x'",
        lambda: EmbeddingRecallAtK(exclude="x"),
    )
    for bad in (("a", "a"), ("a",), "ab", (1, 2), ("a", "")):
        _raises(
            r"`directions` must be two distinct non-empty strings",
            lambda bad=bad: EmbeddingRecallAtK(directions=bad),
        )
    for chunk in (0, -5, 1.5, True):
        _raises(
            r"`chunk_bytes` must be a positive int, got",
            lambda chunk=chunk: EmbeddingRecallAtK(chunk_bytes=chunk),
        )
    _raises(r"`k` must not contain duplicates", lambda: EmbeddingRecallAtK((1, 1)))
    _raises(r"`ties` must be one of", lambda: EmbeddingRecallAtK(ties="random"))
    _raises(
        r"`empty_target_action` must be one of", lambda: EmbeddingRecallAtK(empty_target_action="x")
    )
    _raises(r"`key` must give a distinct key for every K", lambda: EmbeddingRecallAtK(key="recall"))


def test_compute_errors() -> None:
    emb, labels = torch.randn(3, 2), torch.tensor([0, 1, 0])
    only_gallery = EmbeddingRecallAtK()
    only_gallery.update(emb, labels, role="gallery")
    _raises(
        r"`role`: direction 'q2g' \(query -> gallery\) has no queries at compute\(\): add"
        r" embeddings with role='query' or role='both'",
        only_gallery.compute,
    )
    only_queries = EmbeddingRecallAtK(bidirectional=True, directions=("i2t", "t2i"))
    only_queries.update(emb, labels, role="query")
    _raises(r"`role`: direction 'i2t' \(query -> gallery\) has no gallery", only_queries.compute)
    a, b = EmbeddingRecallAtK(), EmbeddingRecallAtK()
    a.update(emb, labels)
    b.update(torch.randn(2, 5), labels[:2])
    a.merge_state(b)
    _raises(r"`embeddings` must all have one width: got widths \[2, 5\]", a.compute)
    wrong_shape = EmbeddingRecallAtK(similarity=lambda q, g: q @ g.T[:, :1])
    wrong_shape.update(emb, labels)
    _raises(
        r"`similarity` must return floating point scores of shape \[3, 3\]", wrong_shape.compute
    )
    nan = EmbeddingRecallAtK(similarity=lambda q, g: torch.full((q.shape[0], g.shape[0]), math.nan))
    nan.update(emb, labels)
    _raises(r"`similarity` returned NaN scores for 3 quer", nan.compute)
    # Scores past float32's range are ranked (in float64), not an error.
    huge = EmbeddingRecallAtK(KS, similarity="dot")
    huge_embeddings = torch.tensor([[1e20, 1e20], [1e20, -1e20], [1.0, 0.0]])
    huge.update(huge_embeddings, labels)
    expected = reference_embedding_recall([Batch(huge_embeddings, labels)], KS, similarity="dot")
    assert {k: float(v) for k, v in huge.compute().items()} == pytest.approx(expected)


def test_a_corrupted_state_is_reported() -> None:
    metric = EmbeddingRecallAtK(k=1)
    metric.update(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]))
    metric.embedding_values[0] = metric.embedding_values[0][:-1]  # one value lost
    with pytest.raises(
        ValueError,
        match=r"`embeddings`: the state holds 11 values for 4 items of width 3; it was corrupted",
    ):
        metric.compute()
