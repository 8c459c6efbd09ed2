"""The plan of a ranking, built once by :func:`make_plan`:

- each direction's sides: its queries and its gallery, each item once per sample
  identity (ids repeated within a role count once; an item without an id is alone);
- the ranking's order: the first direction's gallery, then the second's items not placed
  yet, then every other item, each part sorted by label, so that each gallery is one run
  of rows, a label one run;
- the one copy of the embeddings in that order (:attr:`Plan.embeddings`), every bit kept,
  normalised in place for ``"cosine"`` by :func:`prepare`; none when sharded;
- the labels and groups in that order, int32 where they fit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from recall_at_k._types import Similarity
from recall_at_k.ranking.budget import Budget, budget, wide_rows
from recall_at_k.ranking.score import prepare_rows
from recall_at_k.ranking.stored import BroadcastRows, StoredRows

QUERY, GALLERY = 1, 2
"""The role bits of :attr:`Items.roles`."""


class Items(NamedTuple):
    """What a ranking needs to know of every stored item, in stored order."""

    labels: Tensor  # int64 [N]
    groups: Tensor  # int64 [N] (zeros where none was given)
    ids: Tensor  # int64 [N]
    has_id: Tensor  # bool [N]
    roles: Tensor  # int64 [N]: QUERY | GALLERY bits


class Side(NamedTuple):
    """The items of one side of a direction: their rows and sample identities."""

    rows: Tensor
    identity: Tensor


Direction = tuple[Side, Side]
"""A direction's (queries, gallery)."""


class Plan(NamedTuple):
    """What every ranking of the same stored items starts from (see the module)."""

    embeddings: Tensor | None  # [N, D] the ordered copy; None when sharded
    rows: StoredRows | BroadcastRows  # where the stored rows are read from
    labels: Tensor  # [N] in the plan's order
    groups: Tensor  # [N] (a view of the labels where nothing reads the groups)
    directions: list[Direction | None]  # sides in the plan's rows
    budget: Budget


def identities(ids: Tensor, has_id: Tensor) -> Tensor:
    """A sample identity per item: items sharing an id share it, an item without id is
    alone. Identities are ``0..n-1``, the ids' in ascending order first."""
    num = ids.shape[0]
    identity = torch.empty(num, dtype=torch.int64, device=ids.device)
    sorted_ids, order = torch.sort(ids[has_id])
    distinct, inverse_sorted = torch.unique_consecutive(sorted_ids, return_inverse=True)
    inverse = torch.empty_like(inverse_sorted)
    inverse[order] = inverse_sorted
    identity[has_id] = inverse
    without = (~has_id).nonzero().view(-1)
    identity[without] = distinct.shape[0] + torch.arange(without.shape[0], device=ids.device)
    return identity


def select(plays_role: Tensor, identity: Tensor) -> Side:
    """The items playing a role, the first item of each identity kept."""
    num, rows = identity.shape[0], plays_role.nonzero().view(-1)
    ident = identity[rows]
    first = torch.full((num,), num, dtype=torch.int64, device=identity.device)
    first.scatter_reduce_(0, ident, rows, reduce="amin")
    keep = first[ident] == rows
    return Side(rows[keep], ident[keep])


def directions(items: Items, count: int) -> list[Direction | tuple[int, str] | None]:
    """The first ``count`` directions' sides in stored rows, or ``(direction, what)`` naming the
    side it lacks (``"queries"`` or ``"gallery"``), or None when there are no items."""
    if items.labels.numel() == 0:
        return [None] * count
    identity = identities(items.ids, items.has_id)
    roles = [(QUERY, GALLERY), (GALLERY, QUERY)]
    out: list[Direction | tuple[int, str] | None] = []
    seen: list[Tensor] = []

    def narrow(values: Tensor) -> Tensor:
        """int32 where the items allow; an equal tensor held once."""
        for other in seen:
            if other.shape == values.shape and torch.equal(other, values):
                return other
        seen.append(values.to(torch.int32) if items.labels.shape[0] < 2**31 else values)
        return seen[-1]

    for index, (query, gallery) in enumerate(roles[:count]):
        queries = select((items.roles & query) != 0, identity)
        items_ = select((items.roles & gallery) != 0, identity)
        if queries.rows.numel() == 0:
            out.append((index, "queries"))
        elif items_.rows.numel() == 0:
            out.append((index, "gallery"))
        else:
            sides = [Side(narrow(s.rows), narrow(s.identity)) for s in (queries, items_)]
            out.append((sides[0], sides[1]))
    return out


