"""The ranking engine: a block of queries against a block of gallery items, scanned
(:mod:`~recall_at_k.ranking.scan`) and decided (:mod:`~recall_at_k.ranking.decide`),
over the blocks a source yields (:mod:`~recall_at_k.ranking.blocks`).

Per query it finds ``s*_f`` and its band from the query's positives, counts the negatives
surely above the band and hands every pair inside it to the decider. The walk depends
only on the source:

- one block, leave-one-out on CPU: the product in square blocks, each computed once for
  the queries of its rows and of its columns (:func:`_squares`), after each query's band
  from its label's block;
- one block otherwise: tiles of queries, each tile's label run first, then -- on CPU --
  the other columns in cache-sized panels, or the tile's whole row of scores (:func:`_tiles`);
- a gallery sharded across processes: two passes over the blocks passing by, positives
  first, then negatives (:func:`_passes`).

Tiles and squares run on the CPU's threads (the caller's and workers), merged in order.
:func:`rank` ranks every direction, shares the queries among processes when every process
holds every item, and sums the counts. Counts are integers and ``ties="expected"`` rounds
probabilities to a grid on which float64 sums are exact, so the result is the same for
every tiling, thread count and process count."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k import _collectives as collectives
from recall_at_k import _kernel
from recall_at_k._embedding_checks import nan_scores_error
from recall_at_k._kernel import TieCounts, Workspace, count_dtype
from recall_at_k._types import Similarity
from recall_at_k.ranking.blocks import (
    Gallery,
    LocalSource,
    Processes,
    ShardedSource,
    Source,
    bounds,
    locate,
    product,
    scores_of,
)
from recall_at_k.ranking.budget import (
    CPU_PANEL_BYTES,
    CPU_PANEL_COLUMNS,
    CPU_SQUARE_BYTES,
    SQUARE_MIN_ROWS,
    Budget,
    workers_within,
)
from recall_at_k.ranking.decide import NEAR, NEGATIVE, POSITIVE, Decider
from recall_at_k.ranking.plan import Direction, Plan
from recall_at_k.ranking.progress import Progress
from recall_at_k.ranking.scan import (
    POSITIVE_SLOTS,
    Found,
    Near,
    Stack,
    band_edges,
    hide_ignored,
    hide_own_labels,
    joined,
    near_band,
    pooled,
    positives,
    run_columns,
    saturate,
    scan_square,
)
from recall_at_k.ranking.workers import Workers, caller_on_one_thread, worker_count

Mode = Literal["auto", "squares", "panels", "tiles"]
"""How one block's queries are walked: chosen (``"auto"``) or forced by tests: ``"squares"``
(leave-one-out on CPU), ``"panels"`` (CPU tiles with panels), ``"tiles"`` (whole rows of
scores, as on a GPU). Every mode gives the same counts."""
WIDE_LABELS = 0.25
"""Leave-one-out takes squares (``"auto"``) while every label has at most this share of items."""
NEAR_COUNTS = (
    "near_positive",
    "near_negative_with_positive",
    "near_negative_without_positive",
    "near_hits_at_1",
)
"""What :attr:`Ranked.near` counts, in order."""


class RankOptions(NamedTuple):
    """What a ranking needs besides the items."""

    similarity: Similarity
    exclude: str
    ties: str
    max_k: int
    validate: bool  # look for NaN scores where they could occur
    near_duplicate: float | None = None
    progress: bool = False
    mode: Mode = "auto"
    caller: str = "EmbeddingRecallAtK.compute()"  # named by a failure on another process


class QueryCounts(NamedTuple):
    """One direction's counts on this process, per query of its share, and what the ranking did."""

    counts: TieCounts
    position: Tensor  # each query's index among the direction's queries
    near: Tensor  # int64 [4] (NEAR_COUNTS)
    nan: Tensor  # int64: queries whose scores held NaN
    rescored: int


SATURATE_EVERY = 4
"""Squares merged between looks for queries missed at every K (each look reads them all)."""


class _State:
    """What the scans add up per query of this process's share."""

    def __init__(self, source: Source, options: RankOptions, gallery_size: int) -> None:
        queries = source.queries
        count, device = queries.labels.shape[0], queries.labels.device
        self.has_positive = torch.zeros(count, dtype=torch.bool, device=device)
        self.greater = torch.zeros(count, dtype=count_dtype(gallery_size), device=device)
        self.nan = torch.zeros(count if options.validate else 0, dtype=torch.bool, device=device)
        near = options.near_duplicate is not None
        self.near = torch.zeros(count if near else 0, dtype=torch.int32, device=device)
        self.hole = math.nan if callable(options.similarity) else -math.inf


