"""``query_outcomes()`` (dense with ``query_ids``, flat, embeddings) against a literal
per-query computation, and ``paired_comparison`` against the exact McNemar test through
``math.comb`` and Newcombe's method 10 interval written out (``paired_reference.py``);
queries fed in different orders and batches to the two metrics; every error.

The two-process case is in ``test_paired_distributed.py``.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import random
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from embedding_reference import SCENARIOS, gen, small_ints
from helpers import ACTIONS, TIES
from paired_reference import (
    Outcome,
    literal_mcnemar,
    literal_newcombe,
    reference_embedding_outcomes,
    reference_query_outcomes,
)
from torch import Tensor

import recall_at_k
from recall_at_k import (
    EmbeddingRecallAtK,
    PairedComparison,
    QueryOutcomes,
    RetrievalRecallAtK,
    paired_comparison,
)
from recall_at_k._paired import EXACT_DISCORDANT, mcnemar_p_value, newcombe_interval

# ----------------------------------------------------------------------- helpers


def assert_outcomes(got: QueryOutcomes, expected: dict[int, Outcome], ks: tuple[int, ...]) -> None:
    """``got`` holds exactly the queries of ``expected``, ids ascending, same outcomes."""
    assert got.ids.dtype == torch.int64
    assert got.ids.tolist() == sorted(expected)
    assert got.ks == ks
    assert got.hits.shape == (len(expected), len(ks))
    for row, query in enumerate(got.ids.tolist()):
        hits, rank = expected[query]
        assert got.hits[row].tolist() == pytest.approx(hits, abs=1e-12), query
        assert float(got.first_hit_rank[row]) == pytest.approx(rank, abs=1e-9), query


def dense_problem(seed: int, num: int = 40, gallery: int = 7) -> tuple[Tensor, Tensor, Tensor]:
    """Heavily tied scores, a mask target (some rows without positive), an ignore mask."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (num, gallery), generator=g).float()
    target = torch.rand(num, gallery, generator=g) < 0.25
    ignore = torch.rand(num, gallery, generator=g) < 0.15
    return scores, target, ignore


