"""Every input error of the dense form and of the constructor, with its message."""

from __future__ import annotations

import pytest
import torch
from helpers import DETERMINISTIC_TIES, TIES

from recall_at_k import RetrievalRecallAtK
from recall_at_k.functional import (
    retrieval_first_hit_rank,
    retrieval_recall_at_k,
)

S = torch.rand(3, 4)
T = torch.tensor([0, 1, -1])


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