class _Result(NamedTuple):
    """A tile's or a square's contribution, its rows counted from ``first``."""

    first: int
    stop: int
    has_positive: Tensor | None
    greater: Tensor | None
    near: Tensor | None
    nan: Tensor | None
    found: list[tuple[int, Found]]  # (kind, pairs), positives first


_Square = tuple[int, int, Tensor, tuple[int, int] | None]
"""A square: its spans' indices (rows, columns), a copy of their bands, its rectangle."""
_Counted = list[tuple[int, Tensor, Tensor, Found]]
"""A square's scans by kind: the queries reaching the band, their counts above it, pairs in it."""


class _Walk(NamedTuple):
    """What walking one block's queries needs besides the block."""

    state: _State
    decider: Decider
    options: RankOptions
    budget: Budget
    workers: int
    progress: Progress


def _merge(result: _Result, state: _State, decider: Decider, offset: int = 0) -> None:
    part = slice(result.first, result.stop)
    if result.has_positive is not None:
        state.has_positive[part] |= result.has_positive
    if result.greater is not None:
        state.greater[part] += result.greater
    if result.near is not None:
        state.near[part] += result.near
    if result.nan is not None:
        state.nan[part] |= result.nan
    for kind, found in result.found:
        decider.add(kind, found, result.first + offset)


def rank_direction(
    source: Source,
    options: RankOptions,
    budget: Budget,
    workspace: Workspace,
    known: Tensor | None = None,
) -> QueryCounts:
    """Rank the source's queries against its gallery (a collective for a sharded one).
    ``known``: bool ``[2, Q]``, queries known to have a near positive / negative."""
    queries, state = source.queries, _State(source, options, budget.items)
    decider = Decider(state.greater, source, options.near_duplicate, budget, workspace)
    if isinstance(source, LocalSource):
        gallery = source.gallery
        device = gallery.fast.device
        workers = 1 if callable(options.similarity) else worker_count(device)
        if options.mode == "auto":  # a route named by the tests takes every thread
            workers = workers_within(workers, budget.tile_for(device))
        progress = Progress(queries.labels.shape[0], options.progress)
        walk = _Walk(state, decider, options, budget, workers, progress)
        if not (_squares_possible(source, options, device) and _squares(source, walk)):
            _tiles(source, walk)
        decider.flush(gallery, last=True)
        progress.close()
    else:
        _passes(source, state, decider, options, budget)
    return _counts(source, state, decider, options, known)


def _counts(
    source: Source, state: _State, decider: Decider, options: RankOptions, known: Tensor | None
) -> QueryCounts:
    decided = decider.result()
    greater = state.greater.to(decided.equal.dtype)
    at_or_above = decided.equal.add_(greater)
    counts = TieCounts(greater, at_or_above, decided.tied, state.has_positive)
    device = greater.device
    near = torch.zeros(len(NEAR_COUNTS), dtype=torch.int64, device=device)
    if options.near_duplicate is not None:
        has = state.has_positive
        reaches = has & (decided.best >= options.near_duplicate)
        assert decided.near is not None
        near_positive, near_negative = reaches, (state.near > 0) | decided.near
        if known is not None:
            flags = known[:, source.queries.position]
            near_positive, near_negative = near_positive | flags[0], near_negative | flags[1]
        beaten = greater if options.ties == "optimistic" else at_or_above
        hits = reaches & (beaten == 0)
        counted = (near_positive, near_negative & has, near_negative & ~has, hits)
        near = torch.stack([flag.count_nonzero() for flag in counted])  # no int64 copy
    nan = state.nan.sum()
    return QueryCounts(counts, source.queries.position, near, nan, decider.rescored)


