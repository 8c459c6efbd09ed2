"""Ranking embeddings against a gallery in tiles: pure functions, no Metric.

The metric (:class:`recall_at_k.EmbeddingRecallAtK`) and the one-shot function
(:func:`recall_at_k.functional.embedding_recall_at_k`) describe their items the same way
-- embeddings, labels, groups, a sample identity and the role each item plays -- and
call :func:`rank` for each direction; under DDP the metric hands each process its share
of the queries (:func:`rank_shared`).

The pipeline, one module a step: :mod:`recall_at_k.ranking.score` (the score, prepared rows,
the rounding bound), :mod:`recall_at_k.ranking.gallery` (sides, label order, fast products),
:mod:`recall_at_k.ranking.bands` (each query's band, scanned per tile; the routes),
:mod:`recall_at_k.ranking.panels` and :mod:`recall_at_k.ranking.symmetric` (the CPU routes),
:mod:`recall_at_k.ranking.decide` (the band on canonical scores), then here: the counts of
each query -> rank histogram, summed over tiles and processes.

Counts are integers; ``ties="expected"`` adds per-query probabilities, each rounded to a
multiple of ``2**-(52 - bit_length(N))`` (N the items), so that their float64 sums are
exact, hence the same, however tiles, threads and processes group the queries.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k import _collectives, _kernel
from recall_at_k._embedding_checks import nan_scores_error
from recall_at_k._kernel import TieCounts, Workspace
from recall_at_k._types import Similarity
from recall_at_k.ranking.bands import (
    AUTO_ROUTE,
    NEAR_COUNTS,
    PENDING_SHARE,
    Band,
    RankOptions,
    Route,
    block_band,
    dense_band,
    ignore_in_place,
    tile_mode,
)
from recall_at_k.ranking.decide import decide
from recall_at_k.ranking.gallery import (
    Gallery,
    Queries,
    Side,
    bounds,
    gallery_of,
    queries_of,
    tile_scores,
)
from recall_at_k.ranking.panels import panel_band
from recall_at_k.ranking.progress import Progress
from recall_at_k.ranking.score import float64_products
from recall_at_k.ranking.symmetric import rank_symmetric, symmetric_possible
from recall_at_k.ranking.workers import Workers, worker_count

CPU_TILE_BYTES = 32 * 2**20
"""On CPU, tiles hold at most this many bytes of scores, whatever ``chunk_bytes`` allows:
larger tiles buy nothing (the product is as fast in 32 MiB tiles) and cost memory."""

SCRATCH_SHARE = 4
"""A tile holds at most ``chunk_bytes / SCRATCH_SHARE`` (its scores and its queries'
copies): with what its scan, the panels' stack and the canonical re-scoring add
alongside (each sized from the tile), a ranking's scratch stays within ``chunk_bytes``."""

PENDING_PAIRS = 2**16
"""In-band pairs of successive tiles are re-scored together once this many wait (or at
the end): one canonical pass over D for many tiles."""

PENDING_QUERIES = 2**10
"""... or once the waiting tiles hold this many queries: each waiting tile keeps a dozen
small tensors (about 6 KiB of C heap however few its pairs), and deciding them together
takes memory in proportion to their queries (at 12,000 queries of 21-row tiles, all
waiting to the end: about 3 MiB kept, then 3.7 MiB more to decide them)."""

# ... or once what the waiting tiles keep (estimated: PENDING_TILE_BYTES a tile,
# PENDING_QUERY_BYTES a query, PENDING_PAIR_BYTES a pair) reaches chunk_bytes /
# PENDING_SHARE (bands): deciding them takes about as much again, so that the waiting
# tiles and their decision stay within a quarter of chunk_bytes however few queries a
# tile holds (at 1,600 x 2,048 items and a 512 KiB chunk, all 73 tiles of 11 queries
# waited to the end: 0.9 MiB kept, then 0.6 MiB more to decide them).

PENDING_TILE_BYTES = 6 * 2**10
"""The C heap a waiting tile keeps however few its queries and pairs (its dozen small
tensors)."""

PENDING_QUERY_BYTES = 128
"""What a waiting tile keeps per query: its fields (int64) and its band's counts."""

PENDING_PAIR_BYTES = 32
"""What a waiting tile keeps per in-band pair: row, column (int64) and maybe a score."""


Collector = Callable[[Tensor, TieCounts], None]
"""``collect(positions, counts)``: per-query tie counts as :func:`rank` decides them."""


