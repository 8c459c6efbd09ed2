"""Copies equal up to float rounding: the pairs of bitwise classes that are such copies.

A sort finds the few candidate pairs: each class's first row is projected on random
directions (of the normalised row) and placed in a grid whose cells are as wide as a
copy's projections can differ, whatever their rounding; a copy lies in the same or a
neighbouring cell in every projection. The candidates of neighbouring cells are checked
by the definition (:func:`within`), which decides on the two rows alone. O(N D) for the
projections, a sort in parts, O(candidates x D) for the checks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from recall_at_k._kernel import Workspace
from recall_at_k.audit.bitwise import ROWS_SLOT, Blocks, code_dtype, serial, sorted_parts
from recall_at_k.ranking.budget import AuditSizes

TOLERANCE = 2.0**-12
"""Finite embeddings ``x``, ``y`` with different bits are *equal up to float rounding* when
``|x - y|_2 <= 2^-12 max(|x|_2, |y|_2)``, as stored, decided in float64 with each sum in
the order ``d = 0 .. D-1`` (both rows first scaled by one power of two, which keeps the
squares from underflowing): the same decision on every device, thread and process.

Why ``2^-12``: the same input run through a model in another batch shape differs by a few
float32 units (``2^-24``), and a float16 output in the few coordinates whose rounding
flips, far below it; two distinct points of an integer grid differ by at least 1, so grid
rows of norm below 4,096 steps (int8 codes of up to 1,040 dimensions, binary or ternary
codes) are never copies. A bfloat16 unit (``2^-8``) is coarser: such copies need ``ids=``."""

IN_ORDER_MARGIN = 2.0**-30
"""Pairs whose sums in any order lie within this relative distance of the boundary are
summed again in the fixed order (any order is within ``gamma64_D`` of it, far below)."""

PROJECTIONS = 3
"""The grid's dimensions: the first projections of a row."""

FILTERS = 8
"""Projections in all: a candidate is checked only when each pair of projections is
within a cell of each other."""

NOT_FINITE = 2**63 - 1
"""The cell key of a row that is not finite (it has no copies): above every other."""


class Grid(NamedTuple):
    """The random projections and the width of a cell."""

    weights: Tensor  # float64 [D, FILTERS]
    cell: float


def grid(width: int, device: torch.device) -> Grid:
    """The projections of rows of ``width`` (fixed, the same everywhere) and the cell:
    a copy's distance in a projection of the unit rows, ``|w| 2 tau / (1 - tau)``
    (Cauchy-Schwarz), widened by 2^-20 and a float64 rounding term a step."""
    generator = torch.Generator().manual_seed(20261204)
    weights = torch.randn((width, FILTERS), generator=generator, dtype=torch.float64)
    rounding = 8 * (width + 2) * 2.0**-53 / (1 - (width + 2) * 2.0**-53)
    bound = 2 * TOLERANCE / (1 - TOLERANCE) + rounding
    cell = float(weights.norm(dim=0).max()) * bound * (1 + 2.0**-20)
    return Grid(weights.to(device), cell)


def radix(grid: Grid) -> tuple[int, float]:
    """The radix of a cell key and the cell compared (one cell a projection where there is
    nothing to project or the keys would overflow)."""
    if not grid.cell > 0:
        return 8, 4.0
    base = int(2 / grid.cell) + 8  # cell indices lie in (-1/cell - 1, 1/cell + 1)
    return (8, 4.0) if base**PROJECTIONS >= 2**62 else (base, grid.cell)


def project(grid: Grid, rows: Tensor, scratch: Tensor | None = None) -> Tensor:
    """float64 ``[m, FILTERS]``: the projections of the normalised ``rows`` (NaN for a row
    that is not finite), of one float64 copy (``scratch`` where given) scaled in place."""
    rows = rows.to(torch.float64, copy=True) if scratch is None else scratch.copy_(rows)
    largest = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_())  # NaN propagates
    finite = largest.isfinite()  # (isfinite() of the rows would copy them)
    times_power_of_two(rows, torch.frexp(torch.where(finite, largest, 1.0))[1].neg_())
    norms = rows.norm(dim=1, keepdim=True)
    unit = rows.div_(norms.clamp(min=1e-300)).masked_fill_(~(norms > 0), 0.0)
    return torch.where(finite.unsqueeze(1), unit @ grid.weights, torch.nan)


