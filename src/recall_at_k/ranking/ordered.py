"""The items as one matrix in the ranking's order, built block by block from where they
are stored: the one whole copy of the embeddings that a ranking makes.

The ranking reads the gallery as a contiguous run of rows sorted by label
(:class:`~recall_at_k.ranking.gallery.Gallery`). Instead of copying the stored
embeddings into one matrix, then into a prepared (normalised) matrix, then into the
gallery's label order -- three whole copies -- :func:`ordered_items` writes each stored
block, prepared a chunk at a time, straight to its rows in the ranking's order: the first
direction's gallery sorted by label, then the second direction's gallery items not in the
first (sorted by label), then the rest (sorted by label). Each gallery (and the queries,
read in label order) is then a view of that matrix wherever it is one run (leave-one-out,
query/gallery, and both directions of disjoint query and gallery sets), and the rows'
sides are renumbered to match (their order kept: the audit and the per-query records
read it).

The protocol audit hashes and compares the stored bit patterns: the metric builds the
copy without normalising it, audits it, then normalises it in place (:func:`normalise`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from recall_at_k._kernel import Workspace
from recall_at_k._types import Similarity
from recall_at_k.ranking.gallery import Side, index_dtype
from recall_at_k.ranking.score import prepare_rows
from recall_at_k.ranking.workers import Workers, worker_count

ORDER_CHUNK_BYTES = 2**20
"""Rows are read from the stored blocks and written in order this many bytes at a time."""


class RowSource:
    """Rows ``[N, D]`` stored as a list of ``[b, D]`` blocks (views: nothing is copied
    whole), read in runs."""

    def __init__(self, blocks: Sequence[Tensor], num: int, width: int, dtype: torch.dtype) -> None:
        self.blocks = [block.reshape(-1, width) for block in blocks if block.numel()]
        self.starts = [0]
        for block in self.blocks:
            self.starts.append(self.starts[-1] + block.shape[0])
        self.shape = (num, width)
        if self.blocks:  # one dtype for all: the metric's, or the blocks' promoted
            dtype = self.blocks[0].dtype
            for block in self.blocks[1:]:
                dtype = torch.promote_types(dtype, block.dtype)
        self.dtype = dtype
        self.device = self.blocks[0].device if self.blocks else torch.device("cpu")

    def runs(self, rows_per_chunk: int) -> Iterator[tuple[int, Tensor]]:
        """``(first row, rows)`` of every stored row, in storage order, at most
        ``rows_per_chunk`` rows a part (views)."""
        for start, block in zip(self.starts, self.blocks, strict=False):
            for first in range(0, block.shape[0], rows_per_chunk):
                yield start + first, block[first : first + rows_per_chunk]


class Rows(Protocol):
    """Stored rows read in runs: a :class:`RowSource`, or every process's rows read
    together (:class:`recall_at_k._sync.BroadcastRows`)."""

    shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device

    def runs(self, rows_per_chunk: int) -> Iterator[tuple[int, Tensor]]: ...


class Ordered(NamedTuple):
    """The items in the ranking's order: ``embeddings`` ``[N, D]`` (prepared), ``order``
    (the stored row of each row), ``position`` (the row of each stored row; both
    :func:`~recall_at_k.ranking.gallery.index_dtype`) and the directions' sides
    renumbered (in their own dtype and order)."""

    embeddings: Tensor
    order: Tensor
    position: Tensor
    directions: list[tuple[Side, Side] | None]


def ranking_order(labels: Tensor, directions: Sequence[tuple[Side, Side] | None]) -> Tensor:
    """The stored row of each row of the ranking's order: each direction's gallery items
    not placed before, sorted by label (stable), then every other item (by label too)."""
    num = labels.shape[0]
    placed = torch.zeros(num, dtype=torch.bool, device=labels.device)
    parts = []
    for sides in directions:
        if sides is None:
            continue
        rows = sides[1].rows
        rows = rows[~placed[rows]]
        if rows.numel() == 0:
            continue
        _, by_label = torch.sort(labels[rows], stable=True)
        parts.append(rows[by_label])
        placed[rows] = True
    rest = (~placed).nonzero().view(-1)
    del placed
    if rest.numel():  # in label order too: queries read as one run where they are
        _, by_label = torch.sort(labels[rest], stable=True)
        rest = rest[by_label]
    parts.append(rest)
    return torch.cat(parts)


def ordered_items(
    source: Rows,
    labels: Tensor,
    directions: Sequence[tuple[Side, Side] | None],
    similarity: Similarity | None,
    chunk_bytes: int = ORDER_CHUNK_BYTES,
) -> Ordered:
    """The embeddings in the ranking's order (:func:`ranking_order`), written chunk by
    chunk, prepared for ``similarity`` (None: only brought to at least float32, every
    bit kept, for the audit; :func:`normalise` later): the only whole copy; the sides
    renumbered to its rows. Rows are read and prepared ``chunk_bytes`` at a time (their
    copies: float64 and the dtype's, some 16 bytes a coordinate)."""
    num, width = source.shape
    narrow = index_dtype(num)
    order = ranking_order(labels, directions).to(narrow)
    position = torch.empty_like(order)
    position[order] = torch.arange(num, dtype=order.dtype, device=order.device)
    dtype = torch.promote_types(source.dtype, torch.float32)
    out = torch.empty((num, width), dtype=dtype, device=source.device)
    step = max(1, chunk_bytes // (16 * max(1, width)))
    for first, rows in source.runs(step):
        target = position[first : first + rows.shape[0]].long()  # index_copy_'s dtype
        prepared = rows.to(dtype) if similarity is None else prepare_rows(rows, similarity, dtype)
        out.index_copy_(0, target, prepared)
    # Renumbered in the rows' own dtype; a tensor that two sides share (leave-one-out's
    # queries and gallery, :func:`recall_at_k._items.narrow_sides`) renumbered once.
    done: dict[int, tuple[Tensor, Tensor]] = {}

    def renumber(side: Side) -> Side:
        key = id(side.rows)
        if key not in done:
            done[key] = (side.rows, position[side.rows].to(side.rows.dtype))
        return Side(done[key][1], side.identity)

    renumbered: list[tuple[Side, Side] | None] = []
    for sides in directions:
        renumbered.append(None if sides is None else (renumber(sides[0]), renumber(sides[1])))
    return Ordered(out, order, position, renumbered)


def normalise(
    embeddings: Tensor, similarity: Similarity, chunk_bytes: int = ORDER_CHUNK_BYTES
) -> None:
    """:func:`~recall_at_k.ranking.score.prepare` in place, a chunk of rows at a time
    (each row's value depends on that row alone), the chunks on the CPU's worker threads
    (:mod:`~recall_at_k.ranking.workers`; each writes only its own rows; the copies of
    all chunks in flight together within ``chunk_bytes``)."""
    if similarity != "cosine":
        return
    workers = worker_count(embeddings.device)
    step = max(1, chunk_bytes // (16 * max(1, embeddings.shape[1]) * max(1, workers)))
    starts = range(0, embeddings.shape[0], step)

    def chunk(start: int, _: Workspace) -> None:
        rows = embeddings[start : start + step]
        rows.copy_(prepare_rows(rows, similarity, embeddings.dtype))

    count = min(workers, len(starts))
    with Workers(chunk, count, Workspace()) as pool:
        for _ in pool.map(starts):
            pass
