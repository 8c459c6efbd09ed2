"""Functional Recall@K: what the metrics' ``compute()`` returns, in one call (a scalar
tensor for an int ``k``, else a dict ``{"recall@K": value}`` in the order given).

Example:
    Ranks [1, 1, 2, 1, 8, 3, 1, 12, 1, 4] give R@1 = 0.5 and R@5 = 0.8:

    >>> import torch
    >>> from recall_at_k.functional import recall_at_k_from_ranks
    >>> ranks = torch.tensor([1, 1, 2, 1, 8, 3, 1, 12, 1, 4])
    >>> recall_at_k_from_ranks(ranks, k=(1, 5))
    {'recall@1': tensor(0.5000), 'recall@5': tensor(0.8000)}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import SupportsIndex, overload

import torch
from torch import Tensor

from recall_at_k import _dense, _embedding_checks, _items, _kernel
from recall_at_k._checks import (
    check_choice,
    check_k,
    check_key,
    check_positive_int,
    refuse_torchmetrics_names,
)
from recall_at_k._result import format_output, recall_values
from recall_at_k._types import (
    DETERMINISTIC_TIES,
    EMPTY_TARGET_ACTIONS,
    EXCLUDES,
    TIES,
    DeterministicTies,
    EmptyTargetAction,
    Exclude,
    RecallOutput,
    Similarity,
    Ties,
)
from recall_at_k.ranking import engine as _engine
from recall_at_k.ranking import plan as _plan
from recall_at_k.ranking import progress as _progress
from recall_at_k.ranking.stored import StoredRows

__all__ = [
    "embedding_recall_at_k",
    "recall_at_k_from_ranks",
    "retrieval_first_hit_rank",
    "retrieval_recall_at_k",
]

K = SupportsIndex | Sequence[SupportsIndex]


@refuse_torchmetrics_names
def retrieval_first_hit_rank(
    scores: Tensor,
    target: Tensor,
    *,
    ignore: Tensor | None = None,
    ties: DeterministicTies = "pessimistic",
    validate_args: bool = True,
) -> Tensor:
    """1-based rank of each query's best valid positive among its valid items.

    One or two passes over the scores; no sort of the gallery.

    Args:
        scores: float ``[Q, G]``, higher is more similar; one row per query.
        target: bool, 0/1 integer or 0/1 float ``[Q, G]`` relevance, or integer ``[Q]``
            column of the single true item (``-1``: none in this gallery).
        ignore: optional bool ``[Q, G]``: items removed from that query's gallery.
        ties: ``"pessimistic"`` (rank = g_> + e + 1) or ``"optimistic"`` (rank = g_> + 1).
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
    check_choice("ties", ties, DETERMINISTIC_TIES)
    needed = _kernel.needed_counts(ties)
    counts = _dense.tie_counts(scores, target, ignore, needed, validate_args)
    return _kernel.first_hit_rank(counts, ties)


@overload
def retrieval_recall_at_k(
    scores: Tensor,
    target: Tensor,
    k: SupportsIndex,
    *,
    ignore: Tensor | None = None,
    ties: Ties = "pessimistic",
    empty_target_action: EmptyTargetAction = "neg",
    key: str = "recall@{k}",
    validate_args: bool = True,
) -> Tensor: ...


@overload
def retrieval_recall_at_k(
    scores: Tensor,
    target: Tensor,
    k: Sequence[SupportsIndex] = (1, 5, 10),
    *,
    ignore: Tensor | None = None,
    ties: Ties = "pessimistic",
    empty_target_action: EmptyTargetAction = "neg",
    key: str = "recall@{k}",
    validate_args: bool = True,
) -> dict[str, Tensor]: ...