def _tiles(source: LocalSource, walk: _Walk) -> None:
    """Every query in tiles against the one block (see the module)."""
    state, decider, options, budget, workers, progress = walk
    gallery, located, queries = source.gallery, source.located, source.queries
    stats, similarity = source.stats, options.similarity
    num_gallery, dim = gallery.fast.shape
    device, itemsize = gallery.fast.device, gallery.fast.element_size()
    count, tile_bytes = queries.labels.shape[0], budget.tile_for(device, workers)
    check_nan = options.validate and stats.check_nan
    panels = device.type == "cpu" and not callable(similarity) and not check_nan
    panels = panels and options.mode != "tiles"
    keep, counts = callable(similarity), state.greater.dtype
    junk = options.exclude == "same_label_and_group"
    same_group = options.exclude == "same_group"
    if panels:
        panel_bytes = min(CPU_PANEL_BYTES, max(1, tile_bytes // 2))
        columns = max(1, min(CPU_PANEL_COLUMNS, panel_bytes // itemsize))
        rows = max(1, tile_bytes // ((dim + 3 * columns) * itemsize))
        rows = min(rows, max(1, panel_bytes // (columns * itemsize)))
    else:
        rows = max(1, tile_bytes // ((num_gallery + dim) * itemsize))
    tiles = _cut(located.start, located.length, count, rows, tile_bytes // itemsize)

    def task(tile: tuple[int, int], workspace: Workspace) -> _Result:
        first_query, stop_query = tile
        part = slice(first_query, stop_query)
        rows_fast = source.query_rows(first_query, stop_query)
        bound = bounds(rows_fast, stats)
        start, length = located.start[part], located.length[part]
        own, groups = located.own[part], queries.groups[part]
        nan = None
        if panels:
            present = length > 0
            first = int(torch.where(present, start, num_gallery).min())
            stop = int(torch.where(present, start + length, 0).max())
            first, stop = (first, stop) if first < stop else (0, 0)
            scores = product(rows_fast, gallery, first, stop, workspace, tile_bytes)
        else:
            first, stop = 0, num_gallery
            scores = scores_of(rows_fast, gallery, similarity, workspace)
            if check_nan:
                nan = torch.isnan(scores).any(dim=1)
        column_groups = gallery.groups[first:stop]
        hide_ignored(scores, own - first, groups if same_group else None, column_groups, state.hole)
        junk_groups = (groups, column_groups) if junk else None
        found = positives(
            scores, start - first, length, junk_groups, bound, state.hole, keep, workspace
        )
        band = found.band
        hide_own_labels(scores, found.runs, length, state.hole)
        scanner = _Scanner(workspace, tile_bytes, options.near_duplicate, counts, keep)
        scanned = scanner.scan(scores, band, first, bound)
        greater, near_state = scanned.greater, scanned.near
        if panels:
            saturate(band, greater, options.max_k)
            outside = (own >= 0) & ((own < first) | (own >= stop))
            ignore_outside = same_group or bool(outside.any())
            width = max(1, panel_bytes // (rows * itemsize))
            spans = [(a, min(a + width, first)) for a in range(0, first, width)]
            spans += [(a, min(a + width, num_gallery)) for a in range(stop, num_gallery, width)]
            stack = Stack(band, greater, scanned.pairs, width, workspace, tile_bytes)
            for a, b in spans:
                panel = product(rows_fast, gallery, a, b, workspace, tile_bytes)
                if ignore_outside:
                    row_groups = groups if same_group else None
                    hide_ignored(panel, own - a, row_groups, gallery.groups[a:b], state.hole)
                peak = panel.amax(dim=1, keepdim=True)
                if near_state is not None:
                    near_band, near_sure, pairs = near_state
                    scanner.into(panel, peak, near_band, a, near_sure, pairs)
                if stack.add(panel, peak, a):
                    saturate(band, greater, options.max_k)
            stack.flush()
        positive = Found(found.found.rows, found.found.columns + first, found.found.values)
        kinds = scanned.kinds(positive)
        has_positive, sure = found.has_positive, scanned.sure
        return _Result(first_query, stop_query, has_positive, greater, sure, nan, kinds)

    with Workers(min(workers, len(tiles)), decider.workspace) as pool:
        for result in pool.map(task, tiles):
            _merge(result, state, decider)
            progress.update(result.stop - result.first)
            if decider.full():
                decider.flush(gallery)


class _Scanned(NamedTuple):
    """A block's scan: negatives surely above each band, pairs inside, near scan (or None)."""

    greater: Tensor
    pairs: list[Found]
    near: Near | None

    @property
    def sure(self) -> Tensor | None:
        return None if self.near is None else self.near.sure

    def kinds(self, positive: Found | None) -> list[tuple[int, Found]]:
        """The pairs to decide by kind, positives first."""
        device = self.greater.device
        out: list[tuple[int, Found]] = [] if positive is None else [(POSITIVE, positive)]
        out.append((NEGATIVE, joined(self.pairs, device)))
        if self.near is not None:
            out.append((NEAR, joined(self.near.found, device)))
        return out


class _Scanner(NamedTuple):
    """What scanning a block needs besides its scores and bands."""

    workspace: Workspace
    buffer_bytes: int
    threshold: float | None  # near_duplicate
    counts: torch.dtype
    keep: bool = False  # keep the fast scores (a callable's, which are the canonical)

    def scan(self, scores: Tensor, band: Tensor, first: int, bound: Tensor) -> _Scanned:
        """Scan ``scores`` (a query a row, its items columns from ``first``) for each query's
        ``band`` ``[lo, hi]`` and the near threshold."""
        greater = torch.zeros(scores.shape[0], dtype=self.counts, device=scores.device)
        near = None
        if self.threshold is not None:  # an empty near-duplicate scan
            sure = torch.zeros(scores.shape[0], dtype=torch.int64, device=scores.device)
            near = Near(near_band(self.threshold, bound, scores.dtype), sure, [])
        found = _Scanned(greater, [], near)
        if scores.numel():
            peak = scores.amax(dim=1, keepdim=True)
            if found.near is not None:
                self.into(scores, peak, found.near.band, first, found.near.sure, found.near.found)
            self.into(scores, peak, band, first, greater, found.pairs)
        return found

    def into(
        self, scores: Tensor, peak: Tensor, band: Tensor, first: int, to: Tensor, found: list[Found]
    ) -> None:
        """Count each row's items above its ``band`` into ``to``, add those inside to ``found``:
        :func:`scan_square` of the rows alone (their items columns from ``first``)."""
        room = self.workspace, self.buffer_bytes
        got = scan_square(scores, peak.view(-1), band, (0, first), *room, self.keep)
        if got is not None:
            to.index_add_(0, got[0], got[1].to(to.dtype))
            found.append(got[2])


def _cut(start: Tensor, count: Tensor, total: int, rows: int, most: int) -> list[tuple[int, int]]:
    """Tiles of ``rows`` queries, cut smaller where a tile's label run times its rows
    exceeds ``most`` scores (queries in label order: a tile's runs are one run)."""
    if total == 0:
        return []
    starts, ends, present = start.tolist(), (start + count).tolist(), count.gt(0).tolist()
    tiles = []
    first = 0
    while first < total:
        stop = min(total, first + rows)
        while stop - first > 1:
            lows = [s for s, p in zip(starts[first:stop], present[first:stop], strict=True) if p]
            if not lows:
                break
            highs = [e for e, p in zip(ends[first:stop], present[first:stop], strict=True) if p]
            width = max(highs) - min(lows)
            if (stop - first) * width <= most:
                break
            stop = first + max(1, (stop - first) // 2)
        tiles.append((first, stop))
        first = stop
    return tiles


def _squares_possible(source: LocalSource, options: RankOptions, device: torch.device) -> bool:
    """Whether leave-one-out takes the squares: on CPU, a built-in similarity without NaN
    checks, every label at most :data:`WIDE_LABELS` of the items (``"auto"``)."""
    if not source.leave_one_out or device.type != "cpu" or callable(options.similarity):
        return False
    if options.validate and source.stats.check_nan:
        return False
    if options.mode != "auto":
        return options.mode == "squares"
    count = source.located.length
    return int(count.max()) <= WIDE_LABELS * count.shape[0]


def _squares(source: LocalSource, walk: _Walk) -> bool:
    """Leave-one-out in square blocks ``(I, J)``, ``J >= I``: rows the queries of span I,
    columns (read down) those of span J, every score computed once for both items. Each
    query's band comes first from its label's run; the squares then see negatives only.
    Whether the squares were taken (not when too small, ``"auto"``)."""
    state, decider, options, budget, workers, progress = walk
    gallery, located, stats = source.gallery, source.located, source.stats
    num = gallery.fast.shape[0]
    device, itemsize = gallery.fast.device, gallery.fast.element_size()
    tile_bytes = budget.tile_for(device, workers)
    size = math.isqrt(max(1, min(CPU_SQUARE_BYTES, tile_bytes) // itemsize))
    if options.mode == "auto" and size < min(SQUARE_MIN_ROWS, num):
        return False
    size = max(1, size)
    hole, threshold, max_k = state.hole, options.near_duplicate, options.max_k
    counts = state.greater.dtype
    junk = options.exclude == "same_label_and_group"
    same_group = options.exclude == "same_group"

    def centred(span: slice) -> Tensor:
        rows = gallery.fast[span]
        return rows if stats.centre is None else rows - stats.centre

    bound = torch.empty((num, 1), dtype=torch.float64, device=device)
    for a in range(0, num, size):
        bound[a : a + size] = bounds(centred(slice(a, a + size)), stats)
    widest = int(located.length.max()) if num else 0
    most = max(size, math.isqrt(max(1, tile_bytes // itemsize)))
    spans = label_spans(gallery, size, most) if 0 < widest <= size else None
    aligned = spans is not None
    if spans is None:
        spans = [slice(a, min(a + size, num)) for a in range(0, num, size)]
    band = torch.full((num, 2), math.inf, dtype=gallery.fast.dtype, device=device)
    if aligned:
        parts = [(span.start, span.stop) for span in spans]
    else:  # label runs of ``step`` rows lie within ``step + 2 widest`` columns
        step = size
        while step > 1 and step * (step + 2 * widest) * itemsize > tile_bytes:
            step = (step + 1) // 2
        parts = [(a, min(a + step, s.stop)) for s in spans for a in range(s.start, s.stop, step)]

    def label_task(part: tuple[int, int], workspace: Workspace) -> tuple[_Result, Tensor]:
        a, b = part
        start, length = located.start[a:b], located.length[a:b]
        first, stop = (a, b) if aligned else (int(start.min()), int((start + length).max()))
        scores = product(centred(slice(a, b)), gallery, first, stop, workspace, tile_bytes)
        groups, column_groups = gallery.groups[a:b], gallery.groups[first:stop]
        own = located.own[a:b] - first
        hide_ignored(scores, own, groups if same_group else None, column_groups, hole)
        junk_groups = (groups, column_groups) if junk else None
        found = positives(
            scores, start - first, length, junk_groups, bound[a:b], hole, False, workspace
        )
        kept = Found(found.found.rows, found.found.columns + first, None)
        bands = found.band
        if not aligned:
            result = _Result(a, b, found.has_positive, None, None, None, [(POSITIVE, kept)])
            return result, bands
        # A span of whole labels: its diagonal square's negatives are scanned now.
        hide_own_labels(scores, found.runs, length, hole)
        scanner = _Scanner(workspace, tile_bytes, threshold, counts)
        scanned = scanner.scan(scores, bands, first, bound[a:b])
        kinds = scanned.kinds(kept)
        result = _Result(a, b, found.has_positive, scanned.greater, scanned.sure, None, kinds)
        return result, bands

    junk_runs = None if aligned else _junk(gallery, spans)

    def squares() -> Iterator[_Square]:
        """Each square with a copy of its queries' bands when taken (they rise to +inf)."""
        for index, rows in enumerate(spans):
            for later in range(index + int(aligned), len(spans)):
                columns, rectangle = spans[later], None
                if junk_runs is not None and later > index:
                    run_start, run_stop = junk_runs[index]
                    if run_stop > columns.start:  # one label on both sides: its rectangle
                        top = max(run_start, rows.start) - rows.start
                        rectangle = top, min(run_stop, columns.stop) - columns.start
                sides = band[rows] if later == index else torch.cat((band[rows], band[columns]))
                yield index, later, sides, rectangle

    def square_task(square: _Square, workspace: Workspace) -> _Counted:
        index, later, sides, rectangle = square
        rows, columns = spans[index], spans[later]
        scores = product(centred(rows), gallery, columns.start, columns.stop, workspace, tile_bytes)
        if index == later:  # a diagonal square of spans cut anywhere: its own labels
            same = gallery.labels[rows].unsqueeze(1) == gallery.labels[columns].unsqueeze(0)
            scores.masked_fill_(same, hole)
        elif rectangle is not None:
            scores[rectangle[0] :, : rectangle[1]] = hole
        if same_group:
            same = gallery.groups[rows].unsqueeze(1) == gallery.groups[columns].unsqueeze(0)
            scores.masked_fill_(same, hole)
        # its rows' largest scores, then (read down: the columns' queries) its columns'
        height = scores.shape[0]
        peaks = pooled(workspace, "square_peaks", (sides.shape[0],), scores.dtype, device)
        torch.amax(scores, 1, out=peaks[:height])
        if later > index:
            torch.amax(scores, 0, out=peaks[height:])
        kinds = [(NEGATIVE, sides)]
        if threshold is not None:  # the near-duplicate threshold's band, as the other
            bound_of = bound[rows] if later == index else torch.cat((bound[rows], bound[columns]))
            kinds.append((NEAR, near_band(threshold, bound_of, sides.dtype)))
        firsts, out = (rows.start, columns.start), []
        for kind, bands in kinds:
            got = scan_square(scores, peaks, bands, firsts, workspace, tile_bytes)
            if got is not None:  # the counts in their state's dtype
                queries, above, pairs = got
                out.append((kind, queries, above.to(dtypes[kind]), pairs))
        return out

    dtypes = {NEGATIVE: state.greater.dtype, NEAR: state.near.dtype}
    total = len(spans) * (len(spans) + 1) // 2 - (len(spans) if aligned else 0)
    count = max(1, min(workers, max(len(parts), total)))
    # One pool for both passes: its threads keep their tile and scan buffers.
    with Workers(count, decider.workspace) as pool:
        for result, bands in pool.map(label_task, parts):
            band[result.first : result.stop] = bands
            _merge(result, state, decider)
            if decider.full():
                decider.flush(gallery)
        pool.release(*POSITIVE_SLOTS)
        if aligned:
            saturate(band, state.greater, max_k)
        for merged, results in enumerate(pool.map(square_task, squares()), 1):
            for kind, queries, above, pairs in results:
                (state.greater if kind == NEGATIVE else state.near).index_add_(0, queries, above)
                decider.add(kind, pairs)
            if merged % SATURATE_EVERY == 0:  # queries missed at every K are scanned no more
                saturate(band, state.greater, max_k)
            if decider.full():
                decider.flush(gallery)
    progress.update(num)
    return True


def label_spans(gallery: Gallery, size: int, most: int) -> list[slice]:
    """Spans of about ``size`` rows (at most ``most``) of whole labels (each at most ``size``
    long), each ending at the label boundary nearest ``size`` rows on."""
    num = gallery.fast.shape[0]
    starts = gallery.block_starts.tolist()
    cuts = [0]
    while cuts[-1] + size < num:
        target = cuts[-1] + size
        index = bisect.bisect_right(starts, target) - 1
        cut = starts[index]
        after = starts[index + 1] if index + 1 < len(starts) else num
        if after - target < target - cut and after - cuts[-1] <= most:
            cut = after
        cuts.append(cut)
    if cuts[-1] < num:
        cuts.append(num)
    return [slice(a, b) for a, b in itertools.pairwise(cuts)]


def _junk(gallery: Gallery, spans: list[slice]) -> list[tuple[int, int]]:
    """Per span, the column run of its last row's label (a square may hold it on both sides)."""
    last = torch.tensor([span.stop - 1 for span in spans], device=gallery.labels.device)
    run = torch.searchsorted(gallery.block_labels, gallery.labels[last])
    starts = gallery.block_starts[run]
    stops = starts + gallery.block_counts[run]
    return list(zip(starts.tolist(), stops.tolist(), strict=True))


class _Guard:
    """Runs this process's work; after a failure skips it (the process still takes part in
    every collective) and keeps the error to raise once all have reduced."""

    def __init__(self) -> None:
        self.failure: Exception | None = None

    def run(self, work: Any, *args: Any) -> None:
        if self.failure is None:
            try:
                work(*args)
            except Exception as err:
                self.failure = err


def _passes(
    source: ShardedSource, state: _State, decider: Decider, options: RankOptions, budget: Budget
) -> None:
    """The source's gallery passes by twice: the positives first (``s*_f`` and the
    positives in band of every query), then every item (the negatives)."""
    queries, stats = source.queries, source.stats
    count, device = queries.labels.shape[0], queries.labels.device
    dim = source.rows.shape[1]
    itemsize = torch.finfo(stats.dtype).bits // 8
    tile_bytes = budget.tile_for(device)
    step = max(1, tile_bytes // ((source.run_rows + dim) * itemsize))
    tiles = [(a, min(count, a + step)) for a in range(0, count, step)]
    hole, workspace = state.hole, decider.workspace
    check_nan = options.validate and stats.check_nan
    junk = options.exclude == "same_label_and_group"
    same_group = options.exclude == "same_group"
    guard = _Guard()
    bound = torch.zeros((count, 1), dtype=torch.float64, device=device)
    best = torch.full((count, 1), -math.inf, dtype=stats.dtype, device=device)
    runs = sum(-(-order.shape[0] // source.run_rows) for order in source.orders)
    me = dist.get_rank(source.rows.group)
    progress = Progress(2 * runs, options.progress and me == 0, "sharded gallery", "block")

    def bounds_of() -> None:
        for a, b in tiles:
            bound[a:b] = bounds(source.query_rows(a, b, workspace), stats)

    def positives_of(gallery: Gallery) -> None:
        located = locate(queries, gallery)
        for a, b in tiles:
            start, length = located.start[a:b], located.length[a:b]
            present = length > 0
            if not bool(present.any()):
                continue
            first = int(torch.where(present, start, gallery.fast.shape[0]).min())
            stop = int(torch.where(present, start + length, 0).max())
            rows_fast = source.query_rows(a, b, workspace)
            scores = product(rows_fast, gallery, first, stop, workspace, tile_bytes)
            groups, column_groups = queries.groups[a:b], gallery.groups[first:stop]
            own = located.own[a:b] - first
            hide_ignored(scores, own, groups if same_group else None, column_groups, hole)
            junk_groups = (groups, column_groups) if junk else None
            found = positives(
                scores, start - first, length, junk_groups, bound[a:b], hole, False, workspace
            )
            torch.maximum(best[a:b], found.best, out=best[a:b])
            state.has_positive[a:b] |= found.has_positive
            decider.add(POSITIVE, Found(found.found.rows, found.found.columns + first, None), a)
            if decider.full():  # within the pending share, whatever a run holds
                decider.flush(gallery)
        decider.flush(gallery)

    guard.run(bounds_of)
    for gallery in source.galleries():
        guard.run(positives_of, gallery)
        progress.update(1)
    band = band_edges(best, bound, state.has_positive, hole)
    scanner = _Scanner(workspace, tile_bytes, options.near_duplicate, state.greater.dtype)

    def negatives_of(gallery: Gallery) -> None:
        located, width = locate(queries, gallery), gallery.fast.shape[0]
        for a, b in tiles:
            if options.near_duplicate is None and bool(torch.isinf(band[a:b, 0]).all()):
                continue  # no query of the tile has a band left to reach
            rows_fast = source.query_rows(a, b, workspace)
            scores = product(rows_fast, gallery, 0, width, workspace, tile_bytes)
            if check_nan:
                state.nan[a:b] |= torch.isnan(scores).any(dim=1)
            groups = queries.groups[a:b] if same_group else None
            hide_ignored(scores, located.own[a:b], groups, gallery.groups, hole)
            start, length = located.start[a:b], located.length[a:b]
            hide_own_labels(scores, run_columns(start, length, width, workspace), length, hole)
            scanned = scanner.scan(scores, band[a:b], 0, bound[a:b])
            state.greater[a:b] += scanned.greater
            saturate(band[a:b], state.greater[a:b], options.max_k)
            if scanned.sure is not None:
                state.near[a:b] += scanned.sure
            for kind, found in scanned.kinds(None):
                decider.add(kind, found, a)
            if decider.full():
                decider.flush(gallery)
        decider.flush(gallery)

    for gallery in source.galleries():
        guard.run(negatives_of, gallery)
        progress.update(1)
    progress.close()
    if guard.failure is not None:
        raise guard.failure


class Ranked(NamedTuple):
    """One direction's ranking, summed over the processes."""

    hist: Tensor  # [max K] first hits at each rank (expected numbers for "expected")
    queries: Tensor  # int64 [2]: queries with, without a valid positive
    near: Tensor  # int64 [4] (NEAR_COUNTS)
    ranked: int  # the queries this process ranked
    rescored: int  # the pairs this process re-scored canonically
    records: Tensor | None  # with ``outcomes``: every query's record, in side order


def probability_grid(num_items: int) -> float:
    """``2**k`` such that sums of up to ``num_items`` probabilities, each a multiple of
    ``2**-k``, are exact in float64 in any order (tiles, threads, processes)."""
    return 2.0 ** max(0, 52 - num_items.bit_length())


def records_of(counts: TieCounts, ties: str, max_k: int, grid: float) -> Tensor:
    """Each query's outcome record (``_kernel.query_outcomes``), ``"expected"`` probabilities
    rounded to multiples of ``1 / grid`` (error below ``N * 2**-53``): sums in any grouping."""
    records = _kernel.query_outcomes(counts, ties, max_k)
    if records.is_floating_point():
        return records.mul(grid).round_().div_(grid)
    return records.to(torch.int64)


def _same_sides(previous: Any, current: Any) -> bool:
    return previous is not None and all(
        a.rows.shape == b.rows.shape and torch.equal(a.rows, b.rows)
        for a, b in zip(previous, current, strict=True)
    )


def rank(
    plan: Plan,
    options: RankOptions,
    processes: Processes | None = None,
    sharded: bool = False,
    known: Sequence[Tensor | None] | None = None,
    outcomes: bool = False,
) -> list[Ranked | None]:
    """Rank every direction of ``plan``; None for a direction without sides. With ``processes``
    (every one calls this) the counts are summed over them: each ranks a contiguous share of
    the queries against the whole gallery, or with ``sharded`` the queries it holds against
    a gallery passing by. A direction with the previous one's sides is ranked once.
    ``known``: per direction, bool ``[2, Q]`` queries known to have a near positive /
    negative (the audit's copies). ``outcomes``: also every query's record on every
    process. A failure on any process raises on every process, after the others finish."""
    world, me, group = 1, 0, None
    if processes is not None and dist.is_available() and dist.is_initialized():
        group = processes.group
        world, me = dist.get_world_size(group), dist.get_rank(group)
    else:
        processes = None
    if options.progress and dist.is_available() and dist.is_initialized() and dist.get_rank():
        options = options._replace(progress=False)  # one bar: the process of rank 0's
    threaded = plan.embeddings is not None and plan.embeddings.device.type == "cpu"
    threaded = threaded and not callable(options.similarity)
    grid = probability_grid(plan.rows.shape[0])
    workspace = Workspace()
    failure: Exception | None = None
    counted: list[_Summary | None] = []
    with caller_on_one_thread(threaded):
        for index, sides in enumerate(plan.directions):
            if sides is None:
                counted.append(None)
                continue
            if index and _same_sides(plan.directions[index - 1], sides):
                counted.append(counted[-1])
                continue
            try:
                flags = None if known is None else known[index]
                # Only the summary outlives a direction's ranking (not its source).
                source = _source(plan, sides, options, processes if sharded else None, world, me)
                counts = rank_direction(source, options, plan.budget, workspace, flags)
                del source
                counted.append(_summary(counts, options, grid, outcomes))
                del counts
            except Exception as err:
                if world == 1:
                    raise
                failure = err  # take part in the reductions below, then raise everywhere
                counted.append(None)
            workspace.clear()
    return _reduce(plan, options, counted, outcomes, group, world, failure)


def _source(
    plan: Plan,
    sides: Direction,
    options: RankOptions,
    processes: Processes | None,
    world: int,
    me: int,
) -> Source:
    """A direction's blocks: a sharded gallery, or this process's share of queries against all."""
    if processes is not None:
        return ShardedSource(plan, sides, options.similarity, processes)
    total = sides[0].rows.shape[0]
    share = (total * me // world, total * (me + 1) // world)
    return LocalSource(plan, sides, share, options.similarity)


class _Summary(NamedTuple):
    """A direction's ranking on this process, summarised as soon as it is done."""

    hist: Tensor
    numbers: Tensor  # int64 [8]: queries with, without a positive, NaN, near [4], failed
    records: Tensor | None  # with ``outcomes``: each ranked query's record
    position: Tensor  # with ``outcomes``, the ranked queries' places (else empty)
    ranked: int
    rescored: int


def _summary(counts: QueryCounts, options: RankOptions, grid: float, outcomes: bool) -> _Summary:
    record = records_of(counts.counts, options.ties, options.max_k, grid)
    hist, queries = _kernel.histogram_of(record, options.max_k)
    zero = queries.new_zeros(1)
    numbers = torch.cat([queries, counts.nan.view(1), counts.near, zero])
    kept = record if outcomes else None
    ranked = int(counts.position.shape[0])
    position = counts.position.to(torch.int64) if outcomes else counts.position[:0]
    return _Summary(hist, numbers, kept, position, ranked, counts.rescored)


def _reduce(
    plan: Plan,
    options: RankOptions,
    counted: list[_Summary | None],
    outcomes: bool,
    group: Any,
    world: int,
    failure: Exception | None,
) -> list[Ranked | None]:
    """Sum each direction's counts over the processes; gather the records."""
    device = plan.labels.device
    hist_dtype = torch.float64 if options.ties == "expected" else torch.int64
    none = torch.zeros(0, dtype=torch.int64, device=device)
    no_hist = torch.zeros(options.max_k, dtype=hist_dtype, device=device)
    empty = _Summary(no_hist, none.new_zeros(8), None, none, 0, 0)
    summaries = [empty if c is None else c for c in counted]
    every = torch.stack([c.numbers for c in summaries])
    every[:, 7] = int(failure is not None)
    hist_all = torch.stack([c.hist for c in summaries])
    if world > 1:
        collectives.all_reduce(hist_all, op=dist.ReduceOp.SUM, group=group)
        collectives.all_reduce(every, op=dist.ReduceOp.SUM, group=group)
    if failure is not None:
        raise failure
    if int(every[:, 7].sum()):
        raise RuntimeError(f"{options.caller} failed on another process; see its error")
    nan = int(every[:, 2].sum())
    if nan:
        raise nan_scores_error(nan)
    out: list[Ranked | None] = []
    for index, (sides, summary) in enumerate(zip(plan.directions, summaries, strict=True)):
        if sides is None:
            out.append(None)
            continue
        gathered = None
        if outcomes:
            total = sides[0].rows.shape[0]
            gathered = _gather_records(summary, total, options, group, world, device)
        ranked = summary.ranked
        hist, numbers = hist_all[index], every[index]
        out.append(Ranked(hist, numbers[:2], numbers[3:7], ranked, summary.rescored, gathered))
    return out


def _gather_records(
    summary: _Summary,
    total: int,
    options: RankOptions,
    group: Any,
    world: int,
    device: torch.device,
) -> Tensor:
    """Every query's record in side order, on every process: each process's records of
    the queries it ranked (their positions with them), gathered."""
    width = (options.max_k + 1,) if options.ties == "expected" else ()
    dtype = torch.float64 if width else torch.int64
    out = torch.zeros((total, *width), dtype=dtype, device=device)
    record, position = summary.records, summary.position
    if record is None:
        record, position = out[:0], position[:0]
    if world == 1:
        out[position] = record
        return out
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    collectives.all_gather(sizes, torch.tensor([position.shape[0]], device=device), group=group)
    widest = max(int(size) for size in sizes)
    padded = out.new_zeros((widest, *width))
    padded[: record.shape[0]] = record
    places = torch.full((widest,), -1, dtype=torch.int64, device=device)
    places[: position.shape[0]] = position
    records = [torch.empty_like(padded) for _ in range(world)]
    positions = [torch.empty_like(places) for _ in range(world)]
    collectives.all_gather(records, padded, group=group)
    collectives.all_gather(positions, places, group=group)
    for part, place, size in zip(records, positions, sizes, strict=True):
        out[place[: int(size)]] = part[: int(size)]
    return out
