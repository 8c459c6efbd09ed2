"""The dense form against the brute-force reference: the kernel, functional API and metric.

Random cases over every tie policy and empty-target action (with default and one-row CPU
blocks), the mask path against the select path, the worked example of the definition,
extreme but legal inputs (+-inf, K past the gallery, every item ignored, strided and
half precision inputs), NaN found by the mask path itself, ``validate_args=False``, and
``query_ids``: padded repeats count once.
"""

from __future__ import annotations

import itertools
import math
import random
import warnings

import pytest
import torch
from helpers import ACTIONS, DETERMINISTIC_TIES, TIES, assert_recall_close, tied_rows
from reference import reference_first_hit_rank, reference_recall

from recall_at_k import RetrievalRecallAtK, _dense, _kernel
from recall_at_k.functional import retrieval_first_hit_rank, retrieval_recall_at_k
from recall_at_k.ranking import budget


def _random_case(rng: random.Random) -> dict[str, object]:
    """Scores from a few values (heavy ties), sparse masks, ignores and empty rows."""
    num_queries = rng.randint(1, 9)
    gallery = rng.randint(1, 10)
    levels = [rng.choice([-2.0, -0.5, 0.0, 0.5, 1.0, float("inf"), float("-inf")])]
    levels += [round(rng.uniform(-1, 1), 1) for _ in range(rng.randint(1, 3))]
    scores = [[rng.choice(levels) for _ in range(gallery)] for _ in range(num_queries)]
    index_form = rng.random() < 0.4
    if index_form:
        columns = [rng.randint(-1, gallery - 1) for _ in range(num_queries)]
        mask = [[j == c for j in range(gallery)] for c in columns]
        target = torch.tensor(columns)
    else:
        density = rng.choice([0.0, 0.15, 0.4, 0.9])
        mask = [[rng.random() < density for _ in range(gallery)] for _ in range(num_queries)]
        target = torch.tensor(mask, dtype=torch.bool)
        if rng.random() < 0.3:
            target = target.to(rng.choice([torch.int64, torch.int32, torch.uint8]))
    ignored = None
    if rng.random() < 0.5:
        ignored = [[rng.random() < 0.25 for _ in range(gallery)] for _ in range(num_queries)]
    ks = tuple(rng.sample(range(1, 13), rng.randint(1, 4)))
    return {
        "scores": scores,
        "mask": mask,
        "target": target,
        "ignored": ignored,
        "ks": ks,
        "dtype": rng.choice([torch.float32, torch.float64]),
    }


@pytest.mark.parametrize(
    ("block_bytes", "small_batch"),
    [(None, None), (None, 0), (1, 0)],
    ids=["small-batch-paths", "default-blocks", "one-row-blocks"],
)
@pytest.mark.parametrize("seed", range(6))
def test_agreement_with_reference(
    seed: int, block_bytes: int | None, small_batch: int | None
) -> None:
    """600 random cases: every tie policy, every empty-target action, batch splits.

    Run three times through the metric: with the paths of small batches (bool
    comparisons; every case here is small), and with those off, with the CPU mask path's
    default row blocks (a case fits in one) and with blocks of one row, so that every
    row of a case is its own block.
    """
    rng = random.Random(seed)
    for _ in range(100):
        case = _random_case(rng)
        scores = torch.tensor(case["scores"], dtype=case["dtype"])  # type: ignore[arg-type]
        target: torch.Tensor = case["target"]  # type: ignore[assignment]
        ignored = case["ignored"]
        ignore = None if ignored is None else torch.tensor(ignored, dtype=torch.bool)
        ks: tuple[int, ...] = case["ks"]  # type: ignore[assignment]
        ties = rng.choice(TIES)
        action = rng.choice(ACTIONS)
        try:
            expected = reference_recall(case["scores"], case["mask"], ignored, ks, ties, action)  # type: ignore[arg-type]
        except ValueError:
            with pytest.raises(ValueError, match="had no valid positive"):
                retrieval_recall_at_k(
                    scores, target, ks, ignore=ignore, ties=ties, empty_target_action=action
                )
            continue
        with pytest.warns(UserWarning) if math.isnan(expected[0]) else _no_warning():
            got = retrieval_recall_at_k(
                scores, target, ks, ignore=ignore, ties=ties, empty_target_action=action
            )
        assert isinstance(got, dict)
        assert_recall_close(got, expected, ks)

        # The metric, fed the same rows in a random split into batches, agrees too.
        metric = RetrievalRecallAtK(ks, ties=ties, empty_target_action=action)
        if block_bytes is not None:
            metric._dense_block_bytes = block_bytes
        if small_batch is not None:
            metric._dense_small_batch = small_batch
        cuts = sorted(rng.choices(range(scores.shape[0] + 1), k=rng.randint(0, 3)))
        bounds = [0, *cuts, scores.shape[0]]
        for lo, hi in itertools.pairwise(bounds):
            metric.update(
                scores[lo:hi], target[lo:hi], ignore=None if ignore is None else ignore[lo:hi]
            )
        with pytest.warns(UserWarning) if math.isnan(expected[0]) else _no_warning():
            from_metric = metric.compute()
        assert isinstance(from_metric, dict)
        assert_recall_close(from_metric, expected, ks)

        if ties != "expected":
            ranks = retrieval_first_hit_rank(scores, target, ignore=ignore, ties=ties)
            for q, row in enumerate(case["scores"]):  # type: ignore[arg-type]
                want = reference_first_hit_rank(
                    row,
                    case["mask"][q],
                    None if ignored is None else ignored[q],
                    ties,  # type: ignore[index]
                )
                assert int(ranks[q]) == want