def ranking_order(labels: Tensor, directions: Sequence[Direction | None]) -> Tensor:
    """The stored row of each row of the ranking's order (see the module)."""
    placed = torch.zeros(labels.shape[0], dtype=torch.bool, device=labels.device)
    parts = []
    for sides in [*filter(None, directions), None]:  # the galleries, then the rest
        rows = (~placed).nonzero().view(-1) if sides is None else sides[1].rows.long()
        rows = rows[~placed[rows]]
        parts.append(rows[torch.sort(labels[rows], stable=True)[1]])
        placed[rows] = True
    return torch.cat(parts)


def narrow_columns(labels: Tensor, groups: Tensor | None) -> tuple[Tensor, Tensor]:
    """Labels and groups int32 where every value fits (they are only compared and sorted),
    new tensors; the groups a view of the labels when None (nothing reads them)."""
    columns = labels.unsqueeze(0) if groups is None else torch.stack([labels, groups])
    dtype = torch.int64
    if columns.numel():
        low, high = (int(v) for v in torch.aminmax(columns))
        dtype = torch.int32 if low >= -(2**31) and high < 2**31 else torch.int64
    columns = columns.to(dtype, copy=True)
    return columns[0], columns[0] if groups is None else columns[1]


def make_plan(
    rows: StoredRows | BroadcastRows,
    items: Items,
    sides: Sequence[Direction | None],
    exclude: str,
    chunk_bytes: int,
    sharded: bool = False,
) -> Plan:
    """The plan of ranking ``sides`` (from :func:`directions`) of the stored ``rows`` and their
    ``items``: the ordered copy (none when ``sharded``), labels, groups, sides renumbered."""
    num, width = rows.shape
    plan_budget = budget(chunk_bytes, num, width)
    groups = items.groups if exclude != "none" else None
    if sharded:
        labels, group_column = narrow_columns(items.labels, groups)
        return Plan(None, rows, labels, group_column, list(sides), plan_budget)
    order = ranking_order(items.labels, sides)
    narrow = torch.int32 if num < 2**31 else torch.int64
    position = torch.empty(num, dtype=narrow, device=order.device)
    position[order] = torch.arange(num, dtype=narrow, device=order.device)
    labels, group_column = narrow_columns(
        items.labels[order], None if groups is None else groups[order]
    )
    dtype = torch.promote_types(rows.dtype, torch.float32)
    copy = torch.empty((num, width), dtype=dtype, device=rows.device)
    for first, part in rows.runs(plan_budget.row_block_rows(8)):
        copy.index_copy_(0, position[first : first + part.shape[0]].long(), part.to(dtype))
    renumbered: dict[int, Tensor] = {}

    def renumber(side: Side) -> Side:
        if id(side.rows) not in renumbered:  # a side two directions share, once
            renumbered[id(side.rows)] = position[side.rows.long()].to(side.rows.dtype)
        return Side(renumbered[id(side.rows)], side.identity)

    planned: list[Direction | None] = [
        None if s is None else (renumber(s[0]), renumber(s[1])) for s in sides
    ]
    return Plan(copy, rows, labels, group_column, planned, plan_budget)


def prepare(plan: Plan, similarity: Similarity) -> None:
    """Normalise the ordered copy in place for ``"cosine"`` (each row's value depends on
    that row alone), :func:`wide_rows` rows at a time through one float64 buffer (torch's
    own threads share each block: worker threads, each a task this small, cost more)."""
    embeddings = plan.embeddings
    if similarity != "cosine" or embeddings is None:
        return
    step = wide_rows(embeddings.shape[1], plan.budget.row_block_rows(), embeddings.device)
    wide = embeddings.new_empty((step, embeddings.shape[1]), dtype=torch.float64)
    for start in range(0, embeddings.shape[0], step):
        part = embeddings[start : start + step]
        prepare_rows(part, similarity, embeddings.dtype, out=part, wide=wide[: part.shape[0]])
