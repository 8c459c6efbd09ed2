"""The symmetric route of leave-one-out on CPU: each score computed once for both of its
items.

Leave-one-out on CPU (the queries are the gallery) takes the symmetric route
(:func:`rank_symmetric`): each query's band first, from its label block; then the product in
square blocks ``(I, J)``, ``J >= I``, each scanned by rows (block I's queries) and by
columns (block J's): every score is computed once for both of its items.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from recall_at_k._kernel import Workspace, count_dtype
from recall_at_k.ranking.bands import (
    PENDING_SHARE,
    SPARSE_MAX_BLOCK_FRACTION,
    SYMMETRIC_MIN_ROWS,
    Band,
    Found,
    Near,
    Pairs,
    RankOptions,
    Route,
    band_edges,
    block_best,
    label_run,
    near_block,
    near_scan,
    pairs_of,
    pooled,
    saturate,
)
from recall_at_k.ranking.gallery import (
    Gallery,
    Queries,
    centred_rows,
    gallery_bounds,
    index_dtype,
    product,
)
from recall_at_k.ranking.workers import Workers


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
    workers: int = 1,
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

    Label blocks and blocks are tasks for ``workers`` threads (:mod:`.workers`),
    ``tile_bytes`` each: a block's task reads copies of its queries' band edges and
    returns its own counts and pairs, added here in the blocks' order.
    """
    num = gallery.embeddings.shape[0]
    embeddings = gallery.embeddings  # the queries (centred like the gallery by centred_rows)
    size = math.isqrt(max(1, min(route.block_bytes, tile_bytes) // embeddings.element_size()))
    if route.mode == "auto" and size < min(SYMMETRIC_MIN_ROWS, num):
        return 0
    size = max(1, size)
    device, dtype = embeddings.device, embeddings.dtype
    # The pairs that wait (each 2 int32 or int64 positions; a span's buffer at most
    # 1.5 times its pairs, _Waiting) stay within a share of chunk_bytes, or two a query
    # (the label blocks keep at least each query's best positive).
    budget = max(2 * num, options.chunk_bytes // (PENDING_SHARE * PAIR_BYTES))
    pending_limit = min(route.pending_pairs, budget)
    positive_limit = min(route.positive_pairs, budget)
    bound = gallery_bounds(gallery, options.similarity)
    greater = torch.zeros(num, dtype=count_dtype(num), device=device)
    has_positive = torch.zeros(num, dtype=torch.bool, device=device)
    lo = torch.full((num, 1), math.inf, dtype=dtype, device=device)
    hi = torch.full((num, 1), math.inf, dtype=dtype, device=device)
    widest = int(share.block_count.max()) if num else 0
    # Spans of rows made of whole labels where every label fits a span: each span's
    # label blocks are then its diagonal block, scored once for its band and its
    # negatives, and no block off the diagonal holds items of one label on both sides.
    most = max(size, math.isqrt(max(1, tile_bytes // embeddings.element_size())))
    spans = _label_spans(gallery, size, most) if 0 < widest <= size else None
    aligned = spans is not None
    if spans is None:
        spans = [slice(start, min(start + size, num)) for start in range(0, num, size)]
    # Per span, its queries' waiting pairs: in-band (positives first), near the threshold.
    positions = index_dtype(num)
    found = [_Waiting(positions) for _ in spans]
    near_found = [_Waiting(positions) for _ in spans]
    near = near_scan(options.near_duplicate, bound, lo, num)
    # Pairs kept for each block's queries, and their total for the blocks not yet done.
    kept, waiting, positive_count = [0 for _ in spans], 0, 0
    if aligned:
        parts = [(index, rows, 0) for index, rows in enumerate(spans)]
    else:
        # The label blocks of as many rows as fit ``tile_bytes``: those of ``step`` rows
        # lie in a run of at most ``step + 2 * widest`` columns (rows in label order).
        step = size
        while step > 1 and step * (step + 2 * widest) * embeddings.element_size() > tile_bytes:
            step = (step + 1) // 2
        parts = [
            (index, slice(sub, min(sub + step, rows.stop)), sub - rows.start)
            for index, rows in enumerate(spans)
            for sub in range(rows.start, rows.stop, step)
        ]

    def label_task(part: tuple[int, slice, int], space: Workspace) -> _Labelled | None:
        rows = part[1]
        if not aligned:
            labelled = _label_blocks(gallery, share, options, space, rows, bound, part[2])
            return None if labelled is None else _Labelled(labelled, None)
        return _diagonal(gallery, share, options, space, rows, bound, near)

    with Workers(label_task, min(workers, len(parts)), workspace) as pool:
        for (index, rows, _), result in zip(parts, pool.map(parts), strict=True):
            if result is None:
                continue
            labelled = result.blocks
            lo[rows], hi[rows] = labelled.lo, labelled.hi
            has_positive[rows] = labelled.has_positive
            found[index].add([labelled.positives])
            kept[index] += labelled.size
            waiting += labelled.size
            positive_count += labelled.size
            if positive_count > positive_limit:  # many tied positives: the tiles
                return 0  # are better (they decide each tile's pairs as they go)
            if result.diagonal is not None:
                side, pairs, near_part = result.diagonal
                if side.greater is not None:
                    greater[rows] += side.greater
                if near is not None and side.near is not None:
                    near.sure[rows] += side.near
                added = found[index].add(pairs) + near_found[index].add(near_part)
                kept[index] += added
                waiting += added
    # Above -inf, which the blocks write where an item is ignored (scores are finite).
    lo.clamp_(min=torch.finfo(dtype).min)
    if aligned:
        saturate(lo, greater, options.max_k)

    junk = None if aligned else _junk(gallery, spans)

    def blocks() -> Iterator[_Block]:
        """The blocks in order, each with copies of its queries' band edges as they
        are when it is taken (the diagonal ones already scanned when aligned)."""
        for index, rows in enumerate(spans):
            for later in range(index + int(aligned), len(spans)):
                columns = spans[later]
                # hi is final after the label blocks: only lo changes (saturate).
                edges = lo[rows].clone(), hi[rows], lo[columns].clone(), hi[columns]
                rectangle = None
                if junk is not None:
                    run_start, run_stop = junk[index]
                    if later > index and run_stop > columns.start:  # one label both sides
                        top = max(run_start, rows.start) - rows.start
                        rectangle = top, min(run_stop, columns.stop) - columns.start
                yield _Block(index, later, *edges, rectangle)

    def block_task(block: _Block, space: Workspace) -> _Scanned:
        return _scan_block(block, spans, gallery, options, near, space)

    def complete(index: int) -> bool:
        """Add the queries of span ``index`` (every block of theirs scanned); whether
        the route goes on (False: too many pairs wait, the caller ranks the rest)."""
        nonlocal waiting
        rows = spans[index]
        tile = Queries._make(t[rows] for t in share)
        near_pairs = None if near is None else near_found[index].pairs(device)
        band_pairs = found[index].pairs(device)
        band = Band(
            greater[rows],
            has_positive[rows],
            band_pairs,
            None if near is None else near.sure[rows],
            near_pairs,
        )
        found[index], near_found[index] = _Waiting(positions), _Waiting(positions)
        add_band(tile, band)
        waiting -= kept[index]
        return waiting <= pending_limit

    total = len(spans) * (len(spans) + 1) // 2 - (len(spans) if aligned else 0)
    with Workers(block_task, max(1, min(workers, total)), workspace) as block_pool:
        for scanned in block_pool.map(blocks()):
            index, later = scanned.row_block, scanned.column_block
            rows = spans[index]
            for part, (side, pairs, near_part) in enumerate(scanned.sides):
                where = spans[later] if part else rows
                if side.greater is not None:
                    greater[where] += side.greater
                    saturate(lo[where], greater[where], options.max_k)
                if near is not None and side.near is not None:
                    near.sure[where] += side.near
                target = later if part else index
                added = found[target].add(pairs) + near_found[target].add(near_part)
                kept[target] += added
                waiting += added
            if later == len(spans) - 1:
                if not complete(index):
                    return int(rows.stop)
            elif waiting > pending_limit and index > 0:
                return int(rows.start)  # the queries of the spans before are ranked
    if aligned:
        complete(len(spans) - 1)  # the last span has no block off the diagonal as rows
    return num


OWN_LABEL_SQUARES = 32
"""A diagonal block hides its queries' own labels as one square of -inf a label when
it holds at most this many labels (a slice each), else by one scatter."""

SCAN_SHARE = 8
"""A block's scan copies the rows (or columns) that reach their band at most
``1 / SCAN_SHARE`` of the block at a time: its scratch stays small beside the block."""

PAIR_BYTES = 16
"""The bytes of a waiting pair: its query's row and its item's column, int64."""


def _label_spans(gallery: Gallery, size: int, most: int) -> list[slice]:
    """Spans of about ``size`` rows (gallery positions), never more than ``most``, made
    of whole labels (every label's run, ``gallery.block_counts``, at most ``size``
    long): each span ends at the label boundary nearest ``size`` rows on; one
    ``bisect`` a span."""
    num = gallery.embeddings.shape[0]
    starts = gallery.block_starts.tolist()
    cuts = [0]
    while cuts[-1] + size < num:
        target = cuts[-1] + size
        index = bisect.bisect_right(starts, target) - 1
        cut = starts[index]  # after cuts[-1]: the label starting there fits ``size``
        after = starts[index + 1] if index + 1 < len(starts) else num
        if after - target < target - cut and after - cuts[-1] <= most:
            cut = after
        cuts.append(cut)
    if cuts[-1] < num:
        cuts.append(num)
    return [slice(a, b) for a, b in itertools.pairwise(cuts)]


def _ignore_own_labels(scores: Tensor, share: Queries, rows: slice, workspace: Workspace) -> None:
    """Write -inf over each query's own label in the diagonal block of a span of whole
    labels (the query itself, its positives, label-and-group junk): the columns
    ``block_start .. + block_count`` of its row, one scatter of ``[T, widest]``
    positions instead of a ``[T, T]`` label mask (a position past the label is the
    label's last column again)."""
    count = share.block_count[rows]
    widest = int(count.max()) if count.numel() else 0
    if widest == 0:
        return
    # The span's labels are runs of its rows (its own items in label order): a square
    # of -inf for each, when they are few.
    runs, lengths = torch.unique_consecutive(share.block_start[rows], return_counts=True)
    if runs.numel() <= OWN_LABEL_SQUARES:
        for first, length in zip((runs - rows.start).tolist(), lengths.tolist(), strict=True):
            scores[first : first + length, first : first + length] = -math.inf
        return
    device = scores.device
    start = (share.block_start[rows] - rows.start).unsqueeze(1)
    # The label pass's column buffer (done with): no scratch beyond what it held.
    columns = workspace.get("block_columns", (scores.shape[0], widest), torch.int64, device)
    torch.add(start, torch.arange(widest, device=device), out=columns)
    torch.minimum(columns, start + count.unsqueeze(1) - 1, out=columns)
    scores.scatter_(1, columns, -math.inf)


class _Labelled(NamedTuple):
    """A label task's result: the label blocks, and (aligned spans) the scan of the
    diagonal block."""

    blocks: _LabelBlocks
    diagonal: tuple[_Side, Found, Found] | None


def _diagonal(
    gallery: Gallery,
    share: Queries,
    options: RankOptions,
    workspace: Workspace,
    rows: slice,
    bound: Tensor,
    near: Near | None,
) -> _Labelled | None:
    """The diagonal block of a span of whole labels: its label blocks (each query's
    band), then its negatives scanned by rows with that band."""
    labelled = _label_blocks(gallery, share, options, workspace, rows, bound, 0, True)
    if labelled is None:
        return None
    scores = labelled.scores
    assert scores is not None and scores.shape[1] == rows.stop - rows.start
    _ignore_own_labels(scores, share, rows, workspace)
    if options.exclude == "same_group":
        same = gallery.groups[rows].unsqueeze(1) == gallery.groups[rows].unsqueeze(0)
        scores.masked_fill_(same, -math.inf)
    lo = labelled.lo.clamp(min=torch.finfo(scores.dtype).min)
    counts = count_dtype(gallery.embeddings.shape[0])
    peak = scores.amax(dim=1, keepdim=True)
    row_found: Found = []
    row_near: Found = []
    near_sure = None
    if near is not None:
        near_sure = torch.zeros(peak.shape[0], dtype=counts, device=scores.device)
        labels = gallery.labels[rows], gallery.labels[rows]
        part = Near(near.lo[rows], near.hi[rows], near_sure, row_near)
        near_block(scores, peak, part, labels, rows.start, False, workspace)
    greater = scan_queries(
        scores, 0, peak, lo, labelled.hi, rows.start, counts, row_found, workspace
    )
    side = (_Side(greater, near_sure), row_found, row_near)
    return _Labelled(labelled._replace(scores=None), side)


class _Block(NamedTuple):
    """A block ``(row_block, column_block)`` of the product and copies of its queries' band edges
    (rows: block ``index``'s queries; columns: block ``later``'s)."""

    row_block: int
    column_block: int
    row_lo: Tensor
    row_hi: Tensor
    column_lo: Tensor
    column_hi: Tensor
    junk: tuple[int, int] | None  # off the diagonal: (top, right) of its own label's items


class _Side(NamedTuple):
    """One side's counts in a block: negatives surely above s*, items surely near
    (None: none)."""

    greater: Tensor | None
    near: Tensor | None


class _Scanned(NamedTuple):
    """What a block adds: per side (its rows' queries, then its columns' unless on the
    diagonal) the counts, the in-band pairs and the near-duplicate pairs."""

    row_block: int
    column_block: int
    sides: list[tuple[_Side, Found, Found]]


def _scan_block(
    block: _Block,
    spans: list[slice],
    gallery: Gallery,
    options: RankOptions,
    near: Near | None,
    workspace: Workspace,
) -> _Scanned:
    """Compute and scan one block: by columns (off the diagonal) and by rows."""
    rows, columns = spans[block.row_block], spans[block.column_block]
    counts = count_dtype(gallery.embeddings.shape[0])
    scores = product(
        centred_rows(gallery, rows.start, rows.stop),
        gallery,
        columns.start,
        columns.stop,
        options.similarity,
        workspace,
    )
    if block.row_block == block.column_block:
        ignore_in_block(scores, gallery, options.exclude, rows, columns)
    else:
        if block.junk is not None:  # one label on both sides: its rectangle
            top, right = block.junk
            scores[top:, :right] = -math.inf
        if options.exclude == "same_group":
            same = gallery.groups[rows].unsqueeze(1) == gallery.groups[columns].unsqueeze(0)
            scores.masked_fill_(same, -math.inf)
    sides: list[tuple[_Side, Found, Found]] = []
    # Off the diagonal, read down: the column's queries against the rows' items.
    if block.column_block > block.row_block:
        down_found: Found = []
        down_near: Found = []
        peak = scores.amax(dim=0).unsqueeze(1)
        near_sure = None
        if near is not None:
            near_sure = torch.zeros(peak.shape[0], dtype=counts, device=scores.device)
            labels = gallery.labels[columns], gallery.labels[rows]
            part = Near(near.lo[columns], near.hi[columns], near_sure, down_near)
            near_block(scores.T, peak, part, labels, rows.start, False, workspace)
        greater = scan_queries(
            scores,
            1,
            peak,
            block.column_lo,
            block.column_hi,
            rows.start,
            counts,
            down_found,
            workspace,
        )
        sides.append((_Side(greater, near_sure), down_found, down_near))
    row_found: Found = []
    row_near: Found = []
    peak = scores.amax(dim=1, keepdim=True)
    near_sure = None
    if near is not None:
        near_sure = torch.zeros(peak.shape[0], dtype=counts, device=scores.device)
        labels = gallery.labels[rows], gallery.labels[columns]
        part = Near(near.lo[rows], near.hi[rows], near_sure, row_near)
        near_block(scores, peak, part, labels, columns.start, False, workspace)
    greater = scan_queries(
        scores, 0, peak, block.row_lo, block.row_hi, columns.start, counts, row_found, workspace
    )
    sides.insert(0, (_Side(greater, near_sure), row_found, row_near))
    return _Scanned(block.row_block, block.column_block, sides)


def _junk(gallery: Gallery, spans: list[slice]) -> list[tuple[int, int]]:
    """Per span of rows, the run of gallery positions ``[start, stop)`` of its last
    row's label (the gallery is in label order): the only label whose items a block off
    the diagonal may have on both sides."""
    last = torch.tensor([span.stop - 1 for span in spans], device=gallery.labels.device)
    run = torch.searchsorted(gallery.block_labels, gallery.labels[last])
    starts = gallery.block_starts[run]
    stops = starts + gallery.block_counts[run]
    return list(zip(starts.tolist(), stops.tolist(), strict=True))


WAITING_MIN_PAIRS = 16
"""A span's waiting pairs start with room for this many, then grow by half."""


class _Waiting:
    """The pairs waiting for one span of queries (rows, columns: gallery positions), in
    one buffer ``[2, capacity]`` that grows by half as they come, not a list of the
    small tensors each scan finds: those, kept from block to block between a block's
    temporaries, fragmented the C heap (hundreds of tensors a span, a few hundred
    bytes of heap each). Positions are kept int32 where the gallery allows (every span
    waits at once: at 24,000 items some 30,000 pairs in 370 spans)."""

    __slots__ = ("buffer", "dtype", "size")

    def __init__(self, dtype: torch.dtype) -> None:
        self.buffer: Tensor | None = None
        self.dtype = dtype
        self.size = 0

    def add(self, parts: Found) -> int:
        """Append the pairs of ``parts`` (a scan's, in order); how many."""
        count = sum(part[0].shape[0] for part in parts)
        if count == 0:
            return 0
        need = self.size + count
        if self.buffer is None or need > self.buffer.shape[1]:
            capacity = max(WAITING_MIN_PAIRS, need + need // 2)
            device = parts[0][0].device
            grown = torch.empty((2, capacity), dtype=self.dtype, device=device)
            if self.buffer is not None:
                grown[:, : self.size] = self.buffer[:, : self.size]
            self.buffer = grown
        for rows, columns, _ in parts:
            stop = self.size + rows.shape[0]
            self.buffer[0, self.size : stop] = rows
            self.buffer[1, self.size : stop] = columns
            self.size = stop
        return count

    def pairs(self, device: torch.device) -> Pairs:
        """The pairs so far (int64 copies: the buffer is freed with this span)."""
        if self.buffer is None:
            return pairs_of([], device)
        rows, columns = self.buffer[:, : self.size].long()
        return Pairs(rows, columns, None)


class _LabelBlocks(NamedTuple):
    """Queries' s*_f and band edges from their label blocks, and their valid positives
    in the band (rows counted from the symmetric block's first)."""

    lo: Tensor
    hi: Tensor
    has_positive: Tensor
    positives: tuple[Tensor, Tensor, Tensor | None]
    size: int
    scores: Tensor | None = None  # the label run's scores, when asked for


def _label_blocks(
    gallery: Gallery,
    share: Queries,
    options: RankOptions,
    workspace: Workspace,
    rows: slice,
    bound: Tensor,
    offset: int,
    keep_scores: bool = False,
) -> _LabelBlocks | None:
    """The queries ``rows`` against their label blocks (one run of columns): each one's
    s*_f and band edges, and its valid positives in the band (all of them are at most
    ``hi``), rows counted from ``offset`` before ``rows.start``: the blocks then scan
    negatives only, so that a query's scan may stop early. None where no query of
    ``rows`` has a label block."""
    tile = Queries._make(t[rows] for t in share)
    if not bool((tile.block_count > 0).any()):
        return None
    queries = centred_rows(gallery, rows.start, rows.stop)
    run = label_run(queries, tile, gallery, options, workspace)
    groups = gallery.groups[run.first : run.stop]
    block = block_best(run.scores, run.tile, groups, options.exclude, workspace)
    lo, hi = band_edges(block.best, bound[rows], block.has_positive)
    row, step = (block.valid & (block.values >= lo)).nonzero(as_tuple=True)
    positives = (row + offset, tile.block_start[row] + step, None)
    scores = run.scores if keep_scores else None
    return _LabelBlocks(lo, hi, block.has_positive, positives, int(row.shape[0]), scores)


def scan_queries(
    scores: Tensor,
    axis: int,
    peak: Tensor,
    lo: Tensor,
    hi: Tensor,
    first: int,
    counts: torch.dtype,
    found: Found,
    workspace: Workspace,
) -> Tensor | None:
    """:func:`scan` of a block's queries along ``axis`` (0: each row a query, its
    columns items ``first:``; 1: each column a query, its rows items ``first:``), whose
    largest scores are ``peak``: per query the count (``counts`` dtype) of scores above
    ``hi`` (None when no query reaches ``lo``), and into ``found`` the pairs within
    ``[lo, hi]``. ``scores`` is kept. Only the queries reaching ``lo`` are gathered, at
    most ``1 / SCAN_SHARE`` of the block at a time (all of them may reach it), in the
    scores' memory order, into buffers of ``workspace``."""
    reaching = torch.ge(peak, lo).view(-1).nonzero().view(-1)
    if reaching.numel() == 0:
        return None
    size, other = scores.shape[axis], scores.shape[1 - axis]
    shape = (-1, 1) if axis == 0 else (1, -1)
    step = max(1, size // SCAN_SHARE)
    # Buffers of the workspace, not fresh temporaries (:func:`pooled`).
    device = scores.device
    values = pooled(workspace, "scan_values", step * other, scores.dtype, device)
    above_marks = pooled(workspace, "scan_above", step * other, torch.bool, device)
    inside_marks = pooled(workspace, "scan_inside", step * other, torch.bool, device)
    greater = torch.zeros(size, dtype=counts, device=scores.device)
    for picked in torch.split(reaching, step):
        held = picked.shape[0] * other
        picked_shape = (picked.shape[0], other) if axis == 0 else (other, picked.shape[0])
        candidates = values[:held].view(picked_shape)
        torch.index_select(scores, axis, picked, out=candidates)
        above = above_marks[:held].view(picked_shape)
        torch.gt(candidates, hi.index_select(0, picked).view(shape), out=above)
        greater.index_add_(0, picked, above.sum(dim=1 - axis, dtype=counts))
        # hi >= lo for a query that reaches lo: what is above hi is at or above lo.
        inside = inside_marks[:held].view(picked_shape)
        torch.ge(candidates, lo.index_select(0, picked).view(shape), out=inside)
        row, column = inside.logical_xor_(above).nonzero(as_tuple=True)
        if row.numel():
            query, item = (row, column) if axis == 0 else (column, row)
            found.append((picked[query], item + first, None))
    return greater


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
