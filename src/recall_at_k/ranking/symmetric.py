"""The symmetric route of leave-one-out on CPU: each score computed once for both of its
items.

Leave-one-out on CPU (the queries are the gallery) takes the symmetric route
(:func:`rank_symmetric`): each query's band first, from its label block; then the product in
square blocks ``(I, J)``, ``J >= I``, each scanned by rows (block I's queries) and by
columns (block J's): every score is computed once for both of its items.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from recall_at_k._kernel import Workspace, count_dtype
from recall_at_k.ranking.bands import (
    SPARSE_MAX_BLOCK_FRACTION,
    SYMMETRIC_MIN_ROWS,
    Band,
    Found,
    Near,
    RankOptions,
    Route,
    band_edges,
    block_best,
    label_run,
    near_block,
    near_scan,
    pairs_of,
    saturate,
    scan,
)
from recall_at_k.ranking.gallery import Gallery, Queries, centred_rows, gallery_bounds, product


def symmetric_possible(share: Queries, gallery: Gallery, route: Route) -> bool:
    """Whether the queries are the gallery's items, in its order, each ignoring only
    itself by identity (leave-one-out), with narrow label blocks (``"auto"``)."""
    if route.mode not in ("auto", "symmetric"):
        return False
    rows = share.rows
    if rows.shape != gallery.rows.shape or not torch.equal(rows, gallery.rows):
        return False
    own = torch.arange(rows.shape[0], device=rows.device)
    if not torch.equal(share.self_column, own):
        return False
    widest = int(share.block_count.max()) if rows.numel() else 0
    return route.mode == "symmetric" or widest <= SPARSE_MAX_BLOCK_FRACTION * rows.shape[0]


def rank_symmetric(
    gallery: Gallery,
    share: Queries,
    options: RankOptions,
    route: Route,
    tile_bytes: int,
    workspace: Workspace,
    add_band: Callable[[Queries, Band], None],
) -> int:
    """Rank leave-one-out queries (the gallery's own items, in its order) computing each
    score once for both of its items: the product in square blocks ``(I, J)``,
    ``J >= I``, whose rows are queries of block I and whose columns, read down, are
    queries of block J. Returns the number of queries ranked (the first ones): all, or
    fewer when more than ``route.pending_pairs`` in-band pairs wait for later blocks
    (or none when the blocks would be too small, or more than ``route.positive_pairs``
    in-band positives wait before the first block); the caller ranks the rest. Each
    block I of queries goes to ``add_band`` once scanned.

    First each query's s*_f and band edges, from its label block (as in
    :func:`block_scan`); then the blocks, each scanned by rows and by columns with
    those edges. A score of a block may differ in its last bits from the same pair's
    score in the label block's product; both are within B of the canonical score, so
    the band (2B around s*_f) is still certain. The blocks hide every item of the
    query's own label (the query itself, its positives -- their band pairs come from the
    label blocks --, label-and-group junk) and same-group items (``"same_group"``) as
    -inf: they scan negatives only, and a query's scan stops once ``max_k`` of them are
    surely above s*.
    """
    num = gallery.embeddings.shape[0]
    embeddings = gallery.embeddings  # the queries (centred like the gallery by centred_rows)
    size = math.isqrt(max(1, min(route.block_bytes, tile_bytes) // embeddings.element_size()))
    if route.mode == "auto" and size < min(SYMMETRIC_MIN_ROWS, num):
        return 0
    size = max(1, size)
    starts = list(range(0, num, size))
    device, dtype = embeddings.device, embeddings.dtype
    bound = gallery_bounds(gallery, options.similarity)
    greater = torch.zeros(num, dtype=count_dtype(num), device=device)
    has_positive = torch.zeros(num, dtype=torch.bool, device=device)
    lo = torch.full((num, 1), math.inf, dtype=dtype, device=device)
    hi = torch.full((num, 1), math.inf, dtype=dtype, device=device)
    positives: list[Found] = [[] for _ in starts]
    # The label blocks' scores of as many rows as fit ``tile_bytes`` at full width.
    step = max(1, tile_bytes // max(1, num * embeddings.element_size()))
    # Pairs kept for each block's queries, and their total for the blocks not yet done.
    kept, waiting = [0 for _ in starts], 0
    for index, start in enumerate(starts):
        for sub in range(start, min(start + size, num), step):
            rows = slice(sub, min(sub + step, start + size, num))
            count = _label_blocks(
                embeddings,
                gallery,
                share,
                options,
                workspace,
                rows,
                bound,
                lo,
                hi,
                has_positive,
                positives[index],
                sub - start,
            )
            kept[index] += count
            waiting += count
            if waiting > route.positive_pairs:  # many tied positives: the tiles are
                return 0  # better (they decide each tile's pairs as they go)
    # Above -inf, which the blocks write where an item is ignored (scores are finite).
    lo.clamp_(min=torch.finfo(dtype).min)
    near = near_scan(options.near_duplicate, bound, lo, num)
    found: list[Found] = [[] for _ in starts]
    near_found: list[Found] = [[] for _ in starts]
    for index, start in enumerate(starts):
        rows = slice(start, min(start + size, num))
        queries = centred_rows(gallery, rows.start, rows.stop)
        for later, column in enumerate(starts[index:], start=index):
            columns = slice(column, min(column + size, num))
            scores = product(queries, gallery, column, columns.stop, options.similarity, workspace)
            ignore_in_block(scores, gallery, options.exclude, rows, columns)
            if later > index:  # read down: the column's queries against the rows' items
                known = len(found[later]), len(near_found[later])
                down = scores.T
                peak = down.amax(dim=1, keepdim=True)
                if near is not None:
                    labels = gallery.labels[columns], gallery.labels[rows]
                    near_block(
                        down,
                        peak,
                        near_part(near, columns, near_found[later]),
                        labels,
                        start,
                        False,
                    )
                scan_down(
                    scores,
                    peak,
                    lo[columns],
                    hi[columns],
                    start,
                    greater[columns],
                    found[later],
                    workspace,
                )
                saturate(lo[columns], greater[columns], options.max_k)
                added = _size(found[later][known[0] :]) + _size(near_found[later][known[1] :])
                kept[later] += added
                waiting += added
            peak = scores.amax(dim=1, keepdim=True)
            if near is not None:
                labels = gallery.labels[rows], gallery.labels[columns]
                near_block(
                    scores, peak, near_part(near, rows, near_found[index]), labels, column, False
                )
            scan(
                scores,
                lo[rows],
                hi[rows],
                column,
                greater[rows],
                found[index],
                False,
                workspace,
                peak=peak,
            )
            saturate(lo[rows], greater[rows], options.max_k)
        tile = Queries._make(t[rows] for t in share)
        near_pairs = None if near is None else pairs_of(near_found[index], device)
        band_pairs = pairs_of(positives[index] + found[index], device)
        band = Band(
            greater[rows],
            has_positive[rows],
            band_pairs,
            None if near is None else near.sure[rows],
            near_pairs,
        )
        found[index], near_found[index], positives[index] = [], [], []
        add_band(tile, band)
        waiting -= kept[index]
        if waiting > route.pending_pairs:
            return min(num, start + size)
    return num


def _size(parts: Found) -> int:
    """The number of pairs in ``parts``."""
    return sum(part[0].shape[0] for part in parts)


def _label_blocks(
    embeddings: Tensor,
    gallery: Gallery,
    share: Queries,
    options: RankOptions,
    workspace: Workspace,
    rows: slice,
    bound: Tensor,
    lo: Tensor,
    hi: Tensor,
    has_positive: Tensor,
    positives: Found,
    offset: int,
) -> int:
    """The queries ``rows`` against their label blocks (one run of columns): each one's
    s*_f and band edges into ``lo``, ``hi``, ``has_positive``, and its valid positives
    in the band (all of them are at most ``hi``) into ``positives``, rows counted from
    ``offset`` before ``rows.start``: the blocks then scan negatives only, so that a
    query's scan may stop early. Returns the number of those positives."""
    tile = Queries._make(t[rows] for t in share)
    if not bool((tile.block_count > 0).any()):
        return 0
    queries = centred_rows(gallery, rows.start, rows.stop)
    run = label_run(queries, tile, gallery, options, workspace)
    groups = gallery.groups[run.first : run.stop]
    block = block_best(run.scores, run.tile, groups, options.exclude, workspace)
    lo_hi = band_edges(block.best, bound[rows], block.has_positive)
    lo[rows], hi[rows] = lo_hi
    has_positive[rows] = block.has_positive
    row, step = (block.valid & (block.values >= lo_hi[0])).nonzero(as_tuple=True)
    positives.append((row + offset, tile.block_start[row] + step, None))
    return int(row.shape[0])


