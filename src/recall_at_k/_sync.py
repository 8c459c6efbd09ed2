"""One rule for list states across processes: a process without data sends a typed empty.

torchmetrics gathers a ``"cat"`` list state by concatenating each process's list and
gathering the result; a process whose list is empty sends a 1-D tensor of the metric's
float dtype instead, which cannot be gathered beside other processes' int64
``[rows, width]`` blocks (the collective fails or hangs). Every list state therefore
declares its layout, the trailing shape and dtype of its blocks, and an empty list is
replaced by an empty block of that layout before the gather. Tensor (``"sum"``) states
need nothing: every process always holds one of the same shape.

A float list state (embeddings) keeps each block in the dtype it was stored in, float32
or wider; processes may hold different ones (one was given float64 inputs), so before a
gather they agree on the widest and widen their blocks to it (exactly), and every
process gathers the same dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric

from recall_at_k import _collectives

FLOAT_FLOOR = torch.float32
"""The narrowest dtype a float list state stores (half-precision inputs widen to it)."""


class ListLayout(NamedTuple):
    """The blocks of a list state: ``[rows, *trailing]`` of ``dtype``.

    ``dtype=None`` stands for float blocks of at least ``FLOAT_FLOOR``, each in the dtype
    it was stored in (see :func:`agree_float_dtypes`). No module cast changes a list
    state's dtype.
    """

    trailing: tuple[int, ...]
    dtype: torch.dtype | None


def fill_empty_list_states(metric: Metric, layouts: dict[str, ListLayout]) -> list[str]:
    """Give every empty list state one empty block of its layout, before a gather.

    Returns:
        The names of the states filled, for :func:`empty_filled_list_states`.
    """
    filled = []
    for name, layout in layouts.items():
        value = getattr(metric, name)
        if isinstance(value, list) and not value:
            dtype = FLOAT_FLOOR if layout.dtype is None else layout.dtype
            value.append(torch.empty((0, *layout.trailing), dtype=dtype, device=metric.device))
            filled.append(name)
    return filled


def empty_filled_list_states(metric: Metric, filled: list[str]) -> None:
    """After ``unsync``: the local states filled before the gather are empty lists again."""
    for name in filled:
        value = getattr(metric, name)
        if isinstance(value, list) and all(block.numel() == 0 for block in value):
            value.clear()


class BroadcastRows:
    """Every process's stored rows, read in runs without gathering them whole.

    torchmetrics gathers a list state into a list of every process's blocks, then
    concatenates them: two whole copies beside the local state's cached clone. For the
    embeddings, each process instead keeps its own blocks and, when a ranking reads the
    rows (:func:`recall_at_k.ranking.ordered.ordered_items`, which writes each run to
    its place at once), process r's rows are broadcast from r a run at a time, in
    process order: every process sees the rows of the gathered state, in its order,
    holding one run of them at a time. Every process must read them together (a
    collective); ``counts`` (the rows of each process) and ``dtype`` (the widest any
    process stores, into which every process widens its rows exactly) come from
    :func:`local_counts`.
    """

    def __init__(
        self,
        local: list[Tensor],
        counts: list[int],
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        group: Any,
    ) -> None:
        self.local = [block.reshape(-1, width) for block in local if block.numel()]
        self.counts = counts
        self.shape = (sum(counts), width)
        self.dtype = dtype
        self.device = device
        self.group = group

    def runs(self, rows_per_chunk: int) -> Iterator[tuple[int, Tensor]]:
        """``(first row, rows)`` of every process's rows, in process order, at most
        ``rows_per_chunk`` rows a part (a buffer reused from one part to the next)."""
        me = dist.get_rank(self.group)
        buffer = torch.empty((rows_per_chunk, self.shape[1]), dtype=self.dtype, device=self.device)
        start, cursor = 0, _Cursor(self.local)
        for rank, count in enumerate(self.counts):
            for first in range(0, count, rows_per_chunk):
                part = buffer[: min(rows_per_chunk, count - first)]
                _broadcast_part(part, rank, me, cursor, self.group)
                yield start + first, part
            start += count


class LocalBlocks:
    """This process's stored rows, a list of ``[b, D]`` blocks (views of the state), read
    as one ``[n, D]`` tensor of ``dtype`` a few rows at a time: nothing is copied whole.

    :meth:`span` of rows within one block is a view (widened where ``dtype`` is wider);
    :meth:`take` gathers any rows into a new tensor."""

    def __init__(
        self, blocks: list[Tensor], width: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        # 2-D blocks as they are (rows of width 0 included), flat ones reshaped
        rows = [b if b.dim() == 2 else b.reshape(-1, width) for b in blocks if b.numel()]
        rows += [b for b in blocks if b.dim() == 2 and b.numel() == 0]
        self.blocks = [block for block in rows if block.shape[0]]
        self.starts = [0]
        for block in self.blocks:
            self.starts.append(self.starts[-1] + block.shape[0])
        self.shape = (self.starts[-1], width)
        self.dtype = dtype
        self.device = device
        self._ends = torch.tensor(self.starts[1:], dtype=torch.int64, device=device)

    def span(self, first: int, stop: int) -> Tensor:
        """Rows ``first:stop`` in ``dtype`` (a view where they lie in one block and are
        stored in ``dtype``)."""
        parts = []
        for start, block in zip(self.starts, self.blocks, strict=False):
            lo, hi = max(first, start), min(stop, start + block.shape[0])
            if lo < hi:
                parts.append(block[lo - start : hi - start])
        if not parts:
            return torch.empty((0, self.shape[1]), dtype=self.dtype, device=self.device)
        if len(parts) == 1:
            return parts[0].to(self.dtype)
        return torch.cat([part.to(self.dtype) for part in parts])

    def take(self, index: Tensor) -> Tensor:
        """The rows ``index`` (any order) in ``dtype``, a new ``[len(index), D]`` tensor."""
        if len(self.blocks) == 1:
            return self.blocks[0].index_select(0, index).to(self.dtype)
        out = torch.empty((index.shape[0], self.shape[1]), dtype=self.dtype, device=self.device)
        self.take_into(index, out)
        return out

    def span_into(self, first: int, stop: int, out: Tensor) -> None:
        """:meth:`span` written into ``out`` (``[stop - first, D]``, of ``dtype`` or
        wider: widened exactly), a block's part at a time."""
        for start, block in zip(self.starts, self.blocks, strict=False):
            lo, hi = max(first, start), min(stop, start + block.shape[0])
            if lo < hi:
                out[lo - first : hi - first].copy_(block[lo - start : hi - start])

    def take_into(self, index: Tensor, out: Tensor) -> None:
        """:meth:`take` written into ``out`` (``[len(index), D]``, of ``dtype`` or
        wider)."""
        if len(self.blocks) == 1 and self.blocks[0].dtype == out.dtype:
            torch.index_select(self.blocks[0], 0, index, out=out)
            return
        if len(self.blocks) == 1:
            out.copy_(self.blocks[0].index_select(0, index))
            return
        which = torch.searchsorted(self._ends, index, right=True)
        for block in torch.unique(which).tolist():
            chosen = (which == block).nonzero().view(-1)
            rows = index.index_select(0, chosen) - self.starts[block]
            out.index_copy_(0, chosen, self.blocks[block].index_select(0, rows).to(out.dtype))

    def runs(self, rows_per_chunk: int) -> Iterator[tuple[int, Tensor]]:
        """``(first row, rows)`` of every row in order, at most ``rows_per_chunk`` rows a
        part (views of the blocks, in their stored dtype)."""
        for start, block in zip(self.starts, self.blocks, strict=False):
            for first in range(0, block.shape[0], rows_per_chunk):
                yield start + first, block[first : first + rows_per_chunk]