class _no_warning:
    def __enter__(self) -> None:
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def _several_row_blocks_case() -> tuple[torch.Tensor, torch.Tensor]:
    """A [Q, G] mask batch larger than one CPU row block, with heavy ties, infinities,
    rows whose positives all score -inf and rows without a positive."""
    gen = torch.Generator().manual_seed(7)
    # 262 rows fit a block of the default size a thread: 3 blocks at 1 thread, 2 at 2
    num_queries, gallery = 600, 1000
    assert num_queries * gallery * 4 > budget.DENSE_BLOCK_BYTES * min(torch.get_num_threads(), 2)
    levels = torch.tensor([float("-inf"), -1.0, 0.0, 0.5, 1.0, float("inf")])
    scores = levels[torch.randint(0, len(levels), (num_queries, gallery), generator=gen)]
    mask = torch.rand(num_queries, gallery, generator=gen) < 0.01
    mask[::7] = False  # no positive
    rows = torch.arange(3, num_queries, 11)
    scores[rows] = torch.where(mask[rows], float("-inf"), scores[rows])  # positives at -inf
    return scores, mask


@pytest.mark.parametrize("ties", DETERMINISTIC_TIES)
def test_mask_path_agrees_on_a_batch_of_several_row_blocks(ties: str) -> None:
    scores, mask = _several_row_blocks_case()
    ks = (1, 5, 10, 100)
    expected = reference_recall(scores.tolist(), mask.tolist(), None, ks, ties, "neg")
    got = retrieval_recall_at_k(scores, mask, ks, ties=ties, empty_target_action="neg")
    assert isinstance(got, dict)
    assert_recall_close(got, expected, ks)
    ranks = retrieval_first_hit_rank(scores, mask, ties=ties)
    want = [
        reference_first_hit_rank(row, m, None, ties)
        for row, m in zip(scores.tolist(), mask.tolist(), strict=True)
    ]
    assert ranks.tolist() == want


def test_mask_path_counts_equal_the_select_path_for_every_count() -> None:
    """The CPU block path (no ignore) and the select path (taken with an all-False
    ignore) give the same g_>, g_> + e, p and has-positive on the case above (the
    reference enumerates tie placements, too slow for "expected" at this size)."""
    scores, mask = _several_row_blocks_case()
    need = _kernel.needed_counts("expected")
    blocks = _dense.dense_tie_counts(scores, mask, None, need)
    selects = _dense.dense_tie_counts(scores, mask, torch.zeros_like(mask), need)
    assert torch.equal(blocks.has_positive, selects.has_positive)
    has = blocks.has_positive
    assert has.any() and not has.all()
    for name in ("greater", "at_or_above", "tied_positives"):
        a, b = getattr(blocks, name), getattr(selects, name)
        assert torch.equal(a[has], b[has]), name


