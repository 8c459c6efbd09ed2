"""Dense form with query_ids: padded repeats count once, on one process or several."""

from __future__ import annotations

import pytest
import torch
from helpers import TIES, tied_rows

from recall_at_k import RetrievalRecallAtK
from recall_at_k.functional import retrieval_recall_at_k


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