class _Cursor:
    """Reads a list of blocks' rows in order, a part at a time."""

    def __init__(self, blocks: list[Tensor]) -> None:
        self.blocks, self.block, self.row = blocks, 0, 0

    def fill(self, out: Tensor) -> None:
        """``out`` = the next ``len(out)`` rows."""
        filled = 0
        while filled < out.shape[0]:
            block = self.blocks[self.block]
            take = min(block.shape[0] - self.row, out.shape[0] - filled)
            out[filled : filled + take] = block[self.row : self.row + take]
            filled += take
            self.row += take
            if self.row == block.shape[0]:
                self.block, self.row = self.block + 1, 0


def local_counts(
    rows: int, dtype: torch.dtype, group: Any, device: torch.device
) -> tuple[list[int], torch.dtype]:
    """The rows each process of ``group`` holds and the widest float dtype any holds
    them in (``dtype``: this process's, :func:`widest_float` of its blocks): one
    all-gather of two integers. The rows are then read in that dtype (widened exactly),
    as :func:`agree_float_dtypes` agrees before torchmetrics' gather."""
    counts, _, widest = process_rows(rows, 0, dtype, group, device)
    return counts, widest


def process_rows(
    rows: int, held: int, dtype: torch.dtype, group: Any, device: torch.device
) -> tuple[list[int], list[int], torch.dtype]:
    """:func:`local_counts`, with the values each process holds (``held``, for a check
    every process makes alike): one all-gather of three integers."""
    world = dist.get_world_size(group)
    mine = torch.tensor([rows, held, _BITS[dtype]], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    _collectives.all_gather(every, mine, group=group)
    widest = max(int(row[2]) for row in every)
    return [int(row[0]) for row in every], [int(row[1]) for row in every], _FLOAT_OF_BITS[widest]


def broadcast_rows(
    local: list[Tensor], counts: list[int], width: int, device: torch.device, group: Any
) -> Tensor:
    """Every process's int64 ``[rows, width]`` blocks (``counts`` rows each, from
    :func:`process_rows`) in one new tensor, in process order: each process's rows are
    broadcast from it straight into their place (no padded or per-process copies)."""
    out = torch.empty((sum(counts), width), dtype=torch.int64, device=device)
    me, start, cursor = dist.get_rank(group), 0, _Cursor(local)
    for rank, count in enumerate(counts):
        if count:
            _broadcast_part(out[start : start + count], rank, me, cursor, group)
        start += count
    return out


def _broadcast_part(part: Tensor, rank: int, me: int, cursor: _Cursor, group: Any) -> None:
    """``part`` = the next rows of process ``rank`` of ``group`` (read by ``cursor`` on
    that process, which is process ``me``), broadcast from it to every process."""
    if rank == me:
        cursor.fill(part)
    source = rank if group is None else dist.get_global_rank(group, rank)
    _collectives.broadcast(part, src=source, group=group)


def agree_float_dtypes(
    metric: Metric,
    layouts: dict[str, ListLayout],
    dist_sync_fn: Callable[..., Any],
    process_group: Any | None,
) -> None:
    """Before a gather: every process widens its float list states' blocks to the widest
    dtype any process holds (one small gather of each process's widest, with the
    metric's own ``dist_sync_fn``), so that the gathered blocks share one dtype.

    The states are replaced by new lists: the local copy torchmetrics keeps for
    ``unsync`` stays as it was.
    """
    names = [name for name, layout in layouts.items() if layout.dtype is None]
    if not names:
        return
    states = [_blocks(getattr(metric, name)) for name in names]
    widest = [widest_float([block.dtype for block in blocks]) for blocks in states]
    local = torch.tensor([_BITS[dtype] for dtype in widest], device=metric.device)
    gathered = torch.stack([g.reshape(-1) for g in dist_sync_fn(local, group=process_group)])
    for name, blocks, bits in zip(names, states, gathered.amax(dim=0).tolist(), strict=True):
        dtype = _FLOAT_OF_BITS[int(bits)]
        if any(block.dtype != dtype for block in blocks):
            setattr(metric, name, [block.to(dtype) for block in blocks])


def widest_float(dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype float blocks of ``dtypes`` are ranked in together: the promotion of
    them all and ``FLOAT_FLOOR`` (what ``torch.cat`` of the stored blocks gives)."""
    widest = FLOAT_FLOOR
    for dtype in dtypes:
        widest = torch.promote_types(widest, dtype)
    return widest


_BITS = {torch.float32: 32, torch.float64: 64}
_FLOAT_OF_BITS = {bits: dtype for dtype, bits in _BITS.items()}


def _blocks(value: Any) -> list[Tensor]:
    return [value] if isinstance(value, Tensor) else list(value)
