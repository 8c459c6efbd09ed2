"""Scanning a tile's fast scores against each query's band: the routes, the scans, the
near-duplicate threshold, the label blocks.

A query's band is ``[s*_f - 2B, s*_f + 2B]`` around the best fast score of its valid
positives (:mod:`recall_at_k.ranking.score`): items above it are counted as surely above s*,
items inside it are kept as pairs for :mod:`recall_at_k.ranking.decide`.

Per tile, a query's positives are read from a small block: the gallery's columns are its
items sorted by label, which puts the items of each label in one run of adjacent
columns, so a query's positives are the ``block_count`` columns from ``block_start`` on
(a gather of adjacent values). Ignored items (the query itself, same-group items) are
written as NaN into the tile, and NaN compares false with everything. Beyond the matrix
product, the full-width work is one read per panel (each row's largest score); only the
rows that reach their band are compared with its edges. When a tile's label blocks are
wide (few, large classes) the tile goes through full relevance and ignore masks
instead; every route gives the same counts.

**Near-duplicate counts** (the protocol audit's, with a threshold ``t``) are made in the
same tiles: each row's largest score (read anyway) is compared with ``t - B``; the rare
rows that reach it are compared with ``t - B`` and ``t + B``, items above ``t + B`` are
surely near, those in between re-scored canonically with the band's pairs. A positive is
near when s* is (decided canonically anyway).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from recall_at_k._kernel import Workspace, count_dtype
from recall_at_k._types import Similarity
from recall_at_k.ranking.gallery import Gallery, Queries, product

CPU_COUNT_BLOCK_BYTES = 2 * 2**20
"""Rows of a tile are counted this many bytes at a time on CPU: a block that stays in the
core's cache between its comparison and its sum."""

CPU_PANEL_BYTES = 2 * 2**20
"""On CPU a tile's scores are computed in panels of columns of about this many bytes."""

SPARSE_MAX_BLOCK_FRACTION = 0.25
"""A tile takes a label-block route while its widest label block is at most this share
of the gallery; above it the dense masks are cheaper than gathering the blocks."""


SYMMETRIC_BLOCK_BYTES = 4 * 2**20
"""Leave-one-out on CPU: scores are computed in square blocks of about this many bytes,
each block once for the queries of its rows and those of its columns."""

SYMMETRIC_MIN_ROWS = 64
"""The symmetric route is taken (``"auto"``) when its blocks have at least this many rows
(or hold every item): smaller blocks cost more than they save."""

SYMMETRIC_PENDING_PAIRS = 2**22
"""The symmetric route keeps the in-band pairs found for queries of later blocks; when
more than this many wait, the remaining queries are ranked by the other routes (and
when its label blocks hold more in-band positives than this, all of them)."""


class Route(NamedTuple):
    """How tiles are counted; every route gives the same counts.

    ``"auto"`` chooses: on CPU (built-in similarity, no NaN check) the symmetric route
    for leave-one-out (:func:`rank_symmetric`, where label blocks are narrow and its blocks
    have ``SYMMETRIC_MIN_ROWS`` rows), then per tile panels of columns, elsewhere whole
    tiles, and dense masks when the tile's widest label block exceeds
    ``SPARSE_MAX_BLOCK_FRACTION`` of the gallery. Tests force the others:
    ``"symmetric"`` (wherever it can run, blocks of any size; the rest as ``"auto"``),
    ``"panels"`` (CPU only; falls back to ``"tiles"`` where panels cannot be used),
    ``"tiles"`` (whole tiles through label blocks, as on a GPU) and ``"dense"``.
    """

    mode: Literal["auto", "symmetric", "panels", "tiles", "dense"] = "auto"
    panel_bytes: int = CPU_PANEL_BYTES
    block_bytes: int = SYMMETRIC_BLOCK_BYTES
    pending_pairs: int = SYMMETRIC_PENDING_PAIRS
    positive_pairs: int = SYMMETRIC_PENDING_PAIRS


AUTO_ROUTE = Route()


