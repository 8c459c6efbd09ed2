"""The protocol audit's item codes over stored rows sharded across processes.

:func:`sharded_codes` gives what :func:`recall_at_k._audit.codes` gives on every
process's rows concatenated in process order, while each process holds only its own
rows and, of the others', one broadcast batch of at most ``_COMPARE_BYTES`` at a time:

- each process hashes its own rows (:func:`~recall_at_k._audit.hash_rows`: exact integer
  arithmetic, the same hash for the same bits on any process); the hashes are broadcast
  process by process into one int64 array, the same on every process;
- every process sorts it alike: items of one hash form a run, and each item is compared
  bit for bit with its run's earliest item (:meth:`_Shard.check`: the owner of the item
  compares, the earliest item's row is broadcast to it from its owner in batches). A
  genuine hash collision (rows that differ within a run) splits the run -- the items
  unequal to its earliest item form a new run, compared again with their own earliest
  -- until every run is one bit pattern: the classes of ``bitwise_classes``, exactly,
  numbered by their first item;
- each process projects the first row of the classes whose first item it holds
  (:func:`~recall_at_k._audit.project`); the projections are broadcast into one array,
  and every process walks the same candidate pairs
  (:func:`~recall_at_k._audit.rounding_candidates`), each checked by
  :func:`~recall_at_k._audit.within` on the process holding its first row, the other
  row broadcast to it in batches. ``within`` decides on the two rows alone (the sums near
  the boundary are taken in one fixed order), and the cell width of the grid covers
  every rounding of the projections, so the pairs are those of ``rounding_pairs``.

Memory per item: the int64 hashes and their sort (in parts, ``_audit.sorted_parts``),
then int32 runs and classes; 10 bytes per class (its place in the grid,
``_audit.GridPlaces``) and its first item; no process holds more than one batch of
other processes' rows. Collective: every process of the group calls
:func:`sharded_codes` together.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k import _audit, _collectives
from recall_at_k._audit import Codes
from recall_at_k._sync import LocalBlocks, local_counts, widest_float

_T = TypeVar("_T")

PROJECT_SHARE = 8
"""Each process projects its classes' first rows an eighth of ``_audit.project_step`` at
a time: a projection's float64 temporaries are a fixed cost beside the per-item arrays
(the projections are the same whatever the batch: the grid's cell covers every
rounding, and pairs are decided on the two rows alone)."""


CANDIDATE_PAIRS = 2**13
"""Candidate pairs enumerated at a time (``_audit.rounding_candidates``): a fixed cost
beside the per-item arrays; every process enumerates the same chunks."""


def sharded_codes(
    local: Tensor | LocalBlocks,
    counts: list[int],
    labels: Tensor,
    groups: Tensor,
    group: Any,
    *,
    hashes: Callable[[Tensor], Tensor] | None = None,
) -> Codes:
    """``_audit.codes(all_rows, labels, groups)`` for ``all_rows`` every process's stored
    rows concatenated in process order, without any process holding them all.

    The classes may be numbered otherwise than ``codes`` numbers them (here: in the order
    of their first item), the same on every process; ``adjacent`` holds the same pairs of
    classes, both orientations, sorted.

    Args:
        local: this process's rows ``[counts[rank], D]`` (float32 or wider; processes
            holding different dtypes compare in the widest, widened exactly): one
            tensor, or its stored blocks (:class:`recall_at_k._sync.LocalBlocks`: no
            copy of them is made).
        counts: the rows of each process of ``group``, in process order.
        labels: int64 ``[sum(counts)]``, every process's, in the same order.
        groups: int64 ``[sum(counts)]``, likewise.
        group: the process group (None: the default group); every process of it calls
            this together.
        hashes: the row hash (tests pass colliding ones), as in ``bitwise_classes``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if isinstance(local, LocalBlocks):
            local = local.span(0, local.shape[0])
        return _audit.codes(local, labels, groups, hashes)
    shard = _Shard(local, counts, group)
    if shard.num == 0 or shard.width == 0:
        klass = torch.zeros(shard.num, dtype=_audit.code_dtype(shard.num), device=shard.device)
        none = _audit.both_orientations([], 0, shard.device)
        return _audit.codes_of(klass, none, labels, groups)
    klass, first = shard.classes(hashes)
    adjacent = shard.rounding_pairs(first)
    shard.raise_any()
    return _audit.codes_of(klass, adjacent, labels, groups)


