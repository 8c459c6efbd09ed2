"""Where the engine's blocks come from: this process's queries and the gallery in blocks.

A source gives this process's queries in label order (:attr:`~LocalSource.queries`,
rows by :meth:`~LocalSource.query_rows`), what every block shares (``stats``), the gallery
in blocks sorted by label (:meth:`~LocalSource.galleries`) and the canonical scores of a
block's pairs. :class:`LocalSource` serves the one ordered copy as one block;
:class:`ShardedSource` a gallery sharded across processes, every process's items passing
by in runs broadcast by their owner, the statistics agreed by collectives."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k import _collectives as collectives
from recall_at_k._kernel import Workspace
from recall_at_k._types import Similarity
from recall_at_k.ranking.budget import PRODUCT_COLUMNS
from recall_at_k.ranking.plan import Direction, Plan
from recall_at_k.ranking.score import (
    bound_absolute,
    bound_coefficient,
    canonical_scores,
    fast_dtype,
    largest_magnitude,
    may_produce_nan,
    norm_upper,
    prepare_rows,
    row_norms,
)
from recall_at_k.ranking.stored import BroadcastRows


class Stats(NamedTuple):
    """What every gallery block of a ranking shares."""

    dtype: torch.dtype  # of the fast products
    centre: Tensor | None  # [D], subtracted from every row for "euclidean"
    max_norm: float  # bounds the norm of every gallery row as the product reads it
    coefficient: float  # the bound's relative part (score.bound_coefficient)
    absolute: float  # and its absolute part (score.bound_absolute)
    check_nan: bool  # whether fast scores could be NaN
    block_rows: int  # rows read at a time to make blocks (Budget.row_block_rows)


class Queries(NamedTuple):
    """This process's queries of a direction, in label order (stable)."""

    rows: Tensor  # the source's row of each query
    labels: Tensor
    groups: Tensor
    identity: Tensor
    position: Tensor  # int64: each query's index among the direction's queries


class Gallery(NamedTuple):
    """A block of gallery items sorted by label."""

    canonical: Tensor  # [G, D] prepared rows, for canonical scores
    fast: Tensor  # [G, D] the same rows in the fast products' dtype (maybe one tensor)
    labels: Tensor
    groups: Tensor
    block_labels: Tensor  # [C] the distinct labels, ascending
    block_starts: Tensor  # [C] the first column of each label's run
    block_counts: Tensor  # [C] its length
    identity_sorted: Tensor  # [G] the items' sample identities, ascending
    identity_column: Tensor  # [G] the column of each
    centre: Tensor | None  # "euclidean": the stats' centre ...
    neg_sq_norms: Tensor | None  # ... and -|g - centre|^2 of each column, [1, G]


class Located(NamedTuple):
    """Each query's label run of columns (``length`` 0: none), its own column (-1: none)."""

    start: Tensor
    length: Tensor
    own: Tensor


def gallery_block(
    canonical: Tensor, fast: Tensor, labels: Tensor, groups: Tensor, identity: Tensor, stats: Stats
) -> Gallery:
    """A :class:`Gallery` of rows already sorted by label."""
    block_labels, counts = torch.unique_consecutive(labels, return_counts=True)
    # Copies of their own size (the storages keep every item's capacity).
    block_labels, counts = block_labels.clone(), counts.to(index_dtype(labels.shape[0]), copy=True)
    starts = torch.cumsum(counts, dim=0, dtype=counts.dtype) - counts
    identity_sorted, identity_column = torch.sort(identity)
    by_identity = identity_sorted, identity_column.to(index_dtype(identity.shape[0]))
    del identity_sorted, identity_column  # the int64 columns: not held
    neg_sq_norms = None
    if stats.centre is not None:
        neg_sq_norms = torch.empty((1, fast.shape[0]), dtype=fast.dtype, device=fast.device)
        for first, part in chunks(fast, stats.block_rows):
            squares = (part - stats.centre).square_().sum(dim=1).neg_()
            neg_sq_norms[0, first : first + part.shape[0]] = squares
    blocks = block_labels, starts, counts
    return Gallery(
        canonical, fast, labels, groups, *blocks, *by_identity, stats.centre, neg_sq_norms
    )


def chunks(rows: Tensor, step: int) -> Iterator[tuple[int, Tensor]]:
    """``(first, rows)`` of ``rows``, ``step`` rows at a time (views)."""
    for first in range(0, rows.shape[0], step):
        yield first, rows[first : first + step]


