"""Per-query outcomes (``query_outcomes()``): which query was hit at which K, as
:class:`QueryOutcomes`, following ``empty_target_action`` as ``compute()`` does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from recall_at_k import _items
from recall_at_k._checks import INTEGER_DTYPES, describe
from recall_at_k._kernel import first_of_each_id
from recall_at_k._result import no_positive_error
from recall_at_k.ranking.plan import Side


class QueryOutcomes(NamedTuple):
    """Each counted query's outcome, from the synchronised state.

    Attributes:
        ids: int64 ``[Q]`` query ids, ascending for the retrieval forms (dense ``query_ids``,
            flat ``indexes``); for embeddings the ``ids`` given to ``update``, or else the
            query's position among the items of its role in the (gathered) state.
        hits: float64 ``[Q, number of K]``: hit@K of each query for each K of ``ks``; 0 or
            1, under ``ties="expected"`` the probability of a hit. ``hits.mean(0)`` is
            ``compute()``'s Recall@K.
        first_hit_rank: the first-hit rank under the tie policy, capped at max K + 1:
            ``1 + sum over K' = 1..max K of (1 - P(hit@K'))``, int64 ``[Q]``, or for
            ``"expected"`` the expected capped rank, float64 ``[Q]``.
        ks: the K of each column of ``hits``.
        keys: ``compute()``'s key of each column of ``hits``, or None when ``compute()``
            returns one tensor (an int ``k``).
        labels: for ``EmbeddingRecallAtK``, int64 ``[Q]`` labels in the order of ``ids``;
            None for ``RetrievalRecallAtK``, whose queries have none."""

    ids: Tensor
    hits: Tensor
    first_hit_rank: Tensor
    ks: tuple[int, ...]
    keys: tuple[str, ...] | None
    labels: Tensor | None = None

    def grouped(self, groups: Tensor | None) -> dict[int, dict[str, Tensor]]:
        """Recall@K of each group of queries: per class with ``outcomes.labels``, per camera,
        domain or any other partition with an integer tensor ``[Q]``.

        Each group's value is the mean of its queries' ``hits``: what ``compute()`` returns for
        those queries alone against the same gallery, under the same rules (under ``"skip"`` a
        group whose queries were all skipped does not appear; under ``ties="expected"``,
        expected recalls).

        Args:
            groups: integer ``[Q]``, one group value per query in the order of ``ids``
                (``outcomes.labels`` per class; a value stored per sample looked up by id,
                e.g. ``camera_of_id[outcomes.ids]``).

        Returns:
            One entry per distinct group value (a Python ``int``), ascending, each a dict of
            Recall@K keyed as ``compute()``'s dict (``"recall@{k}"`` for an int ``k``), float
            tensors of the default dtype on ``hits``' device. No value is NaN; no queries give
            an empty dict.

        Example:
            Per class: class 0 is found less often than class 1.

            >>> import torch
            >>> from recall_at_k import EmbeddingRecallAtK
            >>> metric = EmbeddingRecallAtK(k=(1, 2))
            >>> embeddings = torch.tensor(
            ...     [[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [0.6, 0.8], [0.3, 0.95]]
            ... )
            >>> metric.update(embeddings, torch.tensor([0, 0, 1, 1, 1]))
            >>> outcomes = metric.query_outcomes()
            >>> outcomes.labels
            tensor([0, 0, 1, 1, 1])
            >>> for label, recall in outcomes.grouped(outcomes.labels).items():
            ...     print(label, recall)
            0 {'recall@1': tensor(0.5000), 'recall@2': tensor(0.5000)}
            1 {'recall@1': tensor(0.6667), 'recall@2': tensor(1.)}
            >>> metric.compute()
            {'recall@1': tensor(0.6000), 'recall@2': tensor(0.8000)}
        """
        values = _checked_groups(groups, self.ids).to(self.hits.device)
        keys = self.keys if self.keys is not None else tuple(f"recall@{k}" for k in self.ks)
        distinct, inverse = torch.unique(values, sorted=True, return_inverse=True)
        sums = self.hits.new_zeros((distinct.numel(), self.hits.shape[1]), dtype=torch.float64)
        sums.index_add_(0, inverse, self.hits.to(torch.float64))
        counts = torch.bincount(inverse, minlength=distinct.numel())
        recall = (sums / counts.unsqueeze(1)).to(torch.get_default_dtype())
        return {
            group: {key: recall[row, column] for column, key in enumerate(keys)}
            for row, group in enumerate(distinct.tolist())
        }


def _checked_groups(groups: object, ids: Tensor) -> Tensor:
    """``groups`` of :meth:`QueryOutcomes.grouped`: an integer ``[Q]`` tensor."""
    length = ids.shape[0]
    if groups is None:
        raise ValueError(
            "`groups` is None: these outcomes carry no `labels` (only"
            " EmbeddingRecallAtK's query_outcomes() has each query's label); pass an"
            f" integer tensor of shape [{length}] with each query's group, in the order"
            " of `ids`"
        )
    if not isinstance(groups, Tensor):
        raise ValueError(
            f"`groups` must be a torch.Tensor of integers, shape [{length}], got"
            f" {type(groups).__name__}; pass torch.as_tensor(groups)"
        )
    if groups.dtype not in INTEGER_DTYPES:
        raise ValueError(
            f"`groups` must be an integer (int64) tensor, one group value per query, got"
            f" {describe(groups)}; pass `groups.long()` for whole-number values"
        )
    if groups.dim() != 1 or groups.shape[0] != length:
        raise ValueError(
            f"`groups` must have shape [{length}], one group value per query in the"
            f" order of `ids`, got {describe(groups)}; take each query's group by its id,"
            " e.g. `group_of_id[outcomes.ids]`"
        )
    return groups.to(torch.int64)


def from_records(
    ids: Tensor,
    records: Tensor,
    ks: tuple[int, ...],
    max_k: int,
    empty_target_action: str,
    keys: Sequence[str] | None,
    labels: Tensor | None = None,
) -> QueryOutcomes:
    """:class:`QueryOutcomes` of identified queries from their outcome records (embeddings:
    ``labels`` row for row); queries without a valid positive as in ``compute()``."""
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
        labels = None if labels is None else labels[keep]
    rank = 1 + (1 - cdf).sum(dim=1)
    if not records.is_floating_point():
        rank = rank.round().to(torch.int64)
    columns = torch.tensor([k - 1 for k in ks], dtype=torch.int64, device=cdf.device)
    hits = cdf.index_select(1, columns)
    keys_kept = None if keys is None else tuple(keys)
    labels_kept = None if labels is None else labels.to(torch.int64)
    return QueryOutcomes(ids.to(torch.int64), hits, rank, ks, keys_kept, labels_kept)


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
    """:class:`QueryOutcomes` of ``EmbeddingRecallAtK``'s direction 0 or 1 from the items'
    ``meta``, the direction's ``queries`` (None: nothing ranked) and their ``records``."""
    if queries is None or records is None:
        none = torch.zeros(0, dtype=torch.int64, device=meta.device)
        return from_records(none, none, ks, max_k, empty_target_action, keys, none)
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
    labels = meta[queries.rows, _items.LABEL]
    if ids.numel():
        keep = first_of_each_id(ids)
        ids, records, labels = ids[keep], records[keep], labels[keep]
    return from_records(ids, records, ks, max_k, empty_target_action, keys, labels)