def tile_mode(
    route: Route, widest: int, num_gallery: int, panels_possible: bool
) -> Literal["panels", "tiles", "dense"]:
    """How one tile is counted: the route's mode, or for ``"auto"`` (and the tiles that
    ``"symmetric"`` leaves) dense masks when the tile's widest label block (``widest``
    gallery items) exceeds ``SPARSE_MAX_BLOCK_FRACTION`` of the gallery, else panels
    where possible, else tiles."""
    mode: Literal["panels", "tiles", "dense"]
    if route.mode == "auto" or route.mode == "symmetric":
        narrow = widest <= SPARSE_MAX_BLOCK_FRACTION * num_gallery
        mode = ("panels" if panels_possible else "tiles") if narrow else "dense"
    else:
        mode = route.mode
    if mode == "panels" and not panels_possible:
        mode = "tiles"
    return mode


PENDING_SHARE = 8
"""What waits to be decided -- the tiles' waiting bands (``rank``) and the symmetric
route's waiting in-band pairs -- takes at most ``chunk_bytes / PENDING_SHARE``; deciding
it takes about as much again."""


class RankOptions(NamedTuple):
    """What a ranking needs to know besides the items."""

    similarity: Similarity
    exclude: str
    ties: str
    max_k: int
    chunk_bytes: int
    check_nan: bool
    near_duplicate: float | None = None  # a threshold: count the near items (the audit)
    progress: bool = False  # a tqdm bar over the queries ranked


NEAR_COUNTS = (
    "near_positive",  # queries with a valid positive whose s* is at or above the threshold
    "near_negative_with_positive",  # ... with a valid negative at or above it
    "near_negative_without_positive",  # queries without a valid positive, with such a negative
    "near_hits_at_1",  # queries whose rank-1 hit (certain: no negative at s*) is at or above it
)
"""What ``RankCounts.near`` counts, in order, on canonical scores (queries flagged in
``known`` count as near positive / near negative too)."""


class Pairs(NamedTuple):
    """(query, item) pairs to decide on canonical scores."""

    rows: Tensor  # [M] tile row of each pair
    columns: Tensor  # [M] gallery column of each pair
    values: Tensor | None  # [M] the pair's score, kept for a callable similarity


Found = list[tuple[Tensor, Tensor, Tensor | None]]
"""Pairs found by a scan, a part per scanned block: (tile rows, gallery columns, values)."""


class Band(NamedTuple):
    """What one tile's scanning yields, per query of the tile."""

    greater: (
        Tensor  # [T] (a float count dtype) valid negatives surely above s* (fast score above hi)
    )
    has_positive: Tensor  # [T] bool
    pairs: Pairs  # the in-band pairs: fast score within 2B of s*_f
    near_sure: Tensor | None  # [T] items surely at or above the near threshold (no positive)
    near_pairs: Pairs | None  # items whose fast score lies within B of the threshold


