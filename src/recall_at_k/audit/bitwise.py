"""Classes of bitwise-equal rows, and the integer codes and sorts the audit counts with.
Each item is compared bit for bit with the first of its hash's run, so the classes are
exact whatever the hash. Sorts run in parts, rows a block at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from recall_at_k._kernel import Workspace
from recall_at_k.ranking.budget import AUDIT_HASH_DIM_BLOCK, AuditSizes, wide_rows

CODE32_LIMIT = 2**31 - 1  # codes of up to this many items are int32, int64 beyond

# Hash sums modulo this prime: up to 2^15 terms below 2^37 sum exactly in float64.
HASH_PRIME = 2**21 - 9

ROWS_SLOT = "audit_rows"  # the workspace slot of a block's float64 rows


def code_dtype(num: int) -> torch.dtype:
    """The dtype of the codes of ``num`` items: int32 where they fit."""
    return torch.int32 if num <= CODE32_LIMIT else torch.int64


def in_blocks(task: Callable[[slice, Workspace], None], num: int, row: int, total: int) -> None:
    """``task(rows, workspace)`` for blocks of the ``num`` rows (``row`` bytes each), ``total``
    bytes at a time, in one workspace (torch's own threads share each block: worker threads,
    each a task this small, cost more); results depend on rows alone."""
    step, workspace = max(1, total // max(1, row)), Workspace()
    for at in range(0, num, step):
        task(slice(at, at + step), workspace)


def words(rows: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The bits of float ``rows`` ``[m, D]`` (widened exactly to ``dtype``) as int16 words
    ``[m, W]``, of a row-major copy where the rows are not row-major."""
    rows = rows if dtype is None else rows.to(dtype)
    if rows.stride(-1) != 1 or not rows.is_contiguous():
        rows = rows.clone(memory_format=torch.contiguous_format)
    return rows.view(torch.int16)


def same_bits(first: Tensor, second: Tensor) -> Tensor:
    """bool per pair of rows (``[m, D]`` each, one dtype): the same bit pattern."""
    return (words(first) == words(second)).all(dim=1)


def hash_words(bits: Tensor, workspace: Workspace) -> Tensor:
    """int64 ``[m]``: each row's hash, three sums of its words times fixed coefficients
    modulo :data:`HASH_PRIME` (exact float64 integers: the same in any order or place)."""
    generator = torch.Generator().manual_seed(20261203)
    coefficients = torch.randint(1, HASH_PRIME, (bits.shape[1], 3), generator=generator)
    coefficients = coefficients.to(device=bits.device, dtype=torch.float64).T
    # [3, m], a row's sums a column (c^T w^T: faster than w c for 3 columns; exact in any order)
    keys = torch.zeros((3, bits.shape[0]), dtype=torch.float64, device=bits.device)
    rows = wide_rows(bits.shape[1], bits.shape[0], bits.device)
    for first in range(0, bits.shape[0], rows):
        part, block = bits[first : first + rows], keys[:, first : first + rows]
        wide = workspace.get(ROWS_SLOT, tuple(part.shape), torch.float64, bits.device)
        wide.copy_(part).add_(2**15)
        for at in range(0, bits.shape[1], AUDIT_HASH_DIM_BLOCK):
            columns = slice(at, at + AUDIT_HASH_DIM_BLOCK)
            block.addmm_(coefficients[:, columns], wide[:, columns].T).remainder_(HASH_PRIME)
    key = keys.to(torch.int64)
    return key[0].mul(HASH_PRIME).add_(key[1]).mul_(HASH_PRIME).add_(key[2])


def hash_rows(
    rows_of: Callable[[slice], Tensor],
    num: int,
    row_bytes: int,
    sizes: AuditSizes,
    device: torch.device,
) -> Tensor:
    """int64 ``[num]``: the :func:`hash_words` of the rows ``rows_of(part)``, in blocks."""
    out = torch.empty(num, dtype=torch.int64, device=device)

    def hash_block(part: slice, workspace: Workspace) -> None:
        out[part] = hash_words(words(rows_of(part)), workspace)

    in_blocks(hash_block, num, row_bytes, sizes.block_bytes)
    return out