def times_power_of_two(rows: Tensor, exponent: Tensor) -> None:
    """``rows[i] *= 2^exponent[i]`` in place (float64 rows): exact, in two factors where one
    would leave the float64 range (a subnormal row's scaling reaches ``2^1073``)."""
    first = exponent.clamp(-1022, 1022)
    rows.mul_(torch.pow(2.0, first.unsqueeze(1).to(rows.dtype)))
    rest = exponent - first
    if bool(rest.any()):
        rows.mul_(torch.pow(2.0, rest.unsqueeze(1).to(rows.dtype)))


class Places(NamedTuple):
    """Each class's place in the grid (10 bytes, not eight float64 projections): the cell of
    its first PROJECTIONS projections as one int64 key (NOT_FINITE: no copies), and each
    other projection's cell index modulo 8, three bits each, in an int16. A copy's indices
    differ by at most 1, so by 7, 0 or 1 modulo 8: a weaker filter than the projections,
    as sound."""

    key: Tensor  # int64 [C]
    others: Tensor  # int16 [C]

    @staticmethod
    def empty(count: int, device: torch.device) -> Places:
        return Places(
            torch.empty(count, dtype=torch.int64, device=device),
            torch.empty(count, dtype=torch.int16, device=device),
        )

    def place(self, grid: Grid, projected: Tensor, start: int) -> None:
        """Write the places of :func:`project`'s ``projected`` as rows ``start...``."""
        base, cell = radix(grid)
        stop = start + projected.shape[0]
        finite = projected.isfinite().all(dim=1)
        index = projected.div_(cell).floor_().masked_fill_(~finite.unsqueeze(1), 0.0)
        key = self.key[start:stop].zero_()
        for k in range(PROJECTIONS):
            key.mul_(base).add_(index[:, k].to(torch.int64) + base // 2)
        key.masked_fill_(~finite, NOT_FINITE)
        low = index[:, PROJECTIONS:].remainder_(8)  # integers: exact
        weights = 8.0 ** torch.arange(FILTERS - PROJECTIONS, dtype=low.dtype, device=low.device)
        self.others[start:stop] = (low @ weights).to(torch.int16)


def candidates(grid: Grid, places: Places, sizes: AuditSizes) -> Iterator[tuple[Tensor, Tensor]]:
    """The candidate pairs ``(a, b)`` of classes (rows of ``places``), each unordered pair
    once, at most ``candidate_pairs`` a chunk: the finite rows in the same or a
    neighbouring cell (the 13 of one half-space) whose other projections are within a
    cell too. Deterministic: processes holding the same places walk the same chunks."""
    base, _ = radix(grid)
    count, device = places.key.shape[0], places.key.device
    key = torch.empty_like(places.key)
    members = torch.empty(count, dtype=code_dtype(count), device=device)
    at = 0
    for order, values in sorted_parts(places.key, sizes):
        key[at : at + order.shape[0]], members[at : at + order.shape[0]] = values, order
        at += order.shape[0]
    rows = int(torch.searchsorted(key, torch.tensor(NOT_FINITE, device=device)))
    key, members = key[:rows], members[:rows]
    shifts: list[tuple[int, ...]] = [()]
    for _ in range(PROJECTIONS):
        shifts = [(*s, d) for s in shifts for d in (-1, 0, 1)]
    offsets = [0]  # the own cell first, then the 13 of one half-space
    for shift in (s for s in shifts if s > (0,) * PROJECTIONS):
        offsets.append(sum(d * base ** (PROJECTIONS - 1 - k) for k, d in enumerate(shift)))
    step = max(1, sizes.candidate_pairs // len(offsets))
    low = 3 * torch.arange(FILTERS - PROJECTIONS, dtype=torch.int32, device=device)
    for row_start in range(0, rows if rows > 1 else 0, step):
        position = torch.arange(row_start, min(rows, row_start + step), device=device)
        own = key[position]
        begin = [position + 1]  # the own cell: the rows after it
        size = [torch.searchsorted(key, own, right=True) - position - 1]
        for offset in offsets[1:]:
            begin.append(torch.searchsorted(key, own + offset))
            size.append(torch.searchsorted(key, own + offset, right=True) - begin[-1])
        starts, counts = torch.stack(begin, dim=1).view(-1), torch.stack(size, dim=1).view(-1)
        owner = position.repeat_interleave(len(offsets))
        ends = torch.cumsum(counts, dim=0)
        total = int(ends[-1])
        for chunk in range(0, total, sizes.candidate_pairs):
            pair = torch.arange(chunk, min(chunk + sizes.candidate_pairs, total), device=device)
            at_ = torch.searchsorted(ends, pair, right=True)
            a = members[owner[at_]].long()
            b = members[starts[at_] + pair - (ends[at_] - counts[at_])].long()
            others_a = (places.others[a].to(torch.int32).unsqueeze(1) >> low) & 7
            others_b = (places.others[b].to(torch.int32).unsqueeze(1) >> low) & 7
            close = (((others_a - others_b + 1) & 7) <= 2).all(dim=1)
            yield a[close], b[close]


def within(first: Tensor, second: Tensor) -> Tensor:
    """bool per pair of rows (``[m, D]`` each): equal up to rounding (:data:`TOLERANCE`).

    The sums are taken in any order first (all terms non-negative: within ``gamma64_D``);
    only pairs within :data:`IN_ORDER_MARGIN` of the boundary are summed again in the
    order ``d = 0 .. D-1``. The decision depends on the two rows alone."""
    if first.shape[1] == 0:
        return torch.ones(first.shape[0], dtype=torch.bool, device=first.device)
    a = first.to(torch.float64, copy=True)  # scaled in place: never the caller's rows
    b = second.to(torch.float64, copy=True)
    largest = torch.stack(
        [a.amax(dim=1), a.amin(dim=1).neg_(), b.amax(dim=1), b.amin(dim=1).neg_()]
    )
    exponent = torch.frexp(largest.amax(dim=0))[1].neg_()
    times_power_of_two(a, exponent)
    times_power_of_two(b, exponent)
    gap = torch.sub(a, b).square_().sum(dim=1)
    dots = [torch.bmm(r.unsqueeze(1), r.unsqueeze(2)).view(-1) for r in (a, b)]  # no copies
    scale = torch.maximum(*dots).mul_(TOLERANCE**2)
    decided = gap <= scale
    unsure = ((gap - scale).abs() <= IN_ORDER_MARGIN * scale).nonzero().view(-1)
    if unsure.numel():
        a, b = a[unsure].T.contiguous(), b[unsure].T.contiguous()
        sums = torch.zeros((3, a.shape[1]), dtype=torch.float64, device=a.device)
        for d in range(a.shape[0]):  # in the order d = 0 .. D-1
            sums[0].add_((a[d] - b[d]).square_())
            sums[1].add_(a[d].square())
            sums[2].add_(b[d].square())
        decided[unsure] = sums[0] <= TOLERANCE**2 * torch.maximum(sums[1], sums[2])
    return decided


def both_orientations(found: Sequence[Tensor], count: int, device: torch.device) -> Tensor:
    """int64 ``[P, 2]``: the pairs of ``found`` (``[m, 2]`` blocks, each unordered pair
    once) in both orientations, sorted (classes below ``count``)."""
    if not found:
        return torch.zeros((0, 2), dtype=torch.int64, device=device)
    pairs = torch.cat(list(found))
    pairs = torch.cat([pairs, pairs.flip(1)])
    return pairs[torch.argsort(pairs[:, 0] * count + pairs[:, 1])]


def rounding_pairs(
    rows: Tensor, first: Tensor, sizes: AuditSizes, blocks: Blocks | None = None
) -> Tensor:
    """int64 ``[P, 2]``: the pairs ``(a, b)``, ``a != b``, of classes whose first rows
    ``rows[first[a]]``, ``rows[first[b]]`` are equal up to rounding, both orientations,
    sorted. Rows are projected and checked a block at a time (``blocks``: on which
    threads, together within the block bytes). Rows that are not finite have no copies."""
    device, count = rows.device, first.shape[0]
    if count < 2:
        return both_orientations([], count, device)
    blocks = serial(blocks, device, sizes)
    lattice = grid(rows.shape[1], device)
    row_bytes = (8 + rows.element_size()) * rows.shape[1]  # a copy and its float64 copy
    step = blocks.rows(count, row_bytes, sizes.project_bytes)
    places = Places.empty(count, device)

    def project_block(start: int, workspace: Workspace) -> None:
        chunk = rows.index_select(0, first[start : start + step])
        wide = workspace.get(ROWS_SLOT, tuple(chunk.shape), torch.float64, device)
        places.place(lattice, project(lattice, chunk, wide), start)

    for _ in blocks.map(project_block, range(0, count, step)):
        pass
    blocks.release()
    pair_step = blocks.rows(count, 64 * rows.shape[1])  # a pair's float64 copies

    def check(pair: tuple[Tensor, Tensor], workspace: Workspace) -> Tensor:
        a, b = pair
        keep = (
            torch.cat(
                [
                    within(rows[first[a[s : s + pair_step]]], rows[first[b[s : s + pair_step]]])
                    for s in range(0, a.shape[0], pair_step)
                ]
            )
            if a.numel()
            else a.bool()
        )
        return torch.stack([a[keep], b[keep]], dim=1)

    found = list(blocks.map(check, candidates(lattice, places, sizes)))
    return both_orientations(found, count, device)
