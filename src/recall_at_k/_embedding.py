"""Ranking embeddings against a gallery in tiles: pure functions, no Metric.

The metric (:class:`recall_at_k.EmbeddingRecallAtK`) and the one-shot function
(:func:`recall_at_k.functional.embedding_recall_at_k`) describe their items the same way
-- embeddings, labels, groups, a sample identity and the role each item plays -- and
call :func:`rank` for each direction; under DDP the metric hands each process its share
of the queries.

Per tile, a query's positives are read from a small block: the gallery's columns are its
items sorted by label, which puts the items of each label in one run of adjacent
columns, so a query's positives are the ``block_count`` columns from ``block_start`` on
(a gather of adjacent values). Ignored items (the query itself, same-group items) are
written as NaN into the tile, and NaN compares false with everything, so the full-width
work per tile is one matrix product and one comparison with the best positive's score.
When a tile's label blocks are wide (few, large classes) the tile goes through the dense
kernel with full relevance and ignore masks instead; every route gives the same counts.

On CPU the block route never holds a tile's full score rows: queries are ranked in label
order, so a tile's label blocks form one run of columns, scored first; the remaining
columns follow in panels that are compared with each query's best positive while they
are still in the core's cache. Every score is computed exactly once, so the value that
sets a query's s* is the one its counts compare.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k import _kernel
from recall_at_k._checks import (
    check_choice,
    check_id_vector,
    check_same_device,
    check_tensors,
    describe,
)
from recall_at_k._dense import dense_tie_counts
from recall_at_k._kernel import NeededCounts, TieCounts, Workspace, count_dtype
from recall_at_k._types import SIMILARITIES, Similarity

CPU_TILE_BYTES = 32 * 2**20
"""On CPU, tiles hold at most this many bytes of scores, whatever ``chunk_bytes`` allows:
larger tiles buy nothing (the product is as fast in 32 MiB tiles) and cost memory."""
CPU_COUNT_BLOCK_BYTES = 2 * 2**20
"""Rows of a tile are counted this many bytes at a time on CPU: a block that stays in the
core's cache between its comparison and its sum."""
CPU_PANEL_BYTES = 2 * 2**20
"""On CPU a tile's scores are computed in panels of columns of about this many bytes."""
SPARSE_MAX_BLOCK_FRACTION = 0.25
"""A tile takes a label-block route while its widest label block is at most this share
of the gallery; above it the dense masks are cheaper than gathering the blocks."""


class Route(NamedTuple):
    """How tiles are counted; every route gives the same counts.

    ``"auto"`` chooses per tile: on CPU (built-in similarity, no NaN check) panels of
    columns, elsewhere whole tiles, and dense masks when the tile's widest label block
    exceeds ``SPARSE_MAX_BLOCK_FRACTION`` of the gallery. Tests force the others:
    ``"panels"`` (CPU only; falls back to ``"tiles"`` where panels cannot be used),
    ``"tiles"`` (whole tiles through label blocks, as on a GPU) and ``"dense"``.
    """

    mode: Literal["auto", "panels", "tiles", "dense"] = "auto"
    panel_bytes: int = CPU_PANEL_BYTES


AUTO_ROUTE = Route()


def tile_mode(
    route: Route, widest: int, num_gallery: int, panels_possible: bool
) -> Literal["panels", "tiles", "dense"]:
    """How one tile is counted: the route's mode, or for ``"auto"`` dense masks when the
    tile's widest label block (``widest`` gallery items) exceeds
    ``SPARSE_MAX_BLOCK_FRACTION`` of the gallery, else panels where possible, else tiles."""
    mode = route.mode
    if mode == "auto":
        narrow = widest <= SPARSE_MAX_BLOCK_FRACTION * num_gallery
        mode = ("panels" if panels_possible else "tiles") if narrow else "dense"
    if mode == "panels" and not panels_possible:
        mode = "tiles"
    return mode


class Side(NamedTuple):
    """The items that play one role, each sample once: rows into the item tensors and
    the sample identity of each."""

    rows: Tensor
    identity: Tensor


class RankOptions(NamedTuple):
    """What a ranking needs to know besides the items."""

    similarity: Similarity
    exclude: str
    ties: str
    max_k: int
    chunk_bytes: int
    check_nan: bool