def bitwise_classes(
    hashes: Tensor, same: Callable[[Tensor, Tensor], Tensor], sizes: AuditSizes
) -> tuple[Tensor, Tensor]:
    """``[N]`` codes of the classes of bitwise-equal items (``0..C-1`` by first item) and the
    ``[C]`` first items, from row hashes and ``same(items, firsts)`` (per pair; maybe a
    collective, called alike everywhere). Items unequal to their run's first leave it together."""
    num, device = hashes.shape[0], hashes.device
    run = code(hashes, sizes)
    del hashes
    pending: Tensor | None = None  # None: every item
    while num:
        first = first_items(run, sizes)
        moved = torch.zeros(num, dtype=torch.bool, device=device)
        for at in range(0, num, sizes.candidate_pairs):
            index = torch.arange(at, min(num, at + sizes.candidate_pairs), device=device)
            earliest = first[run[index]].long()
            todo = (earliest != index) & (True if pending is None else pending[index])
            if bool(todo.any()):
                moved[index[todo][~same(index[todo], earliest[todo])]] = True
        if not bool(moved.any()):
            break
        run, pending = code(run.long() * 2 + moved, sizes), moved
    first, by_first = torch.sort(first_items(run, sizes) if num else run)
    renumber = torch.empty_like(first)
    renumber[by_first] = torch.arange(first.shape[0], dtype=first.dtype, device=device)
    return renumber[run.long()], first


def first_items(codes: Tensor, sizes: AuditSizes) -> Tensor:
    """``[C]`` (the codes' dtype): the first item of each code ``0..C-1``."""
    num = codes.shape[0]
    first = torch.full((int(codes.max()) + 1,), num, dtype=codes.dtype, device=codes.device)
    for at in range(0, num, sizes.sort_items):
        where = torch.arange(at, min(num, at + sizes.sort_items), device=codes.device)
        first.scatter_reduce_(0, codes[where].long(), where.to(codes.dtype), reduce="amin")
    return first


def sorted_parts(keys: Tensor, sizes: AuditSizes) -> Iterator[tuple[Tensor, Tensor]]:
    """The stable ascending sort of integer ``keys`` ``[N]`` in parts ``(order, values)`` of about
    ``sort_items``, split at sampled keys (a splitter's items a part of their own)."""
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
            index = torch.eq(keys, splitter, out=mask).nonzero().view(-1)
            del mask
            if index.numel():
                yield index, keys.new_full((1,), splitter).expand(index.shape[0])
            lowest = splitter
        del index


def sorted_copy(keys: Tensor, sizes: AuditSizes) -> tuple[Tensor, Tensor]:
    """:func:`sorted_parts` as one sorted copy of ``keys`` and its order (code dtype)."""
    values = torch.empty_like(keys)
    order = torch.empty(keys.shape[0], dtype=code_dtype(keys.shape[0]), device=keys.device)
    at = 0
    for part, ascending in sorted_parts(keys, sizes):
        values[at : at + part.shape[0]], order[at : at + part.shape[0]] = ascending, part
        at += part.shape[0]
    return values, order


def code(values: Tensor, sizes: AuditSizes) -> Tensor:
    """The codes ``0..K-1`` (:func:`code_dtype`) of integer ``values``, in their order."""
    codes = torch.empty(values.shape[0], dtype=code_dtype(values.shape[0]), device=values.device)
    keys = values if values.dtype in (torch.int32, torch.int64) else values.to(torch.int64)
    offset = 0
    for order, ascending in sorted_parts(keys, sizes) if keys.numel() else ():
        starts = torch.ones(ascending.shape[0], dtype=torch.bool, device=values.device)
        torch.ne(ascending[1:], ascending[:-1], out=starts[1:])
        runs = torch.cumsum(starts, dim=0, dtype=codes.dtype).add_(offset - 1)
        del starts
        codes[order] = runs
        offset = int(runs[-1]) + 1
    return codes


def pair_code(first: Tensor, second: Tensor, sizes: AuditSizes) -> Tensor:
    """The code in ``[0, N)`` of each pair of codes (``[N]`` each, in ``[0, N)``)."""
    if first.numel() == 0:
        return first.clone()
    radix = int(second.max()) + 1
    fits = (int(first.max()) + 1) * radix <= CODE32_LIMIT + 1
    key = first.to(torch.int32 if fits else torch.int64) * radix
    return code(key.add_(second.to(key.dtype)), sizes)


def expand(begin: Tensor, size: Tensor, chunk: int) -> Iterator[tuple[Tensor, Tensor]]:
    """``(owner, index)`` in chunks of at most ``chunk``: for each owner ``i`` (a position
    in ``begin``) the indices ``begin[i] .. begin[i] + size[i] - 1``."""
    ends = torch.cumsum(size, dim=0)
    total = int(ends[-1]) if ends.numel() else 0
    for at in range(0, total, chunk):
        pair = torch.arange(at, min(at + chunk, total), device=begin.device)
        owner = torch.searchsorted(ends, pair, right=True)
        yield owner, begin[owner] + pair - (ends[owner] - size[owner])