def scan_down(
    scores: Tensor,
    peak: Tensor,
    lo: Tensor,
    hi: Tensor,
    first: int,
    greater: Tensor,
    found: Found,
    workspace: Workspace,
) -> None:
    """:func:`scan` of the columns of ``scores`` (each column a query, its rows items
    ``first:``), whose largest scores are ``peak`` ``[C, 1]``; ``scores`` is kept. Only
    the columns that reach ``lo`` are gathered, in the scores' memory order."""
    columns = (peak < lo).logical_not_().view(-1).nonzero().view(-1)
    if columns.numel() == 0:
        return
    shape = (scores.shape[0], columns.shape[0])
    candidates = workspace.get("down", shape, scores.dtype, scores.device)
    torch.index_select(scores, 1, columns, out=candidates)
    column_lo = lo.index_select(0, columns).view(1, -1)
    column_hi = hi.index_select(0, columns).view(1, -1)
    above = torch.gt(candidates, column_hi)
    greater.index_add_(0, columns, above.sum(dim=0, dtype=greater.dtype))
    inside = torch.ge(candidates, column_lo).logical_and_(above.logical_not_())
    row, column = inside.nonzero(as_tuple=True)
    if row.numel():
        found.append((columns[column], row + first, None))


def near_part(near: Near, rows: slice, found: Found) -> Near:
    """The near-duplicate scan of the queries ``rows`` (views of ``near``'s tensors)."""
    return Near(near.lo[rows], near.hi[rows], near.sure[rows], found)


