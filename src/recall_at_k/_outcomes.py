"""Per-query outcomes (``query_outcomes()``): which query was hit at which K.

Every input form ends in one outcome record a query (:func:`recall_at_k._kernel.query_outcomes`:
an int64 histogram bin, or for ``"expected"`` float64 first-hit probabilities); this
module turns the records of identified queries into :class:`QueryOutcomes`, following
``empty_target_action`` as ``compute()`` does, so that ``hits.mean(0)`` is ``compute()``'s
value of each K.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from recall_at_k import _items
from recall_at_k._kernel import first_of_each_id
from recall_at_k._result import no_positive_error
from recall_at_k.ranking.plan import Side


class QueryOutcomes(NamedTuple):
    """Each counted query's outcome, from the synchronised state.

    Attributes:
        ids: int64 ``[Q]`` query ids, ascending for the retrieval forms (the dense form's
            ``query_ids``, the flat form's ``indexes``); for embeddings the ``ids`` given
            to ``update``, or without them the position of the query among the items of
            its role, in the order of the (gathered) state.
        hits: float64 ``[Q, number of K]``: hit@K of each query for each K, in the order
            of ``ks``; 0 or 1, and under ``ties="expected"`` the probability of a hit.
            ``hits.mean(0)`` is ``compute()``'s Recall@K.
        first_hit_rank: the first-hit rank under the tie policy, capped at max K + 1
            (a later hit, or none): ``1 + sum over K' = 1..max K of (1 - P(hit@K'))``,
            int64 ``[Q]`` for ``"pessimistic"`` and ``"optimistic"``; for ``"expected"``
            that sum is the expected capped rank, float64 ``[Q]``.
        ks: the K of each column of ``hits``.
        keys: ``compute()``'s key of each column of ``hits``, or None when ``compute()``
            returns one tensor (an int ``k``).
    """

    ids: Tensor
    hits: Tensor
    first_hit_rank: Tensor
    ks: tuple[int, ...]
    keys: tuple[str, ...] | None


def from_records(
    ids: Tensor,
    records: Tensor,
    ks: tuple[int, ...],
    max_k: int,
    empty_target_action: str,
    keys: Sequence[str] | None,
) -> QueryOutcomes:
    """:class:`QueryOutcomes` of identified queries from their outcome records.

    A query without a valid positive is a miss (``"neg"``: rank max K + 1), a hit at
    every K (``"pos"``: rank 1), left out (``"skip"``), or an error (``"error"``), as in
    ``compute()``.
    """
    if records.is_floating_point():
        no_positive = records[:, max_k] > 0.5
        cdf = records[:, :max_k].cumsum(dim=1).clamp(max=1.0)
    else:
        no_positive = records == max_k + 1
        ranks = torch.arange(1, max_k + 1, device=records.device)
        cdf = (records.unsqueeze(1) < ranks).to(torch.float64)
    if empty_target_action == "error" and bool(no_positive.any()):
        raise no_positive_error(int(no_positive.sum()))
    if empty_target_action == "pos":
        cdf = torch.where(no_positive.unsqueeze(1), 1.0, cdf)
    elif empty_target_action in ("skip", "error"):
        keep = ~no_positive
        ids, cdf = ids[keep], cdf[keep]
    rank = 1 + (1 - cdf).sum(dim=1)
    if not records.is_floating_point():
        rank = rank.round().to(torch.int64)
    columns = torch.tensor([k - 1 for k in ks], dtype=torch.int64, device=cdf.device)
    hits = cdf.index_select(1, columns)
    return QueryOutcomes(ids.to(torch.int64), hits, rank, ks, None if keys is None else tuple(keys))


def by_id(ids: Tensor, records: Tensor) -> tuple[Tensor, Tensor]:
    """Records sorted by id, the first record of each id kept (padded repeats)."""
    if ids.numel() == 0:
        return ids, records
    keep = first_of_each_id(ids)
    return ids[keep], records[keep]


def embedding_outcomes(
    meta: Tensor,
    direction: int,
    queries: Side | None,
    records: Tensor | None,
    ks: tuple[int, ...],
    max_k: int,
    empty_target_action: str,
    keys: Sequence[str] | None,
) -> QueryOutcomes:
    """:class:`QueryOutcomes` of one direction of ``EmbeddingRecallAtK``.

    Args:
        meta: the stored items' metadata (:mod:`recall_at_k._items`).
        direction: 0 (query -> gallery) or 1 (gallery -> query).
        queries: the direction's queries (None: nothing was ranked).
        records: their outcome records, in the order of ``queries``.
    """
    device = meta.device
    if queries is None or records is None:
        width = (len(ks),)
        ids = torch.zeros(0, dtype=torch.int64, device=device)
        empty = torch.zeros((0, *width), dtype=torch.float64, device=device)
        return QueryOutcomes(ids, empty, ids.clone(), ks, None if keys is None else tuple(keys))
    flags = meta[:, _items.FLAGS]
    has_id = (flags[queries.rows] & _items.HAS_ID) != 0
    with_ids = int(has_id.sum())
    if with_ids == has_id.numel():
        ids = meta[queries.rows, _items.ID]
    elif with_ids == 0:
        role = _items.IS_QUERY if direction == 0 else _items.IS_GALLERY
        plays_role = ((flags & role) != 0).to(torch.int64)
        ids = (plays_role.cumsum(0) - 1)[queries.rows]
    else:
        raise ValueError(
            f"`ids`: {with_ids} of {has_id.numel()} queries were added with `ids` and the"
            " others without; query_outcomes() identifies queries by their ids, or by"
            " their positions when none has one: pass `ids` in every update (or in none)"
        )
    ids, records = by_id(ids, records)
    return from_records(ids, records, ks, max_k, empty_target_action, keys)
