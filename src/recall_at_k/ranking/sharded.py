"""A gallery sharded across processes: each process ranks its own queries against the
gallery as it passes by, a block at a time; no process ever holds the whole gallery.

With ``EmbeddingRecallAtK(sharded=True)`` under DDP each process keeps the items it was
given. The metadata (labels, groups, ids, roles: a few integers an item) is gathered
whole, so every process knows every direction's sides; the embeddings are read with
:class:`recall_at_k._sync.BroadcastRows`: each process broadcasts its own rows in
turn, in runs of at most a tile's bytes, and every process sees every run once per
pass, holding one run at a time. A process's queries are the queries (each sample once)
whose stored row it holds; it reads them from its stored blocks a tile at a time,
prepared as they are read (no copy of its share: :class:`_Prepared`), and keeps per
query only what the exact decision needs (O(queries) numbers). Every item's
bookkeeping (rows, identities) is int32 where the items allow.

The decision is the one-process ranking's, on the same canonical scores
(:mod:`recall_at_k.ranking.score`): per query, ``s*`` the best canonical score of its
valid positives, ``p`` the valid positives scored ``s*``, ``g_>`` / ``g_> + e`` the
valid negatives scored above / at or above ``s*``. The fast float32 product of a
query tile and a run only finds the pairs to re-score: with ``B`` a certified bound on
``|fast - canonical|`` for every pair of the tile and run (the query's norm and the
run's largest gallery norm), two passes over the gallery decide exactly:

- pass A: per query, a running ``c*`` (the best canonical score of a positive so far)
  and the positives equal to it. A run's positives whose fast score plus ``B`` reaches
  ``max(c*, the run's best fast positive minus B)`` are re-scored (any other scores
  below a proven lower bound of ``s*``); at the end ``c* = s*``. The near-duplicate
  negatives (canonical score at or above the threshold) are found in the same pass.
- pass B: valid negatives with a fast score above ``s* + B`` are above ``s*``; those
  within ``B`` of it are re-scored and compared with ``s*`` (above or equal). A query
  with ``max K`` negatives above ``s*`` misses at every K and is not scanned further.

Each query's counts go through :func:`recall_at_k.ranking.rank._histogram` (whose
``"expected"`` probabilities are rounded to a grid on which float64 sums are exact) and
are summed over the processes as :func:`recall_at_k.ranking.rank.rank_shared` sums
them, with its failure protocol: a process that fails keeps taking part in every
collective, then every process raises. The result is bit for bit the one-process
ranking's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k import _collectives
from recall_at_k._kernel import TieCounts, Workspace, query_outcomes
from recall_at_k._sync import BroadcastRows, LocalBlocks
from recall_at_k.ranking.bands import NEAR_COUNTS, RankOptions, edges
from recall_at_k.ranking.gallery import Side
from recall_at_k.ranking.progress import Progress
from recall_at_k.ranking.rank import (
    CPU_TILE_BYTES,
    RankCounts,
    Shared,
    _histogram,
    _probability_grid,
    same_sides,
    sum_over_processes,
)
from recall_at_k.ranking.score import (
    CANONICAL_BATCH_BYTES,
    UNDERFLOW_SCALE,
    bound_absolute,
    bound_coefficient,
    canonical_pair_scores,
    cosine_norms,
    norm_upper,
    normalised,
    overflows,
)

PREPARE_ROWS_BYTES = 2**18
"""This process's rows are read (their norms, largest value and sum) this many bytes of
float64 at a time."""

RUN_SHARE = 8
"""The gallery passes by in runs of an eighth of a tile's rows (``8 D`` bytes a row
counted; float32 rows: a sixteenth of a tile's bytes): a run is held, prepared and
scored at once, beside the per-item bookkeeping every process holds."""

PAIR_BYTES = 64
"""A tile of queries against a run holds ``chunk_bytes / PAIR_BYTES`` pairs: its fast
scores (4 bytes a pair, 8 in float64), their masked copy and the masks of the pairs
(1 byte each) take about 13 bytes a pair, a third of a tile (the one-process ranking
counts 8 bytes a pair: a sharded gallery's per-item state leaves less room)."""

CANONICAL_SHARE = 16
"""Candidate pairs are re-scored canonically in batches of a sixteenth of a tile of
float64 rows (each side), :data:`CANONICAL_MIN_BYTES` at least, and at most a tile's
queries (whose buffers the batches reuse)."""

CANONICAL_MIN_BYTES = 2**18


class _Prepared:
    """This process's rows prepared as the one-process ranking prepares them
    (:func:`recall_at_k.ranking.score.prepare_rows`: normalised for ``"cosine"``), a few
    at a time from the stored blocks, never as a whole copy: for ``"cosine"`` each
    row's norm is kept (float64, one number a row) and the rows divided by it when read,
    which gives the same values bit for bit."""

    def __init__(self, local: LocalBlocks, similarity: object, norms: Tensor | None) -> None:
        self.local, self.cosine, self.norms = local, similarity == "cosine", norms
        self.dtype = local.dtype

    def _ready(self, rows: Tensor, norms: Tensor | None) -> Tensor:
        if norms is None:
            return rows
        return normalised(rows, norms, self.dtype)

    def span(self, first: int, stop: int) -> Tensor:
        """The prepared rows ``first:stop`` (not to be written into: it may be a view of
        the stored state)."""
        norms = None if self.norms is None else self.norms[first:stop]
        return self._ready(self.local.span(first, stop), norms)

    def take(self, index: Tensor) -> Tensor:
        """The prepared rows ``index`` (local rows, any order)."""
        norms = None if self.norms is None else self.norms[index]
        return self._ready(self.local.take(index), norms)

    def span_into(self, first: int, stop: int, out: Tensor, wide: Tensor) -> Tensor:
        """:meth:`span` written into ``out`` (``[stop - first, D]`` of the prepared
        dtype; ``wide``: a float64 buffer of ``D`` columns, for ``"cosine"``): the same
        values, bit for bit."""
        self.local.span_into(first, stop, out)
        if self.norms is None:
            return out
        return self._ready_into(out, self.norms[first:stop], wide)

    def take_into(self, index: Tensor, out: Tensor, wide: Tensor) -> Tensor:
        """:meth:`take` written into ``out`` (as :meth:`span_into`)."""
        self.local.take_into(index, out)
        if self.norms is None:
            return out
        return self._ready_into(out, self.norms[index], wide)

    @staticmethod
    def _ready_into(rows: Tensor, norms: Tensor, wide: Tensor) -> Tensor:
        """:func:`recall_at_k.ranking.score.normalised` of ``rows`` in place, through
        ``wide`` (a float64 buffer of ``D`` columns, a few rows at a time): the same
        values, bit for bit."""
        step = wide.shape[0]
        for begin in range(0, rows.shape[0], step):
            part = rows[begin : begin + step]
            size = part.shape[0]
            part.copy_(wide[:size].copy_(part).div_(norms[begin : begin + size].unsqueeze(1)))
        return rows


class _Direction:
    """One direction's queries held by this process, the gallery's membership, and the
    per-query state of the two passes."""

    def __init__(self, sides: tuple[Side, Side], offset: int, mine: int, num: int) -> None:
        queries, gallery = sides
        rows = queries.rows
        here = ((rows >= offset) & (rows < offset + mine)).nonzero().view(-1)
        self.position = here  # [q] index of each of this process's queries in the side
        self.rows = rows[here]  # [q] stored rows
        self.local = self.rows.to(torch.int64) - offset  # [q] this process's rows of them
        self.identity = queries.identity[here]
        device = rows.device
        # identity of each stored row that is a gallery item (the first of its id), else -1
        narrow = torch.int32 if num < 2**31 else torch.int64
        self.gallery_identity = torch.full((num,), -1, dtype=narrow, device=device)
        self.gallery_identity[gallery.rows] = gallery.identity.to(narrow)
        count = here.shape[0]
        wide = torch.float64
        self.best = torch.full((count,), -math.inf, dtype=wide, device=device)  # c*, then s*
        self.tied = torch.zeros(count, dtype=torch.int64, device=device)  # p
        self.has_positive = torch.zeros(count, dtype=torch.bool, device=device)
        self.greater = torch.zeros(count, dtype=torch.int64, device=device)  # g_>
        self.equal = torch.zeros(count, dtype=torch.int64, device=device)  # e
        self.near_negative = torch.zeros(count, dtype=torch.bool, device=device)
        self.nan = torch.zeros(count, dtype=torch.bool, device=device)
        self.rescored = 0
        self._norms: Tensor | None = None
        # Where this process's queries are one run of the prepared rows (leave-one-out,
        # a process holding only queries), a tile of them is a view.
        run = torch.arange(count, device=device) + (int(self.local[0]) if count else 0)
        self.contiguous = bool(torch.equal(self.local, run))

    def queries(self, prepared: _Prepared, tile: slice) -> Tensor:
        """The prepared rows of a tile of the queries (read from the stored blocks; a view
        of them where the queries are one run of a block and need no preparing)."""
        if self.contiguous:
            first = int(self.local[0])
            return prepared.span(first + tile.start, first + tile.stop)
        return prepared.take(self.local[tile])

    def queries_into(self, prepared: _Prepared, tile: slice, out: Tensor, wide: Tensor) -> Tensor:
        """:meth:`queries`, written into ``out`` (``wide``: a float64 buffer of as many
        rows, for ``"cosine"``)."""
        if self.contiguous:
            first = int(self.local[0])
            return prepared.span_into(first + tile.start, first + tile.stop, out, wide)
        return prepared.take_into(self.local[tile], out, wide)

    def norms(self, prepared: _Prepared, fast: _Fast) -> Tensor:
        """float64 ``[q, 1]``: upper bounds of the queries' norms as the fast product
        reads them (centred for ``"euclidean"``), computed once, a chunk at a time."""
        if self._norms is None:
            count, dim = self.rows.shape[0], prepared.local.shape[1]
            out = torch.empty((count, 1), dtype=torch.float64, device=prepared.local.device)
            step = max(1, PREPARE_ROWS_BYTES // (8 * max(1, dim)))
            for begin in range(0, count, step):
                tile = slice(begin, min(count, begin + step))
                rows = self.queries(prepared, tile).to(fast.dtype)
                if fast.centre is not None:
                    rows = rows - fast.centre
                norm = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
                out[tile] = norm.to(torch.float64)
            self._norms = norm_upper(out, dim, fast.dtype)
        return self._norms


class _Fast(NamedTuple):
    """How fast scores are computed: their dtype, the centre (``"euclidean"``), the
    bound's relative and absolute parts, whether to look for NaN."""

    dtype: torch.dtype
    centre: Tensor | None
    coefficient: float
    absolute: float
    check_nan: bool


class _Guard:
    """Runs this process's own work; after a failure, skips it (the process still takes
    part in every collective) and keeps the error to raise once all have reduced."""

    def __init__(self) -> None:
        self.failure: Exception | None = None

    def run(self, work: Callable[..., None], *args: Any) -> None:
        if self.failure is not None:
            return
        try:
            work(*args)
        except Exception as err:  # raised after the reduction, on every process
            self.failure = err


def rank_sharded(
    rows: BroadcastRows,
    labels: Tensor,
    groups: Tensor,
    directions: Sequence[tuple[Side, Side] | None],
    options: RankOptions,
    known: Sequence[Tensor | None] | None = None,
    outcomes: bool = False,
) -> tuple[Shared, list[Tensor | None] | None]:
    """Rank every direction with the gallery sharded over ``rows.group``'s processes.

    Args:
        rows: every process's stored rows, read in runs (this process's own blocks in
            ``rows.local``); collective: every process of the group calls this.
        labels: int64 ``[N]`` of every stored item (gathered), in stored order.
        groups: int64 ``[N]``, read by ``options.exclude``.
        directions: each direction's (queries, gallery) as rows in stored order (the
            same on every process), or None.
        options: as for :func:`recall_at_k.ranking.rank.rank` (a callable similarity is
            not supported: its scores are not canonical).
        known: per direction, the audit's known near items ``[2, Q]`` (side order).
        outcomes: also return every query's outcome record, gathered on every process
            (for ``query_outcomes()``).

    Returns:
        What :func:`recall_at_k.ranking.rank.rank_shared` returns (counts summed over
        the processes, this process's own queries ranked and pairs re-scored), and with
        ``outcomes`` per direction the records of all its queries in side order (as
        :func:`recall_at_k.ranking.outcomes.rank_outcomes` gives them), else None.
    """
    group = rows.group
    world, me = dist.get_world_size(group), dist.get_rank(group)
    counts = rows.counts
    offset, mine, num = sum(counts[:me]), counts[me], sum(counts)
    width = rows.shape[1]
    dtype = torch.promote_types(rows.dtype, torch.float32)
    device = rows.device
    guard = _Guard()
    local = LocalBlocks(rows.local, width, dtype, device)
    cosine = options.similarity == "cosine"
    norms = torch.ones(mine if cosine else 0, dtype=torch.float64, device=device)
    largest = torch.zeros(1, dtype=torch.float64, device=device)
    total = torch.zeros(width, dtype=torch.float64, device=device)

    def read_local() -> None:
        """Per row the cosine norm; the largest prepared value and (``"euclidean"``) the
        sum of the rows, a few rows at a time."""
        step = max(1, PREPARE_ROWS_BYTES // (8 * max(1, width)))
        for first, part in local.runs(step):
            ready = part
            if cosine:
                norms[first : first + part.shape[0]] = cosine_norms(part)
                ready = normalised(part, norms[first : first + part.shape[0]], dtype)
            if ready.numel():
                low, high = torch.aminmax(ready)
                largest[0] = max(float(largest[0]), -float(low), float(high))
                if options.similarity == "euclidean":
                    total.add_(ready.to(torch.float64).sum(dim=0))

    guard.run(read_local)
    prepared = _Prepared(local, options.similarity, norms if cosine else None)
    _collectives.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    if options.similarity == "euclidean":
        _collectives.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    fast = _fast_scores(float(largest[0]), total, num, width, dtype, device, options)
    states: list[_Direction | None] = []
    unique: list[_Direction] = []
    for index, sides in enumerate(directions):
        before = directions[index - 1] if index else None
        if sides is None:
            states.append(None)
        elif before is not None and same_sides(before, sides):
            states.append(states[-1])
        else:
            made = _Direction(sides, offset, mine, num)
            states.append(made)
            unique.append(made)
    tile_bytes = options.chunk_bytes
    if device.type == "cpu":
        tile_bytes = min(tile_bytes, CPU_TILE_BYTES)
    run_rows = max(1, tile_bytes // (RUN_SHARE * 8 * max(1, width)))
    runs = sum(-(-count // run_rows) for count in counts)
    shown = options.progress and me == 0 and bool(unique)
    progress = Progress(2 * runs, shown, "sharded gallery", "block")
    scan = _Scan(prepared, labels.to(device), groups.to(device), options, fast, tile_bytes)
    most = max((int(state.rows.shape[0]) for state in unique), default=0)
    near_duplicates = options.near_duplicate is not None
    guard.run(scan.reserve, most, min(run_rows, max(counts, default=0)), width, near_duplicates)
    for positives in (True, False):  # pass A, then pass B
        for first, part in rows.runs(run_rows):
            for state in unique:
                guard.run(scan.run, state, first, part, positives)
            progress.update(1)
    progress.close()
    grid = _probability_grid(num)
    results: list[RankCounts | None] = []
    for index, entry in enumerate(states):
        if entry is None:
            results.append(None)
        else:
            flags = None if known is None else known[index]
            results.append(_counts(entry, options, grid, flags))
    histograms, near = sum_over_processes(results, world, group, guard.failure)
    ranked = [0 if s is None else int(s.rows.shape[0]) for s in states]
    rescored = [0 if s is None else s.rescored for s in states]
    records = None
    if outcomes:
        records = [
            None
            if sides is None or state is None
            else _gathered_records(sides[0], state, rows, options)
            for sides, state in zip(directions, states, strict=True)
        ]
    return Shared(histograms, near, ranked, rescored), records


def _gathered_records(
    queries: Side, state: _Direction, rows: BroadcastRows, options: RankOptions
) -> Tensor:
    """Every query's outcome record (:func:`recall_at_k._kernel.query_outcomes`) in the
    order of ``queries``, on every process: each process's records of its own queries,
    gathered (which queries each process holds follows from the metadata)."""
    counts = TieCounts(state.greater, state.greater + state.equal, state.tied, state.has_positive)
    mine = query_outcomes(counts, options.ties, options.max_k)
    group, world = rows.group, len(rows.counts)
    starts = [sum(rows.counts[:r]) for r in range(world + 1)]
    owners = [
        ((queries.rows >= starts[r]) & (queries.rows < starts[r + 1])).nonzero().view(-1)
        for r in range(world)
    ]
    widest = max(int(owner.shape[0]) for owner in owners)
    padded = mine.new_zeros((widest, *mine.shape[1:]))
    padded[: mine.shape[0]] = mine
    parts = [torch.empty_like(padded) for _ in range(world)]
    _collectives.all_gather(parts, padded, group=group)
    out = mine.new_zeros((queries.rows.shape[0], *mine.shape[1:]))
    for owner, part in zip(owners, parts, strict=True):
        out[owner] = part[: owner.shape[0]]
    return out


def _fast_scores(
    largest: float,
    total: Tensor,
    num: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    options: RankOptions,
) -> _Fast:
    """The fast path's dtype (float64 where float32 products could overflow or come close
    to the subnormal range: :func:`recall_at_k.ranking.score.float64_products` on every
    process's rows), the euclidean centre (the mean of every item) and the bound."""
    similarity = options.similarity
    fast = dtype
    huge = similarity != "cosine" and overflows(largest, width, dtype)
    if dtype == torch.float32 and (0 < largest * largest < UNDERFLOW_SCALE or huge):
        fast = torch.float64
    centre = None
    if similarity == "euclidean":
        centre = total.div(max(1, num)).to(fast)
    return _Fast(
        fast,
        centre,
        bound_coefficient(similarity, width, fast, device),
        bound_absolute(similarity, width, fast),
        options.check_nan and huge,
    )


class _Scan:
    """The work on one run of the gallery, per direction and pass.

    Every buffer of a tile or run of non-trivial size (the queries prepared, the fast
    scores and their masked copy, the masks of the pairs, the run's gallery rows
    prepared, the rows re-scored canonically, the per-query scratch of a run's
    decision) is a view of :attr:`workspace`, allocated once per ranking at the largest size
    asked for and reused by every tile and run: tens of kilobytes allocated and freed
    per tile fragment the C heap, which then keeps megabytes resident (with 20,000
    items on 4 processes the heap grew by 2.7 MiB of free blocks during a ranking that
    holds 1 MiB of scratch at a time)."""

    def __init__(
        self,
        prepared: _Prepared,
        labels: Tensor,
        groups: Tensor,
        options: RankOptions,
        fast: _Fast,
        tile_bytes: int,
    ) -> None:
        self.prepared, self.labels, self.groups = prepared, labels, groups
        self.options, self.fast, self.tile_bytes = options, fast, tile_bytes
        self.workspace = Workspace()
        device = prepared.local.device
        self.device = device
        self.minus_inf = torch.tensor(-math.inf, dtype=fast.dtype, device=device)
        dim = max(1, prepared.local.shape[1])
        # Rows are normalised through float64 a few at a time.
        self.wide_rows = max(1, PREPARE_ROWS_BYTES // (8 * dim))
        # Re-scored in batches of a sixteenth of a tile of float64 rows: each batch is a
        # pass over D, and a run's candidates are few (:meth:`reserve` narrows them).
        batch_bytes = max(
            min(CANONICAL_BATCH_BYTES, tile_bytes // CANONICAL_SHARE), CANONICAL_MIN_BYTES
        )
        self.batch_rows = max(1, batch_bytes // (8 * dim))

    def tile_rows(self, columns: int, dim: int) -> int:
        """Queries a tile against ``columns`` gallery columns: its scores, their copies
        and masks (about 13 bytes a pair) take at most a third of a tile's bytes (32
        bytes a pair counted), its queries one."""
        step = max(1, self.tile_bytes // (PAIR_BYTES * columns))
        return min(step, max(1, self.tile_bytes // (dim * self.prepared.dtype.itemsize)))

    def reserve(self, queries: int, columns: int, dim: int, near: bool) -> None:
        """Allocate the buffers at their largest: tiles of up to ``queries`` queries
        against runs of ``columns`` columns (their sizes are then reused, never grown
        a little at a time)."""
        if queries == 0 or columns == 0:
            return
        rows = min(queries, self.tile_rows(columns, dim))
        # the rows re-scored a batch at a time reuse a tile's query buffers
        self.batch_rows = min(self.batch_rows, rows)
        for index in range(_MASKS + (1 if near else 0)):
            self._mask(index, rows, columns)
        self._scores("scores", rows, columns)
        self._scores("masked", rows, columns)
        self._rows(rows, dim)
        self._gallery(columns, dim)
        self._per_query(queries)
        self._canonical(dim)

    def _mask(self, index: int, rows: int, columns: int) -> Tensor:
        return self.workspace.get(f"sharded_mask{index}", (rows, columns), torch.bool, self.device)

    def _scores(self, slot: str, rows: int, columns: int) -> Tensor:
        return self.workspace.get(f"sharded_{slot}", (rows, columns), self.fast.dtype, self.device)

    def _rows(self, rows: int, dim: int) -> tuple[Tensor, Tensor]:
        """Buffers of ``rows`` prepared rows and of float64 copies of a few of them."""
        dtype = self.prepared.dtype
        ready = self.workspace.get("sharded_rows", (rows, dim), dtype, self.device)
        wide_rows = min(rows, self.wide_rows)
        wide = self.workspace.get("sharded_wide", (wide_rows, dim), torch.float64, self.device)
        return ready, wide

    def _gallery(self, columns: int, dim: int) -> Tensor:
        dtype = self.prepared.dtype
        return self.workspace.get("sharded_gallery", (columns, dim), dtype, self.device)

    def _per_query(self, count: int) -> tuple[Tensor, Tensor, Tensor]:
        best = self.workspace.get("sharded_best", (count,), torch.float64, self.device)
        tied = self.workspace.get("sharded_tied", (count,), torch.int64, self.device)
        flag = self.workspace.get("sharded_flag", (count,), torch.bool, self.device)
        return best, tied, flag

    def _canonical(self, dim: int) -> int:
        """Rows re-scored a batch at a time; the buffers of
        :func:`recall_at_k.ranking.score.canonical_pair_scores` reserved at their
        largest."""
        step = self.batch_rows
        dtype, device = self.prepared.dtype, self.device
        self.workspace.get("canonical_rows", (step, dim), dtype, device)
        self.workspace.get("canonical_q", (dim, step), torch.float64, device)
        self.workspace.get("canonical_g", (dim, step), torch.float64, device)
        self._rows(step, dim)
        return step

    def gallery(self, rows: Tensor) -> Tensor:
        """The run's gallery rows prepared as the one-process copy is (row by row:
        :func:`recall_at_k.ranking.score.prepare` for ``"cosine"``, into a buffer); other
        similarities read the rows as they are."""
        if self.options.similarity != "cosine":
            return rows
        count, dim = rows.shape
        out = self._gallery(count, dim)
        _, wide = self._rows(min(count, self.tile_rows(max(1, count), dim)), dim)
        step = wide.shape[0]
        for begin in range(0, count, step):
            part = wide[: min(step, count - begin)].copy_(rows[begin : begin + step])  # exact
            part.div_(cosine_norms(part).unsqueeze(1))
            out[begin : begin + part.shape[0]].copy_(part)
        return out

    def run(self, state: _Direction, first: int, part: Tensor, positives: bool) -> None:
        """Pass A (``positives``) or pass B of ``state``'s queries over the stored rows
        ``first:first + len(part)``."""
        count = state.rows.shape[0]
        if count == 0:
            return
        if not positives and not bool(
            (state.has_positive & (state.greater < self.options.max_k)).any()
        ):
            return
        identity = state.gallery_identity[first : first + part.shape[0]]
        columns = (identity >= 0).nonzero().view(-1)
        if columns.numel() == 0:
            return
        options, fast = self.options, self.fast
        rows = part if columns.shape[0] == part.shape[0] else part.index_select(0, columns)
        # Prepared as the one-process copy is (row by row); non-cosine rows are as stored.
        gallery = self.gallery(rows)
        stored = columns + first
        column_labels, column_groups = self.labels[stored], self.groups[stored]
        column_identity = identity[columns]
        gallery_fast = gallery.to(fast.dtype)
        if fast.centre is not None:
            gallery_fast = gallery_fast - fast.centre
        dim = gallery.shape[1]
        largest = float(torch.linalg.vector_norm(gallery_fast, dim=1).max())
        gallery_norm = float(
            norm_upper(torch.tensor([largest], dtype=torch.float64), dim, fast.dtype)
        )
        neg_sq_norms = None
        if fast.centre is not None:
            neg_sq_norms = gallery_fast.square().sum(dim=1).neg_().unsqueeze(0)
        norms = state.norms(self.prepared, fast)
        found: _Found = {"positive": [], "near": [], "negative": []}
        width = columns.shape[0]
        step = self.tile_rows(width, dim)
        for begin in range(0, count, step):
            tile = slice(begin, min(count, begin + step))
            size = tile.stop - tile.start
            ready, wide = self._rows(size, dim)
            queries = state.queries_into(self.prepared, tile, ready, wide)
            query_fast = queries.to(fast.dtype)
            if fast.centre is not None:
                query_fast = query_fast - fast.centre
            scores = self._scores("scores", size, width)
            if neg_sq_norms is not None:
                bound = (norms[tile] + gallery_norm).square_().mul_(fast.coefficient)
                torch.addmm(neg_sq_norms, query_fast, gallery_fast.T, alpha=2, out=scores)
                scores.sub_(query_fast.square().sum(dim=1, keepdim=True))
            else:
                bound = norms[tile] * (gallery_norm * fast.coefficient)
                torch.mm(query_fast, gallery_fast.T, out=scores)
            bound.add_(fast.absolute)
            if fast.check_nan:
                state.nan[tile] |= torch.isnan(scores).any(dim=1)
            masks = [self._mask(index, size, width) for index in range(_MASKS)]
            same_label, ignored = masks[0], masks[1]
            torch.eq(
                state_labels(self.labels, state, tile).unsqueeze(1), column_labels, out=same_label
            )
            torch.eq(state.identity[tile].unsqueeze(1), column_identity, out=ignored)
            if options.exclude != "none":
                same_group = masks[2]
                torch.eq(self.groups[state.rows[tile]].unsqueeze(1), column_groups, out=same_group)
                if options.exclude != "same_group":
                    same_group.bitwise_and_(same_label)
                ignored.bitwise_or_(same_group)
            offset = tile.start
            if positives:
                # same_label & ~ignored
                valid = torch.bitwise_not(ignored, out=masks[2]).bitwise_and_(same_label)
                self.positives(state, tile, scores, bound, valid, masks[3], found, offset)
                if options.near_duplicate is not None:
                    # ~same_label & ~ignored
                    valid = self._mask(_MASKS, size, width)
                    torch.bitwise_or(same_label, ignored, out=valid).bitwise_not_()
                    self.near(state, tile, scores, bound, valid, masks[3], found, offset)
            else:
                # ~same_label & ~ignored; then the same label and ignored masks are scratch
                valid = torch.bitwise_or(same_label, ignored, out=masks[2]).bitwise_not_()
                self.negatives(state, tile, scores, bound, valid, masks[:2], found, offset)
        self.decide(state, gallery, found)

    def decide(self, state: _Direction, gallery: Tensor, found: _Found) -> None:
        """Re-score the run's candidate pairs canonically, all at once (one pass over
        D for the run), and update the queries' state."""
        kinds = [kind for kind in ("positive", "near", "negative") if found[kind]]
        if not kinds:
            return
        queries = [torch.cat([r for r, _ in found[kind]]) for kind in kinds]
        columns = [torch.cat([c for _, c in found[kind]]) for kind in kinds]
        sizes = [part.shape[0] for part in queries]
        state.rescored += sum(sizes)
        every_query, every_column = torch.cat(queries), torch.cat(columns)
        scores = torch.empty(every_query.shape[0], dtype=torch.float64, device=gallery.device)
        dim = gallery.shape[1]
        step = self._canonical(dim)
        for begin in range(0, every_query.shape[0], step):
            batch = slice(begin, begin + step)
            index = state.local[every_query[batch]]
            ready, wide = self._rows(index.shape[0], dim)
            rows = self.prepared.take_into(index, ready, wide)
            scores[batch] = canonical_pair_scores(
                rows,
                gallery,
                torch.arange(rows.shape[0], device=rows.device),
                every_column[batch],
                self.options.similarity,
                self.workspace,
                step * 8 * dim,
            )
        for kind, query, part in zip(kinds, queries, torch.split(scores, sizes), strict=True):
            if kind == "positive":
                # In place, in buffers: the per-query state stays where it was allocated
                # (new arrays each run, among a tile's temporaries, fragment the heap).
                best, equal, raised = self._per_query(state.best.shape[0])
                best.fill_(-math.inf).scatter_reduce_(0, query, part, reduce="amax")
                torch.maximum(state.best, best, out=best)
                equal.zero_().index_add_(0, query, (part == best[query]).to(torch.int64))
                torch.gt(best, state.best, out=raised)
                state.tied.masked_fill_(raised, 0).add_(equal)
                state.best.copy_(best)
            elif kind == "near":
                threshold = self.options.near_duplicate
                assert threshold is not None
                state.near_negative[query[part >= threshold]] = True
            else:
                at = state.best[query]
                state.greater.index_add_(0, query, (part > at).to(torch.int64))
                state.equal.index_add_(0, query, (part == at).to(torch.int64))

    def positives(
        self,
        state: _Direction,
        tile: slice,
        scores: Tensor,
        bound: Tensor,
        valid: Tensor,
        scratch: Tensor,
        found: _Found,
        offset: int,
    ) -> None:
        """Pass A: whether each query has a valid positive; the positives that may reach
        the best canonical score (``c*`` is updated once the run is decided).

        ``bound`` (float64 ``[T, 1]``) holds for every item of the run: the run's best
        fast positive minus it is a canonical score reached, and a positive whose fast
        score is below ``max(c*, that) - bound`` scores below s* canonically. The
        comparisons are in the scores' dtype, the edges rounded outwards. ``scratch``: a
        mask buffer of the tile's shape."""
        state.has_positive[tile] |= valid.any(dim=1)
        masked = self._scores("masked", scores.shape[0], scores.shape[1])
        best_fast = torch.where(valid, scores, self.minus_inf, out=masked)
        best_fast = best_fast.amax(dim=1, keepdim=True)
        lower, _ = edges(best_fast.to(torch.float64), bound, scores.dtype)
        # a proven lower bound of s* (c* so far, or the run's best positive minus B)
        floor = torch.maximum(state.best[tile].unsqueeze(1), lower.to(torch.float64))
        reach, _ = edges(floor, bound, scores.dtype)
        _keep(found, "positive", torch.ge(scores, reach, out=scratch).bitwise_and_(valid), offset)

    def near(
        self,
        state: _Direction,
        tile: slice,
        scores: Tensor,
        bound: Tensor,
        valid: Tensor,
        scratch: Tensor,
        found: _Found,
        offset: int,
    ) -> None:
        """Pass A: whether a valid negative scores at or above the near-duplicate
        threshold (surely, or to be decided canonically). ``valid`` is written into;
        ``scratch``: a mask buffer of the tile's shape."""
        threshold = self.options.near_duplicate
        assert threshold is not None
        lo, hi = edges(torch.full_like(bound, threshold), bound, scores.dtype)
        candidates = valid.bitwise_and_(~state.near_negative[tile].unsqueeze(1))
        sure = torch.gt(scores, hi, out=scratch).bitwise_and_(candidates).any(dim=1)
        state.near_negative[tile] |= sure
        unsure = candidates.bitwise_and_(~sure.unsqueeze(1))
        _keep(found, "near", torch.ge(scores, lo, out=scratch).bitwise_and_(unsure), offset)

    def negatives(
        self,
        state: _Direction,
        tile: slice,
        scores: Tensor,
        bound: Tensor,
        valid: Tensor,
        scratch: Sequence[Tensor],
        found: _Found,
        offset: int,
    ) -> None:
        """Pass B: the valid negatives surely above s* (fast score above ``s* + B``),
        and those to compare with it canonically (within ``B`` of it; queries with
        ``max K`` above it are done). ``valid`` is written into; ``scratch``: two mask
        buffers of the tile's shape."""
        active = state.has_positive[tile] & (state.greater[tile] < self.options.max_k)
        best = torch.where(active, state.best[tile], math.inf).unsqueeze(1)
        lo, hi = edges(best, bound, scores.dtype)
        above = torch.gt(scores, hi, out=scratch[0]).bitwise_and_(valid)
        state.greater[tile] += above.sum(dim=1)
        within = valid.bitwise_xor_(above)  # valid & ~above (above lies within valid)
        _keep(found, "negative", torch.ge(scores, lo, out=scratch[1]).bitwise_and_(within), offset)


_MASKS = 4
"""Mask buffers a tile uses (the same label, ignored, valid, scratch); one more for the
near-duplicate negatives."""


_Found = dict[str, list[tuple[Tensor, Tensor]]]
"""A run's candidate pairs by kind: (query of the direction, gallery column of the run)."""


def _keep(found: _Found, kind: str, candidates: Tensor, offset: int) -> None:
    """Add the pairs of a tile's bool ``candidates`` ``[T, run]`` to ``found[kind]``, the
    tile's rows counted from ``offset``."""
    row, column = candidates.nonzero(as_tuple=True)
    if row.numel():
        found[kind].append((row + offset, column))


def state_labels(labels: Tensor, state: _Direction, tile: slice) -> Tensor:
    """The labels of a tile of ``state``'s queries."""
    return labels[state.rows[tile]]


def _counts(
    state: _Direction, options: RankOptions, grid: float, known: Tensor | None
) -> RankCounts:
    """This process's contribution of one direction: its queries' histogram, counts and
    near-duplicate counts."""
    device = state.best.device
    counts = TieCounts(state.greater, state.greater + state.equal, state.tied, state.has_positive)
    hist, queries = _histogram(counts, options, grid)
    near = torch.zeros(len(NEAR_COUNTS), dtype=torch.int64, device=device)
    threshold = options.near_duplicate
    if threshold is not None:
        reaches = state.has_positive & (state.best >= threshold)
        near_positive, near_negative = reaches.clone(), state.near_negative.clone()
        if known is not None:
            near_positive |= known[0, state.position]
            near_negative |= known[1, state.position]
        beaten = counts.greater if options.ties == "optimistic" else counts.at_or_above
        assert beaten is not None
        hits = reaches & (beaten == 0)
        near = torch.stack(
            [
                near_positive.sum(),
                (near_negative & state.has_positive).sum(),
                (near_negative & ~state.has_positive).sum(),
                hits.sum(),
            ]
        )
    nan = state.nan.sum()
    rescored = torch.tensor(state.rescored, dtype=torch.int64, device=device)
    return RankCounts(hist, queries, nan, rescored, near)


def check_sharded(sharded: object, similarity: object) -> bool:
    """``sharded`` as a bool: a ValueError unless it is one, or when it is True with a
    callable ``similarity`` (whose scores are not canonical: a sharded gallery is ranked
    block by block, where a callable's scores could depend on the blocks)."""
    if not isinstance(sharded, bool):
        raise ValueError(
            "`sharded` must be a bool (True: under DDP each process keeps its items and"
            f" the gallery passes around the processes in blocks), got {sharded!r}"
        )
    if sharded and callable(similarity):
        raise ValueError(
            "`sharded=True` needs a built-in `similarity` ('cosine', 'dot' or"
            " 'euclidean'), whose canonical scores do not depend on how the gallery is"
            f" split; got a callable ({similarity!r}): pass sharded=False"
        )
    return sharded