class _Shard:
    """This process's rows among every process's, and the collectives over them."""

    def __init__(self, local: Tensor | LocalBlocks, counts: list[int], group: Any) -> None:
        self.group = group
        self.me = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = local.device
        shape = tuple(local.shape)
        if len(counts) != self.world or len(shape) != 2 or shape[0] != counts[self.me]:
            raise ValueError(
                f"`local` must be this process's rows [counts[rank], D] and `counts` one"
                f" count per process of the group ({self.world} processes), got local of"
                f" shape {shape} on process {self.me} and counts {counts}"
            )
        if isinstance(local, Tensor):
            local = LocalBlocks([local], shape[1], widest_float([local.dtype]), local.device)
        gathered, self.dtype = local_counts(shape[0], local.dtype, group, self.device)
        if gathered != list(counts):
            raise ValueError(
                f"`counts` must be the rows each process holds, {gathered}, got {counts}"
            )
        self.rows = local
        self.width = shape[1]
        self.starts = [0]
        for count in counts:
            self.starts.append(self.starts[-1] + count)
        self.num = self.starts[-1]
        self.ends = torch.tensor(self.starts[1:], dtype=torch.int64, device=self.device)
        self.step = max(1, _audit._COMPARE_BYTES // max(1, self.width * self.dtype.itemsize))
        self.failure: Exception | None = None

    def guarded(self, fallback: _T, work: Callable[..., _T], *args: Any) -> _T:
        """``work(*args)``, this process's own work (on its rows); after a failure here,
        the placeholder ``fallback`` instead: the process keeps taking part in every
        collective, with values that end every loop, and :meth:`raise_any` raises on
        every process."""
        if self.failure is None:
            try:
                return work(*args)
            except Exception as err:  # raised by raise_any, after every collective
                self.failure = err
        return fallback

    def raise_any(self) -> None:
        """Raise a failure of any process on every process (collective), as the
        ranking's :func:`recall_at_k.ranking.rank.sum_over_processes` does."""
        failed = torch.tensor(
            [int(self.failure is not None)], dtype=torch.int64, device=self.device
        )
        _collectives.all_reduce(failed, group=self.group)
        if self.failure is not None:
            raise self.failure
        if int(failed):
            raise RuntimeError(
                "the protocol audit of EmbeddingRecallAtK failed on another process; see its error"
            )

    # ------------------------------------------------------------ primitives

    def source(self, rank: int) -> int:
        """The global rank of process ``rank`` of the group."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def owner(self, index: Tensor) -> Tensor:
        """The process holding each item (global indices)."""
        return torch.searchsorted(self.ends, index, right=True)

    def mine(self, index: Tensor) -> Tensor:
        """The rows of items held here (global indices), in the common dtype."""
        return self.rows.take(index - self.starts[self.me]).to(self.dtype)

    def spread(self, values: Tensor, sizes: list[int]) -> Tensor:
        """Every process's ``values`` (``[sizes[rank], ...]``) concatenated in process
        order, on every process: each process's part broadcast from it in turn."""
        out = values.new_empty((sum(sizes), *values.shape[1:]))
        start = 0
        for rank, size in enumerate(sizes):
            part = out[start : start + size]
            start += size
            if size == 0:
                continue
            if rank == self.me:
                part.copy_(values)
            _collectives.broadcast(part, src=self.source(rank), group=self.group)
        return out

    def check(self, a: Tensor, b: Tensor, test: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """bool per pair of items ``(a, b)`` (global indices, the same on every
        process): ``test`` of their two rows, the same on every process.

        The process holding ``a`` tests the pair; the rows ``b`` it does not hold are
        broadcast by their owners, process by process, :attr:`step` rows (at most
        ``_COMPARE_BYTES``) at a time, each row once however many pairs need it. ``test``
        must decide on each pair's two rows alone (``[m, D]`` each, the common dtype)."""
        device, step = self.device, self.step
        owner_a, owner_b = self.owner(a), self.owner(b)
        home = owner_a == self.me
        ok = torch.ones(a.shape[0], dtype=torch.bool, device=device)
        here = (home & (owner_b == self.me)).nonzero().view(-1)

        def test_here(pairs: Tensor) -> None:
            ok[pairs] = test(self.mine(a[pairs]), self.mine(b[pairs]))

        for start in range(0, here.shape[0], step):
            self.guarded(None, test_here, here[start : start + step])
        cross = owner_a != owner_b
        needed = torch.unique(b[cross])  # sorted, so grouped by owner
        bounds = torch.searchsorted(self.owner(needed), torch.arange(self.world + 1, device=device))
        away = (home & cross).nonzero().view(-1)
        wanted, order = torch.sort(b[away])
        away = away[order]
        buffer = torch.empty(
            (min(step, needed.shape[0]), self.width), dtype=self.dtype, device=device
        )

        def test_away(pairs: Tensor, rows: Tensor) -> None:
            ok[pairs] = test(self.mine(a[pairs]), rows)

        def copy_mine(out: Tensor, items: Tensor) -> Tensor:
            return out.copy_(self.mine(items))

        for rank, (lo, hi) in enumerate(
            zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
        ):
            for start in range(lo, hi, step):
                batch = needed[start : min(start + step, hi)]
                part = buffer[: batch.shape[0]]
                if rank == self.me:
                    self.guarded(part, copy_mine, part, batch)
                _collectives.broadcast(part, src=self.source(rank), group=self.group)
                if rank == self.me:
                    continue
                first = int(torch.searchsorted(wanted, batch[:1]))
                last = int(torch.searchsorted(wanted, batch[-1:], right=True))
                for at in range(first, last, step):
                    pairs = away[at : min(at + step, last)]
                    where = torch.searchsorted(batch, wanted[at : min(at + step, last)])
                    self.guarded(None, test_away, pairs, part[where])
        failed = (~ok).sum().view(1)
        _collectives.all_reduce(failed, group=self.group)
        if int(failed) == 0:
            return ok
        flags = (~ok).to(torch.int32)
        _collectives.all_reduce(flags, group=self.group)
        return flags == 0

    # ------------------------------------------------------------ the codes

    def classes(self, hashes: Callable[[Tensor], Tensor] | None) -> tuple[Tensor, Tensor]:
        """``[N]`` codes (``_audit.code_dtype``): the class of each item's bit pattern,
        numbered in the order of the classes' first items; and ``[C]`` (the codes'
        dtype): each class's first item."""
        device, num = self.device, self.num

        def hashed() -> Tensor:
            mine = [
                _audit.hash_rows(part.to(self.dtype), hashes)
                for _, part in self.rows.runs(self.step)
            ]
            return torch.cat(mine) if mine else torch.zeros(0, dtype=torch.int64, device=device)

        placeholder = torch.zeros(self.rows.shape[0], dtype=torch.int64, device=device)
        local = self.guarded(placeholder, hashed)
        del placeholder
        sizes = [end - start for start, end in itertools.pairwise(self.starts)]
        spread = self.spread(local, sizes)
        del local
        run = _audit._code(spread)  # int32 runs of equal hashes, in hash order, sorted in parts
        del spread
        settled = torch.zeros(num, dtype=torch.bool, device=device)
        while True:
            earliest = _audit.first_items(run, int(run.max()) + 1)[run]
            index = torch.arange(num, dtype=earliest.dtype, device=device)
            todo = (~settled & (earliest != index)).nonzero().view(-1)
            del index
            if todo.numel() == 0:
                break
            earlier = earliest[todo].long()
            del earliest
            equal = self.check(todo, earlier, _audit.same_bits)
            settled[todo[equal]] = True
            settled[earlier] = True
            if bool(equal.all()):
                break
            # A hash collision: the items unequal to their run's earliest leave the run.
            moved = torch.zeros(num, dtype=torch.int64, device=device)
            moved[todo[~equal]] = 1
            run = _audit._code(run.long() * 2 + moved)
        del settled
        first = _audit.first_items(run, int(run.max()) + 1)  # the codes' dtype
        first, by_first = torch.sort(first)
        renumber = torch.empty(by_first.shape, dtype=run.dtype, device=device)
        renumber[by_first] = torch.arange(by_first.shape[0], dtype=run.dtype, device=device)
        return renumber[run], first

    def rounding_pairs(self, first: Tensor) -> Tensor:
        """``rounding_pairs`` of the classes whose first items are ``first`` (ascending)."""
        device, count = self.device, first.shape[0]
        if count < 2:
            return _audit.both_orientations([], count, device)
        grid = _audit.rounding_grid(self.width, device)
        starts = torch.tensor(self.starts, dtype=torch.int64, device=device)
        bounds = torch.searchsorted(first, starts).tolist()
        own = first[bounds[self.me] : bounds[self.me + 1]]
        step = max(1, _audit.project_step(self.width) // PROJECT_SHARE)
        local = _audit.GridPlaces.empty(own.shape[0], device)

        def project_into(out: _audit.GridPlaces) -> bool:
            for s in range(0, own.shape[0], step):
                out.place(grid, _audit.project(grid, self.mine(own[s : s + step])), s)
            return True

        if not self.guarded(False, project_into, local):
            local.fail()  # a failed process's classes: nobody's candidates
        sizes = [hi - lo for lo, hi in itertools.pairwise(bounds)]
        # The int16 cells travel as pairs of bytes (gloo has no int16).
        pairs = self.spread(local.others.view(torch.int8).view(-1, 2), sizes)
        others = pairs.view(torch.int16).view(-1)
        places = _audit.GridPlaces(self.spread(local.key, sizes), others)
        del local
        found = []
        for a, b in _audit.rounding_candidates(grid, places, CANDIDATE_PAIRS):
            if a.numel():
                within = self.check(first[a], first[b], _audit.within)
                found.append(torch.stack([a[within], b[within]], dim=1))
        return _audit.both_orientations(found, count, device)
