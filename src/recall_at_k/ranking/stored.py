"""The stored embeddings (``[b, D]`` blocks) read in runs or by index, never concatenated:
this process's (:class:`StoredRows`), or under DDP every process's
(:class:`BroadcastRows`), broadcast by their owner a run at a time, in process order."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k import _collectives as collectives

FLOAT_FLOOR = torch.float32
"""The narrowest dtype embeddings are stored and ranked in."""


def widest_float(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The dtype float blocks of ``dtypes`` are ranked in together (at least float32)."""
    return functools.reduce(torch.promote_types, dtypes, FLOAT_FLOOR)


class StoredRows:
    """Rows ``[N, D]`` stored as blocks (flat or ``[b, D]``, any strides), read in runs or by
    index in :attr:`dtype` (the widest stored, at least float32; widening is exact)."""

    def __init__(
        self, blocks: Sequence[Tensor], width: int, device: torch.device | None = None
    ) -> None:
        self.blocks = [block.reshape(-1, width) for block in blocks if block.numel()]
        self.starts = [0, *itertools.accumulate(block.shape[0] for block in self.blocks)]
        self.shape = (self.starts[-1], width)
        self.dtype = widest_float([block.dtype for block in self.blocks])
        first = self.blocks[0].device if self.blocks else torch.device("cpu")
        self.device = first if device is None else device
        self._ends = torch.tensor(self.starts[1:], dtype=torch.int64, device=self.device)

    def runs(self, rows: int) -> Iterator[tuple[int, Tensor]]:
        """``(first row, rows)`` of every row in order, at most ``rows`` a part (views)."""
        for start, block in zip(self.starts, self.blocks, strict=False):
            for first in range(0, block.shape[0], rows):
                yield start + first, block[first : first + rows]

    def take(self, index: Tensor, out: Tensor | None = None) -> Tensor:
        """Rows ``index`` in :attr:`dtype` (or wider ``out``'s), into a new tensor or ``out``."""
        if out is None:
            out = torch.empty((index.shape[0], self.shape[1]), dtype=self.dtype, device=self.device)
        if len(self.blocks) == 1:
            block = self.blocks[0]
            if block.dtype == out.dtype and block.is_contiguous():
                return torch.index_select(block, 0, index, out=out)
            return out.copy_(block.index_select(0, index))
        which = torch.searchsorted(self._ends, index, right=True)
        for part in torch.unique(which).tolist():
            chosen = (which == part).nonzero().view(-1)
            rows = index.index_select(0, chosen) - self.starts[part]
            out.index_copy_(0, chosen, self.blocks[part].index_select(0, rows).to(out.dtype))
        return out


class BroadcastRows:
    """Every process's :class:`StoredRows`, read together. ``counts`` (rows per process)
    and ``dtype`` (the widest any process stores) come from :func:`process_rows`."""

    def __init__(self, local: StoredRows, counts: list[int], dtype: torch.dtype, group: Any):
        self.local, self.counts, self.dtype, self.group = local, counts, dtype, group
        self.shape = (sum(counts), local.shape[1])
        self.device = local.device
        self.rank = dist.get_rank(group)
        self.offset = sum(counts[: self.rank])

    def runs(self, rows: int) -> Iterator[tuple[int, Tensor]]:
        """``(first row, rows)`` of all processes' rows in order, ``rows`` a part at most."""
        starts = [0, *itertools.accumulate(self.counts)]
        for rank, first, part in self.broadcast(rows, [None] * len(self.counts)):
            yield starts[rank] + first, part

    def broadcast(
        self, rows: int, orders: Sequence[Tensor | None], prepare: Any = None
    ) -> Iterator[tuple[int, int, Tensor]]:
        """``(owner, first position among the owner's, rows)``: every process's rows in process
        order, in the order ``orders[r]`` gives (None: stored), at most ``rows`` a part, turned
        by ``prepare(rows, local indices)`` on the owner."""
        width = self.shape[1]
        buffer = torch.empty((rows, width), dtype=self.dtype, device=self.device)
        for rank, count in enumerate(self.counts):
            order = orders[rank]
            total = count if order is None else order.shape[0]
            for first in range(0, total, rows):
                part = buffer[: min(rows, total - first)]
                if rank == self.rank:
                    stop = first + part.shape[0]
                    index = (
                        torch.arange(first, stop, device=self.device)
                        if order is None
                        else order[first:stop].long()
                    )
                    self.local.take(index, out=part)
                    if prepare is not None:
                        part.copy_(prepare(part, index))
                collectives.broadcast(part, src=rank, group=self.group)
                yield rank, first, part


FLOAT_BITS = {torch.float32: 32, torch.float64: 64}
"""The bits of each stored float dtype, to agree on one across processes (and back)."""
FLOAT_OF_BITS = {bits: dtype for dtype, bits in FLOAT_BITS.items()}


def process_rows(
    rows: int, held: int, dtype: torch.dtype, group: Any, device: torch.device
) -> tuple[list[int], list[int], torch.dtype]:
    """The rows and values each process of ``group`` holds, and the widest float dtype any
    holds them in (``dtype``: this process's): one all-gather of three integers."""
    world = dist.get_world_size(group)
    mine = torch.tensor([rows, held, FLOAT_BITS[dtype]], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    collectives.all_gather(every, mine, group=group)
    widest = max(int(row[2]) for row in every)
    return [int(row[0]) for row in every], [int(row[1]) for row in every], FLOAT_OF_BITS[widest]


def broadcast_blocks(
    local: Sequence[Tensor], counts: list[int], width: int, device: torch.device, group: Any
) -> Tensor:
    """Every process's int64 ``[rows, width]`` blocks (``counts`` rows each) in one new
    tensor, in process order, each process's rows broadcast from it into their place."""
    out = torch.empty((sum(counts), width), dtype=torch.int64, device=device)
    me, start = dist.get_rank(group), 0
    mine = torch.cat([b.reshape(-1, width) for b in local]) if local else out[:0]
    for rank, count in enumerate(counts):
        part = out[start : start + count]
        if count:
            if rank == me:
                part.copy_(mine)
            collectives.broadcast(part, src=rank, group=group)
        start += count
    return out