class RankCounts(NamedTuple):
    """A ranking's contribution: ``hist`` ``[max K]`` and int64 ``queries``
    (with, without a valid positive), ``nan_queries`` (queries whose scores held NaN)."""

    hist: Tensor
    queries: Tensor
    nan_queries: Tensor


class _Gallery(NamedTuple):
    """A direction's gallery, prepared for scoring.

    Its columns are the gallery's items sorted by label (stable), so that each label's
    items are one run of adjacent columns: a query's positives are read as a contiguous
    block of its score row.
    """

    embeddings: Tensor  # [G, D] in column order
    neg_sq_norms: Tensor | None  # [1, G] negated squared norms, for "euclidean"
    labels: Tensor  # [G], ascending
    groups: Tensor  # [G]
    block_labels: Tensor  # [C] distinct labels, ascending
    block_starts: Tensor  # [C] the first column of each label's run
    block_counts: Tensor  # [C] the run's length
    identity_sorted: Tensor  # [G] identities, ascending
    identity_column: Tensor  # [G] column of each entry of ``identity_sorted``


class _Queries(NamedTuple):
    """Queries in gallery terms, in label order."""

    rows: Tensor  # [Q] rows of the prepared embeddings
    labels: Tensor
    groups: Tensor
    block_start: Tensor  # [Q] first column of the query's label run
    block_count: Tensor  # [Q] its length (0: no item of that label in the gallery)
    self_column: Tensor  # [Q] column of the query itself in the gallery, -1 if absent


# ---------------------------------------------------------------- items and roles


def identities(ids: Tensor, has_id: Tensor) -> Tensor:
    """A sample identity per item: items sharing an id share it, an item without id is
    alone. Identities are ``0..n-1`` with the ids' in ascending order first."""
    num = ids.shape[0]
    identity = torch.empty(num, dtype=torch.int64, device=ids.device)
    sorted_ids, order = torch.sort(ids[has_id])
    distinct, inverse_sorted = torch.unique_consecutive(sorted_ids, return_inverse=True)
    inverse = torch.empty_like(inverse_sorted)
    inverse[order] = inverse_sorted
    identity[has_id] = inverse
    without = (~has_id).nonzero().squeeze(1)
    identity[without] = distinct.shape[0] + torch.arange(without.shape[0], device=ids.device)
    return identity


def select(plays_role: Tensor, identity: Tensor) -> Side:
    """Items playing a role, keeping the first item of each identity (dedupe by id)."""
    num = identity.shape[0]
    rows = plays_role.nonzero().squeeze(1)
    ident = identity[rows]
    first = torch.full((num,), num, dtype=torch.int64, device=identity.device)
    first.scatter_reduce_(0, ident, rows, reduce="amin")
    keep = first[ident] == rows
    return Side(rows[keep], ident[keep])


def prepare(embeddings: Tensor, similarity: Similarity) -> Tensor:
    """Embeddings in a float dtype of at least 32 bits; L2-normalised for ``"cosine"``.

    Always a copy of its own (callers may write into it).
    """
    prepared = embeddings.to(torch.promote_types(embeddings.dtype, torch.float32), copy=True)
    if similarity == "cosine":
        # What F.normalize computes, without another copy of the embeddings.
        norms = torch.linalg.vector_norm(prepared, dim=1, keepdim=True)
        prepared.div_(norms.clamp_min_(1e-12))
    return prepared


def may_produce_nan(embeddings: Tensor, similarity: Similarity) -> bool:
    """Whether scores could be NaN although the embeddings are finite (reads one value)."""
    if callable(similarity):
        return True
    if similarity == "cosine" or embeddings.numel() == 0:
        return False
    # dot / euclidean overflow to inf (and inf - inf = NaN) only for huge values.
    largest = float(embeddings.abs().amax())
    bound = 4.0 * embeddings.shape[1] * largest * largest
    return bound >= torch.finfo(embeddings.dtype).max / 4


# ------------------------------------------------------------------------ ranking


