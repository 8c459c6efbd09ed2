"""Functional Recall@K: validate, then call the kernel.

Example:
    The worked examples of the design: ranks [1, 1, 2, 1, 8, 3, 1, 12, 1, 4] give
    R@1 = 0.5 and R@5 = 0.8.

    >>> import torch
    >>> from recall_at_k.functional import recall_at_k_from_ranks
    >>> ranks = torch.tensor([1, 1, 2, 1, 8, 3, 1, 12, 1, 4])
    >>> recall_at_k_from_ranks(ranks, k=(1, 5))
    {'recall@1': tensor(0.5000), 'recall@5': tensor(0.8000)}
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from recall_at_k import _kernel
from recall_at_k._result import RecallOutput, format_recall, recall_result
from recall_at_k._validation import (
    _checked_dense_tie_counts,
    _dense_structure_validation,
    _empty_target_action_validation,
    _k_validation,
    _key_validation,
    _ties_validation,
)

__all__ = ["recall_at_k_from_ranks", "retrieval_first_hit_rank", "retrieval_recall_at_k"]


def retrieval_first_hit_rank(
    scores: Tensor,
    target: Tensor,
    *,
    ignore: Tensor | None = None,
    ties: str = "pessimistic",
    validate_args: bool = True,
) -> Tensor:
    """1-based rank of each query's best valid positive among its valid items.

    One or two passes over the scores; no sort of the gallery.

    Args:
        scores: float ``[Q, G]``, higher is more similar; one row per query.
        target: bool or 0/1 integer ``[Q, G]`` relevance, or int64 ``[Q]`` column of the
            single true item (``-1``: none in this gallery).
        ignore: optional bool ``[Q, G]``: items removed from that query's gallery.
        ties: ``"pessimistic"`` (rank = g_> + e + 1, ties count against the query) or
            ``"optimistic"`` (rank = g_> + 1).
        validate_args: check values (NaN, target range); costs a host synchronisation.

    Returns:
        int64 ``[Q]``; 0 for a query without a valid positive.

    Example:
        >>> import torch
        >>> from recall_at_k.functional import retrieval_first_hit_rank
        >>> scores = torch.tensor([[0.9, 0.5, 0.5], [0.2, 0.1, 0.8]])
        >>> target = torch.tensor([1, 0])
        >>> retrieval_first_hit_rank(scores, target)
        tensor([3, 2])
        >>> retrieval_first_hit_rank(scores, target, ties="optimistic")
        tensor([2, 2])
    """
    _ties_validation(ties, allowed=("pessimistic", "optimistic"))
    _dense_structure_validation(scores, target, ignore)
    counts = _checked_dense_tie_counts(
        scores, target, ignore, _kernel.needs_for(ties), validate_args
    )
    return _kernel.first_hit_rank(counts, ties)


def retrieval_recall_at_k(
    scores: Tensor,
    target: Tensor,
    k: int | Sequence[int] = (1, 5, 10),
    *,
    ignore: Tensor | None = None,
    ties: str = "pessimistic",
    empty_target_action: str = "neg",
    key: str = "recall@{k}",
    validate_args: bool = True,
) -> RecallOutput:
    """Recall@K of dense scores: the same output as ``RetrievalRecallAtK.compute()``.

    Args:
        scores: float ``[Q, G]``, higher is more similar; one row per complete query.
        target: bool or 0/1 integer ``[Q, G]`` relevance, or int64 ``[Q]`` column of the
            single true item (``-1``: none in this gallery).
        k: an int (returns a scalar tensor) or a sequence of ints (returns a dict).
        ignore: optional bool ``[Q, G]``: items neither positive nor negative.
        ties: ``"pessimistic"``, ``"optimistic"`` or ``"expected"`` (DESIGN section 1).
        empty_target_action: what a query without a valid positive counts as:
            ``"neg"`` (a miss), ``"pos"`` (a hit), ``"skip"`` or ``"error"``.
        key: template of the dict keys.
        validate_args: check values (NaN, target range); costs a host synchronisation.

    Example:
        >>> import torch
        >>> from recall_at_k.functional import retrieval_recall_at_k
        >>> scores = torch.tensor([[0.9, 0.1, 0.4], [0.3, 0.8, 0.5], [0.2, 0.6, 0.6]])
        >>> target = torch.tensor([0, 2, 1])
        >>> retrieval_recall_at_k(scores, target, k=(1, 2))
        {'recall@1': tensor(0.3333), 'recall@2': tensor(1.)}
        >>> retrieval_recall_at_k(scores, target, k=1, ties="expected")
        tensor(0.5000)
    """
    ks = _k_validation(k)
    _ties_validation(ties)
    _empty_target_action_validation(empty_target_action)
    _key_validation(key)
    _dense_structure_validation(scores, target, ignore)
    counts = _checked_dense_tie_counts(
        scores, target, ignore, _kernel.needs_for(ties), validate_args
    )
    hist, queries = _kernel.rank_histogram(counts, ties, max(ks))
    return recall_result(hist, queries, ks, isinstance(k, int), key, empty_target_action)


def recall_at_k_from_ranks(
    ranks: Tensor | Sequence[int], k: int | Sequence[int], *, key: str = "recall@{k}"
) -> RecallOutput:
    """Recall@K from 1-based first-hit ranks: the share of ranks in ``[1, K]``.

    A rank below 1 (such as the 0 that :func:`retrieval_first_hit_rank` gives a query
    without a positive) means no match and counts as a miss.

    Example:
        Ten queries with 6 hits at rank 1 and 9 within rank 5:

        >>> from recall_at_k.functional import recall_at_k_from_ranks
        >>> recall_at_k_from_ranks([1, 1, 1, 1, 1, 1, 2, 3, 5, 9], k=(1, 5))
        {'recall@1': tensor(0.6000), 'recall@5': tensor(0.9000)}
    """
    ks = _k_validation(k)
    _key_validation(key)
    ranks = torch.as_tensor(ranks)
    if ranks.dim() != 1 or ranks.dtype == torch.bool:
        raise ValueError(
            f"`ranks` must be a 1-D tensor of ranks, got shape {list(ranks.shape)}"
            f" and dtype {ranks.dtype}"
        )
    thresholds = torch.tensor(ks, device=ranks.device).unsqueeze(-1)
    hits = ((ranks >= 1) & (ranks <= thresholds)).sum(dim=-1)
    if ranks.numel() == 0:
        values = torch.full((len(ks),), float("nan"), device=ranks.device)
    else:
        values = hits.to(torch.float64) / ranks.numel()
    return format_recall(values, ks, isinstance(k, int), key)
