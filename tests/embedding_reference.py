"""Brute-force EmbeddingRecallAtK: every rule of its definition applied literally.

The items of all updates are laid end to end; each role's members are listed in order,
skipping an item whose id was already listed in that role; the full score matrix is
computed in float64; and for every (query, gallery item) pair the ignore rule is
evaluated on its own: the same sample (the same item, or both carry the same id), or
the exclusion rule. The rows then go to :func:`reference.reference_recall`, which sorts
each query's gallery literally.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from reference import reference_recall
from torch import Tensor


@dataclass(frozen=True)
class Item:
    position: int
    embedding: tuple[float, ...]
    label: int
    role: str
    group: int | None
    id: int | None


@dataclass(frozen=True)
class Batch:
    """The arguments of one ``update`` call."""

    embeddings: Tensor
    labels: Tensor
    role: str = "both"
    groups: Tensor | None = None
    ids: Tensor | None = None

    def kwargs(self) -> dict[str, object]:
        return {"role": self.role, "groups": self.groups, "ids": self.ids}


def items_of(batches: Sequence[Batch]) -> list[Item]:
    items: list[Item] = []
    for batch in batches:
        for i in range(batch.embeddings.shape[0]):
            items.append(
                Item(
                    position=len(items),
                    embedding=tuple(float(v) for v in batch.embeddings[i].tolist()),
                    label=int(batch.labels[i]),
                    role=batch.role,
                    group=None if batch.groups is None else int(batch.groups[i]),
                    id=None if batch.ids is None else int(batch.ids[i]),
                )
            )
    return items


def members(items: Sequence[Item], roles: tuple[str, ...]) -> list[Item]:
    """Items playing a role, in order; an id seen before in this role is skipped."""
    out: list[Item] = []
    seen: set[int] = set()
    for item in items:
        if item.role not in roles:
            continue
        if item.id is not None:
            if item.id in seen:
                continue
            seen.add(item.id)
        out.append(item)
    return out


def score(q: Item, g: Item, similarity: str | Callable[[Tensor, Tensor], Tensor]) -> float:
    a = torch.tensor(q.embedding, dtype=torch.float64)
    b = torch.tensor(g.embedding, dtype=torch.float64)
    if callable(similarity):
        return float(similarity(a.unsqueeze(0), b.unsqueeze(0))[0, 0])
    if similarity == "dot":
        return float(a @ b)
    if similarity == "euclidean":
        return -float(((a - b) ** 2).sum())
    norm_a = max(math.sqrt(float(a @ a)), 1e-12)
    norm_b = max(math.sqrt(float(b @ b)), 1e-12)
    return float(a @ b) / (norm_a * norm_b)


def ignored(q: Item, g: Item, exclude: str) -> bool:
    if q.position == g.position:
        return True
    if q.id is not None and g.id is not None and q.id == g.id:
        return True
    if exclude == "same_group":
        return q.group == g.group
    if exclude == "same_label_and_group":
        return q.label == g.label and q.group == g.group
    return False


def direction_recall(
    queries: Sequence[Item],
    gallery: Sequence[Item],
    ks: Sequence[int],
    similarity: str | Callable[[Tensor, Tensor], Tensor],
    exclude: str,
    ties: str,
    empty_target_action: str,
) -> list[float]:
    scores = [[score(q, g, similarity) for g in gallery] for q in queries]
    relevant = [[q.label == g.label for g in gallery] for q in queries]
    ignore = [[ignored(q, g, exclude) for g in gallery] for q in queries]
    return reference_recall(scores, relevant, ignore, ks, ties, empty_target_action)


def reference_embedding_recall(
    batches: Sequence[Batch],
    ks: Sequence[int],
    *,
    similarity: str | Callable[[Tensor, Tensor], Tensor] = "cosine",
    exclude: str = "none",
    bidirectional: bool = False,
    directions: tuple[str, str] = ("q2g", "g2q"),
    ties: str = "pessimistic",
    empty_target_action: str = "neg",
) -> dict[str, float]:
    """``{key: value}`` with the metric's keys for a sequence of ``k`` values."""
    items = items_of(batches)
    as_query, as_gallery = ("query", "both"), ("gallery", "both")
    plan = [(directions[0], as_query, as_gallery)]
    if bidirectional:
        plan.append((directions[1], as_gallery, as_query))
    out: dict[str, float] = {}
    for name, query_roles, gallery_roles in plan:
        values = direction_recall(
            members(items, query_roles),
            members(items, gallery_roles),
            ks,
            similarity,
            exclude,
            ties,
            empty_target_action,
        )
        prefix = f"{name}/" if bidirectional else ""
        for k, value in zip(ks, values, strict=True):
            out[f"{prefix}recall@{k}"] = value
    return out