def rank(
    embeddings: Tensor,
    labels: Tensor,
    groups: Tensor,
    queries: Side,
    gallery_side: Side,
    options: RankOptions,
    route: Route = AUTO_ROUTE,
) -> RankCounts:
    """Rank ``queries`` against ``gallery_side`` in tiles; the summed rank histogram.

    Args:
        embeddings: ``[N, D]`` from :func:`prepare`, every item of both sides.
        labels: int64 ``[N]``; a gallery item is relevant to a query with its label.
        groups: int64 ``[N]``, read by ``options.exclude``.
        queries: the queries (all, or this process's share).
        gallery_side: the gallery (all of it on every process).
        options: similarity, exclusion, tie policy, largest K, tile size, NaN check.
        route: how tiles are counted (tests choose; every route gives the same counts).
    """
    device = embeddings.device
    hist_dtype = torch.float64 if options.ties == "expected" else torch.int64
    hist_total = torch.zeros(options.max_k, dtype=hist_dtype, device=device)
    query_total = torch.zeros(2, dtype=torch.int64, device=device)
    nan_total = torch.zeros((), dtype=torch.int64, device=device)
    if queries.rows.numel() == 0:
        return RankCounts(hist_total, query_total, nan_total)
    gallery = _gallery(embeddings, labels, groups, gallery_side, options.similarity)
    num_gallery = gallery.embeddings.shape[0]
    share = _queries(labels, groups, queries, gallery)
    tile_bytes = options.chunk_bytes
    if device.type == "cpu":
        tile_bytes = min(tile_bytes, CPU_TILE_BYTES)
    itemsize = gallery.embeddings.element_size()
    rows_per_tile = max(1, tile_bytes // max(1, num_gallery * itemsize))
    needed = _kernel.needed_counts(options.ties)
    panels_possible = (
        device.type == "cpu" and not callable(options.similarity) and not options.check_nan
    )
    workspace = Workspace()
    for start in range(0, share.rows.shape[0], rows_per_tile):
        tile = _Queries._make(t[start : start + rows_per_tile] for t in share)
        tile_embeddings = embeddings.index_select(0, tile.rows)
        widest = int(tile.block_count.max()) if tile.block_count.numel() else 0
        mode = tile_mode(route, widest, num_gallery, panels_possible)
        if mode == "panels":
            counts = _panel_counts(
                tile_embeddings, tile, gallery, needed, widest, options, route, workspace
            )
        else:
            scores = _scores(tile_embeddings, gallery, options.similarity, workspace)
            if options.check_nan:
                nan_total += torch.isnan(scores).any(dim=1).sum()
            _ignore_in_place(scores, tile, gallery, options.exclude)
            if mode == "dense":
                counts = _dense_counts(scores, tile, gallery, needed, options.exclude)
            else:
                counts = _block_counts(
                    scores, tile, gallery.groups, needed, widest, options, workspace
                )[0]
        hist, query_counts = _kernel.rank_histogram(counts, options.ties, options.max_k)
        hist_total += hist
        query_total += query_counts
    return RankCounts(hist_total, query_total, nan_total)


def _gallery(
    embeddings: Tensor, labels: Tensor, groups: Tensor, side: Side, similarity: Similarity
) -> _Gallery:
    labels_sorted, label_order = torch.sort(labels[side.rows], stable=True)
    rows = side.rows[label_order]
    gallery_embeddings = embeddings[rows]
    neg_sq_norms = None
    if similarity == "euclidean":
        neg_sq_norms = gallery_embeddings.square().sum(dim=1).neg_().unsqueeze(0)
    block_labels, block_counts = torch.unique_consecutive(labels_sorted, return_counts=True)
    block_starts = torch.cumsum(block_counts, dim=0) - block_counts
    identity_sorted, identity_column = torch.sort(side.identity[label_order])
    return _Gallery(
        gallery_embeddings,
        neg_sq_norms,
        labels_sorted,
        groups[rows],
        block_labels,
        block_starts,
        block_counts,
        identity_sorted,
        identity_column,
    )


def _queries(labels: Tensor, groups: Tensor, side: Side, gallery: _Gallery) -> _Queries:
    """The queries in label order: a tile's label blocks are then adjacent and together
    one run of columns (what :func:`_panel_counts` computes first)."""
    query_labels, order = torch.sort(labels[side.rows], stable=True)
    side = Side(side.rows[order], side.identity[order])
    block = torch.searchsorted(gallery.block_labels, query_labels)
    block = block.clamp(max=gallery.block_labels.shape[0] - 1)
    found = gallery.block_labels[block] == query_labels
    block_start = gallery.block_starts[block]
    block_count = torch.where(found, gallery.block_counts[block], 0)
    position = torch.searchsorted(gallery.identity_sorted, side.identity)
    position = position.clamp(max=gallery.identity_sorted.shape[0] - 1)
    is_self = gallery.identity_sorted[position] == side.identity
    self_column = torch.where(is_self, gallery.identity_column[position], -1)
    return _Queries(
        side.rows, query_labels, groups[side.rows], block_start, block_count, self_column
    )


def _scores(
    queries: Tensor, gallery: _Gallery, similarity: Similarity, workspace: Workspace
) -> Tensor:
    """Scores ``[T, G]`` of a tile, ours to write into."""
    num_rows, num_gallery = queries.shape[0], gallery.embeddings.shape[0]
    if not callable(similarity):
        return _product(queries, gallery, 0, num_gallery, similarity, workspace)
    scores = similarity(queries, gallery.embeddings)
    if (
        not isinstance(scores, Tensor)
        or tuple(scores.shape) != (num_rows, num_gallery)
        or not scores.is_floating_point()
    ):
        shape = list(scores.shape) if isinstance(scores, Tensor) else type(scores)
        raise ValueError(
            f"`similarity` must return floating point scores of shape"
            f" [{num_rows}, {num_gallery}] for a tile of queries, got {shape}"
        )
    # A private copy: the tile is written to below.
    return scores.detach().clone(memory_format=torch.contiguous_format)


def _product(
    queries: Tensor,
    gallery: _Gallery,
    first: int,
    stop: int,
    similarity: Similarity,
    workspace: Workspace,
) -> Tensor:
    """Scores ``[T, stop - first]`` of a tile against the gallery columns
    ``first:stop``, in the workspace's tile buffer."""
    num_rows, width = queries.shape[0], stop - first
    out = workspace.get("tile", (num_rows, width), queries.dtype, queries.device)
    gallery_t = gallery.embeddings[first:stop].T
    if similarity == "euclidean":
        assert gallery.neg_sq_norms is not None
        # -(|q|^2 - 2 q.g + |g|^2)
        torch.addmm(gallery.neg_sq_norms[:, first:stop], queries, gallery_t, alpha=2, out=out)
        out.sub_(queries.square().sum(dim=1, keepdim=True))
    else:
        torch.matmul(queries, gallery_t, out=out)
    return out


def _panel_counts(
    queries: Tensor,
    tile: _Queries,
    gallery: _Gallery,
    needed: NeededCounts,
    widest: int,
    options: RankOptions,
    route: Route,
    workspace: Workspace,
) -> TieCounts:
    """:func:`_block_counts` of a tile whose scores never exist all at once (CPU).

    The tile's queries are in label order, so their label blocks together are one
    run of columns ``[lo, hi)``: those scores come first, give each query's s*, p
    and its block's share of the counts; the other columns follow in panels of
    about ``route.panel_bytes``, each counted against s* while still in cache. Every
    score is computed once, so the positive that sets s* is counted with that same
    value.
    """
    num_rows, num_gallery = queries.shape[0], gallery.embeddings.shape[0]
    if widest == 0:  # no query of the tile has an item of its label in the gallery
        return _kernel.no_positive_counts(num_rows, queries.device)
    present = tile.block_count > 0
    lo = int(torch.where(present, tile.block_start, num_gallery).min())
    hi = int(torch.where(present, tile.block_start + tile.block_count, 0).max())
    scores = _product(queries, gallery, lo, hi, options.similarity, workspace)
    _ignore_in_place(scores, tile, gallery, options.exclude, lo)
    block_tile = tile._replace(block_start=tile.block_start - lo)
    counts, best = _block_counts(
        scores, block_tile, gallery.groups[lo:hi], needed, widest, options, workspace
    )
    width = max(1, route.panel_bytes // (num_rows * queries.element_size()))
    panels = [(a, min(a + width, lo)) for a in range(0, lo, width)]
    panels += [(a, min(a + width, num_gallery)) for a in range(hi, num_gallery, width)]
    # Each query lies in its own label block, so only same-group exclusion, or an id
    # shared by items of different labels, ignores anything outside [lo, hi).
    self_outside = (tile.self_column >= 0) & ((tile.self_column < lo) | (tile.self_column >= hi))
    ignore_outside = options.exclude == "same_group" or bool(self_outside.any())
    for first, stop in panels:
        scores = _product(queries, gallery, first, stop, options.similarity, workspace)
        if ignore_outside:
            _ignore_in_place(scores, tile, gallery, options.exclude, first)
        panel_gt, panel_ge = _row_counts(scores, best, needed, workspace)
        if counts.greater is not None and panel_gt is not None:
            counts.greater.add_(panel_gt)
        if counts.at_or_above is not None and panel_ge is not None:
            counts.at_or_above.add_(panel_ge)
    return counts


def _ignore_in_place(
    scores: Tensor, tile: _Queries, gallery: _Gallery, exclude: str, first: int = 0
) -> None:
    """Write NaN over the items each query must ignore in the gallery columns
    ``first:first + scores.shape[1]``, except the label-and-group junk, which lies
    inside the label blocks and is handled there."""
    width = scores.shape[1]
    rows = torch.arange(scores.shape[0], device=scores.device)
    local = tile.self_column - first
    inside = (tile.self_column >= 0) & (local >= 0) & (local < width)
    column = local.clamp(min=0, max=max(width - 1, 0))
    current = scores[rows, column]
    scores[rows, column] = torch.where(inside, float("nan"), current)
    if exclude == "same_group":
        groups = gallery.groups[first : first + width]
        same_group = tile.groups.unsqueeze(1) == groups.unsqueeze(0)
        scores.masked_fill_(same_group, float("nan"))


def _dense_counts(
    scores: Tensor, tile: _Queries, gallery: _Gallery, needed: NeededCounts, exclude: str
) -> TieCounts:
    """The dense kernel on full relevance and ignore masks (wide label blocks)."""
    target = tile.labels.unsqueeze(1) == gallery.labels.unsqueeze(0)
    ignore = torch.isnan(scores)
    scores.masked_fill_(ignore, 0.0)
    if exclude == "same_label_and_group":
        ignore |= target & (tile.groups.unsqueeze(1) == gallery.groups.unsqueeze(0))
    return dense_tie_counts(scores, target, ignore, needed)


def _row_counts(
    scores: Tensor, threshold: Tensor, needed: NeededCounts, workspace: Workspace
) -> tuple[Tensor | None, Tensor | None]:
    """Row-wise counts of ``scores > threshold`` and ``scores >= threshold``.

    Overwrites ``scores``: each comparison writes 0/1 into the float tile itself (NaN
    compares false), which needs no second tile of memory and, on CPU, is faster than a
    ``bool`` result (:func:`recall_at_k._kernel.count_dtype`). On CPU the rows go in
    blocks of about ``CPU_COUNT_BLOCK_BYTES``, so that each block's sum reads what its
    comparison has just written from the core's cache.
    """
    num_rows, num_gallery = scores.shape
    sum_dtype = count_dtype(num_gallery)
    step = num_rows
    if scores.device.type == "cpu":
        step = max(1, CPU_COUNT_BLOCK_BYTES // max(1, num_gallery * scores.element_size()))
    device = scores.device
    greater = torch.empty(num_rows, dtype=torch.int64, device=device) if needed.greater else None
    at_or_above = (
        torch.empty(num_rows, dtype=torch.int64, device=device) if needed.at_or_above else None
    )
    spare = None
    if greater is not None and at_or_above is not None:
        spare = workspace.get("spare", (min(step, num_rows), num_gallery), scores.dtype, device)
    for start in range(0, num_rows, step):
        block = scores[start : start + step]
        bound = threshold[start : start + step]
        if greater is not None:
            above = block if spare is None else spare[: block.shape[0]]
            torch.gt(block, bound, out=above)
            greater[start : start + step] = above.sum(dim=1, dtype=sum_dtype)
        if at_or_above is not None:
            block.ge_(bound)
            at_or_above[start : start + step] = block.sum(dim=1, dtype=sum_dtype)
    return greater, at_or_above


def _block_counts(
    scores: Tensor,
    tile: _Queries,
    groups: Tensor,
    needed: NeededCounts,
    widest: int,
    options: RankOptions,
    workspace: Workspace,
) -> tuple[TieCounts, Tensor]:
    """g_>, g_> + e and p of a tile whose positives are read from their label blocks.

    ``scores`` already holds NaN where an item is ignored (the query itself, same-group
    items). Every item sharing the query's label lies in its block, so the valid
    negatives at or above s* are all items at or above s* minus the block's items at or
    above s* (ignored junk of the label-and-group rule included: it is in the block).
    ``groups`` are the groups of the columns of ``scores``; ``tile.block_start`` counts
    in those columns. Returns the counts and s* (``[T, 1]``).
    """
    device = scores.device
    if widest == 0:  # no query of the tile has an item of its label in the gallery
        best = torch.full((scores.shape[0], 1), float("-inf"), device=device)
        return _kernel.no_positive_counts(scores.shape[0], device), best
    steps = torch.arange(widest, device=device)
    in_block = steps.unsqueeze(0) < tile.block_count.unsqueeze(1)
    # Rows without a block (block_count 0) may start anywhere: keep them in range.
    columns = (tile.block_start.unsqueeze(1) + steps.unsqueeze(0)).clamp_(
        min=0, max=max(scores.shape[1] - 1, 0)
    )
    block = scores.gather(1, columns)
    valid = in_block & ~torch.isnan(block)
    if options.exclude == "same_label_and_group":
        valid &= groups[columns] != tile.groups.unsqueeze(1)
    best = torch.where(valid, block, float("-inf")).amax(dim=1, keepdim=True)
    has_positive = valid.any(dim=1)
    block_at_or_above = block >= best  # NaN compares false
    tied = (block_at_or_above & valid).sum(dim=1)
    greater, at_or_above = _row_counts(scores, best, needed, workspace)
    if greater is not None:
        greater -= ((block > best) & in_block).sum(dim=1)
    if at_or_above is not None:
        at_or_above -= (block_at_or_above & in_block).sum(dim=1)
    return TieCounts(greater, at_or_above, tied, has_positive), best


# ------------------------------------------------------------------------- checks


def check_batch(
    embeddings: Tensor,
    labels: Tensor,
    groups: Tensor | None,
    ids: Tensor | None,
    names: tuple[str, str, str, str] = ("embeddings", "labels", "groups", "ids"),
) -> None:
    """Types, shapes, dtypes and devices of one batch of items (no value read)."""
    check_tensors(**dict(zip(names, (embeddings, labels, groups, ids), strict=True)))
    if embeddings.dim() != 2 or not embeddings.is_floating_point():
        raise ValueError(
            f"`{names[0]}` must be a floating point tensor of shape [B, D],"
            f" got {describe(embeddings)}"
        )
    batch = embeddings.shape[0]
    for name, value in zip(names[1:], (labels, groups, ids), strict=True):
        check_id_vector(name, value, batch, f"one entry per row of `{names[0]}`")
    check_same_device(**dict(zip(names, (embeddings, labels, groups, ids), strict=True)))


def check_finite(embeddings: Tensor, name: str = "embeddings") -> None:
    """Finite embeddings (reads values on the host; only with ``validate_args=True``)."""
    if embeddings.numel() and not bool(torch.isfinite(embeddings).all()):
        nan = int(torch.isnan(embeddings).sum())
        inf = int(torch.isinf(embeddings).sum())
        raise ValueError(f"`{name}` must be finite, found {nan} NaN and {inf} infinite value(s)")


def check_similarity(similarity: object) -> None:
    """A built-in similarity's name, or a callable."""
    if not callable(similarity):
        check_choice("similarity", similarity, SIMILARITIES)


def nan_scores_error(queries: int) -> ValueError:
    """The error for scores that came out NaN although the embeddings are finite."""
    return ValueError(
        f"`similarity` returned NaN scores for {queries} quer{'y' if queries == 1 else 'ies'};"
        " scores must not be NaN (a bug in a callable, or the overflow of huge embeddings"
        " under 'dot' / 'euclidean')"
    )


# ---------------------------------------------------------------------- processes


class ProcessGroup(NamedTuple):
    """The process group whose gathered states a ranking sees (``None``: the default)."""

    group: Any


def rank_shared(
    embeddings: Tensor,
    labels: Tensor,
    groups: Tensor,
    directions: list[tuple[Side, Side] | None],
    options: RankOptions,
    route: Route,
    shared: ProcessGroup | None,
) -> tuple[list[tuple[Tensor, Tensor] | None], list[int]]:
    """Rank every direction's (queries, gallery), sharing the queries among processes.

    With ``shared`` (states gathered: every process holds every item) each process ranks
    its contiguous share of each direction's queries against the whole gallery and the
    counts are summed over the group, so every process returns the same histograms. A
    direction that is ``None`` (nothing to rank) gives ``None``; a direction with the
    same sides as the one before (leave-one-out, both ways) is not ranked twice.

    Returns:
        The summed ``(hist, queries)`` per direction, and the number of queries this
        process ranked per direction.
    """
    world, me, group = 1, 0, None
    if shared is not None and dist.is_available() and dist.is_initialized():
        group = shared.group
        world, me = dist.get_world_size(group), dist.get_rank(group)
    results: list[RankCounts | None] = []
    ranked: list[int] = []
    failure: Exception | None = None
    for index, sides in enumerate(directions):
        if sides is None:
            results.append(None)
            ranked.append(0)
            continue
        before = directions[index - 1] if index else None
        if before is not None and same_sides(before, sides):
            results.append(results[-1])
            ranked.append(ranked[-1])
            continue
        queries, gallery = sides
        num = queries.rows.shape[0]
        lo, hi = num * me // world, num * (me + 1) // world
        share = Side(queries.rows[lo:hi], queries.identity[lo:hi])
        try:
            counts = rank(embeddings, labels, groups, share, gallery, options, route)
        except Exception as err:
            if world == 1:
                raise
            # Take part in the all_reduce, so that no other process waits forever, then
            # raise here and there.
            failure = err
            nothing = Side(share.rows[:0], share.identity[:0])
            counts = rank(embeddings, labels, groups, nothing, gallery, options, route)
        results.append(counts)
        ranked.append(hi - lo)
    return sum_over_processes(results, world, group, failure), ranked


def sum_over_processes(
    results: list[RankCounts | None],
    world: int,
    group: Any,
    failure: Exception | None,
) -> list[tuple[Tensor, Tensor] | None]:
    """Sum each direction's counts over the processes (every process calls this, with
    its share's counts, or None for a direction that could not be ranked anywhere), then
    raise a failure of any process on every process.

    Returns:
        ``(hist, queries)`` per direction, or None where ``results`` holds None.
    """
    present = [r for r in results if r is not None]
    if not present:
        return [None for _ in results]
    hists = torch.stack([r.hist for r in present])
    counts = torch.stack([torch.cat([r.queries, r.nan_queries.reshape(1)]) for r in present])
    failed = torch.tensor([int(failure is not None)], device=counts.device)
    if world > 1:
        dist.all_reduce(hists, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(failed, op=dist.ReduceOp.SUM, group=group)
    if failure is not None:
        raise failure
    if int(failed):
        raise RuntimeError("EmbeddingRecallAtK.compute() failed on another process; see its error")
    nan_queries = int(counts[:, 2].sum())
    if nan_queries:
        raise nan_scores_error(nan_queries)
    reduced = iter(zip(hists, counts[:, :2], strict=True))
    return [None if r is None else next(reduced) for r in results]


def same_sides(previous: tuple[Side, Side], current: tuple[Side, Side]) -> bool:
    """Whether a direction ranks the same queries against the same gallery as before."""
    return all(
        a.rows.shape == b.rows.shape and torch.equal(a.rows, b.rows)
        for a, b in zip(previous, current, strict=True)
    )


def check_directions(directions: object) -> tuple[str, str]:
    if (
        isinstance(directions, str)
        or not isinstance(directions, Sequence)
        or len(directions) != 2
        or not all(isinstance(d, str) and d for d in directions)
        or directions[0] == directions[1]
    ):
        raise ValueError(
            "`directions` must be two distinct non-empty strings (the key prefixes of"
            f" query -> gallery and gallery -> query), got {directions!r}"
        )
    return (directions[0], directions[1])