def test_positives_per_row_counts_every_layout_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The word-sum count of positives equals ``mask.sum(1)`` (dense rows, rows of more
    than one lane sum, row slices), is None where the layout does not allow it, and the
    block path gives the same counts with and without it."""
    gen = torch.Generator().manual_seed(3)
    for num_queries, gallery, density in [
        (3, 8, 0.5),
        (5, 127 * 8, 1.0),
        (4, 1250 * 8, 1.0),
        (6, 1000, 0.3),
        (2, 16 * 8 * 7, 0.9),
    ]:
        mask = torch.rand(num_queries, gallery, generator=gen) < density
        got = _dense._positives_per_row(mask)
        assert got is not None and torch.equal(got, mask.sum(dim=1)), (num_queries, gallery)
        got = _dense._positives_per_row(mask[1:])
        assert got is not None and torch.equal(got, mask[1:].sum(dim=1))
    mask = torch.rand(4, 1000, generator=gen) < 0.5
    assert _dense._positives_per_row(mask[:, 1 : 1001 - 8]) is None  # offset of one byte
    assert _dense._positives_per_row(mask[:, :996]) is None  # not whole words
    assert _dense._positives_per_row(torch.ones(2, 131 * 8, dtype=torch.bool)) is None  # no divisor
    wide = torch.rand(2, 1001, generator=gen) < 0.5
    assert _dense._positives_per_row(wide[:1, :1000]) is None  # one row, a row stride of 1001

    scores, mask = _several_row_blocks_case()
    need = _kernel.needed_counts("expected")
    words = _dense.dense_tie_counts(scores, mask, None, need, small_batch=0)
    monkeypatch.setattr(_dense, "_positives_per_row", lambda mask: None)
    signs = _dense.dense_tie_counts(scores, mask, None, need, small_batch=0)
    for a, b in zip(words, signs, strict=True):
        assert torch.equal(a, b)


def test_a_one_row_mask_slice_with_an_odd_row_stride_is_counted() -> None:
    """A one-row mask cut from a wider one (row stride not a multiple of 8) on the block
    path: counted as its copy is (torch's int64 view checks the row stride even for one
    row; this raised a RuntimeError before)."""
    gen = torch.Generator().manual_seed(4)
    wide = torch.rand(2, 40001, generator=gen) < 0.01
    scores = torch.randn(1, 40000, generator=gen)
    need = _kernel.needed_counts("expected")
    got = _dense.dense_tie_counts(scores, wide[:1, :40000], None, need, small_batch=0)
    want = _dense.dense_tie_counts(scores, wide[:1, :40000].clone(), None, need, small_batch=0)
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_small_batch_mask_path_counts_equal_the_other_paths(dtype: torch.dtype) -> None:
    """The small-batch mask path (bool comparisons), the CPU block path and the select
    path give the same g_>, g_> + e, p and has-positive on a small batch with heavy
    ties, infinities, positives all at -inf and rows without a positive; the index path
    of both sizes agrees on rows with one positive."""
    scores, mask = _several_row_blocks_case()
    scores, mask = scores[:32].to(dtype), mask[:32]
    assert scores.numel() <= budget.DENSE_SMALL_BATCH
    need = _kernel.needed_counts("expected")
    small = _dense.dense_tie_counts(scores, mask, None, need)
    blocks = _dense.dense_tie_counts(scores, mask, None, need, small_batch=0)
    selects = _dense.dense_tie_counts(scores, mask, torch.zeros_like(mask), need)
    has = small.has_positive
    assert has.any() and not has.all()
    for other in (blocks, selects):
        assert torch.equal(small.has_positive, other.has_positive)
        for name in ("greater", "at_or_above", "tied_positives"):
            a, b = getattr(small, name), getattr(other, name)
            assert torch.equal(a[has], b[has]), name
    # Each row's first positive alone, as a [Q] index and as a mask.
    column = torch.where(has, mask.to(torch.int64).argmax(dim=1), -1)
    single = torch.zeros_like(mask)
    single[has.nonzero().squeeze(1), column[has]] = True
    small_index = _dense.dense_tie_counts(scores, column, None, need)
    large_index = _dense.dense_tie_counts(scores, column, None, need, small_batch=0)
    small_single = _dense.dense_tie_counts(scores, single, None, need)
    for name in ("greater", "at_or_above", "tied_positives"):
        a, b, c = (getattr(x, name)[has] for x in (small_index, large_index, small_single))
        assert torch.equal(a, b) and torch.equal(a, c), name


@pytest.mark.parametrize("ties", ["pessimistic", "optimistic", "expected"])
def test_state_histogram_equals_the_outcome_records(ties: str) -> None:
    """The state update's histogram (one scatter of bins for a deterministic policy)
    equals the sum of the per-query outcome records that query_ids keeps."""
    scores, mask = _several_row_blocks_case()
    for counts in (
        _dense.dense_tie_counts(scores, mask, None, _kernel.needed_counts(ties)),
        _kernel.no_positive_counts(5, scores.device),
    ):
        for max_k in (1, 3, 10, 1000):
            hist, queries = _kernel.rank_histogram(counts, ties, max_k)
            want = _kernel.histogram_of(_kernel.query_outcomes(counts, ties, max_k), max_k)
            assert torch.equal(hist, want[0]) and torch.equal(queries, want[1])
            assert hist.dtype == want[0].dtype and queries.dtype == torch.int64


def test_worked_examples_through_the_metric() -> None:
    """The worked example of the definition: ranks [1, 1, 2, 1, 8, 3, 1, 12, 1, 4] -> R@1 0.5, R@5 0.8."""
    ranks = [1, 1, 2, 1, 8, 3, 1, 12, 1, 4]
    gallery = 20
    # Query q's true item is column 0 and exactly rank - 1 negatives score above it.
    scores = torch.full((len(ranks), gallery), -1.0)
    scores[:, 0] = 0.5
    for q, rank in enumerate(ranks):
        scores[q, 1:rank] = 1.0
    target = torch.zeros(len(ranks), dtype=torch.int64)
    assert retrieval_first_hit_rank(scores, target).tolist() == ranks
    out = RetrievalRecallAtK(k=(1, 5))
    out.update(scores, target)
    result = out.compute()
    assert isinstance(result, dict)
    assert float(result["recall@1"]) == pytest.approx(0.5)
    assert float(result["recall@5"]) == pytest.approx(0.8)


def test_negative_and_zero_scores_are_ordinary() -> None:
    """Unlike torchmetrics >= 1.7.4, scores <= 0 rank like any others."""
    scores = torch.tensor([[-0.3, -0.9, -0.5], [0.0, -1.0, -2.0]])
    target = torch.tensor([0, 0])
    assert float(retrieval_recall_at_k(scores, target, k=1)) == 1.0


def test_collapsed_model_gets_zero_with_pessimistic_ties() -> None:
    scores = torch.ones(4, 100)
    target = torch.arange(4)
    assert float(retrieval_recall_at_k(scores, target, k=1)) == 0.0
    assert float(retrieval_recall_at_k(scores, target, k=1, ties="optimistic")) == 1.0
    assert float(retrieval_recall_at_k(scores, target, k=1, ties="expected")) == pytest.approx(0.01)


def test_expected_is_exact_for_ten_million_tied_items() -> None:
    from recall_at_k._kernel import expected_hit_probability

    e = torch.tensor([10**7 - 1, 10**7 - 3, 10**7])
    p = torch.tensor([1, 3, 1])
    g = torch.tensor([0, 0, 5])
    prob = expected_hit_probability(g, e, p, 10)
    # 1 - C(e, m) / C(e + p, m) computed with exact integers.
    for q in range(3):
        for j in range(10):
            m = j + 1 - int(g[q])
            ee, pp = int(e[q]), int(p[q])
            want = 0.0 if m <= 0 else 1 - math.comb(ee, m) / math.comb(ee + pp, m)
            assert float(prob[q, j]) == pytest.approx(want, rel=1e-9, abs=1e-15)


def _check(scores: torch.Tensor, mask: torch.Tensor, ks: tuple[int, ...], **kw: object) -> None:
    """Both target forms (when one positive a row) and the mask form agree with the reference."""
    ignore = kw.pop("ignore", None)
    for ties in TIES:
        want = reference_recall(
            scores.double().tolist(),
            mask.tolist(),
            None if ignore is None else ignore.tolist(),  # type: ignore[attr-defined]
            ks,
            ties,
            "neg",
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = retrieval_recall_at_k(scores, mask, ks, ignore=ignore, ties=ties)  # type: ignore[call-overload]
        assert isinstance(got, dict)
        # pytest.approx's default tolerance: relative 1e-6, absolute 1e-12
        assert_recall_close(got, want, ks, abs=1e-12, rel=1e-6, where=ties)
        if bool((mask.sum(1) <= 1).all()):
            column = torch.where(mask.any(1), mask.int().argmax(1), -1)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                by_index = retrieval_recall_at_k(scores, column, ks, ignore=ignore, ties=ties)  # type: ignore[call-overload]
            assert by_index == got


def test_infinite_scores_are_ordinary_values() -> None:
    inf = float("inf")
    scores = torch.tensor(
        [
            [inf, inf, 0.0, -inf],
            [-inf, -inf, -inf, 1.0],
            [inf, 2.0, -inf, inf],
            [-inf, -inf, 0.0, 0.0],
        ]
    )
    mask = torch.tensor([[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 1, 0, 0]], dtype=torch.bool)
    _check(scores, mask, (1, 2, 3, 4))
    # several positives at -inf, and at +inf
    mask2 = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 1], [1, 1, 0, 0]], dtype=torch.bool)
    _check(scores, mask2, (1, 2, 3))


def test_k_larger_than_the_gallery_single_item_and_single_query() -> None:
    _check(
        torch.tensor([[0.3, 0.1, 0.2]]), torch.tensor([[0, 0, 1]], dtype=torch.bool), (1, 5, 100)
    )
    _check(torch.rand(6, 1), torch.tensor([[1], [0], [1], [1], [0], [1]], dtype=torch.bool), (1, 2))
    _check(torch.rand(1, 1), torch.ones(1, 1, dtype=torch.bool), (1,))


def test_every_item_ignored_and_all_scores_equal() -> None:
    scores = torch.ones(3, 5)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[:, 2] = True
    _check(scores, mask, (1, 3, 5), ignore=torch.ones(3, 5, dtype=torch.bool))
    _check(scores, mask, (1, 3, 5))
    assert retrieval_first_hit_rank(scores, mask).tolist() == [5, 5, 5]
    assert retrieval_first_hit_rank(scores, mask, ties="optimistic").tolist() == [1, 1, 1]


def test_non_contiguous_and_expanded_inputs() -> None:
    base = torch.randint(0, 3, (8, 12)).float()
    mask = torch.rand(8, 12) < 0.2
    _check(base.t().contiguous().t(), mask, (1, 4))  # column-major strides
    _check(base[:, ::2], mask[:, ::2], (1, 3))  # strided view
    row = torch.tensor([[0.5, 0.1, 0.5, 0.9]])
    expanded = row.expand(6, 4)  # stride 0 rows
    _check(expanded, torch.eye(6, 4, dtype=torch.bool), (1, 2, 3))
    metric = RetrievalRecallAtK(k=(1, 2))
    metric.update(expanded, torch.eye(6, 4, dtype=torch.bool).t().contiguous().t())
    assert metric.compute() == retrieval_recall_at_k(
        expanded, torch.eye(6, 4, dtype=torch.bool), (1, 2)
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_ranked_in_its_own_precision(dtype: torch.dtype) -> None:
    # 1.0 and 1.0001 are distinct in float32 but the same float16/bfloat16 value: a real tie.
    scores32 = torch.tensor([[1.0001, 1.0, 0.5]])
    target = torch.tensor([1])
    assert float(retrieval_recall_at_k(scores32, target, k=1, ties="optimistic")) == 0.0
    half = scores32.to(dtype)
    assert half[0, 0] == half[0, 1]
    assert float(retrieval_recall_at_k(half, target, k=1, ties="optimistic")) == 1.0
    assert float(retrieval_recall_at_k(half, target, k=1)) == 0.0
    assert float(retrieval_recall_at_k(half, target, k=1, ties="expected")) == 0.5
    # ... and half scores agree with the reference applied to their own values.
    scores = torch.randint(0, 4, (6, 7)).to(dtype) / 3
    _check(scores, torch.rand(6, 7) < 0.3, (1, 2, 5))


def test_value_checks_are_skipped_without_validate_args() -> None:
    metric = RetrievalRecallAtK(k=1, validate_args=False)
    metric.update(torch.tensor([[0.1, 0.5], [0.2, 0.3]]), torch.tensor([[0, 1], [1, 0]]))
    assert float(metric.compute()) == 0.5  # type: ignore[arg-type]
    # structural checks still run: they need no synchronisation
    with pytest.raises(ValueError, match=r"`scores` must be a floating point tensor"):
        metric.update(torch.ones(2, 2, dtype=torch.int64), torch.tensor([0, 1]))


def test_no_counted_query_warns_and_returns_nan() -> None:
    metric = RetrievalRecallAtK(k=(1, 5), empty_target_action="skip")
    with pytest.warns(UserWarning, match=r"No query was counted for Recall@K"):
        result = metric.compute()
    assert isinstance(result, dict)
    assert all(torch.isnan(v) for v in result.values())
    metric.update(torch.rand(2, 3), torch.tensor([-1, -1]))
    with pytest.warns(UserWarning, match=r"No query was counted"):
        metric.compute()


@pytest.mark.parametrize(
    ("position", "target_kind"),
    [
        ((0, 0), "bool"),  # on a positive
        ((1, 3), "bool"),  # on a negative
        ((4, 2), "bool"),  # in a row without a positive
        ((5, 1), "bool"),  # in a row whose positive scores -inf
        ((299, 699), "bool"),  # the last row of the second CPU row block
        ((7, 5), "int"),  # 0/1 integer mask
    ],
)
def test_nan_is_found_by_the_mask_path_itself(position: tuple[int, int], target_kind: str) -> None:
    """A [Q, G] mask without ignore takes the CPU path that detects NaN rows in its own
    pass (no separate NaN check); the error, its count and the untouched state hold."""
    scores = torch.rand(300, 700)
    mask = torch.zeros(300, 700, dtype=torch.bool)
    mask[:, 0] = True
    mask[4] = False
    scores[5, 0] = float("-inf")
    scores[position] = float("nan")
    scores[150, 10] = float("nan")
    target = mask if target_kind == "bool" else mask.to(torch.int64)
    match = r"`scores` must not contain NaN, found 2 NaN value\(s\)"
    metric = RetrievalRecallAtK(k=(1, 5))
    metric.update(torch.rand(2, 700), mask[:2])
    before = metric.rank_histogram.clone(), metric.query_counts.clone()
    with pytest.raises(ValueError, match=match):
        metric.update(scores, target)
    assert torch.equal(metric.rank_histogram, before[0])
    assert torch.equal(metric.query_counts, before[1])
    for ties in DETERMINISTIC_TIES:
        with pytest.raises(ValueError, match=match):
            retrieval_first_hit_rank(scores, target, ties=ties)
    for ties in TIES:
        with pytest.raises(ValueError, match=match):
            retrieval_recall_at_k(scores, target, ties=ties)


@pytest.mark.parametrize("ties", TIES)
def test_repeated_ids_count_once(ties: str) -> None:
    scores, target = tied_rows()
    want = retrieval_recall_at_k(scores, target, (1, 2, 4), ties=ties)
    metric = RetrievalRecallAtK((1, 2, 4), ties=ties)
    order = torch.cat([torch.arange(31), torch.tensor([0, 5, 5, 30])])  # repeats
    for rows in order.split(7):
        metric.update(scores[rows], target[rows], query_ids=rows)
    assert metric.compute() == want
    # Without ids the repeats are counted again: the number differs.
    plain = RetrievalRecallAtK((1, 2, 4), ties=ties)
    plain.update(scores[order], target[order])
    assert plain.compute() != want


def test_query_ids_and_plain_rows_count_together_and_forward_works() -> None:
    scores, target = tied_rows()
    metric = RetrievalRecallAtK((1, 3))
    batch_value = metric(scores[:10], target[:10], query_ids=torch.arange(10))
    assert batch_value == retrieval_recall_at_k(scores[:10], target[:10], (1, 3))
    metric(scores[:10], target[:10], query_ids=torch.arange(10))  # all repeats
    metric.update(scores[10:], target[10:])  # rows without ids: complete, distinct
    assert metric.compute() == retrieval_recall_at_k(scores, target, (1, 3))


@pytest.mark.parametrize("with_ignore", [False, True])
def test_index_path_in_row_blocks_counts_equal_the_one_pass_counts(with_ignore: bool) -> None:
    """The CPU index path counts in blocks of rows (several blocks here, the last one
    short) and gives the same g_>, g_> + e, p and has-positive as the bool comparisons
    over the whole batch, with heavy ties, infinities, rows without a positive and,
    optionally, ignored items (the positive itself among them in some rows)."""
    scores, mask = _several_row_blocks_case()
    has = mask.any(dim=1)
    column = torch.where(has, mask.to(torch.int64).argmax(dim=1), -1)
    ignore = None
    if with_ignore:
        ignore = torch.rand(scores.shape, generator=torch.Generator().manual_seed(3)) < 0.05
        ignore[5::13, :] = False
        rows = torch.arange(0, scores.shape[0], 17)
        ignore[rows, column[rows].clamp(min=0)] = True  # an ignored positive
    need = _kernel.needed_counts("expected")
    whole = _dense.dense_tie_counts(scores, column, ignore, need, small_batch=10**9)
    for block_bytes in (1, 7 * 1000 * 4, 10**9):
        blocks = _dense.dense_tie_counts(
            scores, column, ignore, need, small_batch=0, block_bytes=block_bytes
        )
        assert torch.equal(whole.has_positive, blocks.has_positive)
        valid = whole.has_positive
        for name in ("greater", "at_or_above", "tied_positives"):
            a, b = getattr(whole, name), getattr(blocks, name)
            assert torch.equal(a[valid], b[valid]), (name, block_bytes)