class RankCounts(NamedTuple):
    """A ranking's contribution: ``hist`` ``[max K]`` and int64 ``queries``
    (with, without a valid positive), ``nan_queries`` (queries whose scores held NaN),
    ``rescored`` (int64, the (query, item) pairs re-scored canonically) and ``near``
    (int64 ``[4]``, zeros without ``near_duplicate``; see :data:`NEAR_COUNTS`)."""

    hist: Tensor
    queries: Tensor
    nan_queries: Tensor
    rescored: Tensor
    near: Tensor


def rank(
    embeddings: Tensor,
    labels: Tensor,
    groups: Tensor,
    queries: Side,
    gallery_side: Side,
    options: RankOptions,
    route: Route = AUTO_ROUTE,
    known: Tensor | None = None,
    collect: Collector | None = None,
) -> RankCounts:
    """Rank ``queries`` against ``gallery_side`` in tiles; the summed rank histogram.

    Args:
        embeddings: ``[N, D]`` from :func:`prepare`, every item of both sides.
        labels: int64 ``[N]``; a gallery item is relevant to a query with its label.
        groups: int64 ``[N]``, read by ``options.exclude``.
        queries: the queries (all, or this process's share).
        gallery_side: the gallery (all of it on every process).
        options: similarity, exclusion, tie policy, largest K, tile size, NaN check,
            near-duplicate threshold.
        route: how tiles are counted (tests choose; every route gives the same counts).
        known: bool ``[2, Q]`` (in the order of ``queries``): queries known to have a
            near positive / a near negative whatever their scores (the audit's identical
            items); read only with ``options.near_duplicate``.
        collect: optional ``collect(positions, counts)``, called with the tie counts of
            every decided group of queries and their positions in ``queries`` (for
            per-query outcomes; none by default, at no cost).
    """
    device = embeddings.device
    if queries.rows.numel() == 0:
        return _Tally(embeddings, None, options, None).result()
    if float64_products(embeddings, options.similarity):
        # Float32 products could overflow, or would come close to the subnormal range:
        # the fast path runs in float64 (exact copies; the canonical scores are the same).
        embeddings = embeddings.to(torch.float64)
    workers = 1 if callable(options.similarity) else worker_count(device)
    tile_bytes = scratch_tile_bytes(options.chunk_bytes, device)
    # Each worker holds its own tile: together at most the one tile's bytes.
    tile_bytes = max(1, tile_bytes // workers)
    gallery = gallery_of(
        embeddings, labels, groups, gallery_side, options.similarity, tile_bytes // 2
    )
    num_gallery = gallery.embeddings.shape[0]
    share = queries_of(labels, groups, queries, gallery)
    # The gallery's identities served to find each query's own column: not kept.
    gallery = gallery._replace(identity_sorted=_NONE, identity_column=_NONE)
    tally = _Tally(embeddings, gallery, options, known, collect, share.rows.shape[0])
    itemsize = gallery.embeddings.element_size()
    route = scratch_route(route, tile_bytes, options.similarity, embeddings.shape[1], itemsize)
    # A tile's row: its scores and its query's copy (centred for "euclidean").
    row_bytes = (num_gallery + embeddings.shape[1]) * itemsize
    rows_per_tile = max(1, tile_bytes // max(1, row_bytes))
    panels_possible = (
        device.type == "cpu" and not callable(options.similarity) and not options.check_nan
    )
    if panels_possible and _all_panels(route, share, num_gallery):
        rows_per_tile, route = panel_tiles(route, tile_bytes, embeddings.shape[1], itemsize)
    near = options.near_duplicate is not None
    done = 0
    if panels_possible and symmetric_possible(share, gallery, route):
        done = rank_symmetric(
            gallery, share, options, route, tile_bytes, tally.workspace, tally.add_band, workers
        )

    def count_tile(tile: Queries, workspace: Workspace) -> tuple[Queries, Band | None, Tensor]:
        """A tile's band (None: no query of it has a positive, nothing to decide) and
        its queries whose scores hold NaN."""
        nan = torch.zeros((), dtype=torch.int64, device=device)
        widest = int(tile.block_count.max()) if tile.block_count.numel() else 0
        if widest == 0 and not options.check_nan and not near:
            return tile, None, nan  # no query of the tile has an item of its label
        tile_embeddings = embeddings.index_select(0, tile.rows)
        if gallery.centre is not None:
            tile_embeddings.sub_(gallery.centre)
        bound = bounds(tile_embeddings, gallery, options.similarity)
        mode = tile_mode(route, widest, num_gallery, panels_possible and widest > 0)
        if mode == "panels":
            band = panel_band(
                tile_embeddings, tile, gallery, bound, options, route, workspace, rows_per_tile
            )
            return tile, band, nan
        scores = tile_scores(tile_embeddings, gallery, options.similarity, workspace)
        if options.check_nan:
            nan = torch.isnan(scores).any(dim=1).sum()
        ignore_in_place(scores, tile, gallery, options.exclude)
        if mode == "dense":
            band = dense_band(scores, tile, gallery, bound, options, workspace)
        else:
            columns = gallery.groups, gallery.labels
            band = block_band(scores, tile, *columns, bound, options, workspace)
        return tile, band, nan

    starts = range(done, share.rows.shape[0], rows_per_tile)
    tiles = (Queries._make(t[start : start + rows_per_tile] for t in share) for start in starts)
    with Workers(count_tile, min(workers, len(starts)), tally.workspace) as pool:
        for tile, band, nan in pool.map(tiles):
            tally.nan += nan
            if band is None:
                tally.add_counts(_kernel.no_positive_counts(tile.rows.shape[0], device), [tile])
                tally.progress.update(tile.rows.shape[0])
            else:
                tally.add_band(tile, band)
    return tally.result()


_NONE = torch.zeros(0, dtype=torch.int64)


def scratch_tile_bytes(chunk_bytes: int, device: torch.device) -> int:
    """The bytes of one tile for a ``chunk_bytes`` (:data:`SCRATCH_SHARE`; on CPU at
    most :data:`CPU_TILE_BYTES`)."""
    tile_bytes = max(1, chunk_bytes // SCRATCH_SHARE)
    return min(tile_bytes, CPU_TILE_BYTES) if device.type == "cpu" else tile_bytes


def scratch_route(
    route: Route, tile_bytes: int, similarity: Similarity, width: int, itemsize: int
) -> Route:
    """``route`` with its panels and symmetric blocks no larger than ``tile_bytes``
    (its panels half of it: the panels' stack and marks take as much again). For
    ``"euclidean"`` a symmetric block's rows are centred (a copy of ``size x width``):
    the block and that copy together fit the tile."""
    block = max(1, min(route.block_bytes, tile_bytes))
    if similarity == "euclidean":
        values = block // itemsize  # size^2 + size * width <= values
        size = (math.isqrt(width * width + 4 * values) - width) // 2
        block = max(1, size * size * itemsize)
    return route._replace(
        panel_bytes=max(1, min(route.panel_bytes, tile_bytes // 2)),
        block_bytes=block,
    )


PANEL_COLUMNS = 512
"""On CPU a panel of the panel route is at most this many gallery columns wide: the
BLAS packs a panel's columns into a buffer it keeps (about 768 bytes a column at the
widths measured; 3 MiB for the 6,241 columns of a 21-row tile's 512 KiB panel), so
the panel route's tiles take more rows instead of wider panels."""


def _all_panels(route: Route, share: Queries, num_gallery: int) -> bool:
    """Whether every tile of ``share`` takes the panel route (:func:`tile_mode`; the
    caller checked that panels are possible)."""
    if route.mode == "panels":
        return True
    if route.mode not in ("auto", "symmetric") or share.block_count.numel() == 0:
        return False
    widest = int(share.block_count.max())
    return tile_mode(route, widest, num_gallery, True) == "panels"


def panel_tiles(route: Route, tile_bytes: int, width: int, itemsize: int) -> tuple[int, Route]:
    """Rows per tile and the route for tiles that all take the panel route: a tile
    never holds a row of scores, only its queries' copies, panels of at most
    :data:`PANEL_COLUMNS` columns and the panels' stack and marks (as large as a
    panel each), so a tile holds ``tile_bytes`` of those."""
    columns = max(1, min(PANEL_COLUMNS, route.panel_bytes // itemsize))
    rows = max(1, tile_bytes // ((width + 3 * columns) * itemsize))
    rows = min(rows, max(1, route.panel_bytes // (columns * itemsize)))
    return rows, route._replace(panel_bytes=rows * columns * itemsize)


class _Tally:
    """What :func:`rank` adds up, tile after tile: each tile's counts once its in-band
    pairs are decided (the pairs of successive tiles wait, up to ``PENDING_PAIRS`` or
    ``PENDING_QUERIES``, to be re-scored in one canonical pass)."""

    def __init__(
        self,
        embeddings: Tensor,
        gallery: Gallery | None,
        options: RankOptions,
        known: Tensor | None,
        collect: Collector | None = None,
        num_queries: int = 0,
    ) -> None:
        device = embeddings.device
        hist_dtype = torch.float64 if options.ties == "expected" else torch.int64
        self.hist = torch.zeros(options.max_k, dtype=hist_dtype, device=device)
        self.queries = torch.zeros(2, dtype=torch.int64, device=device)
        self.nan = torch.zeros((), dtype=torch.int64, device=device)
        self.rescored = torch.zeros((), dtype=torch.int64, device=device)
        self.near = torch.zeros(len(NEAR_COUNTS), dtype=torch.int64, device=device)
        self.embeddings = embeddings
        self.gallery = gallery
        self.options = options
        self.known = known
        self.collect = collect
        self.grid = _probability_grid(embeddings.shape[0])
        self.workspace = Workspace()
        self.pending: list[tuple[Queries, Band]] = []
        self.pending_pairs = 0
        self.pending_queries = 0
        self.pending_budget = max(1, options.chunk_bytes // PENDING_SHARE)
        total = 0 if gallery is None else int(num_queries)
        self.progress = Progress(total, options.progress)

    def add_counts(self, counts: TieCounts, tiles: Sequence[Queries] = ()) -> None:
        """The counts of ``tiles`` (their queries in order)."""
        hist, query_counts = _histogram(counts, self.options, self.grid)
        self.hist += hist
        self.queries += query_counts
        if self.collect is not None:
            self.collect(torch.cat([tile.position for tile in tiles]), counts)

    def add_band(self, tile: Queries, band: Band) -> None:
        """A scanned tile; decided with the pending ones once enough pairs wait."""
        self.pending.append((tile, band))
        self.progress.update(tile.rows.shape[0])
        self.pending_pairs += band.pairs.rows.shape[0]
        self.pending_queries += tile.rows.shape[0]
        if band.near_pairs is not None:
            self.pending_pairs += band.near_pairs.rows.shape[0]
        kept = (
            len(self.pending) * PENDING_TILE_BYTES
            + self.pending_queries * PENDING_QUERY_BYTES
            + self.pending_pairs * PENDING_PAIR_BYTES
        )
        if (
            self.pending_pairs >= PENDING_PAIRS
            or self.pending_queries >= PENDING_QUERIES
            or kept >= self.pending_budget
        ):
            self.flush()

    def flush(self) -> None:
        """Decide the pending tiles."""
        if not self.pending:
            return
        assert self.gallery is not None
        decided = decide(
            self.embeddings, self.gallery, self.pending, self.options, self.known, self.workspace
        )
        self.rescored += decided.rescored
        self.near += decided.near
        self.add_counts(decided.counts, [tile for tile, _ in self.pending])
        self.pending, self.pending_pairs, self.pending_queries = [], 0, 0

    def result(self) -> RankCounts:
        self.flush()
        self.progress.close()
        return RankCounts(self.hist, self.queries, self.nan, self.rescored, self.near)


def _probability_grid(num_items: int) -> float:
    """``2**k`` such that sums of up to ``num_items`` probabilities, each a multiple of
    ``2**-k``, are exact in float64 in any order (tiles, threads, processes)."""
    return 2.0 ** max(0, 52 - num_items.bit_length())


def _histogram(counts: TieCounts, options: RankOptions, grid: float) -> tuple[Tensor, Tensor]:
    """:func:`recall_at_k._kernel.rank_histogram`, with each query's ``"expected"``
    probabilities rounded to a multiple of ``1 / grid`` (an error below ``N * 2**-53``
    a query), so that their sums are the same however the queries are grouped."""
    outcomes = _kernel.query_outcomes(counts, options.ties, options.max_k)
    if outcomes.is_floating_point():
        outcomes = outcomes.mul(grid).round_().div_(grid)
    return _kernel.histogram_of(outcomes, options.max_k)


# ---------------------------------------------------------------------- processes


class ProcessGroup(NamedTuple):
    """The process group whose gathered states a ranking sees (``None``: the default)."""

    group: Any


class Shared(NamedTuple):
    """What :func:`rank_shared` returns, per direction (None where nothing is ranked)."""

    histograms: list[tuple[Tensor, Tensor] | None]  # (hist, queries) summed over processes
    near: list[Tensor | None]  # NEAR_COUNTS summed over processes
    ranked: list[int]  # the queries this process ranked
    rescored: list[int]  # the (query, item) pairs this process re-scored canonically


def rank_shared(
    embeddings: Tensor,
    labels: Tensor,
    groups: Tensor,
    directions: list[tuple[Side, Side] | None],
    options: RankOptions,
    route: Route,
    shared: ProcessGroup | None,
    known: Sequence[Tensor | None] | None = None,
) -> Shared:
    """Rank every direction's (queries, gallery), sharing the queries among processes.

    With ``shared`` (states gathered: every process holds every item) each process ranks
    its contiguous share of each direction's queries against the whole gallery and the
    counts are summed over the group, so every process returns the same counts. A
    direction that is ``None`` (nothing to rank) gives ``None``; a direction with the
    same sides as the one before (leave-one-out, both ways) is not ranked twice.
    ``known``: per direction, :func:`rank`'s ``known`` for all its queries.
    """
    world, me, group = 1, 0, None
    if shared is not None and dist.is_available() and dist.is_initialized():
        group = shared.group
        world, me = dist.get_world_size(group), dist.get_rank(group)
    if options.progress and dist.is_available() and dist.is_initialized() and dist.get_rank():
        options = options._replace(progress=False)  # one bar: the process of rank 0's
    results: list[RankCounts | None] = []
    ranked: list[int] = []
    rescored: list[int] = []
    failure: Exception | None = None
    for index, sides in enumerate(directions):
        if sides is None:
            results.append(None)
            ranked.append(0)
            rescored.append(0)
            continue
        before = directions[index - 1] if index else None
        if before is not None and same_sides(before, sides):
            results.append(results[-1])
            ranked.append(ranked[-1])
            rescored.append(rescored[-1])
            continue
        queries, gallery = sides
        num = queries.rows.shape[0]
        lo, hi = num * me // world, num * (me + 1) // world
        share = Side(queries.rows[lo:hi], queries.identity[lo:hi])
        flags = None if known is None or known[index] is None else known[index]
        flags = None if flags is None else flags[:, lo:hi]
        try:
            counts = rank(embeddings, labels, groups, share, gallery, options, route, flags)
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
        rescored.append(int(counts.rescored))
    histograms, near = sum_over_processes(results, world, group, failure)
    return Shared(histograms, near, ranked, rescored)


def sum_over_processes(
    results: list[RankCounts | None],
    world: int,
    group: Any,
    failure: Exception | None,
) -> tuple[list[tuple[Tensor, Tensor] | None], list[Tensor | None]]:
    """Sum each direction's counts over the processes (every process calls this, with
    its share's counts, or None for a direction that could not be ranked anywhere), then
    raise a failure of any process on every process.

    Returns:
        ``(hist, queries)`` and the near counts per direction, or None where
        ``results`` holds None.
    """
    present = [r for r in results if r is not None]
    if not present:
        return [None for _ in results], [None for _ in results]
    hists = torch.stack([r.hist for r in present])
    counts = torch.stack(
        [torch.cat([r.queries, r.nan_queries.reshape(1), r.near]) for r in present]
    )
    failed = torch.tensor([int(failure is not None)], device=counts.device)
    if world > 1:
        _collectives.all_reduce(hists, op=dist.ReduceOp.SUM, group=group)
        _collectives.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        _collectives.all_reduce(failed, op=dist.ReduceOp.SUM, group=group)
    if failure is not None:
        raise failure
    if int(failed):
        raise RuntimeError("EmbeddingRecallAtK.compute() failed on another process; see its error")
    nan_queries = int(counts[:, 2].sum())
    if nan_queries:
        raise nan_scores_error(nan_queries)
    reduced = iter(zip(hists, counts[:, :2], counts[:, 3:], strict=True))
    histograms: list[tuple[Tensor, Tensor] | None] = []
    near: list[Tensor | None] = []
    for result in results:
        if result is None:
            histograms.append(None)
            near.append(None)
        else:
            hist, queries, near_counts = next(reduced)
            histograms.append((hist, queries))
            near.append(near_counts)
    return histograms, near


def same_sides(previous: tuple[Side, Side], current: tuple[Side, Side]) -> bool:
    """Whether a direction ranks the same queries against the same gallery as before."""
    return all(
        a.rows.shape == b.rows.shape and torch.equal(a.rows, b.rows)
        for a, b in zip(previous, current, strict=True)
    )