def index_dtype(count: int) -> torch.dtype:
    """The dtype of positions among ``count`` items: int32 where they fit."""
    return torch.int32 if count < 2**31 else torch.int64


def locate(queries: Queries, gallery: Gallery) -> Located:
    """Where each query's label run and own column lie in ``gallery``."""
    device, narrow = queries.labels.device, index_dtype(gallery.labels.shape[0])
    if gallery.block_labels.numel() == 0:
        none = torch.zeros(queries.labels.shape[0], dtype=narrow, device=device)
        return Located(none, none, none - 1)
    small = narrow == torch.int32
    labels = queries.labels.to(gallery.block_labels.dtype)
    block = torch.searchsorted(gallery.block_labels, labels, out_int32=small)
    block.clamp_(max=gallery.block_labels.shape[0] - 1)
    found = gallery.block_labels[block] == labels
    length = gallery.block_counts.to(narrow)[block].masked_fill_(~found, 0)
    start = gallery.block_starts.to(narrow)[block]
    del block, found
    identity = queries.identity.to(gallery.identity_sorted.dtype)
    at = torch.searchsorted(gallery.identity_sorted, identity, out_int32=small)
    at.clamp_(max=gallery.identity_sorted.shape[0] - 1)
    missing = gallery.identity_sorted[at] != identity
    own = gallery.identity_column[at].masked_fill_(missing, -1).to(narrow)
    return Located(start, length, own)


def bounds(rows: Tensor, stats: Stats) -> Tensor:
    """``[T, 1]`` float64: each query's bound ``B`` on ``|fast - canonical|`` (``rows``:
    the queries as the fast product reads them, centred for ``"euclidean"``)."""
    norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True).to(torch.float64)
    norms = norm_upper(norms, rows.shape[1], rows.dtype)
    if stats.centre is not None:
        norms = norms.add_(stats.max_norm).square_().mul_(stats.coefficient)
    else:
        norms.mul_(stats.max_norm * stats.coefficient)
    return norms.add_(stats.absolute)


