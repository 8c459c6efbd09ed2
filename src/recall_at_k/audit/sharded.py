"""The audit's codes of rows sharded across processes (one process: a shard of its own).
Every process runs the one-process steps alike on small gathered per-item data;
:meth:`Shard.check` moves only the rows of the pairs compared. Collective: a failure on
one process raises on every process."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k import _collectives as collectives
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
) -> Codes:
    """:func:`recall_at_k.audit.codes` of every process's rows in process order: this process's
    ``[b, D]`` ``blocks`` (compared in the widest float held), ``counts`` per process of
    ``group``, and every process's int64 ``labels`` / ``groups`` (None: no group codes)."""
    distributed = dist.is_available() and dist.is_initialized()
    shard = Shard(blocks, counts, group if distributed else False, sizes, labels.device)
    return shard.codes(labels, groups)


class Shard:
    """This process's rows among all processes', and collectives (``group`` False: none)."""

    def __init__(
        self,
        blocks: Sequence[Tensor],
        counts: list[int],
        group: Any,
        sizes: AuditSizes,
        device: torch.device,
    ) -> None:
        self.group, self.sizes, self.counts = group, sizes, counts
        self.failure: Exception | None = None
        self.me = 0 if group is False else dist.get_rank(group)
        self.world = 1 if group is False else dist.get_world_size(group)
        if len(counts) != self.world or any(block.dim() != 2 for block in blocks):
            raise ValueError(
                "`blocks` must be this process's rows, [b, D] blocks, and `counts` one count"
                f" per process of the group ({self.world} processes), got blocks of shapes"
                f" {[tuple(b.shape) for b in blocks]} on process {self.me} and counts {counts}"
            )
        self.blocks = [block for block in blocks if block.shape[0]]
        self.device = self.blocks[0].device if self.blocks else device
        self.ends = [*itertools.accumulate(block.shape[0] for block in self.blocks)]
        self.rows = self.ends[-1] if self.blocks else 0
        width = max((block.shape[1] for block in self.blocks), default=0)
        itemsize = max((block.dtype.itemsize for block in self.blocks), default=4)
        every = torch.tensor([[self.rows, width, itemsize]] * self.world, device=self.device)
        if self.world > 1:  # every process's rows, width and widest float
            collectives.all_gather(list(every.unbind()), every[self.me].clone(), group=group)
        if every[:, 0].tolist() != list(counts):
            held = every[:, 0].tolist()
            raise ValueError(f"`counts` must be the rows each process holds, {held}, got {counts}")
        self.width = int(every[:, 1].max())
        self.dtype = torch.float64 if int(every[:, 2].max()) > 4 else torch.float32
        self.starts = [0, *itertools.accumulate(counts)]
        self.step = max(1, sizes.block_bytes // max(1, self.width * self.dtype.itemsize))
        self.pairs = max(1, sizes.block_bytes // max(1, 64 * self.width))  # float64 work

    def codes(self, labels: Tensor, groups: Tensor | None) -> Codes:
        """The codes of every process's rows."""
        device, sizes, size = self.device, self.sizes, self.dtype.itemsize * self.width
        if self.width == 0:  # no bits: every row in one class
            klass = torch.zeros(self.starts[-1], dtype=torch.int64, device=device)
            return codes_of(klass, rounding.both_orientations([], 1, device), labels, groups, sizes)

        def hashes() -> Tensor:  # each process hashes its own rows (their words, a copy)
            own = torch.arange(
                self.starts[self.me], self.starts[self.me] + self.rows, device=device
            )
            args = (lambda part: self.rows_of(own[part]), self.rows, 5 * size, sizes, device)
            return self.spread(
                self.guarded(torch.zeros_like(own), bitwise.hash_rows, *args), self.counts
            )

        def same(a: Tensor, b: Tensor) -> Tensor:
            return self.check(a, b, bitwise.same_bits)

        klass, first = bitwise.bitwise_classes(hashes(), same, sizes)  # freed once coded
        adjacent = rounding.both_orientations([], first.shape[0], device)
        if first.shape[0] > 1:  # each process projects the classes whose first row it holds
            grid = rounding.grid(self.width, device)
            bounds = torch.searchsorted(first, torch.tensor(self.starts, device=device)).tolist()
            mine = first[bounds[self.me] : bounds[self.me + 1]].long()
            failed = rounding.Places(torch.full_like(mine, rounding.NOT_FINITE), mine.short())
            rows = (lambda part: self.rows_of(mine[part]), mine.shape[0], 8 * self.width + size)
            local = self.guarded(failed, rounding.place_rows, grid, *rows, sizes, device)
            shares = [hi - lo for lo, hi in itertools.pairwise(bounds)]
            # The int16 cells travel as pairs of bytes (gloo has no int16).
            others = self.spread(local.others.view(torch.int8).view(-1, 2), shares)
            places = rounding.Places(
                self.spread(local.key, shares), others.view(torch.int16).view(-1)
            )

            def within(a: Tensor, b: Tensor) -> Tensor:
                return self.check(first[a], first[b], rounding.within)

            adjacent = rounding.rounding_pairs(grid, places, within, sizes)
        self.raise_any()
        return codes_of(klass, adjacent, labels, groups, sizes)

    def guarded(self, fallback: T, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)``, or after a failure ``fallback`` (collectives go on; see raise_any)."""
        if self.failure is None:
            try:
                return work(*args)
            except Exception as err:  # raised by raise_any, after every collective
                self.failure = err
        return fallback

    def raise_any(self) -> None:
        """Raise a failure of any process on every process (collective)."""
        failed = torch.tensor([int(self.failure is not None)], device=self.device)
        self.all_reduce(failed)
        if self.failure is not None:
            raise self.failure
        if int(failed):
            raise RuntimeError(
                "the protocol audit of EmbeddingRecallAtK failed on another process; see its error"
            )

    def all_reduce(self, values: Tensor) -> None:
        if self.world > 1:
            collectives.all_reduce(values, group=self.group)

    def broadcast(self, values: Tensor, rank: int) -> None:
        """``values`` of process ``rank`` of the group, on every process."""
        if self.world > 1:
            collectives.broadcast(values, src=rank, group=self.group)

    def spread(self, values: Tensor, sizes: list[int]) -> Tensor:
        """Every process's ``values`` (``[sizes[rank], ...]``) concatenated in process
        order, on every process: each process's part broadcast from it in turn."""
        if self.world == 1:
            return values
        out = values.new_empty((sum(sizes), *values.shape[1:]))
        for rank, (lo, hi) in enumerate(itertools.pairwise([0, *itertools.accumulate(sizes)])):
            if rank == self.me:
                out[lo:hi] = values
            if hi > lo:
                self.broadcast(out[lo:hi], rank)
        return out

    def rows_of(self, index: Tensor) -> Tensor:
        """:meth:`take` of ascending ``index`` (each once), a view where it is a run of
        this process's rows in one block of the common dtype (read in place, no copy)."""
        one = len(self.blocks) == 1 and self.blocks[0].dtype == self.dtype and index.numel()
        if one and int(index[-1]) - (first := int(index[0])) == index.shape[0] - 1:
            first -= self.starts[self.me]
            return self.blocks[0][first : first + index.shape[0]]
        return self.take(index)

    def take(self, index: Tensor, out: Tensor | None = None) -> Tensor:
        """The rows of items held here (global int64 indices) in the common dtype."""
        local = index - self.starts[self.me]
        if out is None:
            out = torch.empty((index.shape[0], self.width), dtype=self.dtype, device=self.device)
        which = torch.searchsorted(torch.tensor(self.ends, device=self.device), local, right=True)
        order = torch.argsort(which, stable=True)  # the indices grouped by block, each once
        grouped = out if bool((order[1:] > order[:-1]).all()) else torch.empty_like(out)
        counts = torch.bincount(which, minlength=len(self.blocks)).tolist()
        for block, stop in enumerate(itertools.accumulate(counts)):
            if counts[block]:
                part = slice(stop - counts[block], stop)
                rows = local[order[part]] - (self.ends[block] - self.blocks[block].shape[0])
                if self.blocks[block].dtype == self.dtype:  # no copy beside ``out``
                    torch.index_select(self.blocks[block], 0, rows, out=grouped[part])
                else:
                    grouped[part] = self.blocks[block].index_select(0, rows)
        return out if grouped is out else out.index_copy_(0, order, grouped)

    def check(self, a: Tensor, b: Tensor, test: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """bool per pair of items ``(a, b)`` (global indices): ``test`` of their rows, by the
        process holding ``a``; the rows of ``b`` are broadcast by their owner, each once."""
        a, b, step = a.long(), b.long(), self.step
        ends = torch.tensor(self.starts[1:], device=self.device)
        owner_a, owner_b = (torch.searchsorted(ends, x, right=True) for x in (a, b))
        ok = torch.ones(a.shape[0], dtype=torch.bool, device=self.device)
        mine = (owner_a == self.me).nonzero().view(-1)
        mine = mine[torch.argsort(b[mine], stable=True)]  # this process's pairs, by b
        wanted = b[mine]

        def test_batch(batch: Tensor, rows: Tensor | None = None) -> None:
            """Test this process's pairs whose ``b`` is in ``batch`` (sorted, one owner's)."""
            rows = self.take(batch) if rows is None else rows
            lo = int(torch.searchsorted(wanted, batch[:1]))
            hi = int(torch.searchsorted(wanted, batch[-1:], right=True))
            for at in range(lo, hi, self.pairs):
                stop = min(hi, at + self.pairs)
                pairs, b_at = mine[at:stop], wanted[at:stop]
                ok[pairs] = test(self.take(a[pairs]), rows[torch.searchsorted(batch, b_at)])

        sent = torch.unique(b[owner_a != owner_b])  # sorted, so grouped by owner
        for rank in range(self.world):
            part = sent[torch.searchsorted(ends, sent, right=True) == rank]
            for at in range(0, part.shape[0], step):
                batch = part[at : at + step]
                rows = torch.empty((batch.shape[0], self.width), dtype=self.dtype, device=a.device)
                if rank == self.me:
                    self.guarded(None, self.take, batch, rows)
                self.broadcast(rows, rank)
                if rank != self.me:
                    self.guarded(None, test_batch, batch, rows)
        local = torch.unique(wanted[owner_b[mine] == self.me])
        for at in range(0, local.shape[0], step):
            self.guarded(None, test_batch, local[at : at + step])
        failed = (~ok).to(torch.int32)
        self.all_reduce(failed)
        return failed == 0