def edges(centre: Tensor, half: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``lo <= centre - half`` and ``hi >= centre + half`` (float64 ``[T, 1]``) in
    ``dtype``, rounded outwards."""
    lo_wide, hi_wide = centre - half, centre + half
    lo, hi = lo_wide.to(dtype), hi_wide.to(dtype)
    lo = torch.where(
        lo.to(torch.float64) > lo_wide, torch.nextafter(lo, lo.new_tensor(-math.inf)), lo
    )
    hi = torch.where(
        hi.to(torch.float64) < hi_wide, torch.nextafter(hi, hi.new_tensor(math.inf)), hi
    )
    return lo, hi


def band_edges(best: Tensor, bound: Tensor, has_positive: Tensor) -> tuple[Tensor, Tensor]:
    """``[T, 1]`` edges ``lo <= s*_f - 2B`` and ``hi >= s*_f + 2B`` in the scores' dtype
    (rounded outwards); +inf for a query without a valid positive (its counts are not
    read)."""
    lo, hi = edges(best.to(torch.float64), 2 * bound, best.dtype)
    missing = ~has_positive.unsqueeze(1)
    return lo.masked_fill_(missing, math.inf), hi.masked_fill_(missing, math.inf)


def scan(
    scores: Tensor,
    lo: Tensor,
    hi: Tensor,
    first: int,
    greater: Tensor,
    found: Found,
    keep_values: bool,
    workspace: Workspace,
    every_row: bool = False,
    peak: Tensor | None = None,
) -> None:
    """Add to ``greater`` (per row of ``scores``, a float dtype from
    :func:`recall_at_k._kernel.count_dtype`) the count of scores above ``hi``, and to
    ``found`` the positions (rows, gallery columns ``first + j``) with
    ``lo <= score <= hi``; NaN, an ignored item, is neither. Overwrites ``scores``
    unless ``keep_values``. ``peak``: each row's largest score, where
    the caller has it already.

    The full-width work is one read: each row's largest score (NaN where the row holds
    an ignored item), in blocks of rows of about ``CPU_COUNT_BLOCK_BYTES`` on CPU. Only
    the rows reaching ``lo`` (or holding a NaN) are copied and compared with ``lo``
    and ``hi`` (written as 0/1 into float buffers and summed, on CPU faster than a
    ``bool`` result, :func:`recall_at_k._kernel.count_dtype`), and only the rows whose
    two counts differ, those with band items, are searched. With ``every_row`` (every
    row holds its best positive, so reaches ``lo``), or when most rows reach ``lo``,
    the block is compared whole instead.
    """
    num_rows, width = scores.shape
    sum_dtype = greater.dtype
    step = num_rows
    if scores.device.type == "cpu":
        step = max(1, CPU_COUNT_BLOCK_BYTES // max(1, width * scores.element_size()))
    for start in range(0, num_rows, step):
        block, block_lo, block_hi, block_peak = scores, lo, hi, peak
        if step < num_rows:
            stop = start + step
            block, block_lo, block_hi = scores[start:stop], lo[start:stop], hi[start:stop]
            block_peak = None if peak is None else peak[start:stop]
        if every_row:
            rows = None
        else:
            if block_peak is None:
                block_peak = block.amax(dim=1, keepdim=True)
            rows = (block_peak < block_lo).logical_not_().view(-1).nonzero().view(-1)
            if rows.numel() == 0:
                continue
            if 2 * rows.shape[0] > block.shape[0]:
                rows = None  # most rows: compare them all rather than copy them
        if rows is None:
            marks = workspace.get("marks", tuple(block.shape), scores.dtype, scores.device)
            reach = torch.ge(block, block_lo, out=marks).sum(dim=1, dtype=sum_dtype)
            if keep_values:
                upper = workspace.get("upper", tuple(block.shape), scores.dtype, scores.device)
                above = torch.gt(block, block_hi, out=upper)
            else:
                above = block.gt_(block_hi)  # the scores are not read again
            # marks: score >= lo and not above hi (no bool temporaries).
            marks.sub_(above)
            above = above.sum(dim=1, dtype=sum_dtype)
            greater[start : start + block.shape[0]] += above
            if torch.equal(reach, above):
                continue
            rows = (reach > above).nonzero().view(-1)
            inside = marks if rows.shape[0] == block.shape[0] else marks.index_select(0, rows)
            row, column = inside.nonzero(as_tuple=True)
            if inside is not marks:
                row = rows[row]
            value = block[row, column] if keep_values else None
            found.append((row + start, column + first, value))
        else:
            rows += start
            shape = (rows.shape[0], width)
            candidates = workspace.get("candidates", shape, scores.dtype, scores.device)
            torch.index_select(scores, 0, rows, out=candidates)
            marks = workspace.get("marks", shape, scores.dtype, scores.device)
            reach = torch.ge(candidates, lo.index_select(0, rows), out=marks)
            reach = reach.sum(dim=1, dtype=sum_dtype)
            above = candidates.gt_(hi.index_select(0, rows)).sum(dim=1, dtype=sum_dtype)
            greater.index_add_(0, rows, above)
            if torch.equal(reach, above):
                continue
            rows = rows[reach > above]
            candidates = scores.index_select(0, rows)
            inside = (candidates >= lo.index_select(0, rows)) & (
                candidates <= hi.index_select(0, rows)
            )
            row, column = inside.nonzero(as_tuple=True)
            value = candidates[row, column] if keep_values else None
            found.append((rows[row], column + first, value))


def pairs_of(found: Found, device: torch.device) -> Pairs:
    """The pairs of a scan's parts, in one tensor each."""
    if not found:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return Pairs(empty, empty, None)
    values = None
    if found[0][2] is not None:
        values = torch.cat([v for _, _, v in found if v is not None])
    rows = torch.cat([r for r, _, _ in found])
    columns = torch.cat([c for _, c, _ in found])
    return Pairs(rows, columns, values)