@refuse_torchmetrics_names
def retrieval_recall_at_k(
    scores: Tensor,
    target: Tensor,
    k: K = (1, 5, 10),
    *,
    ignore: Tensor | None = None,
    ties: Ties = "pessimistic",
    empty_target_action: EmptyTargetAction = "neg",
    key: str = "recall@{k}",
    validate_args: bool = True,
) -> RecallOutput:
    """Recall@K of dense scores: the same output as ``RetrievalRecallAtK.compute()``.

    Args:
        scores: float ``[Q, G]``, higher is more similar; one row per complete query.
        target: bool, 0/1 integer or 0/1 float ``[Q, G]`` relevance, or integer ``[Q]``
            column of the single true item (``-1``: none in this gallery).
        k: an int (returns a scalar tensor) or a sequence of ints (returns a dict).
        ignore: optional bool ``[Q, G]``: items neither positive nor negative.
        ties: ``"pessimistic"``, ``"optimistic"`` or ``"expected"``.
        empty_target_action: a query without a valid positive counts as ``"neg"`` (a
            miss), ``"pos"`` (a hit), ``"skip"`` or ``"error"``.
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
    ks, single = check_k(k)
    check_choice("ties", ties, TIES)
    check_choice("empty_target_action", empty_target_action, EMPTY_TARGET_ACTIONS)
    keys = check_key(key, ks)
    needed = _kernel.needed_counts(ties)
    counts = _dense.tie_counts(scores, target, ignore, needed, validate_args)
    hist, queries = _kernel.rank_histogram(counts, ties, max(ks))
    values, _ = recall_values(hist, queries, ks, empty_target_action)
    return format_output(values, keys, single)


@overload
def recall_at_k_from_ranks(
    ranks: Tensor | Sequence[int], k: SupportsIndex, *, key: str = "recall@{k}"
) -> Tensor: ...


@overload
def recall_at_k_from_ranks(
    ranks: Tensor | Sequence[int], k: Sequence[SupportsIndex], *, key: str = "recall@{k}"
) -> dict[str, Tensor]: ...


@refuse_torchmetrics_names
def recall_at_k_from_ranks(
    ranks: Tensor | Sequence[int], k: K, *, key: str = "recall@{k}"
) -> RecallOutput:
    """Recall@K from 1-based first-hit ranks: the share of ranks in ``[1, K]``. A rank below 1
    (the 0 :func:`retrieval_first_hit_rank` gives a query without a positive) is a miss.

    Example:
        Ten queries with 6 hits at rank 1 and 9 within rank 5:

        >>> from recall_at_k.functional import recall_at_k_from_ranks
        >>> recall_at_k_from_ranks([1, 1, 1, 1, 1, 1, 2, 3, 5, 9], k=(1, 5))
        {'recall@1': tensor(0.6000), 'recall@5': tensor(0.9000)}
    """
    ks, single = check_k(k)
    keys = check_key(key, ks)
    ranks = torch.as_tensor(ranks)
    if ranks.dim() != 1 or ranks.dtype == torch.bool or ranks.is_floating_point():
        raise ValueError(
            f"`ranks` must be a 1-D integer tensor of ranks, got shape {list(ranks.shape)}"
            f" and dtype {ranks.dtype}"
        )
    thresholds = torch.tensor(ks, device=ranks.device).unsqueeze(-1)
    hits = ((ranks >= 1) & (ranks <= thresholds)).sum(dim=-1)
    return format_output(hits.to(torch.float64) / ranks.numel(), keys, single)  # 0/0: NaN


@overload
def embedding_recall_at_k(
    queries: Tensor,
    query_labels: Tensor,
    gallery: Tensor | None,
    gallery_labels: Tensor | None,
    k: SupportsIndex,
    *,
    query_groups: Tensor | None = None,
    gallery_groups: Tensor | None = None,
    query_ids: Tensor | None = None,
    gallery_ids: Tensor | None = None,
    similarity: Similarity = "cosine",
    exclude: Exclude = "none",
    ties: Ties = "pessimistic",
    empty_target_action: EmptyTargetAction = "neg",
    chunk_bytes: int = 256 * 2**20,
    key: str = "recall@{k}",
    validate_args: bool = True,
    progress: bool = False,
) -> Tensor: ...


@overload
def embedding_recall_at_k(
    queries: Tensor,
    query_labels: Tensor,
    gallery: Tensor | None = None,
    gallery_labels: Tensor | None = None,
    *,
    k: SupportsIndex,
    query_groups: Tensor | None = None,
    gallery_groups: Tensor | None = None,
    query_ids: Tensor | None = None,
    gallery_ids: Tensor | None = None,
    similarity: Similarity = "cosine",
    exclude: Exclude = "none",
    ties: Ties = "pessimistic",
    empty_target_action: EmptyTargetAction = "neg",
    chunk_bytes: int = 256 * 2**20,
    key: str = "recall@{k}",
    validate_args: bool = True,
    progress: bool = False,
) -> Tensor: ...


@overload
def embedding_recall_at_k(
    queries: Tensor,
    query_labels: Tensor,
    gallery: Tensor | None = None,
    gallery_labels: Tensor | None = None,
    k: Sequence[SupportsIndex] = (1, 5, 10),
    *,
    query_groups: Tensor | None = None,
    gallery_groups: Tensor | None = None,
    query_ids: Tensor | None = None,
    gallery_ids: Tensor | None = None,
    similarity: Similarity = "cosine",
    exclude: Exclude = "none",
    ties: Ties = "pessimistic",
    empty_target_action: EmptyTargetAction = "neg",
    chunk_bytes: int = 256 * 2**20,
    key: str = "recall@{k}",
    validate_args: bool = True,
    progress: bool = False,
) -> dict[str, Tensor]: ...


@refuse_torchmetrics_names
def embedding_recall_at_k(
    queries: Tensor,
    query_labels: Tensor,
    gallery: Tensor | None = None,
    gallery_labels: Tensor | None = None,
    k: K = (1, 5, 10),
    *,
    query_groups: Tensor | None = None,
    gallery_groups: Tensor | None = None,
    query_ids: Tensor | None = None,
    gallery_ids: Tensor | None = None,
    similarity: Similarity = "cosine",
    exclude: Exclude = "none",
    ties: Ties = "pessimistic",
    empty_target_action: EmptyTargetAction = "neg",
    chunk_bytes: int = 256 * 2**20,
    key: str = "recall@{k}",
    validate_args: bool = True,
    progress: bool = False,
) -> RecallOutput:
    """Recall@K of query embeddings ranked against a gallery, in one call.

    The ranking of ``EmbeddingRecallAtK.compute()``: a query is relevant to gallery items of
    its label, never retrieves itself, and the ``Q x G`` matrix is never built (tiles of at
    most ``chunk_bytes``). ``gallery=None`` is leave-one-out over ``queries``; otherwise
    ``queries`` are ranked against ``gallery`` (re-ID splits, image -> text retrieval).

    Args:
        queries: float ``[Q, D]``.
        query_labels: integer ``[Q]`` (class, identity, image id).
        gallery: float ``[G, D]``, or None for leave-one-out.
        gallery_labels: integer ``[G]``, with ``gallery``.
        k: an int (returns a scalar tensor) or a sequence of ints (returns a dict).
        query_groups: integer ``[Q]`` (camera, source photo, ...), for ``exclude``.
        gallery_groups: integer ``[G]``, for ``exclude`` with a gallery.
        query_ids: integer ``[Q]`` sample ids: a gallery item with a query's id is that
            query and is ignored; a query id repeated counts once.
        gallery_ids: integer ``[G]`` sample ids (a repeated one counts once), in the
            queries' id space: overlap only where a query and an item are one sample.
        similarity: ``"cosine"``, ``"dot"``, ``"euclidean"`` (negative squared L2) or a
            callable ``(queries [T, D], gallery [G, D]) -> scores [T, G]``.
        exclude: ``"none"``, ``"same_group"`` or ``"same_label_and_group"`` (the
            Market-1501 "junk" rule); needs the groups.
        ties: ``"pessimistic"``, ``"optimistic"`` or ``"expected"``.
        empty_target_action: ``"neg"``, ``"pos"``, ``"skip"`` or ``"error"``.
        chunk_bytes: upper bound of the bytes of one tile of scores.
        key: template of the dict keys.
        validate_args: check that embeddings are finite (reads values on the host).
        progress: a tqdm progress bar on stderr over the queries ranked (needs tqdm).

    Example:
        Leave-one-out over four items of two classes, then two queries against a gallery:

        >>> import torch
        >>> from recall_at_k.functional import embedding_recall_at_k
        >>> items = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [0.6, 0.8]])
        >>> embedding_recall_at_k(items, torch.tensor([0, 0, 1, 1]), k=(1, 2))
        {'recall@1': tensor(0.5000), 'recall@2': tensor(1.)}
        >>> embedding_recall_at_k(items[:2], torch.tensor([0, 1]), items[2:],
        ...                       torch.tensor([1, 0]), k=1)
        tensor(0.5000)
    """
    ks, single = check_k(k)
    check_choice("ties", ties, TIES)
    check_choice("empty_target_action", empty_target_action, EMPTY_TARGET_ACTIONS)
    keys = check_key(key, ks)
    _embedding_checks.check_similarity(similarity)
    check_choice("exclude", exclude, EXCLUDES)
    chunk_bytes = check_positive_int("chunk_bytes", chunk_bytes)
    progress = _progress.check_progress(progress)
    query_names = ("queries", "query_labels", "query_groups", "query_ids")
    _embedding_checks.check_batch(queries, query_labels, query_groups, query_ids, query_names)
    sides = [(queries, query_labels, query_groups, query_ids)]
    if gallery is None:
        names = ("gallery_labels", "gallery_groups", "gallery_ids")
        for name, value in zip(names, (gallery_labels, gallery_groups, gallery_ids), strict=True):
            if value is not None:
                raise ValueError(
                    f"`{name}` was given without `gallery`: pass `gallery` too, or leave"
                    f" `{name}` out for leave-one-out over `queries`"
                )
    else:
        if gallery_labels is None:
            raise ValueError("`gallery_labels` are required with `gallery`")
        sides.append((gallery, gallery_labels, gallery_groups, gallery_ids))
        gallery_names = ("gallery", "gallery_labels", "gallery_groups", "gallery_ids")
        _embedding_checks.check_batch(*sides[1], gallery_names)
        if gallery.shape[1] != queries.shape[1] or gallery.device != queries.device:
            raise ValueError(
                f"`gallery` must have the width and device of `queries` ({queries.shape[1]},"
                f" {queries.device}), got {gallery.shape[1]}, {gallery.device}"
            )
    if exclude != "none" and any(side[2] is None for side in sides):
        raise ValueError(
            f"`query_groups` and `gallery_groups` are required with exclude={exclude!r}"
        )
    if validate_args:
        for name, side in zip(("queries", "gallery"), sides, strict=False):
            _embedding_checks.check_finite(side[0], name)
    roles = ("both",) if gallery is None else ("query", "gallery")
    meta = [_items.metadata(*side[1:], role, 0) for side, role in zip(sides, roles, strict=True)]
    items = _items.items_of(torch.cat(meta))
    rows = StoredRows([side[0] for side in sides], queries.shape[1])
    planned = _plan.make_plan(rows, items, _plan.directions(items, 1), exclude, chunk_bytes)  # type: ignore[arg-type]
    _plan.prepare(planned, similarity)
    opts = _engine.RankOptions(similarity, exclude, ties, max(ks), validate_args, progress=progress)
    ranked = _engine.rank(planned, opts)[0]
    assert ranked is not None
    values, _ = recall_values(ranked.hist, ranked.queries, ks, empty_target_action)
    return format_output(values, keys, single)
