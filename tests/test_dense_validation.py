"""Every input error of the dense form and of the constructor, with its message."""

from __future__ import annotations

import pytest
import torch
from helpers import DETERMINISTIC_TIES, TIES

from recall_at_k import RetrievalRecallAtK
from recall_at_k.functional import (
    recall_at_k_from_ranks,
    retrieval_first_hit_rank,
    retrieval_recall_at_k,
)

S = torch.rand(3, 4)
T = torch.tensor([0, 1, -1])


@pytest.mark.parametrize(
    ("k", "match"),
    [
        ((), r"`k` must not be empty"),
        ((1, 5, 1), r"`k` must not contain duplicates"),
        ((1, 2.0), r"`k` must contain only ints, got 2.0"),
        ((1, True), r"`k` must contain only ints, got True"),
        (0, r"`k` values must be >= 1, got 0"),
        ((5, -1), r"`k` values must be >= 1, got -1"),
        ("5", r"`k` must be a positive int or a sequence"),
        (2.5, r"`k` must be a positive int or a sequence"),
        (True, r"`k` must be a positive int or a sequence"),
    ],
)
def test_bad_k_at_construction(k: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RetrievalRecallAtK(k=k)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        retrieval_recall_at_k(S, T, k=k)  # type: ignore[arg-type]


def test_bad_options() -> None:
    with pytest.raises(ValueError, match=r"`ties` must be one of 'pessimistic', 'optimistic'"):
        RetrievalRecallAtK(ties="random")
    with pytest.raises(ValueError, match=r"`empty_target_action` must be one of 'neg'"):
        RetrievalRecallAtK(empty_target_action="drop")
    with pytest.raises(ValueError, match=r"`key` must give a distinct key for every K"):
        RetrievalRecallAtK(key="recall")
    with pytest.raises(ValueError, match=r"`ignore_index` must be an int or None, got 1.5"):
        RetrievalRecallAtK(ignore_index=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`ties` must be one of 'pessimistic', 'optimistic', got"):
        retrieval_first_hit_rank(S, T, ties="expected")


@pytest.mark.parametrize(
    ("scores", "target", "ignore", "match"),
    [
        (
            torch.randint(0, 5, (3, 4)),
            T,
            None,
            r"`scores` must be a floating point tensor of shape \[Q, G\], got shape \[3, 4\] and dtype torch.int64",
        ),
        (
            torch.rand(2, 3, 4),
            T,
            None,
            r"`scores` must be a floating point .* got shape \[2, 3, 4\]",
        ),
        (
            S,
            torch.tensor([0, 1]),
            None,
            r"`target` of one dimension must be a signed integer \(int64\) tensor of shape \[Q\] = \[3\].*got shape \[2\]",
        ),
        (
            S,
            torch.tensor([0.0, 1.0, 2.0]),
            None,
            r"`target` of one dimension .* dtype torch.float32",
        ),
        (
            S,
            torch.tensor([True, False, True]),
            None,
            r"`target` of one dimension .* dtype torch.bool",
        ),
        (
            S,
            torch.zeros(3, 5, dtype=torch.bool),
            None,
            r"`target` of two dimensions must be a bool or 0/1 integer tensor of the same shape as `scores` \[3, 4\], got shape \[3, 5\]",
        ),
        (S, torch.zeros(3, 4), None, r"`target` of two dimensions .* dtype torch.float32"),
        (
            S,
            torch.zeros(3, 4, 1, dtype=torch.bool),
            None,
            r"`target` must be a \[Q, G\] bool/0-1 mask or a \[Q\] int64 column index",
        ),
        (
            S,
            T,
            torch.zeros(3, 4),
            r"`ignore` must be a bool tensor of the same shape as `scores` \[3, 4\], got shape \[3, 4\] and dtype torch.float32",
        ),
        (
            S,
            T,
            torch.zeros(4, 3, dtype=torch.bool),
            r"`ignore` must be a bool tensor .* got shape \[4, 3\]",
        ),
        (
            S,
            T,
            torch.zeros(3, 4, dtype=torch.bool, device="meta"),
            r"`ignore` is on device meta but `scores` is on cpu",
        ),
        (S, T.to("meta"), None, r"`target` is on device meta but `scores` is on cpu"),
        (S, [0, 1, 2], None, r"`target` must be a torch.Tensor, got list"),
        (
            torch.tensor([[0.1, float("nan")], [0.2, 0.3]]),
            torch.tensor([0, 1]),
            None,
            r"`scores` must not contain NaN, found 1 NaN value\(s\)",
        ),
        (
            S,
            torch.tensor([0, 4, -1]),
            None,
            r"`target` column indices must lie in \[-1, 4\) \(the gallery has 4 items; -1 = no true item\), got values in \[-1, 4\]",
        ),
        (
            S,
            torch.tensor([0, -2, 1]),
            None,
            r"`target` column indices must lie in \[-1, 4\).*got values in \[-2, 1\]",
        ),
        (
            S,
            torch.tensor([[0, 1, 2, 0]] * 3),
            None,
            r"`target` mask values must be 0 or 1, got 3 other value\(s\), e.g. 2",
        ),
    ],
)
def test_bad_dense_inputs(scores: object, target: object, ignore: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RetrievalRecallAtK().update(scores, target, ignore=ignore)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        retrieval_recall_at_k(scores, target, ignore=ignore)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        retrieval_first_hit_rank(scores, target, ignore=ignore)  # type: ignore[arg-type]


def test_value_checks_are_skipped_without_validate_args() -> None:
    metric = RetrievalRecallAtK(k=1, validate_args=False)
    metric.update(torch.tensor([[0.1, 0.5], [0.2, 0.3]]), torch.tensor([[0, 1], [1, 0]]))
    assert float(metric.compute()) == 0.5  # type: ignore[arg-type]
    # structural checks still run: they need no synchronisation
    with pytest.raises(ValueError, match=r"`scores` must be a floating point tensor"):
        metric.update(torch.ones(2, 2, dtype=torch.int64), torch.tensor([0, 1]))


def test_empty_target_error_names_the_count() -> None:
    metric = RetrievalRecallAtK(k=1, empty_target_action="error")
    metric.update(torch.rand(4, 3), torch.tensor([0, -1, -1, 2]))
    with pytest.raises(ValueError, match=r"2 queries had no valid positive target"):
        metric.compute()
    metric.reset()
    metric.update(torch.rand(4, 3), torch.tensor([0, -1, 1, 2]))
    with pytest.raises(ValueError, match=r"1 query had no valid positive target"):
        metric.compute()


def test_no_counted_query_warns_and_returns_nan() -> None:
    metric = RetrievalRecallAtK(k=(1, 5), empty_target_action="skip")
    with pytest.warns(UserWarning, match=r"No query was counted for Recall@K"):
        result = metric.compute()
    assert isinstance(result, dict)
    assert all(torch.isnan(v) for v in result.values())
    metric.update(torch.rand(2, 3), torch.tensor([-1, -1]))
    with pytest.warns(UserWarning, match=r"No query was counted"):
        metric.compute()


def test_bad_ranks() -> None:
    with pytest.raises(
        ValueError, match=r"`ranks` must be a 1-D integer tensor of ranks, got shape \[2, 2\]"
    ):
        recall_at_k_from_ranks(torch.ones(2, 2), k=1)
    with pytest.raises(ValueError, match=r"`ranks` must be a 1-D integer tensor .* torch.bool"):
        recall_at_k_from_ranks(torch.ones(2, dtype=torch.bool), k=1)
    with pytest.raises(ValueError, match=r"`k` must not be empty"):
        recall_at_k_from_ranks([1, 2], k=())
    with pytest.raises(ValueError, match=r"`key` must be a str template such as"):
        recall_at_k_from_ranks([1, 2], k=1, key=5)  # type: ignore[arg-type]


def test_one_dimensional_preds_without_indexes_points_to_the_flat_form() -> None:
    with pytest.raises(
        ValueError,
        match=r"`preds` of shape \[4\] is the flat form: pass the query ids too, `update\(preds, target, indexes\)`",
    ):
        RetrievalRecallAtK()(torch.rand(4), torch.tensor([0, 1, 0, 0]))
    with pytest.raises(ValueError, match=r"`scores` must be a floating point .* got shape \[3\]"):
        retrieval_recall_at_k(torch.rand(3), T)


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