def product(
    queries: Tensor,
    gallery: Gallery,
    first: int,
    stop: int,
    workspace: Workspace,
    tile_bytes: int = 0,
) -> Tensor:
    """Fast scores ``[T, stop - first]`` (a view) against gallery columns ``first:stop``,
    widened by neighbouring columns to a multiple of :data:`PRODUCT_COLUMNS` (the BLAS's
    fast width) where ``tile_bytes`` (a worker's tile share) holds them. ``"euclidean"``:
    ``2 q'.g' - |q'|^2 - |g'|^2`` on centred rows, as many at a time as the tile or
    ``tile_bytes`` holds (else a tile of few rows centres a column or two a product). On CPU
    the tile's slot is taken at the whole share at once (:class:`Workspace`)."""
    rows, width, num = queries.shape[0], stop - first, gallery.fast.shape[0]
    wide, itemsize = -(-width // PRODUCT_COLUMNS) * PRODUCT_COLUMNS, queries.element_size()
    fits = wide <= num and rows * wide * itemsize <= tile_bytes
    width = wide if fits else width
    lo = min(num, first + width) - width  # first, or before it where widened at the end
    dim, dtype, device = queries.shape[1], queries.dtype, queries.device
    out = workspace.get("tile", (rows, width), dtype, device, 0, tile_bytes // itemsize)
    if gallery.centre is None or gallery.neg_sq_norms is None:
        torch.matmul(queries, gallery.fast[lo : lo + width].T, out=out)
        return out[:, first - lo : stop - lo]
    room = max(rows * width, tile_bytes // itemsize)
    step = max(1, min(width, room // max(1, dim)))
    centred = workspace.get("centred", (step * dim,), dtype, device)  # once: parts reuse it
    slot = (rows * step,), dtype, device
    parted = None if step >= width else workspace.get("centred_scores", *slot)
    for part in range(lo, lo + width, step):
        end = min(lo + width, part + step)
        into = centred[: (end - part) * dim].view(-1, dim)
        rows_centred = torch.sub(gallery.fast[part:end], gallery.centre, out=into)
        norms = gallery.neg_sq_norms[:, part:end]
        target = out if parted is None else parted[: rows * (end - part)].view(rows, -1)
        torch.addmm(norms, queries, rows_centred.T, alpha=2, out=target)
        if parted is not None:
            out[:, part - lo : end - lo] = target
    squares = torch.bmm(queries.unsqueeze(1), queries.unsqueeze(2)).view(-1, 1)  # |q'|^2, no copy
    return out.sub_(squares)[:, first - lo : stop - lo]


def scores_of(
    queries: Tensor, gallery: Gallery, similarity: Similarity, workspace: Workspace
) -> Tensor:
    """Writable scores ``[T, G]`` of a tile: fast product, or a callable's (checked)."""
    if not callable(similarity):
        return product(queries, gallery, 0, gallery.fast.shape[0], workspace)
    scores = similarity(queries, gallery.fast)
    shape = (queries.shape[0], gallery.fast.shape[0])
    if (
        not isinstance(scores, Tensor)
        or tuple(scores.shape) != shape
        or not scores.is_floating_point()
    ):
        got = list(scores.shape) if isinstance(scores, Tensor) else type(scores)
        raise ValueError(
            f"`similarity` must return floating point scores of shape [{shape[0]},"
            f" {shape[1]}] for a tile of queries, got {got}"
        )
    return scores.detach().clone(memory_format=torch.contiguous_format)


class Processes(NamedTuple):
    """The processes a ranking is shared among: those of ``group`` (None: the default)."""

    group: Any


class Reduce(NamedTuple):
    """How statistics are agreed: by one process (None) or by every process."""

    processes: Processes | None

    def max(self, value: float, device: torch.device) -> float:
        if self.processes is None:
            return value
        out = torch.tensor([value], dtype=torch.float64, device=device)
        collectives.all_reduce(out, op=dist.ReduceOp.MAX, group=self.processes.group)
        return float(out[0])

    def sum(self, value: Tensor) -> Tensor:
        if self.processes is not None:
            collectives.all_reduce(value, op=dist.ReduceOp.SUM, group=self.processes.group)
        return value


def statistics(
    similarity: Similarity,
    every_row: Callable[[], Iterator[Tensor]],
    gallery_rows: Callable[[], Iterator[Tensor]],
    gallery_count: int,
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
    reduce: Reduce,
    block_rows: int,
) -> Stats:
    """The :class:`Stats` of a gallery: ``every_row()`` and ``gallery_rows()`` yield prepared
    rows (this process's, under ``reduce``), read at most twice, ``block_rows`` at a time."""
    if callable(similarity):
        return Stats(dtype, None, 0.0, 0.0, 0.0, True, block_rows)
    largest = reduce.max(max((largest_magnitude(p) for p in every_row()), default=0.0), device)
    fast = fast_dtype(largest, dim, dtype, similarity)
    centre = None
    if similarity == "euclidean":
        total = torch.zeros(dim, dtype=torch.float64, device=device)
        for part in gallery_rows():
            total += part.to(torch.float64).sum(dim=0)
        centre = reduce.sum(total).div_(max(1, gallery_count)).to(fast)
    largest_norm = 0.0
    for part in gallery_rows():
        rows = part.to(fast) if centre is None else part.to(fast) - centre
        if rows.numel():
            largest_norm = max(largest_norm, float(torch.linalg.vector_norm(rows, dim=1).max()))
    largest_norm = reduce.max(largest_norm, device)
    max_norm = float(norm_upper(torch.tensor([largest_norm], dtype=torch.float64), dim, fast))
    coefficient = bound_coefficient(similarity, dim, fast, device)
    nan = may_produce_nan(largest, dim, fast, similarity)
    absolute = bound_absolute(similarity, dim, fast)
    return Stats(fast, centre, max_norm, coefficient, absolute, nan, block_rows)


def run_of(rows: Tensor) -> slice | None:
    """The slice ``rows`` are, where they are one ascending run, else None."""
    if rows.numel() == 0:
        return None
    first, count = int(rows[0]), rows.shape[0]
    if int(rows[-1]) != first + count - 1:
        return None
    run = torch.arange(first, first + count, dtype=rows.dtype, device=rows.device)
    return slice(first, first + count) if torch.equal(rows, run) else None


def in_label_order(rows: Tensor, labels: Tensor) -> tuple[Tensor | None, slice | None]:
    """The order that sorts ``rows`` by their labels (stable; None: sorted already), and
    the slice they then are if one run (as the plan puts galleries: no sort, no copy)."""
    run = run_of(rows)
    if run is not None:
        values = labels[run]
        if bool((values[1:] >= values[:-1]).all()):
            return None, run
    order = torch.sort(labels[rows.long()], stable=True)[1]
    return order, run_of(rows[order])


def _by_label(rows: Tensor, lo: int, hi: int, labels: Tensor) -> Tensor:
    """The positions of the ``rows`` in ``[lo, hi)``, sorted by their labels (stable)."""
    at = ((rows >= lo) & (rows < hi)).nonzero().view(-1)
    return at[torch.sort(labels[rows[at]], stable=True)[1]]


class LocalSource:
    """A plan's ordered copy: the gallery as one block (a view), this process's queries."""

    def __init__(
        self, plan: Plan, sides: Direction, share: tuple[int, int], similarity: Similarity
    ) -> None:
        embeddings = plan.embeddings
        assert embeddings is not None
        self.embeddings, self.similarity = embeddings, similarity
        device, (queries, items) = embeddings.device, sides
        order, run = in_label_order(items.rows, plan.labels)
        rows, identity = items.rows, items.identity
        if order is not None:
            rows, identity = rows[order], identity[order]
        index: slice | Tensor = rows.long() if run is None else run
        canonical = embeddings[index]
        step = plan.budget.row_block_rows()
        self.stats = statistics(
            similarity,
            lambda: (part for _, part in chunks(embeddings, step)),
            lambda: (part for _, part in chunks(canonical, step)),
            canonical.shape[0],
            embeddings.shape[1],
            embeddings.dtype,
            device,
            Reduce(None),
            step,
        )
        self.fast = embeddings.to(self.stats.dtype)
        fast, labels, groups = self.fast[index], plan.labels[index], plan.groups[index]
        self.gallery = gallery_block(canonical, fast, labels, groups, identity, self.stats)
        del fast, labels, groups
        lo, hi = share
        narrow = index_dtype(hi)
        everything = queries.rows is items.rows and (lo, hi) == (0, rows.shape[0])
        if everything:  # leave-one-out: the gallery's own items, in its order
            if order is None:
                order = torch.arange(hi, dtype=narrow, device=device)
            labels, groups = self.gallery.labels, self.gallery.groups
            self.queries = Queries(rows, labels, groups, identity, order.to(narrow))
        else:
            query_rows, query_identity = queries.rows[lo:hi], queries.identity[lo:hi]
            position = torch.arange(lo, hi, dtype=narrow, device=device)
            by_label, query_run = in_label_order(query_rows, plan.labels)
            if by_label is not None:
                query_rows, query_identity = query_rows[by_label], query_identity[by_label]
                position = position[by_label]
            query_index: slice | Tensor = query_rows.long() if query_run is None else query_run
            labels, groups = plan.labels[query_index], plan.groups[query_index]
            self.queries = Queries(query_rows, labels, groups, query_identity, position)
        del order, labels, groups
        self.located = locate(self.queries, self.gallery)
        # The identities served to find each query's own column: not kept.
        nothing = identity.new_empty(0)
        self.gallery = self.gallery._replace(identity_sorted=nothing, identity_column=nothing)
        # Leave-one-out: each query ignores only itself, by identity.
        own = torch.arange(rows.shape[0], dtype=self.located.own.dtype, device=device)
        self.leave_one_out = everything and torch.equal(self.located.own, own)

    def galleries(self) -> Iterator[Gallery]:
        yield self.gallery

    def query_rows(self, first: int, stop: int) -> Tensor:
        """The fast rows of queries ``first:stop`` (new, centred for ``"euclidean"``)."""
        rows = self.fast.index_select(0, self.queries.rows[first:stop].long())
        return rows if self.stats.centre is None else rows.sub_(self.stats.centre)

    def canonical(
        self, gallery: Gallery, queries: Tensor, columns: Tensor, workspace: Workspace, batch: int
    ) -> Tensor:
        """Canonical scores of the pairs (query ``queries[i]``, column ``columns[i]``)."""
        rows = self.queries.rows.long()[queries]
        return canonical_scores(
            self.embeddings, gallery.canonical, rows, columns, self.similarity, workspace, batch
        )


class ShardedSource:
    """A gallery sharded across the processes of ``plan.rows`` (``BroadcastRows``): this
    process ranks the queries it holds; the gallery passes by in runs of ``budget.run_bytes``,
    each process's rows sorted by label and prepared by their owner."""

    def __init__(
        self, plan: Plan, sides: Direction, similarity: Similarity, processes: Processes
    ) -> None:
        rows = plan.rows
        assert isinstance(rows, BroadcastRows)
        self.rows, self.similarity, self.plan = rows, similarity, plan
        local, device, self.dtype = rows.local, rows.device, rows.dtype
        starts = self.starts = [sum(rows.counts[:r]) for r in range(len(rows.counts) + 1)]
        queries, items = sides
        query_rows = queries.rows.long()
        here = _by_label(query_rows, starts[rows.rank], starts[rows.rank + 1], plan.labels)
        mine = query_rows[here]
        self.queries = Queries(
            mine - rows.offset, plan.labels[mine], plan.groups[mine], queries.identity[here], here
        )
        # Each process's gallery rows sorted by label: the order its runs pass by in.
        gallery_rows = items.rows.long()
        self.orders: list[Tensor] = []
        self.identities: list[Tensor] = []
        for rank in range(len(rows.counts)):
            owned = _by_label(gallery_rows, starts[rank], starts[rank + 1], plan.labels)
            self.orders.append(gallery_rows[owned] - starts[rank])
            self.identities.append(items.identity[owned])
        own_order = self.orders[rows.rank]
        width = rows.shape[1]
        step = plan.budget.row_block_rows()
        # "cosine": each held row's norm, once (8 bytes a row), not for every tile and run.
        self.norms: Tensor | None = None
        if similarity == "cosine":
            self.norms = torch.empty(local.shape[0], dtype=torch.float64, device=device)
            for first, part in local.runs(step):
                self.norms[first : first + part.shape[0]] = row_norms(part.to(torch.float64))

        def every_row() -> Iterator[Tensor]:
            for first, part in local.runs(step):
                yield self.prepare(part, slice(first, first + part.shape[0]))

        def own_gallery() -> Iterator[Tensor]:
            for first in range(0, own_order.shape[0], step):
                index = own_order[first : first + step]
                yield self.prepare(local.take(index), index)

        count, reduce = int(gallery_rows.shape[0]), Reduce(processes)
        self.stats = statistics(
            similarity, every_row, own_gallery, count, width, rows.dtype, device, reduce, step
        )
        self.run_rows = max(1, plan.budget.run_bytes // (width * self.dtype.itemsize))

    def prepare(
        self,
        rows: Tensor,
        index: Tensor | slice,
        out: Tensor | None = None,
        wide: Tensor | None = None,
    ) -> Tensor:
        """This process's rows ``index`` (``rows``) as the ranking scores them: new, or in
        ``out`` (``wide``: ``"cosine"``'s float64 buffer; :func:`prepare_rows`)."""
        norms = None if self.norms is None else self.norms[index]
        return prepare_rows(rows, self.similarity, self.dtype, norms, out, wide)

    def galleries(self) -> Iterator[Gallery]:
        """Every process's gallery, a run at a time (a collective)."""
        labels, groups = self.plan.labels, self.plan.groups
        for owner, first, part in self.rows.broadcast(self.run_rows, self.orders, self.prepare):
            order = self.orders[owner][first : first + part.shape[0]]
            stored = order + self.starts[owner]
            fast = part.to(self.stats.dtype)
            identity = self.identities[owner][first : first + part.shape[0]]
            yield gallery_block(part, fast, labels[stored], groups[stored], identity, self.stats)

    def _held(self, index: Tensor, workspace: Workspace, slot: str) -> Tensor:
        """This process's rows ``index`` as :meth:`prepare` makes them, in ``workspace``'s
        buffers named after ``slot`` (rows taken anew for every step would churn the C heap)."""
        shape, device = (index.shape[0], self.rows.shape[1]), self.rows.device
        taken = workspace.get(slot + "_taken", shape, self.dtype, device)
        taken = self.rows.local.take(index, out=taken)
        out = workspace.get(slot, shape, self.dtype, device)
        cosine = self.norms is not None
        wide = workspace.get(slot + "_wide", shape, torch.float64, device) if cosine else None
        return self.prepare(taken, index, out, wide)

    def query_rows(self, first: int, stop: int, workspace: Workspace) -> Tensor:
        """Queries ``first:stop`` as the ranking scores them (in ``workspace``)."""
        rows = self._held(self.queries.rows[first:stop], workspace, "queries")
        rows = rows.to(self.stats.dtype)
        return rows if self.stats.centre is None else rows.sub_(self.stats.centre)

    def canonical(
        self, gallery: Gallery, queries: Tensor, columns: Tensor, workspace: Workspace, batch: int
    ) -> Tensor:
        distinct, inverse = torch.unique(queries, return_inverse=True)
        rows = self._held(self.queries.rows[distinct], workspace, "canonical_queries")
        return canonical_scores(
            rows, gallery.canonical, inverse, columns, self.similarity, workspace, batch
        )


Source = LocalSource | ShardedSource
"""A source of blocks (see the module)."""