class Near(NamedTuple):
    """A tile's near-duplicate scan: the threshold's edges ``[T, 1]`` (``t - B``,
    ``t + B`` rounded outwards), the count of items surely at or above it, the pairs
    within the edges."""

    lo: Tensor
    hi: Tensor
    sure: Tensor
    found: Found


def near_scan(threshold: float | None, bound: Tensor, like: Tensor, total: int) -> Near | None:
    """The empty near-duplicate scan of a tile (None without a threshold): ``like`` gives
    the scores' dtype and the tile's rows, ``total`` the gallery's size."""
    if threshold is None:
        return None
    centre = torch.full_like(bound, threshold)
    lo, hi = edges(centre, bound, like.dtype)
    sure = torch.zeros(like.shape[0], dtype=count_dtype(total), device=like.device)
    return Near(lo, hi, sure, [])


def near_block(
    scores: Tensor,
    peak: Tensor | None,
    near: Near,
    labels: tuple[Tensor, Tensor] | None,
    first: int,
    keep_values: bool,
    workspace: Workspace | None = None,
) -> None:
    """Add a block of scores (columns ``first:``) to a near-duplicate scan: per row, the
    items of another label scored above ``near.hi`` (surely at or above the threshold)
    to ``near.sure``, those within the edges to ``near.found``. ``peak``: each row's
    largest score (or None); ``labels``: those of the rows and of the columns (None: no
    column has a row's label, as in the panel route's panels). Besides the rows' copy,
    two bool masks of them, in buffers of ``workspace`` (:func:`pooled`) where given.

    Only the rows whose largest score reaches ``near.lo`` are copied (a positive is near
    when s* is; its label's items are set aside here); NaN, an ignored item, is neither.
    """
    if peak is None:  # NaN (an ignored item) taken as -inf: never near
        peak = torch.where(scores.isnan(), -math.inf, scores).amax(dim=1, keepdim=True)
    rows = (peak < near.lo).logical_not_().view(-1).nonzero().view(-1)
    if rows.numel() == 0:
        return
    count, width, device = rows.shape[0], scores.shape[1], scores.device
    held = count * width
    values = pooled(workspace, "near_values", held, scores.dtype, device)
    if scores.stride(0) == 1 and scores.stride(1) != 1:  # a transposed block: gather its rows
        # column by column in memory order
        candidates = torch.index_select(scores.T, 1, rows, out=values.view(width, count)).T
    else:
        candidates = torch.index_select(scores, 0, rows, out=values.view(count, width))
    above = pooled(workspace, "near_above", held, torch.bool, device).view(count, width)
    if labels is not None:
        row_labels = labels[0].index_select(0, rows).unsqueeze(1)
        same_label = torch.eq(row_labels, labels[1].unsqueeze(0), out=above)
        candidates.masked_fill_(same_label, math.nan)
    lo, hi = near.lo.index_select(0, rows), near.hi.index_select(0, rows)
    torch.gt(candidates, hi, out=above)
    near.sure.index_add_(0, rows, above.sum(dim=1, dtype=near.sure.dtype))
    # Within the edges: at or above lo and not above hi (NaN is neither).
    inside = pooled(workspace, "near_inside", held, torch.bool, device).view(count, width)
    torch.ge(candidates, lo, out=inside).logical_and_(above.logical_not_())
    row, column = inside.nonzero(as_tuple=True)
    if row.numel():
        value = candidates[row, column] if keep_values else None
        near.found.append((rows[row], column + first, value))