def ignore_in_block(
    scores: Tensor, gallery: Gallery, exclude: str, rows: slice, columns: slice
) -> None:
    """Write -inf over the items of a block of leave-one-out scores (queries ``rows``
    against items ``columns``, both gallery positions) that its scan must not see: every
    item of the query's own label -- the query itself, its positives (their band pairs
    come from the label blocks), label-and-group junk -- and its group under
    ``"same_group"``.

    The gallery is in label order, so an item's label is a run of positions: in a block
    off the diagonal at most one label (a run from the rows' last position to the
    columns' first) has items on both sides, one rectangle. -inf, below every band's
    ``lo`` (finite or +inf) and the threshold's, is never counted or found -- like NaN
    elsewhere, but it leaves each row's largest score meaningful."""
    labels = gallery.labels
    if rows == columns:
        same_label = labels[rows].unsqueeze(1) == labels[columns].unsqueeze(0)
        scores.masked_fill_(same_label, -math.inf)
    else:
        last = labels[rows.stop - 1]
        if bool(labels[columns.start] == last):
            block = int(torch.searchsorted(gallery.block_labels, last))
            run_start = int(gallery.block_starts[block])
            run_stop = run_start + int(gallery.block_counts[block])
            top = max(run_start, rows.start) - rows.start  # the run ends past rows.stop
            right = min(run_stop, columns.stop) - columns.start  # it starts before columns
            scores[top:, :right] = -math.inf
    if exclude == "same_group":
        same = gallery.groups[rows].unsqueeze(1) == gallery.groups[columns].unsqueeze(0)
        scores.masked_fill_(same, -math.inf)
