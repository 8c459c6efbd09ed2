"""One rule for list states across processes: a process without data sends a typed empty.

torchmetrics gathers a ``"cat"`` list state by concatenating each process's list and
gathering the result; a process whose list is empty sends a 1-D tensor of the metric's
float dtype instead, which cannot be gathered beside other processes' int64
``[rows, width]`` blocks (the collective fails or hangs). Every list state therefore
declares its layout, the trailing shape and dtype of its blocks, and an empty list is
replaced by an empty block of that layout before the gather. Tensor (``"sum"``) states
need nothing: every process always holds one of the same shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric


class ListLayout(NamedTuple):
    """The blocks of a list state: ``[rows, *trailing]`` of ``dtype``.

    ``dtype=None`` stands for the metric's own dtype (``Metric.dtype``), for float data
    that follows the module's dtype casts.
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
            dtype = metric.dtype if layout.dtype is None else layout.dtype
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
    collective); ``counts`` (the rows of each process) come from the gathered metadata.
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
            source = rank if self.group is None else dist.get_global_rank(self.group, rank)
            for first in range(0, count, rows_per_chunk):
                part = buffer[: min(rows_per_chunk, count - first)]
                if rank == me:
                    cursor.fill(part)
                dist.broadcast(part, src=source, group=self.group)
                yield start + first, part
            start += count


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


def local_counts(rows: int, group: Any, device: torch.device) -> list[int]:
    """The rows each process of ``group`` holds (one all-gather of a count)."""
    world = dist.get_world_size(group)
    mine = torch.tensor([rows], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return [int(count) for count in every]
