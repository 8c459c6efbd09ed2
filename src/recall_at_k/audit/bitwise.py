"""Classes of bitwise-equal rows, and the integer codes and sorts the audit counts with.

Each row's bits get a 62-bit hash (:func:`hash_rows`: exact integer arithmetic, the same
for the same bits on any device, thread or process); the items of one hash form a run,
and each item is compared bit for bit with its run's first item
(:func:`bitwise_classes`). A hash collision (chance about ``N^2 / 2^62``) splits the run
and the items that left are compared again, so the classes are exact whatever the hash.
O(N log N + N D): sorts run in parts (:func:`sorted_parts`), rows are read a block at a
time (:class:`Blocks`, on the ranking's worker threads), never copied whole.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from recall_at_k._kernel import Workspace
from recall_at_k.ranking.budget import AuditSizes
from recall_at_k.ranking.workers import Workers, worker_count

Result = TypeVar("Result")

CODE32_LIMIT = 2**31 - 1
"""Codes of up to this many items are int32 (the dtype's range), int64 beyond."""

HASH_PRIME = 2**21 - 9
"""The hash's sums are taken modulo this prime."""

HASH_TERMS = 2**15
"""Words summed before a reduction modulo the prime: each term is an integer below 2^37,
so a sum of up to 2^16 of them is exact in float64, in any order."""

ROWS_SLOT = "audit_rows"
"""The workspace slot of a block's float64 rows (the hash's, then the projections')."""


def code_dtype(num: int) -> torch.dtype:
    """The dtype of the codes of ``num`` items: int32 where they fit."""
    return torch.int32 if num <= CODE32_LIMIT else torch.int64


def run_task(task: Callable[[Workspace], Result], workspace: Workspace) -> Result:
    """Run one block's ``task`` with its thread's scratch."""
    return task(workspace)


class Blocks:
    """The audit's block work on the ranking's worker threads (``torch.get_num_threads()``
    of them on CPU, each running torch on one thread; the caller alone elsewhere). A
    context manager. Each block's result depends on its rows alone and results come in
    the blocks' order, so the audit is the same for every thread count."""

    def __init__(self, device: torch.device, sizes: AuditSizes, count: int | None = None) -> None:
        self.count = worker_count(device) if count is None else count
        self.sizes = sizes
        self.workers: Workers[Callable[[Workspace], Any], Any]
        self.workers = Workers(run_task, self.count, Workspace())

    def __enter__(self) -> Blocks:
        self.workers.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.workers.__exit__(*exc)

    def map(
        self, function: Callable[[Any, Workspace], Result], items: Iterable[Any]
    ) -> Iterator[Result]:
        """``function(item, workspace)`` for each item, in order."""
        tasks = (functools.partial(function, item) for item in items)
        return cast(Iterator[Result], self.workers.map(tasks))

    def release(self) -> None:
        """Free every thread's scratch: one phase's buffers are not kept beside the next's."""
        self.workers.workspace.clear()
        self.workers.local = threading.local()

    def rows(self, num: int, row_bytes: int, total: int | None = None) -> int:
        """Rows a block: each thread's share of ``total`` (the block bytes) at
        ``row_bytes`` a row, fewer where that gives a thread under its blocks."""
        total = self.sizes.block_bytes if total is None else total
        step = max(1, total // max(1, self.count * row_bytes))
        if self.count > 1:
            step = min(step, -(-num // (self.sizes.blocks_per_worker * self.count)))
        return max(1, step)


def serial(blocks: Blocks | None, device: torch.device, sizes: AuditSizes) -> Blocks:
    """``blocks``, or every block in the calling thread."""
    return Blocks(device, sizes, 1) if blocks is None else blocks


def words(rows: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The bits of float ``rows`` ``[m, D]`` (widened exactly to ``dtype`` where given) as
    int16 words ``[m, W]``: a row-major copy where the rows are not (stored views may have
    any strides, a single row of width 1 included)."""
    rows = rows if dtype is None else rows.to(dtype)
    if rows.stride(-1) != 1 or not rows.is_contiguous():
        rows = rows.clone(memory_format=torch.contiguous_format)
    return rows.view(torch.int16)


def same_bits(first: Tensor, second: Tensor) -> Tensor:
    """bool per pair of rows (``[m, D]`` each, one dtype): the same bit pattern."""
    return (words(first) == words(second)).all(dim=1)


def hash_rows(
    rows: Tensor,
    sizes: AuditSizes,
    blocks: Blocks | None = None,
    hashes: Callable[[Tensor], Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """int64 ``[m]`` in ``[0, 2^63)``, each row's hash from its bits alone (in ``dtype``).

    Three sums of the row's int16 words (shifted to ``[0, 2^16)``) times fixed
    coefficients below a prime ``p`` of 21 bits, each modulo ``p``, as ``(k0 p + k1) p +
    k2``: a float64 product whose every partial sum is an integer below 2^53, exact in any
    order, blocking or device. Rows are widened a block at a time (``blocks``: on which
    threads). ``hashes``: a hash of the words instead (tests pass colliding ones)."""
    num = rows.shape[0]
    device = rows.device
    width = rows.shape[1] * (dtype or rows.dtype).itemsize // 2
    generator = torch.Generator().manual_seed(20261203)
    coefficients = torch.randint(1, HASH_PRIME, (width, 3), generator=generator)
    coefficients = coefficients.to(device=device, dtype=torch.float64)
    blocks = serial(blocks, device, sizes)
    step = blocks.rows(num, 8 * width)
    out = torch.empty(num, dtype=torch.int64, device=device)

    def hash_block(start: int, workspace: Workspace) -> None:
        bits = words(rows[start : start + step], dtype)
        part = out[start : start + bits.shape[0]]
        if hashes is not None:
            part.copy_(hashes(bits))
            return
        wide = workspace.get(ROWS_SLOT, tuple(bits.shape), torch.float64, device)
        wide.copy_(bits).add_(2**15)
        target = torch.zeros((bits.shape[0], 3), dtype=torch.float64, device=device)
        for first in range(0, width, HASH_TERMS):
            stop = first + HASH_TERMS
            target.addmm_(wide[:, first:stop], coefficients[first:stop]).remainder_(HASH_PRIME)
        keys = target.to(torch.int64)
        torch.mul(keys[:, 0], HASH_PRIME, out=part).add_(keys[:, 1])
        part.mul_(HASH_PRIME).add_(keys[:, 2])

    for _ in blocks.map(hash_block, range(0, num, step)):
        pass
    blocks.release()
    return out


def same_rows(rows: Tensor, blocks: Blocks) -> Callable[[Tensor, Tensor], Tensor]:
    """:func:`bitwise_classes`'s comparison of the items of ``rows`` held here: the
    pairs' rows a block at a time (two copies), on ``blocks``' threads."""
    row_bytes = 2 * rows.shape[1] * rows.element_size()

    def same(a: Tensor, b: Tensor) -> Tensor:
        step = blocks.rows(a.shape[0], row_bytes)

        def block(start: int, workspace: Workspace) -> Tensor:
            stop = start + step
            return same_bits(
                rows.index_select(0, a[start:stop]), rows.index_select(0, b[start:stop])
            )

        parts = list(blocks.map(block, range(0, a.shape[0], step)))
        return torch.cat(parts) if parts else torch.ones(0, dtype=torch.bool, device=a.device)

    return same


def bitwise_classes(
    hashes: Tensor, same: Callable[[Tensor, Tensor], Tensor], sizes: AuditSizes
) -> tuple[Tensor, Tensor]:
    """The classes of bitwise-equal items: ``[N]`` codes (:func:`code_dtype`) numbered
    ``0..C-1`` in the order of each class's first item, and ``[C]`` those first items.

    ``hashes``: int64 ``[N]``, each item's :func:`hash_rows` (freed here once coded).
    ``same(items, firsts)``: bool per pair of int64 item indices, whether their rows have
    the same bits; called with the same pairs wherever ``hashes`` is the same (every
    process of a sharded audit calls it together). Items are walked ``sort_items`` at a
    time; an item unequal to its run's first (a hash collision) leaves the run with the
    others that did, and only those are compared again."""
    num, device = hashes.shape[0], hashes.device
    run = code(hashes, sizes)
    del hashes
    pending: Tensor | None = None  # None: every item
    while num:
        first = first_items(run, sizes)
        moved = torch.zeros(num, dtype=torch.bool, device=device)
        for start in range(0, num, sizes.sort_items):
            index = torch.arange(start, min(num, start + sizes.sort_items), device=device)
            earliest = first[run[index]].long()
            todo = earliest != index
            if pending is not None:
                todo &= pending[index]
            items = index[todo]
            if items.numel():
                moved[items[~same(items, earliest[todo])]] = True
        del first
        if not bool(moved.any()):
            break
        run = code(run.long() * 2 + moved, sizes)
        pending = moved
    first = first_items(run, sizes) if num else run[:0]
    first, by_first = torch.sort(first)
    renumber = torch.empty_like(first)
    renumber[by_first] = torch.arange(first.shape[0], dtype=first.dtype, device=device)
    return renumber[run.long()], first


def first_items(codes: Tensor, sizes: AuditSizes) -> Tensor:
    """``[C]`` (the codes' dtype): the first item of each code ``0..C-1``, ``sort_items``
    items at a time (no whole-set index array)."""
    num = codes.shape[0]
    count = int(codes.max()) + 1
    first = torch.full((count,), num, dtype=codes.dtype, device=codes.device)
    for start in range(0, num, sizes.sort_items):
        stop = min(num, start + sizes.sort_items)
        where = torch.arange(start, stop, dtype=codes.dtype, device=codes.device)
        first.scatter_reduce_(0, codes[start:stop].long(), where, reduce="amin")
    return first


def sorted_parts(keys: Tensor, sizes: AuditSizes) -> Iterator[tuple[Tensor, Tensor]]:
    """The stable ascending sort of integer ``keys`` ``[N]`` in consecutive parts
    ``(order, values)`` (int64 item indices, their keys), equal keys never in two parts,
    about ``sort_items`` items a part where the keys allow.

    The parts' ranges come from a regular sample of the keys: a key that fills a range
    alone gets a part of its own (no sort; its values one key broadcast: every item of a
    collapsed model); between two such keys, the keys strictly between. Each part costs
    a pass over the keys (a comparison of each, one byte an item)."""
    num = keys.shape[0]
    if num <= sizes.sort_items:
        values, order = torch.sort(keys, stable=True)
        yield order, values
        return
    passes = min(sizes.sort_passes, -(-num // sizes.sort_items))
    sample = torch.sort(keys[:: max(1, num // (64 * passes))])[0]  # ~64 samples a pass
    at = torch.arange(1, passes, device=keys.device) * sample.shape[0] // passes
    lowest: int | None = None
    for splitter in [*torch.unique_consecutive(sample[at]).tolist(), None]:
        mask = torch.ones(num, dtype=torch.bool, device=keys.device)
        if lowest is not None:
            torch.gt(keys, lowest, out=mask)
        if splitter is not None:
            mask &= keys < splitter
        index = mask.nonzero().view(-1)
        if index.numel():
            values, order = torch.sort(keys[index], stable=True)
            yield index[order], values
            del values, order
        if splitter is not None:  # the keys equal to the splitter, in item order
            torch.eq(keys, splitter, out=mask)
            index = mask.nonzero().view(-1)
            del mask
            if index.numel():
                yield index, keys.new_full((1,), splitter).expand(index.shape[0])
            lowest = splitter
        del index


def code(values: Tensor, sizes: AuditSizes) -> Tensor:
    """The codes ``0..K-1`` of integer ``values`` (:func:`code_dtype`), in the order of
    the values (those of ``torch.unique``), sorted in parts."""
    num = values.shape[0]
    codes = torch.empty(num, dtype=code_dtype(num), device=values.device)
    keys = values if values.dtype in (torch.int32, torch.int64) else values.to(torch.int64)
    offset = 0
    for order, ascending in sorted_parts(keys, sizes):
        if ascending.numel() == 0:
            continue
        starts = torch.ones(ascending.shape[0], dtype=torch.bool, device=values.device)
        torch.ne(ascending[1:], ascending[:-1], out=starts[1:])
        runs = torch.cumsum(starts, dim=0, dtype=codes.dtype)
        del starts
        runs += offset - 1
        codes[order] = runs
        offset = int(runs[-1]) + 1
    return codes


def composite(*parts: Tensor, sizes: AuditSizes) -> Tensor:
    """The code of the tuple of codes ``parts`` (each ``[N]`` in ``[0, N)``), made pair by
    pair, each step coded back into ``[0, N)`` (an int32 key where the pairs fit one)."""
    result = parts[0]
    for part in parts[1:]:
        if result.numel() == 0:
            return result.clone()
        radix = int(part.max()) + 1
        fits = (int(result.max()) + 1) * radix <= CODE32_LIMIT + 1
        key = result.to(torch.int32 if fits else torch.int64) * radix
        result = code(key.add_(part.to(key.dtype)), sizes)
    return result
