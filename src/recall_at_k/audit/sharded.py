"""The audit's codes of rows sharded across processes, no process holding them all.

The same steps as one process, on every process alike: each process hashes its own rows
and the hashes are gathered (8 bytes an item); :func:`~recall_at_k.audit.bitwise.bitwise_classes`
sorts them and compares each item with its run's first item through :meth:`Shard.check`;
each process projects the first rows of the classes whose first item it holds, the places
are gathered (10 bytes a class), every process walks the same
:func:`~recall_at_k.audit.rounding.candidates` and checks them through :meth:`Shard.check`.
Only the rows of the pairs compared travel, each once, a block at a time. The codes are
those of :func:`recall_at_k.audit.codes` of every process's rows in process order.
Collective: every process of the group calls :func:`sharded_codes` together.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k.audit import bitwise, rounding
from recall_at_k.audit.report import Codes, codes_of
from recall_at_k.ranking.budget import AuditSizes

T = TypeVar("T")


def sharded_codes(
    blocks: Sequence[Tensor],
    counts: list[int],
    labels: Tensor,
    groups: Tensor | None,
    group: Any,
    sizes: AuditSizes,
    *,
    hashes: Callable[[Tensor], Tensor] | None = None,
) -> Codes:
    """:func:`recall_at_k.audit.codes` of every process's rows concatenated in process
    order (the same codes), each process holding only its own.

    Args:
        blocks: this process's rows, ``[b, D]`` blocks of any float dtype and strides (the
            stored views, never copied whole; processes holding different dtypes compare in
            the widest, widened exactly).
        counts: the rows of each process of ``group``, in process order.
        labels, groups: int64 ``[sum(counts)]``, every process's, in the same order
            (``groups`` None: no group codes).
        group: the process group (None: the default group, or one process without
            torch.distributed).
        sizes: the blocks and chunks to work in.
        hashes: the row hash (tests pass colliding ones).
    """
    shard = Shard(blocks, counts, group, sizes, labels.device)
    device = shard.device
    if shard.num == 0 or shard.width == 0:
        klass = torch.zeros(shard.num, dtype=bitwise.code_dtype(shard.num), device=device)
        return codes_of(klass, rounding.both_orientations([], 0, device), labels, groups, sizes)
    mine = shard.guarded(
        torch.zeros(shard.rows, dtype=torch.int64, device=device), shard.hashes, hashes
    )
    klass, first = bitwise.bitwise_classes(
        shard.spread(mine, counts), lambda a, b: shard.check(a, b, bitwise.same_bits), sizes
    )
    adjacent = shard.rounding_pairs(first)
    shard.raise_any()
    return codes_of(klass, adjacent, labels, groups, sizes)


class Shard:
    """This process's rows among every process's, and the collectives over them."""

    def __init__(
        self,
        blocks: Sequence[Tensor],
        counts: list[int],
        group: Any,
        sizes: AuditSizes,
        device: torch.device,
    ) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group, self.sizes = group, sizes
        self.me = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        if len(counts) != self.world or any(block.dim() != 2 for block in blocks):
            raise ValueError(
                "`blocks` must be this process's rows, [b, D] blocks, and `counts` one count"
                f" per process of the group ({self.world} processes), got blocks of shapes"
                f" {[tuple(b.shape) for b in blocks]} on process {self.me} and counts {counts}"
            )
        self.blocks = [block for block in blocks if block.shape[0]]
        self.device = blocks[0].device if blocks else device
        self.rows = sum(block.shape[0] for block in self.blocks)
        width = max((block.shape[1] for block in self.blocks), default=0)
        itemsize = max((block.dtype.itemsize for block in self.blocks), default=4)
        mine = torch.tensor([self.rows, itemsize, width], dtype=torch.int64, device=self.device)
        every = [mine] if self.world == 1 else [torch.zeros_like(mine) for _ in range(self.world)]
        if self.world > 1:
            dist.all_gather(every, mine, group=group)
        gathered = [int(row[0]) for row in every]
        if gathered != list(counts):
            raise ValueError(
                f"`counts` must be the rows each process holds, {gathered}, got {counts}"
            )
        self.dtype = torch.float64 if max(int(row[1]) for row in every) > 4 else torch.float32
        self.width = max(int(row[2]) for row in every)
        self.starts = [sum(counts[:rank]) for rank in range(self.world + 1)]
        self.num = self.starts[-1]
        self.ends = torch.tensor(self.starts[1:], dtype=torch.int64, device=self.device)
        self.block_starts = [
            sum(b.shape[0] for b in self.blocks[:i]) for i in range(len(self.blocks))
        ]
        self.step = max(1, sizes.block_bytes // max(1, self.width * self.dtype.itemsize))
        self.failure: Exception | None = None

    def guarded(self, fallback: T, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)``, this process's own work; after a failure here, ``fallback``: the
        process keeps taking part in every collective and :meth:`raise_any` raises."""
        if self.failure is None:
            try:
                return work(*args)
            except Exception as err:  # raised by raise_any, after every collective
                self.failure = err
        return fallback

    def raise_any(self) -> None:
        """Raise a failure of any process on every process (collective)."""
        failed = torch.tensor(
            [int(self.failure is not None)], dtype=torch.int64, device=self.device
        )
        self.all_reduce(failed)
        if self.failure is not None:
            raise self.failure
        if int(failed):
            raise RuntimeError(
                "the protocol audit of EmbeddingRecallAtK failed on another process; see its error"
            )

    def all_reduce(self, values: Tensor) -> None:
        if self.world > 1:
            dist.all_reduce(values, group=self.group)

    def broadcast(self, values: Tensor, rank: int) -> None:
        """``values`` of process ``rank`` of the group, on every process."""
        if self.world > 1:
            source = rank if self.group is None else dist.get_global_rank(self.group, rank)
            dist.broadcast(values, src=source, group=self.group)

    def take(self, index: Tensor, out: Tensor | None = None) -> Tensor:
        """The rows of items held here (global indices), in the common dtype (into ``out``)."""
        local = index - self.starts[self.me]
        if out is None:
            out = torch.empty((index.shape[0], self.width), dtype=self.dtype, device=self.device)
        bounds = torch.tensor(self.block_starts[1:], dtype=torch.int64, device=self.device)
        which = torch.searchsorted(bounds, local, right=True)
        for block in torch.unique(which).tolist():
            chosen = (which == block).nonzero().view(-1)
            rows = local[chosen] - self.block_starts[block]
            out[chosen] = self.blocks[block].index_select(0, rows).to(self.dtype)
        return out

    def hashes(self, hashes: Callable[[Tensor], Tensor] | None) -> Tensor:
        """This process's rows' hashes, a block at a time."""
        parts = [bitwise.hash_rows(b, self.sizes, None, hashes, self.dtype) for b in self.blocks]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=self.device)

    def spread(self, values: Tensor, sizes: list[int]) -> Tensor:
        """Every process's ``values`` (``[sizes[rank], ...]``) concatenated in process
        order, on every process: each process's part broadcast from it in turn."""
        out = values.new_empty((sum(sizes), *values.shape[1:]))
        for rank, size in enumerate(sizes):
            part = out[sum(sizes[:rank]) : sum(sizes[: rank + 1])]
            if rank == self.me:
                part.copy_(values)
            if size:
                self.broadcast(part, rank)
        return out

    def check(self, a: Tensor, b: Tensor, test: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """bool per pair of items ``(a, b)`` (global indices, the same on every process):
        ``test`` of their two rows (deciding on each pair alone), the same on every process.
        The process holding ``a`` tests; the rows ``b`` it does not hold are broadcast by
        their owners, each once, ``step`` rows at a time."""
        a, b = a.long(), b.long()
        step, owner_a, owner_b = self.step, self.owner(a), self.owner(b)
        home = owner_a == self.me
        ok = torch.ones(a.shape[0], dtype=torch.bool, device=self.device)

        def test_pairs(pairs: Tensor, rows: Tensor | None) -> None:
            ok[pairs] = test(self.take(a[pairs]), self.take(b[pairs]) if rows is None else rows)

        here = (home & (owner_b == self.me)).nonzero().view(-1)
        for start in range(0, here.shape[0], step):
            self.guarded(None, test_pairs, here[start : start + step], None)
        cross = owner_a != owner_b
        needed = torch.unique(b[cross])  # sorted, so grouped by owner
        bounds = torch.searchsorted(
            self.owner(needed), torch.arange(self.world + 1, device=self.device)
        )
        away = (home & cross).nonzero().view(-1)
        wanted, order = torch.sort(b[away])
        away = away[order]
        buffer = torch.empty(
            (min(step, needed.shape[0]), self.width), dtype=self.dtype, device=self.device
        )
        for rank, (lo, hi) in enumerate(
            zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
        ):
            for start in range(lo, hi, step):
                batch = needed[start : min(start + step, hi)]
                part = buffer[: batch.shape[0]]
                if rank == self.me:
                    self.guarded(None, self.take, batch, part)
                self.broadcast(part, rank)
                if rank == self.me:
                    continue
                first = int(torch.searchsorted(wanted, batch[:1]))
                last = int(torch.searchsorted(wanted, batch[-1:], right=True))
                for at in range(first, last, step):
                    where = torch.searchsorted(batch, wanted[at : min(at + step, last)])
                    self.guarded(None, test_pairs, away[at : min(at + step, last)], part[where])
        flags = (~ok).to(torch.int32)
        self.all_reduce(flags)
        return flags == 0

    def owner(self, index: Tensor) -> Tensor:
        """The process holding each item (global indices)."""
        return torch.searchsorted(self.ends, index, right=True)

    def rounding_pairs(self, first: Tensor) -> Tensor:
        """:func:`~recall_at_k.audit.rounding.rounding_pairs` of the classes whose first
        items are ``first`` (ascending)."""
        device, count = self.device, first.shape[0]
        if count < 2:
            return rounding.both_orientations([], count, device)
        grid = rounding.grid(self.width, device)
        bounds = torch.searchsorted(first, torch.tensor(self.starts, device=device)).tolist()
        own = first[bounds[self.me] : bounds[self.me + 1]]
        row_bytes = (8 + self.dtype.itemsize) * self.width
        step = max(1, self.sizes.project_bytes // row_bytes)
        local = rounding.Places.empty(own.shape[0], device)

        def project() -> bool:
            for s in range(0, own.shape[0], step):
                local.place(grid, rounding.project(grid, self.take(own[s : s + step])), s)
            return True

        if not self.guarded(False, project):
            local.key.fill_(rounding.NOT_FINITE)  # a failed process's classes: no candidates
        sizes = [hi - lo for lo, hi in itertools.pairwise(bounds)]
        # The int16 cells travel as pairs of bytes (gloo has no int16).
        others = self.spread(local.others.view(torch.int8).view(-1, 2), sizes)
        places = rounding.Places(self.spread(local.key, sizes), others.view(torch.int16).view(-1))
        found = []
        for a, b in rounding.candidates(grid, places, self.sizes):
            if a.numel():
                within = self.check(first[a], first[b], rounding.within)
                found.append(torch.stack([a[within], b[within]], dim=1))
        return rounding.both_orientations(found, count, device)
