"""Brute-force EmbeddingRecallAtK: every rule of its definition applied literally.

The items of all updates are laid end to end; each role's members are listed in order,
skipping an item whose id was already listed in that role; the full score matrix is
computed in float64; and for every (query, gallery item) pair the ignore rule is
evaluated on its own: the same sample (the same item, or both carry the same id), or
the exclusion rule. The rows then go to :func:`reference.reference_recall`, which sorts
each query's gallery literally.

Below the reference: the scenarios it is checked on (``SCENARIOS``, each returning the
batches and the metric's options) and :func:`run_metric`, the metric on a scenario.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from reference import reference_recall
from torch import Tensor

from recall_at_k import EmbeddingRecallAtK
from recall_at_k._kernel import Workspace, recall_from_histogram
from recall_at_k.ranking import blocks, engine, plan
from recall_at_k.ranking import score as ranking_score
from recall_at_k.ranking.stored import StoredRows

Route = tuple[engine.Mode, int]
"""How the engine walks the blocks (its mode) and the ``chunk_bytes`` that sizes them."""

ROUTES: tuple[Route, ...] = (
    ("auto", 256 * 2**20),
    ("panels", 256 * 2**20),
    ("panels", 2**14),  # panels of a few columns
    ("tiles", 256 * 2**20),  # whole rows of scores, as on a GPU
    ("tiles", 2**12),
    ("squares", 2**13),  # squares narrower than a label
    ("squares", 2**16),  # spans of whole labels
)
"""Every way the engine walks one block, at a few sizes."""


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

    def take(self, rows: slice | Tensor) -> Batch:
        """The same call restricted to ``rows`` of every tensor."""
        return Batch(
            self.embeddings[rows],
            self.labels[rows],
            self.role,
            None if self.groups is None else self.groups[rows],
            None if self.ids is None else self.ids[rows],
        )


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


def fl32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float64).to(torch.float32))


def prepared_row(vector: Sequence[float], similarity: str) -> list[float]:
    """The stored float32 row as the score sees it: for cosine, fl32(x / sqrt(S)) with S
    the float64 sum of squares in order."""
    if similarity != "cosine":
        return list(vector)
    total = 0.0
    for value in vector:
        total += value * value
    norm = max(math.sqrt(total), 1e-12)
    return [fl32(value / norm) for value in vector]


def canonical_score(q: Sequence[float], g: Sequence[float], similarity: str) -> float:
    """The float64 sum over d in order of q_d g_d, or of (q_d - g_d)^2, negated."""
    total = 0.0
    if similarity == "euclidean":
        for a, b in zip(q, g, strict=True):
            total += (a - b) * (a - b)
        return -total
    for a, b in zip(q, g, strict=True):
        total += a * b
    return total


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


def canonical_embedding_recall(
    batches: Sequence[Batch], ks: Sequence[int], *, similarity: str, ties: str = "pessimistic"
) -> dict[str, float]:
    """:func:`reference_embedding_recall` (one direction, no exclusion, ``"neg"``) on the
    canonical score instead of the float64 one: each stored row as the score sees it
    (:func:`prepared_row`), then :func:`canonical_score` pair by pair."""
    items = items_of(batches)
    queries = members(items, ("query", "both"))
    gallery = members(items, ("gallery", "both"))
    rows = {item.position: prepared_row(item.embedding, similarity) for item in items}
    scores = [
        [canonical_score(rows[q.position], rows[g.position], similarity) for g in gallery]
        for q in queries
    ]
    relevant = [[q.label == g.label for g in gallery] for q in queries]
    ignore = [[ignored(q, g, "none") for g in gallery] for q in queries]
    values = reference_recall(scores, relevant, ignore, ks, ties, "neg")
    return {f"recall@{k}": value for k, value in zip(ks, values, strict=True)}


# ---------------------------------------------------------------- scenarios

KS = (1, 2, 5, 10)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def signs(n: int, d: int, g: torch.Generator) -> Tensor:
    """+-1 vectors of width 16: every cosine is a multiple of 1/16, exact in float32."""
    return torch.randint(0, 2, (n, d), generator=g).float() * 2 - 1


def small_ints(n: int, d: int, g: torch.Generator) -> Tensor:
    """Small integers: dot products and squared distances are exact and often tie.

    No row is all zeros (its dot products would all tie, and the brute-force "expected"
    enumeration of a tie block that large would take hours).
    """
    values = torch.randint(-1, 3, (n, d), generator=g).float()
    values[(values == 0).all(dim=1), 0] = 1.0
    return values


def split(emb: Tensor, labels: Tensor, sizes: list[int], **extra: Any) -> list[Batch]:
    batches, start = [], 0
    for size in sizes:
        part = {
            k: (v[start : start + size] if isinstance(v, Tensor) else v) for k, v in extra.items()
        }
        batches.append(Batch(emb[start : start + size], labels[start : start + size], **part))
        start += size
    return batches


def leave_one_out_continuous() -> tuple[list[Batch], dict[str, Any]]:
    g = gen(1)
    emb = torch.randn(48, 8, generator=g)
    labels = torch.randint(0, 5, (48,), generator=g)
    labels[47] = 9  # a class of one: that query has no positive
    return split(emb, labels, [20, 1, 27]), {"similarity": "cosine"}


def leave_one_out_tied_cosine() -> tuple[list[Batch], dict[str, Any]]:
    g = gen(2)
    emb = signs(36, 16, g)
    emb[30:] = emb[:6]  # exact duplicates (different samples: no ids)
    labels = torch.randint(0, 4, (36,), generator=g)
    return split(emb, labels, [17, 19]), {"similarity": "cosine"}


def leave_one_out_tied_dot() -> tuple[list[Batch], dict[str, Any]]:
    g = gen(3)
    emb = small_ints(40, 4, g)
    labels = torch.randint(0, 5, (40,), generator=g)
    return split(emb, labels, [25, 15]), {"similarity": "dot"}


def leave_one_out_tied_euclidean() -> tuple[list[Batch], dict[str, Any]]:
    g = gen(4)
    emb = small_ints(40, 3, g)
    labels = torch.randint(0, 3, (40,), generator=g)
    return split(emb, labels, [40]), {"similarity": "euclidean"}


def leave_one_out_padded_ids() -> tuple[list[Batch], dict[str, Any]]:
    """DistributedSampler-style padding: the first items again, with their ids."""
    g = gen(5)
    emb = small_ints(30, 4, g)
    labels = torch.randint(0, 4, (30,), generator=g)
    ids = torch.arange(100, 130)
    pad = [0, 3, 7, 11]
    emb = torch.cat([emb, emb[pad]])
    labels = torch.cat([labels, labels[pad]])
    ids = torch.cat([ids, ids[pad]])
    return split(emb, labels, [16, 18], ids=ids), {"similarity": "dot"}


def _query_gallery(exclude: str, seed: int) -> tuple[list[Batch], dict[str, Any]]:
    g = gen(seed)
    q_emb, g_emb = small_ints(22, 4, g), small_ints(44, 4, g)
    q_lab = torch.randint(0, 7, (22,), generator=g)  # labels 6 never in the gallery
    g_lab = torch.randint(0, 6, (44,), generator=g)
    q_grp, g_grp = torch.randint(0, 3, (22,), generator=g), torch.randint(0, 3, (44,), generator=g)
    batches = [
        Batch(q_emb[:9], q_lab[:9], "query", q_grp[:9]),
        Batch(g_emb[:30], g_lab[:30], "gallery", g_grp[:30]),
        Batch(q_emb[9:], q_lab[9:], "query", q_grp[9:]),
        Batch(g_emb[30:], g_lab[30:], "gallery", g_grp[30:]),
    ]
    return batches, {"similarity": "dot", "exclude": exclude}


def query_gallery_same_group() -> tuple[list[Batch], dict[str, Any]]:
    return _query_gallery("same_group", 6)


def query_gallery_junk() -> tuple[list[Batch], dict[str, Any]]:
    return _query_gallery("same_label_and_group", 7)


def leave_one_out_same_group() -> tuple[list[Batch], dict[str, Any]]:
    g = gen(8)
    emb = signs(40, 16, g)
    labels = torch.randint(0, 5, (40,), generator=g)
    groups = torch.randint(0, 4, (40,), generator=g)
    return split(emb, labels, [13, 27], groups=groups), {"exclude": "same_group"}


def cross_modal() -> tuple[list[Batch], dict[str, Any]]:
    """Eight images, five captions each; the dataset yields the image once per caption."""
    g = gen(9)
    images = small_ints(8, 4, g)
    image_ids = torch.arange(8).repeat_interleave(5)
    captions = images[image_ids] + torch.randint(-1, 2, (40, 4), generator=g).float()
    repeated = images[image_ids]
    batches = [
        Batch(repeated[:15], image_ids[:15], "query", ids=image_ids[:15]),
        Batch(captions[:15], image_ids[:15], "gallery"),
        Batch(repeated[15:], image_ids[15:], "query", ids=image_ids[15:]),
        Batch(captions[15:], image_ids[15:], "gallery"),
    ]
    kwargs = {"similarity": "dot", "bidirectional": True, "directions": ("i2t", "t2i")}
    return batches, kwargs


def mixed_roles_with_ids() -> tuple[list[Batch], dict[str, Any]]:
    """Roles mixed; a query and a gallery item sharing an id are one sample."""
    g = gen(10)
    emb = small_ints(30, 4, g)
    labels = torch.randint(0, 4, (30,), generator=g)
    ids = torch.arange(30)
    ids[20:25] = ids[:5]  # gallery items 20..24 are the queries 0..4 again
    batches = [
        Batch(emb[:10], labels[:10], "query", ids=ids[:10]),
        Batch(emb[10:20], labels[10:20], "both", ids=ids[10:20]),
        Batch(emb[20:], labels[20:], "gallery", ids=ids[20:]),
        Batch(emb[25:28], labels[25:28], "both"),  # without ids: samples of their own
    ]
    return batches, {"similarity": "euclidean", "bidirectional": True}


def _tanh_similarity(q: Tensor, g: Tensor) -> Tensor:
    return torch.tanh(q @ g.T / 4).round(decimals=1)


def callable_similarity() -> tuple[list[Batch], dict[str, Any]]:
    g = gen(11)
    emb = small_ints(30, 4, g)
    labels = torch.randint(0, 4, (30,), generator=g)
    return split(emb, labels, [30]), {"similarity": _tanh_similarity}


SCENARIOS: dict[str, Callable[[], tuple[list[Batch], dict[str, Any]]]] = {
    f.__name__: f
    for f in (
        leave_one_out_continuous,
        leave_one_out_tied_cosine,
        leave_one_out_tied_dot,
        leave_one_out_tied_euclidean,
        leave_one_out_padded_ids,
        leave_one_out_same_group,
        query_gallery_same_group,
        query_gallery_junk,
        cross_modal,
        mixed_roles_with_ids,
        callable_similarity,
    )
}


def run_metric(
    batches: list[Batch], ks: Any = KS, route: Route | None = None, **kwargs: Any
) -> dict[str, float]:
    """The metric's result on ``batches`` (``route``: through the engine's interface,
    in that mode and ``chunk_bytes``)."""
    if route is not None:
        return engine_recall(batches, ks, route, **kwargs)
    metric = EmbeddingRecallAtK(ks, **kwargs)
    for batch in batches:
        metric.update(batch.embeddings, batch.labels, **batch.kwargs())
    result = metric.compute()
    assert isinstance(result, dict)
    return {key: float(value) for key, value in result.items()}


ROLE_BITS = {"query": plan.QUERY, "gallery": plan.GALLERY, "both": plan.QUERY | plan.GALLERY}


def engine_recall(
    batches: Sequence[Batch],
    ks: Any = KS,
    route: Route = ("auto", 256 * 2**20),
    *,
    similarity: Any = "cosine",
    exclude: str = "none",
    ties: str = "pessimistic",
    empty_target_action: str = "neg",
    bidirectional: bool = False,
    directions: tuple[str, str] = ("q2g", "g2q"),
    chunk_bytes: int | None = None,
    near_duplicate: float | None = None,
    validate_args: bool = True,
    raw: bool = False,
) -> dict[str, float]:
    """Recall@K of ``batches`` through the engine's interface (plan, prepare, rank),
    as the metric ranks them, walking the blocks in ``route``'s mode (``raw``: the
    engine's rankings themselves)."""
    ks = (ks,) if isinstance(ks, int) else tuple(ks)
    mode, route_bytes = route
    chunk = route_bytes if chunk_bytes is None else chunk_bytes
    zeros = [torch.zeros(b.labels.shape[0], dtype=torch.int64) for b in batches]
    items = plan.Items(
        torch.cat([b.labels.long() for b in batches]),
        torch.cat(
            [
                z if b.groups is None else b.groups.long()
                for b, z in zip(batches, zeros, strict=False)
            ]
        ),
        torch.cat(
            [z if b.ids is None else b.ids.long() for b, z in zip(batches, zeros, strict=False)]
        ),
        torch.cat([z.bool() | (b.ids is not None) for b, z in zip(batches, zeros, strict=False)]),
        torch.cat([z + ROLE_BITS[b.role] for b, z in zip(batches, zeros, strict=False)]),
    )
    rows = StoredRows(
        [
            b.embeddings.float() if b.embeddings.dtype != torch.float64 else b.embeddings
            for b in batches
        ],
        batches[0].embeddings.shape[1],
    )
    count = 2 if bidirectional else 1
    sides = plan.directions(items, count)
    assert all(not isinstance(s, tuple) or not isinstance(s[1], str) for s in sides), sides
    planned = plan.make_plan(rows, items, sides, exclude, chunk)  # type: ignore[arg-type]
    plan.prepare(planned, similarity)
    options = engine.RankOptions(
        similarity, exclude, ties, max(ks), validate_args, near_duplicate, False, mode
    )
    rankings = engine.rank(planned, options)
    if raw:
        return rankings  # type: ignore[return-value]
    out: dict[str, float] = {}
    for index, ranked in enumerate(rankings):
        assert ranked is not None
        values, _, _ = recall_from_histogram(ranked.hist, ranked.queries, ks, empty_target_action)
        values = values.to(torch.get_default_dtype())  # as the metric returns them
        prefix = f"{directions[index]}/" if bidirectional else ""
        out.update({f"{prefix}recall@{k}": float(v) for k, v in zip(ks, values, strict=False)})
    return out