def compute_values(metric: Any) -> list[float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = metric.compute()
    if isinstance(result, Tensor):
        return [float(result)]
    return [float(v) for v in result.values()]


def hits_model(hits: list[int]) -> tuple[Tensor, Tensor]:
    """Dense rows whose single true item (column 0) is at rank 1 (hit) or 2 (miss)."""
    scores = torch.tensor([[1.0, 0.0] if hit else [0.0, 1.0] for hit in hits])
    return scores, torch.zeros(len(hits), dtype=torch.int64)


def literal_comparison(hits_a: list[int], hits_b: list[int], level: float) -> PairedComparison:
    """The comparison of two lists of 0/1 hits, query by query."""
    both = sum(1 for a, b in zip(hits_a, hits_b, strict=True) if a and b)
    only_a = sum(1 for a, b in zip(hits_a, hits_b, strict=True) if a and not b)
    only_b = sum(1 for a, b in zip(hits_a, hits_b, strict=True) if b and not a)
    n = len(hits_a)
    neither = n - both - only_a - only_b
    low, high = literal_newcombe(both, only_a, only_b, neither, level)
    difference = sum(hits_b) / n - sum(hits_a) / n
    return PairedComparison(
        difference, low, high, literal_mcnemar(only_a, only_b), only_a, only_b, n
    )


def assert_comparison(got: PairedComparison, expected: PairedComparison) -> None:
    assert isinstance(got, PairedComparison)
    assert (got.only_a, got.only_b, got.queries) == expected[4:]
    assert got.difference == pytest.approx(expected.difference, abs=1e-12)
    assert got.low == pytest.approx(expected.low, abs=1e-12)
    assert got.high == pytest.approx(expected.high, abs=1e-12)
    assert got.p_value == pytest.approx(expected.p_value, rel=1e-12, abs=1e-300)
    assert -1.0 <= got.low <= got.difference <= got.high <= 1.0


# ------------------------------------------------------------- query_outcomes()


@pytest.mark.parametrize("ties", TIES)
@pytest.mark.parametrize("action", ACTIONS)
def test_dense_outcomes_match_a_literal_sort(ties: str, action: str) -> None:
    ks = (1, 2, 5)
    scores, target, ignore = dense_problem(3)
    if action == "error":
        target[:, 0] = True
        ignore[:, 0] = False  # every query has a valid positive
    ids = torch.randperm(scores.shape[0], generator=torch.Generator().manual_seed(1)) * 3 - 50
    metric = RetrievalRecallAtK(k=ks, ties=ties, empty_target_action=action)
    for rows in torch.arange(scores.shape[0]).split(13):
        metric.update(scores[rows], target[rows], ignore=ignore[rows], query_ids=ids[rows])
    expected = {}
    for q in range(scores.shape[0]):
        outcome = reference_query_outcomes(
            scores[q].tolist(), target[q].tolist(), ignore[q].tolist(), ks, ties, action
        )
        if outcome is not None:
            expected[int(ids[q])] = outcome
    outcomes = metric.query_outcomes()
    assert_outcomes(outcomes, expected, ks)
    assert outcomes.keys == ("recall@1", "recall@2", "recall@5")
    assert outcomes.hits.mean(0).tolist() == pytest.approx(compute_values(metric), abs=1e-6)
    int_rank = ties != "expected"
    assert (outcomes.first_hit_rank.dtype == torch.int64) is int_rank


def test_dense_index_target_and_repeated_ids_count_once() -> None:
    """A ``[Q]`` column target; rows repeated with their id (padding) count once."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 4, (12, 6), generator=g).float()
    target = torch.randint(-1, 6, (12,), generator=g)
    ids = torch.arange(12) + 1000
    metric = RetrievalRecallAtK(k=(1, 3))
    metric.update(scores, target, query_ids=ids)
    metric.update(scores[:4], target[:4], query_ids=ids[:4])  # padded repeats
    expected = {}
    for q in range(12):
        relevant = [j == int(target[q]) for j in range(6)]
        outcome = reference_query_outcomes(
            scores[q].tolist(), relevant, None, (1, 3), "pessimistic", "neg"
        )
        assert outcome is not None
        expected[1000 + q] = outcome
    assert_outcomes(metric.query_outcomes(), expected, (1, 3))
    assert metric.query_outcomes().hits.mean(0).tolist() == pytest.approx(compute_values(metric))


@pytest.mark.parametrize("ties", TIES)
@pytest.mark.parametrize("action", ("neg", "pos", "skip"))
@pytest.mark.parametrize("complete", [False, True])
def test_flat_outcomes_match_a_literal_sort(ties: str, action: str, complete: bool) -> None:
    rng = random.Random(7)
    ks = (1, 3)
    queries: dict[int, list[tuple[float, int]]] = {}
    for q in rng.sample(range(-40, 400), 25):
        queries[q] = [
            (float(rng.randint(0, 3)), int(rng.random() < 0.3)) for _ in range(rng.randint(1, 8))
        ]
    metric = RetrievalRecallAtK(
        k=ks, ties=ties, empty_target_action=action, complete_queries=complete
    )
    if complete:  # each update holds whole queries; some come again (padding)
        order = list(queries) + list(queries)[:5]
        for start in range(0, len(order), 4):
            chunk = [(q, s, t) for q in order[start : start + 4] for s, t in queries[q]]
            metric.update(*_flat(chunk))
    else:  # items of a query spread over several updates, shuffled
        items = [(q, s, t) for q, rows in queries.items() for s, t in rows]
        rng.shuffle(items)
        for start in range(0, len(items), 7):
            metric.update(*_flat(items[start : start + 7]))
    expected = {}
    for q, rows in queries.items():
        outcome = reference_query_outcomes(
            [s for s, _ in rows], [bool(t) for _, t in rows], None, ks, ties, action
        )
        if outcome is not None:
            expected[q] = outcome
    outcomes = metric.query_outcomes()
    assert_outcomes(outcomes, expected, ks)
    assert outcomes.hits.mean(0).tolist() == pytest.approx(compute_values(metric), abs=1e-6)


def _flat(items: list[tuple[int, float, int]]) -> tuple[Tensor, Tensor, Tensor]:
    preds = torch.tensor([s for _, s, _ in items])
    target = torch.tensor([t for _, _, t in items])
    indexes = torch.tensor([q for q, _, _ in items])
    return preds, target, indexes


EMBEDDING_SCENARIOS = sorted(set(SCENARIOS) - {"mixed_roles_with_ids"})


@pytest.mark.parametrize("name", EMBEDDING_SCENARIOS)
@pytest.mark.parametrize("ties", TIES)
def test_embedding_outcomes_match_a_literal_sort(name: str, ties: str) -> None:
    batches, options = SCENARIOS[name]()
    ks = (1, 2, 5)
    action = "skip" if ties == "optimistic" else "neg"
    metric = EmbeddingRecallAtK(
        ks, ties=ties, empty_target_action=action, chunk_bytes=64, **options
    )
    for batch in batches:
        metric.update(batch.embeddings, batch.labels, **batch.kwargs())
    expected = reference_embedding_outcomes(
        batches, ks, ties=ties, empty_target_action=action, **options
    )
    got = metric.query_outcomes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        values = metric.compute()
    assert isinstance(values, dict)
    if options.get("bidirectional"):
        assert isinstance(got, dict) and list(got) == list(metric.directions)
        per_direction = list(got.values())
    else:
        assert isinstance(got, QueryOutcomes)
        per_direction = [got]
    keys = iter(values)
    for outcomes, reference in zip(per_direction, expected, strict=True):
        assert_outcomes(outcomes, reference, ks)
        assert outcomes.keys == tuple(next(keys) for _ in ks)
        means = outcomes.hits.mean(0).tolist()
        assert means == pytest.approx([float(values[key]) for key in outcomes.keys], abs=1e-6)


def test_embedding_int_k_and_the_empty_metric() -> None:
    metric = EmbeddingRecallAtK(k=2)
    empty = metric.query_outcomes()
    assert isinstance(empty, QueryOutcomes)
    assert empty.ids.shape == (0,) and empty.hits.shape == (0, 1) and empty.keys is None
    g = gen(3)
    metric.update(small_ints(20, 3, g), torch.randint(0, 3, (20,), generator=g))
    outcomes = metric.query_outcomes()
    assert isinstance(outcomes, QueryOutcomes) and outcomes.keys is None
    assert outcomes.ids.tolist() == list(range(20))  # positions, no ids
    assert float(outcomes.hits.mean()) == pytest.approx(compute_values(metric)[0])


# ----------------------------------------------------------- paired_comparison


@pytest.mark.parametrize("seed", range(6))
def test_paired_comparison_matches_the_literal_test(seed: int) -> None:
    """Two dense metrics fed the same queries in different orders and batches."""
    rng = random.Random(seed)
    n = rng.randint(1, 300)
    rate_a, rate_b = rng.random(), rng.random()
    hits_a = [int(rng.random() < rate_a) for _ in range(n)]
    hits_b = [int(rng.random() < (rate_b if rng.random() < 0.3 else rate_a)) for _ in range(n)]
    ids = torch.tensor(rng.sample(range(10**6), n))
    a, b = RetrievalRecallAtK(k=1), RetrievalRecallAtK(k=1)
    scores_a, target_a = hits_model(hits_a)
    scores_b, target_b = hits_model(hits_b)
    for rows in torch.arange(n).split(17):
        a.update(scores_a[rows], target_a[rows], query_ids=ids[rows])
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    for rows in order.split(29):
        b.update(scores_b[rows], target_b[rows], query_ids=ids[rows])
    level = rng.choice([0.8, 0.9, 0.95, 0.99])
    got = paired_comparison(a, b, level=level)
    assert_comparison(got, literal_comparison(hits_a, hits_b, level))
    # the outcomes themselves compare the same way
    assert paired_comparison(a.query_outcomes(), b.query_outcomes(), level=level) == got


def test_paired_comparison_of_two_input_forms_and_several_k() -> None:
    """A dense metric (query_ids) against a flat one (indexes), keys as in compute()."""
    scores, target, ignore = dense_problem(11, num=60)
    ids = torch.arange(60) * 7
    a = RetrievalRecallAtK(k=(1, 2, 4), key="R{k}")
    a.update(scores, target, ignore=ignore, query_ids=ids)
    other, _, _ = dense_problem(12, num=60)
    b = RetrievalRecallAtK(k=(1, 2, 4), key="R{k}")
    keep = ~ignore
    rows = torch.arange(60).unsqueeze(1).expand_as(scores)
    perm = torch.randperm(int(keep.sum()), generator=torch.Generator().manual_seed(2))
    b.update(other[keep][perm], target[keep][perm], ids[rows[keep]][perm])
    result = paired_comparison(a, b)
    assert list(result) == ["R1", "R2", "R4"]
    out_a, out_b = a.query_outcomes(), b.query_outcomes()
    for column, key in enumerate(result):
        hits_a = [int(v) for v in out_a.hits[:, column].tolist()]
        hits_b = [int(v) for v in out_b.hits[:, column].tolist()]
        assert_comparison(result[key], literal_comparison(hits_a, hits_b, 0.95))
        assert result[key].difference == pytest.approx(
            compute_values(b)[column] - compute_values(a)[column], abs=1e-6
        )


def test_paired_comparison_of_embeddings_fed_in_different_orders() -> None:
    """Two embedding models over the same samples (ids), bidirectional, fed shuffled."""
    g = gen(21)
    images = small_ints(30, 4, g)
    image_ids = torch.arange(30) + 500
    captions = images + torch.randint(-1, 2, (30, 4), generator=g).float()
    other = images + torch.randint(-2, 3, (30, 4), generator=g).float()
    options: dict[str, Any] = {"similarity": "dot", "bidirectional": True, "k": (1, 3)}
    a, b = EmbeddingRecallAtK(**options), EmbeddingRecallAtK(**options)
    a.update(images, image_ids, role="query", ids=image_ids)
    a.update(captions, image_ids, role="gallery", ids=image_ids + 10_000)
    perm = torch.randperm(30, generator=g)
    for rows in perm.split(11):
        b.update(other[rows], image_ids[rows], role="gallery", ids=image_ids[rows] + 10_000)
        b.update(images[rows], image_ids[rows], role="query", ids=image_ids[rows])
    result = paired_comparison(a, b)
    assert list(result) == ["q2g/recall@1", "q2g/recall@3", "g2q/recall@1", "g2q/recall@3"]
    values_a, values_b = compute_values(a), compute_values(b)
    outcomes_a, outcomes_b = a.query_outcomes(), b.query_outcomes()
    assert isinstance(outcomes_a, dict) and isinstance(outcomes_b, dict)
    for index, key in enumerate(result):
        direction = key.split("/")[0]
        column = index % 2
        hits_a = [int(v) for v in outcomes_a[direction].hits[:, column].tolist()]
        hits_b = [int(v) for v in outcomes_b[direction].hits[:, column].tolist()]
        assert_comparison(result[key], literal_comparison(hits_a, hits_b, 0.95))
        assert result[key].difference == pytest.approx(values_b[index] - values_a[index], abs=1e-6)


def test_the_readme_example() -> None:
    """R@1 0.620 against 0.645 on 1,000 queries that disagree on 99 (37 against 62)."""
    hits_a = [1] * 583 + [1] * 37 + [0] * 62 + [0] * 318
    hits_b = [1] * 583 + [0] * 37 + [1] * 62 + [0] * 318
    a, b = RetrievalRecallAtK(k=1), RetrievalRecallAtK(k=1)
    ids = torch.arange(1000)
    a.update(*hits_model(hits_a), query_ids=ids)
    b.update(*hits_model(hits_b), query_ids=ids)
    assert float(a.compute()) == pytest.approx(0.620) and float(b.compute()) == pytest.approx(0.645)
    result = paired_comparison(a, b)
    assert (result.only_a, result.only_b, result.queries) == (37, 62, 1000)
    assert round(result.difference, 3) == 0.025
    assert round(result.p_value, 3) == 0.015  # the chi-square approximation gives 0.012
    assert (round(result.low, 3), round(result.high, 3)) == (0.005, 0.045)
    assert round((62 - 37) ** 2 / 99, 1) == 6.3
    assert round(math.erfc(math.sqrt(625 / 99 / 2)), 3) == 0.012
    # disagreeing on 299 queries (137 against 162), the same gap is not shown
    assert round(literal_mcnemar(137, 162), 2) == 0.17
    assert round((162 - 137) ** 2 / 299, 1) == 2.1
    assert mcnemar_p_value(137, 162) == pytest.approx(literal_mcnemar(137, 162), rel=1e-12)
    # the Wilson intervals of the protocol guide's example overlap
    assert a.confidence_interval().tolist() == pytest.approx([0.590, 0.650], abs=5e-4)
    assert b.confidence_interval().tolist() == pytest.approx([0.615, 0.674], abs=5e-4)


@pytest.mark.parametrize(
    ("only_a", "only_b"),
    [(0, 0), (0, 1), (1, 0), (5, 5), (3, 9), (40, 2), (500, 560), (0, 60), (1_000, 1_100)],
)
def test_mcnemar_equals_math_comb(only_a: int, only_b: int) -> None:
    assert mcnemar_p_value(only_a, only_b) == pytest.approx(
        literal_mcnemar(only_a, only_b), rel=1e-12, abs=0
    )


def test_mcnemar_beyond_the_exact_range_stays_accurate() -> None:
    only_a, only_b = EXACT_DISCORDANT // 2 + 60, EXACT_DISCORDANT // 2 + 200
    exact = literal_mcnemar(only_a, only_b)
    assert only_a + only_b > EXACT_DISCORDANT
    assert mcnemar_p_value(only_a, only_b) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize(
    ("only_a", "only_b"),
    [
        (10**6, 10**6 + 3000),
        (10**8, 10**8 + 20_000),
        (10**8, 10**8 + 100_000),
        (10**9, 10**9 + 60_000),
    ],
)
def test_mcnemar_for_billions_of_queries(only_a: int, only_b: int) -> None:
    stats = pytest.importorskip("scipy.stats")
    expected = 2 * stats.binom.cdf(only_a, only_a + only_b, 0.5)
    assert mcnemar_p_value(only_a, only_b) == pytest.approx(expected, rel=1e-10)
    assert mcnemar_p_value(only_b, only_a) == mcnemar_p_value(only_a, only_b)


@pytest.mark.parametrize(
    "table",
    [
        (583, 37, 62, 318),
        (0, 0, 5, 0),
        (0, 5, 0, 0),
        (5, 0, 0, 0),
        (0, 0, 0, 5),
        (1, 0, 0, 0),
        (10, 0, 0, 10),
        (0, 10, 10, 0),
        (3, 1, 0, 2),
        (50, 0, 30, 20),
    ],
)
@pytest.mark.parametrize("level", [0.5, 0.9, 0.95, 0.999])
def test_newcombe_interval_written_out(table: tuple[int, int, int, int], level: float) -> None:
    low, high = newcombe_interval(*table, level)
    ref_low, ref_high = literal_newcombe(*table, level)
    assert (low, high) == pytest.approx((max(-1, ref_low), min(1, ref_high)), abs=1e-12)
    _, only_a, only_b, _ = table
    difference = (only_b - only_a) / sum(table)
    assert -1.0 <= low <= difference <= high <= 1.0


def test_random_tables_stay_within_bounds_and_cover_the_difference() -> None:
    rng = random.Random(3)
    for _ in range(500):
        table = tuple(rng.choice([0, 0, 1, 2, rng.randint(0, 50)]) for _ in range(4))
        if sum(table) == 0:
            continue
        low, high = newcombe_interval(*table, 0.95)
        ref = literal_newcombe(*table, 0.95)
        assert (low, high) == pytest.approx(ref, abs=1e-12), table
        assert -1.0 <= low <= (table[2] - table[1]) / sum(table) <= high <= 1.0, table


def test_expected_ties_without_fractional_hits_compare_like_pessimistic() -> None:
    scores = torch.tensor([[0.9, 0.1], [0.1, 0.9], [0.5, 0.2]])
    target = torch.zeros(3, dtype=torch.int64)
    ids = torch.arange(3)
    metrics = {}
    for ties in ("expected", "pessimistic"):
        a, b = RetrievalRecallAtK(k=1, ties=ties), RetrievalRecallAtK(k=1, ties=ties)
        a.update(scores, target, query_ids=ids)
        b.update(scores.flip(1), target, query_ids=ids)
        metrics[ties] = paired_comparison(a, b)
    assert metrics["expected"] == metrics["pessimistic"]


def test_no_queries_gives_nan_and_p_one() -> None:
    result = paired_comparison(RetrievalRecallAtK(k=1), RetrievalRecallAtK(k=1))
    assert math.isnan(result.difference) and math.isnan(result.low) and math.isnan(result.high)
    assert (result.p_value, result.only_a, result.only_b, result.queries) == (1.0, 0, 0, 0)


def test_exported_at_the_top_level() -> None:
    for name in ("paired_comparison", "PairedComparison", "QueryOutcomes"):
        assert name in recall_at_k.__all__
    assert PairedComparison._fields == (
        "difference",
        "low",
        "high",
        "p_value",
        "only_a",
        "only_b",
        "queries",
    )
    assert QueryOutcomes._fields[:3] == ("ids", "hits", "first_hit_rank")


# ------------------------------------------------------------------------ errors


def _dense_metric(ids: list[int], **kwargs: Any) -> RetrievalRecallAtK[Any]:
    metric: RetrievalRecallAtK[Any] = RetrievalRecallAtK(**kwargs)
    scores, target = hits_model([1] * len(ids))
    metric.update(scores, target, query_ids=torch.tensor(ids))
    return metric


def test_error_dense_rows_without_query_ids() -> None:
    metric = RetrievalRecallAtK(k=1)
    metric.update(*hits_model([1, 0]))
    with pytest.raises(
        ValueError, match=r"`query_ids`: .*2 row\(s\) were added without `query_ids`"
    ):
        metric.query_outcomes()
    with pytest.raises(ValueError, match="`query_ids`"):
        paired_comparison(metric, metric)


def test_error_dense_and_flat_in_one_metric() -> None:
    metric = _dense_metric([1, 2], k=1)
    metric.update(torch.tensor([0.5, 0.1]), torch.tensor([1, 0]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"holds dense rows .* and flat items"):
        metric.query_outcomes()


def test_error_empty_target_action_error() -> None:
    metric = RetrievalRecallAtK(k=1, empty_target_action="error")
    metric.update(torch.tensor([[0.5, 0.1]]), torch.tensor([-1]), query_ids=torch.tensor([4]))
    with pytest.raises(ValueError, match="1 query had no valid positive"):
        metric.query_outcomes()


def test_error_some_embedding_queries_with_ids() -> None:
    batches, options = SCENARIOS["mixed_roles_with_ids"]()
    metric = EmbeddingRecallAtK(k=1, **options)
    for batch in batches:
        metric.update(batch.embeddings, batch.labels, **batch.kwargs())
    with pytest.raises(ValueError, match=r"`ids`: \d+ of \d+ queries were added with `ids`"):
        metric.query_outcomes()


def test_error_different_query_ids_are_named() -> None:
    a = _dense_metric([1, 2, 3, 4, 5], k=1)
    b = _dense_metric([1, 2, 3, 40, 50, 60], k=1)
    message = r"same query ids: 2 only in `a` \(e.g. \[4, 5\]\), 3 only in `b` \(e.g. \[40, 50, 60\]\), of 5 and 6 queries"
    with pytest.raises(ValueError, match=message):
        paired_comparison(a, b)


def test_error_different_k_or_directions() -> None:
    with pytest.raises(ValueError, match="same K and keys"):
        paired_comparison(_dense_metric([1], k=1), _dense_metric([1], k=(1, 5)))
    with pytest.raises(ValueError, match="same K and keys"):
        paired_comparison(_dense_metric([1], k=(1, 5)), _dense_metric([1], k=(1, 5), key="R{k}"))
    one = EmbeddingRecallAtK(k=1)
    both = EmbeddingRecallAtK(k=1, bidirectional=True)
    for metric in (one, both):
        metric.update(torch.eye(3), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="same directions"):
        paired_comparison(one, both)


def test_error_repeated_ids_in_given_outcomes() -> None:
    good = _dense_metric([1, 2], k=1).query_outcomes()
    bad = good._replace(ids=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"`b`: query ids must be unique, got 1 repeated id"):
        paired_comparison(good, bad)


def test_error_fractional_hits_under_expected_ties() -> None:
    a = RetrievalRecallAtK(k=1, ties="expected")
    a.update(
        torch.tensor([[0.5, 0.5], [0.9, 0.1]]), torch.tensor([0, 0]), query_ids=torch.tensor([0, 1])
    )
    b = _dense_metric([0, 1], k=1, ties="expected")
    with pytest.raises(
        ValueError, match=r"`a`: 1 queries have a hit probability strictly between 0 and 1"
    ):
        paired_comparison(a, b)


def test_error_not_a_metric_and_bad_level() -> None:
    metric = _dense_metric([1], k=1)
    with pytest.raises(ValueError, match="`b` must be a RetrievalRecallAtK or EmbeddingRecallAtK"):
        paired_comparison(metric, torch.tensor([1.0]))  # type: ignore[call-overload]
    with pytest.raises(ValueError, match=r"`level` must be a float in \(0, 1\)"):
        paired_comparison(metric, metric, level=95)


# ------------------------------------------------------------------ the docs


ROOT = Path(__file__).resolve().parent.parent


def _blocks_with(path: Path, needle: str) -> list[str]:
    text = path.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    return [block for block in blocks if needle in block]


@pytest.mark.parametrize("page", ["docs/protocol.md"])
def test_the_paired_block_prints_what_its_comments_say(page: str) -> None:
    (block,) = _blocks_with(ROOT / page, "paired_comparison(a, b)")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, page, "exec"), {})
    lines = block.splitlines()
    said = [  # a comment right after a statement is what that statement prints
        line[2:]
        for before, line in itertools.pairwise(lines)
        if line.startswith("# ") and before.endswith(")") and not before.startswith("#")
    ]
    assert printed.getvalue().splitlines() == said


def test_policies_bound_the_expected_hits() -> None:
    """ "pessimistic" <= "expected" <= "optimistic", query by query (what the docs advise
    comparing under when expected hits are fractional)."""
    scores, target, ignore = dense_problem(9)
    ids = torch.arange(scores.shape[0])
    hits = {}
    for ties in TIES:
        metric = RetrievalRecallAtK(k=(1, 2, 3), ties=ties)
        metric.update(scores, target, ignore=ignore, query_ids=ids)
        hits[ties] = metric.query_outcomes().hits
    assert bool((hits["pessimistic"] <= hits["expected"]).all())
    assert bool((hits["expected"] <= hits["optimistic"]).all())
    assert bool(((hits["expected"] > 0) & (hits["expected"] < 1)).any())  # ties at cut-offs
    assert EXACT_DISCORDANT == 4096  # the docs state it