def pooled(
    workspace: Workspace | None, slot: str, numel: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """A flat buffer of at least ``numel`` elements from ``workspace`` (a fresh one
    without), of a power-of-two size, so that a slot is allocated a few times per
    ranking rather than once per block or panel. A scan's copies and marks, fresh
    temporaries of varying size (many near the C heap's 128 KiB mmap threshold) made
    between the small tensors a ranking keeps for later (pairs, views), left the heap
    fragmented: its resident size grew by megabytes that were free."""
    if workspace is None:
        return torch.empty(numel, dtype=dtype, device=device)
    capacity = 1 << max(0, numel - 1).bit_length()
    return workspace.get(slot, (capacity,), dtype, device)[:numel]


def gather_band(
    greater: Tensor, has_positive: Tensor, found: Found, near: Near | None = None
) -> Band:
    device = greater.device
    if near is None:
        return Band(greater, has_positive, pairs_of(found, device), None, None)
    return Band(
        greater, has_positive, pairs_of(found, device), near.sure, pairs_of(near.found, device)
    )


class Block(NamedTuple):
    """The label blocks of a tile's queries, ``[T, widest]``."""

    best: Tensor  # [T, 1] s*_f, the best fast score of a valid positive (-inf: none)
    has_positive: Tensor  # [T] bool
    values: Tensor  # the scores (label-and-group rule), else -inf where not valid
    in_block: Tensor  # bool: the entry is in the query's block
    valid: Tensor  # bool: the entry is a valid positive


def block_best(
    scores: Tensor, tile: Queries, groups: Tensor, exclude: str, workspace: Workspace
) -> Block:
    """s*_f, whether a valid positive exists, and each query's label block: its values
    (for the label-and-group rule; otherwise -inf where not a valid positive), which
    entries are in the block, which are valid positives.

    ``groups`` are the groups of the columns of ``scores``; ``tile.block_start`` counts
    in those columns. The block's buffers come from ``workspace``.
    """
    device = scores.device
    widest = int(tile.block_count.max()) if tile.block_count.numel() else 0
    shape = (scores.shape[0], widest)
    if widest == 0:  # no query of the tile has an item of its label in the gallery
        nothing = torch.zeros(shape, dtype=torch.bool, device=device)
        best = torch.full((shape[0], 1), -math.inf, dtype=scores.dtype, device=device)
        return Block(best, nothing.any(dim=1), scores.new_empty(shape), nothing, nothing)
    steps = torch.arange(widest, device=device)
    in_block = steps.unsqueeze(0) < tile.block_count.unsqueeze(1)
    # Rows without a block (block_count 0) may start anywhere: keep them in range.
    columns = workspace.get("block_columns", shape, torch.int64, device)
    torch.add(tile.block_start.unsqueeze(1), steps.unsqueeze(0), out=columns)
    columns.clamp_(min=0, max=max(scores.shape[1] - 1, 0))
    block = torch.gather(
        scores, 1, columns, out=workspace.get("block", shape, scores.dtype, device)
    )
    valid = in_block & ~torch.isnan(block)
    if exclude == "same_label_and_group":
        valid &= groups[columns] != tile.groups.unsqueeze(1)
        best = torch.where(valid, block, float("-inf")).amax(dim=1, keepdim=True)
    else:
        best = block.masked_fill_(~valid, float("-inf")).amax(dim=1, keepdim=True)
    return Block(best, valid.any(dim=1), block, in_block, valid)


class TileScan(NamedTuple):
    """A tile's scan in progress: the counts and pairs so far, the band's edges."""

    greater: Tensor  # [T] valid negatives surely above s* so far
    has_positive: Tensor  # [T] bool
    found: Found  # in-band pairs so far
    lo: Tensor  # [T, 1] the band's edges
    hi: Tensor
    near: Near | None  # the near-duplicate scan so far

    def band(self) -> Band:
        return gather_band(self.greater, self.has_positive, self.found, self.near)


def block_scan(
    scores: Tensor,
    tile: Queries,
    groups: Tensor,
    column_labels: Tensor,
    bound: Tensor,
    options: RankOptions,
    workspace: Workspace,
    first: int = 0,
    num_gallery: int | None = None,
) -> TileScan:
    """The scan of a tile (or of the columns ``first:`` holding every label block of
    it, ``num_gallery`` columns in all) whose positives are read from their label
    blocks.

    ``scores`` already holds NaN where an item is ignored (the query itself, same-group
    items). Every item sharing the query's label lies in its block; no valid positive
    scores above ``hi``, so the block's items above ``hi`` are label-and-group junk,
    taken off the count of negatives surely above s*. ``groups`` and ``column_labels``
    are those of the columns. The near-duplicate scan (with a threshold) comes first.
    """
    best, has_positive, block, in_block, _ = block_best(
        scores, tile, groups, options.exclude, workspace
    )
    lo, hi = band_edges(best, bound, has_positive)
    total = scores.shape[1] if num_gallery is None else num_gallery
    greater = torch.zeros(scores.shape[0], dtype=count_dtype(total), device=scores.device)
    found: Found = []
    keep = callable(options.similarity)
    near = near_scan(options.near_duplicate, bound, scores, total)
    if near is not None:
        labels = tile.labels, column_labels
        near_block(scores, None, near, labels, first, keep, workspace)
    scan(scores, lo, hi, first, greater, found, keep, workspace, True)
    if options.exclude == "same_label_and_group":
        greater -= ((block > hi) & in_block).sum(dim=1)
    return TileScan(greater, has_positive, found, lo, hi, near)


def block_band(
    scores: Tensor,
    tile: Queries,
    groups: Tensor,
    labels: Tensor,
    bound: Tensor,
    options: RankOptions,
    workspace: Workspace,
) -> Band:
    """The band of a whole tile whose positives are read from their label blocks."""
    return block_scan(scores, tile, groups, labels, bound, options, workspace).band()


def saturate(lo: Tensor, greater: Tensor, max_k: int) -> None:
    """Stop scanning the queries with at least ``max_k`` negatives surely above s*: a
    miss at every K whatever else is found (their ``lo`` becomes +inf, which no score
    reaches). Only negatives are scanned after the band's positives are found."""
    lo.masked_fill_(greater.unsqueeze(1) >= max_k, math.inf)


class LabelRun(NamedTuple):
    """A tile's scores against the one run of columns ``[first, stop)`` that holds every
    label block of its queries (in label order), ignored items NaN."""

    scores: Tensor
    tile: Queries  # block_start counted from first
    first: int
    stop: int


def label_run(
    queries: Tensor, tile: Queries, gallery: Gallery, options: RankOptions, workspace: Workspace
) -> LabelRun:
    """:class:`LabelRun` of the tile's queries (embeddings ``queries``; at least one of
    them has a label block)."""
    num = gallery.embeddings.shape[0]
    present = tile.block_count > 0
    first = int(torch.where(present, tile.block_start, num).min())
    stop = int(torch.where(present, tile.block_start + tile.block_count, 0).max())
    scores = product(queries, gallery, first, stop, options.similarity, workspace)
    ignore_in_place(scores, tile, gallery, options.exclude, first)
    return LabelRun(scores, tile._replace(block_start=tile.block_start - first), first, stop)


def ignore_in_place(
    scores: Tensor, tile: Queries, gallery: Gallery, exclude: str, first: int = 0
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


def dense_band(
    scores: Tensor,
    tile: Queries,
    gallery: Gallery,
    bound: Tensor,
    options: RankOptions,
    workspace: Workspace,
) -> Band:
    """The band of a tile read through full relevance and ignore masks (wide label
    blocks): the junk is written as NaN too, so nothing above ``hi`` is a positive."""
    target = tile.labels.unsqueeze(1) == gallery.labels.unsqueeze(0)
    if options.exclude == "same_label_and_group":
        junk = target & (tile.groups.unsqueeze(1) == gallery.groups.unsqueeze(0))
        scores.masked_fill_(junk, math.nan)
    valid = target & ~torch.isnan(scores)
    best = torch.where(valid, scores, float("-inf")).amax(dim=1, keepdim=True)
    has_positive = valid.any(dim=1)
    lo, hi = band_edges(best, bound, has_positive)
    greater = torch.zeros(scores.shape[0], dtype=count_dtype(scores.shape[1]), device=scores.device)
    found: Found = []
    keep = callable(options.similarity)
    near = near_scan(options.near_duplicate, bound, scores, scores.shape[1])
    if near is not None:
        near_block(scores, None, near, (tile.labels, gallery.labels), 0, keep, workspace)
    scan(scores, lo, hi, 0, greater, found, keep, workspace, True)
    return gather_band(greater, has_positive, found, near)
