"""Extreme but legal inputs of the dense form, each checked against the reference."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import TIES, assert_recall_close
from reference import reference_recall

from recall_at_k import RetrievalRecallAtK
from recall_at_k.functional import retrieval_first_hit_rank, retrieval_recall_at_k


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
            got = retrieval_recall_at_k(scores, mask, ks, ignore=ignore, ties=ties)  # type: ignore[arg-type]
        assert isinstance(got, dict)
        # pytest.approx's default tolerance: relative 1e-6, absolute 1e-12
        assert_recall_close(got, want, ks, abs=1e-12, rel=1e-6, where=ties)
        if bool((mask.sum(1) <= 1).all()):
            column = torch.where(mask.any(1), mask.int().argmax(1), -1)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                by_index = retrieval_recall_at_k(scores, column, ks, ignore=ignore, ties=ties)  # type: ignore[arg-type]
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
    assert float(retrieval_recall_at_k(scores32, target, k=1, ties="optimistic")) == 0.0  # type: ignore[arg-type]
    half = scores32.to(dtype)
    assert half[0, 0] == half[0, 1]
    assert float(retrieval_recall_at_k(half, target, k=1, ties="optimistic")) == 1.0  # type: ignore[arg-type]
    assert float(retrieval_recall_at_k(half, target, k=1)) == 0.0  # type: ignore[arg-type]
    assert float(retrieval_recall_at_k(half, target, k=1, ties="expected")) == 0.5  # type: ignore[arg-type]
    # ... and half scores agree with the reference applied to their own values.
    scores = torch.randint(0, 4, (6, 7)).to(dtype) / 3
    _check(scores, torch.rand(6, 7) < 0.3, (1, 2, 5))