def fast_and_canonical(
    embeddings: Tensor, similarity: str, queries: int, width: int, tile_bytes: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """|fast - canonical| per pair (fast scores from tiles of ``queries`` rows and
    panels of ``width`` columns, each product in a tile of ``tile_bytes``), and each
    query's bound, ``[Q, G]`` and ``[Q, 1]``."""
    prepared = ranking_score.prepare_rows(embeddings, similarity, torch.float32)  # type: ignore[arg-type]
    num, dim = prepared.shape
    stats = blocks.statistics(
        similarity,  # type: ignore[arg-type]
        lambda: iter([prepared]),
        lambda: iter([prepared]),
        num,
        dim,
        prepared.dtype,
        prepared.device,
        blocks.Reduce(None),
        max(1, num),
    )
    fast_rows = prepared.to(stats.dtype)
    labels = torch.zeros(num, dtype=torch.int64)
    gallery = blocks.gallery_block(prepared, fast_rows, labels, labels, torch.arange(num), stats)
    centred = fast_rows if stats.centre is None else fast_rows - stats.centre
    bound = blocks.bounds(centred, stats)
    fast = torch.empty(num, num, dtype=fast_rows.dtype)
    workspace = Workspace()
    for start in range(0, num, queries):
        block = centred[start : start + queries]
        for first in range(0, num, width):
            stop = min(first + width, num)
            part = blocks.product(block, gallery, first, stop, workspace, tile_bytes)
            fast[start : start + queries, first:stop] = part
    rows = torch.arange(num)
    pairs = torch.cartesian_prod(rows, rows)
    canonical = ranking_score.canonical_scores(
        prepared,
        prepared,
        pairs[:, 0],
        pairs[:, 1],
        similarity,  # type: ignore[arg-type]
    ).view(num, num)
    return (fast.double() - canonical).abs(), bound, canonical
