"""Copies equal up to float rounding: the pairs of bitwise classes that are such copies.
Each class's first row, normalised, is projected on random directions into a grid of
cells as wide as a copy's projections can differ: a copy lies in the same or a
neighbouring cell. The candidates found by one sort are checked by :func:`within`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from recall_at_k._kernel import Workspace
from recall_at_k.audit.bitwise import ROWS_SLOT, expand, in_blocks, sorted_copy
from recall_at_k.ranking.budget import AuditSizes, wide_rows

TOLERANCE = 2.0**-12
"""Finite ``x``, ``y`` with different bits are *equal up to float rounding* when ``|x - y|_2
<= 2^-12 max(|x|_2, |y|_2)`` as stored, decided in float64 in the order ``d = 0 .. D-1``:
far above float32/float16 batch-shape noise; integer grid rows (norm < 4,096) never are;
bfloat16 copies need ``ids=``."""
IN_ORDER_MARGIN = 2.0**-30
"""Pairs whose sums in any order lie within this relative distance of the boundary are
summed again in the fixed order (any order is within ``gamma64_D`` of it, far below)."""
PROJECTIONS = 3  # the grid's dimensions: a row's first projections
FILTERS = 8  # projections in all: a candidate is checked when each is within a cell
NOT_FINITE = 2**63 - 1  # the cell key of a row that is not finite (no copies)


class Grid(NamedTuple):
    """The random projections (float64 ``[D, FILTERS]``), a cell's width, a key's radix."""

    weights: Tensor
    cell: float
    radix: int


def grid(width: int, device: torch.device) -> Grid:
    """The fixed projections of rows of ``width`` and the cell: a copy's largest distance
    in a projection of the unit rows, ``|w| 2 tau / (1 - tau)``, widened for rounding."""
    generator = torch.Generator().manual_seed(20261204)
    weights = torch.randn((width, FILTERS), generator=generator, dtype=torch.float64)
    rounding = 8 * (width + 2) * 2.0**-53 / (1 - (width + 2) * 2.0**-53)
    bound = (2 * TOLERANCE / (1 - TOLERANCE) + rounding) * (1 + 2.0**-20)
    cell = float(weights.norm(dim=0).max()) * bound
    radix = int(2 / cell) + 8  # cell indices lie in (-1/cell - 1, 1/cell + 1)
    if radix**PROJECTIONS >= 2**62:  # keys would overflow: one cell a projection
        cell, radix = 4.0, 8
    return Grid(weights.to(device), cell, radix)


def times_power_of_two(rows: Tensor, exponent: Tensor) -> None:
    """``rows[i] *= 2^exponent[i]`` in place (float64 rows): exact, in two factors where one
    would leave the float64 range (a subnormal row's scaling reaches ``2^1073``)."""
    first = exponent.clamp(-1022, 1022)
    rows.mul_(torch.pow(2.0, first.unsqueeze(1).to(rows.dtype)))
    if bool((exponent != first).any()):
        rows.mul_(torch.pow(2.0, (exponent - first).unsqueeze(1).to(rows.dtype)))


def project(grid: Grid, rows: Tensor, workspace: Workspace) -> Tensor:
    """float64 ``[m, FILTERS]``: the projections of the normalised ``rows`` (NaN for a row
    that is not finite), of float64 copies scaled in place, :func:`wide_rows` at a time in
    one buffer of ``workspace``."""
    step = wide_rows(rows.shape[1], rows.shape[0], rows.device)
    scratch = workspace.get(ROWS_SLOT, (step, rows.shape[1]), torch.float64, rows.device)
    out = torch.empty((rows.shape[0], FILTERS), dtype=torch.float64, device=rows.device)
    for at in range(0, rows.shape[0], step):
        part = scratch[: rows[at : at + step].shape[0]].copy_(rows[at : at + step])
        if rows.dtype.itemsize > 4:  # float64 squares may overflow: largest scaled to [1/2, 1)
            largest = torch.maximum(part.amax(dim=1), part.amin(dim=1).neg_())  # NaN propagates
            exponent = torch.frexp(torch.where(largest.isfinite(), largest, 1.0))[1]
            times_power_of_two(part, exponent.neg_())
        # (narrower floats' squares stay normal in float64: the same bits as scaled rows)
        norms = part.norm(dim=1, keepdim=True)
        finite = norms.view(-1).isfinite()  # inf or NaN in a row: so is its norm
        unit = part.div_(norms.clamp(min=1e-300))  # a zero row stays zero
        # (w^T r^T: faster than r w for 8 columns; cells allow for any order of the sums)
        out[at : at + step] = torch.mm(grid.weights.T, unit.T).T
        out[at : at + step].masked_fill_(~finite.unsqueeze(1), torch.nan)
    return out


class Places(NamedTuple):
    """Each class's place in the grid: the cell of its first PROJECTIONS projections as an
    int64 key (NOT_FINITE: no copies), the other cells modulo 8 in three bits each."""

    key: Tensor  # int64 [C]
    others: Tensor  # int16 [C]


def place_rows(
    grid: Grid,
    rows_of: Callable[[slice], Tensor],
    num: int,
    row_bytes: int,
    sizes: AuditSizes,
    device: torch.device,
) -> Places:
    """The places of the rows ``rows_of(part)``, projected ``project_bytes`` at a time."""
    keys = torch.empty(num, dtype=torch.int64, device=device)
    places = Places(keys, torch.empty(num, dtype=torch.int16, device=device))
    shifts = 3 * torch.arange(FILTERS - PROJECTIONS, device=device)

    def block(part: slice, workspace: Workspace) -> None:
        projected = project(grid, rows_of(part), workspace)
        finite = projected[:, 0].isfinite()  # a row's projections are all NaN or finite
        index = projected.div_(grid.cell).floor_().masked_fill_(~finite.unsqueeze(1), 0.0)
        key = places.key[part].zero_()
        for k in range(PROJECTIONS):
            key.mul_(grid.radix).add_(index[:, k].to(torch.int64) + grid.radix // 2)
        key.masked_fill_(~finite, NOT_FINITE)
        low = index[:, PROJECTIONS:].to(torch.int64).bitwise_and_(7)  # modulo 8
        places.others[part] = low.bitwise_left_shift_(shifts).sum(dim=1).to(torch.int16)

    in_blocks(block, num, row_bytes, sizes.project_bytes)
    return places


def candidates(grid: Grid, places: Places, sizes: AuditSizes) -> Iterator[tuple[Tensor, Tensor]]:
    """The candidate pairs ``(a, b)`` of classes, each unordered pair once, in chunks: the
    finite rows in the same or a neighbouring cell whose other cells are neighbours too."""
    key, members = sorted_copy(places.key, sizes)
    key = key[: int(torch.searchsorted(key, torch.tensor(NOT_FINITE, device=key.device)))]
    # The neighbouring cells of a key above it, as runs of keys: a cell's own and the next
    # (the last projection one up), then per step (-1, 0 or 1) of the two leading ones that
    # goes up, the three cells of the last projection's steps (no digit leaves the radix).
    radix = grid.radix
    ups = [a * radix * radix + b * radix for a, b in ((0, 1), (1, -1), (1, 0), (1, 1))]
    lows = torch.tensor([up - 1 for up in ups], device=key.device)
    low = 3 * torch.arange(FILTERS - PROJECTIONS, dtype=torch.int32, device=key.device)
    runs = 1 + len(ups)
    step = max(1, sizes.candidate_pairs // runs)
    for start in range(0, key.shape[0] if key.shape[0] > 1 else 0, step):
        position = torch.arange(start, min(key.shape[0], start + step), device=key.device)
        count, at = position.shape[0], key[start : start + position.shape[0]]
        begin = torch.empty((runs, count), dtype=torch.int64, device=key.device)  # run-major
        end = torch.empty_like(begin)
        torch.add(position, 1, out=begin[0])  # in its own cell, the rows after this one
        torch.searchsorted(key, at + 2, out=end[0])
        near = torch.add(lows.unsqueeze(1), at)
        torch.searchsorted(key, near, out=begin[1:])
        torch.searchsorted(key, near.add_(3), out=end[1:])
        for owner, other in expand(begin.view(-1), end.sub_(begin).view(-1), sizes.candidate_pairs):
            a, b = members[position[owner % count]].long(), members[other].long()
            cells = [(places.others[c].to(torch.int32).unsqueeze(1) >> low) & 7 for c in (a, b)]
            close = (((cells[0] - cells[1] + 1) & 7) <= 2).all(dim=1)
            yield a[close], b[close]


def within(first: Tensor, second: Tensor) -> Tensor:
    """bool per pair of rows (``[m, D]`` each): equal up to rounding (:data:`TOLERANCE`);
    pairs within :data:`IN_ORDER_MARGIN` of the boundary summed again in a fixed order."""
    a = first.to(torch.float64, copy=True)  # scaled in place: never the caller's rows
    b = second.to(torch.float64, copy=True)
    largest = torch.stack([a.amax(1), a.amin(1).neg_(), b.amax(1), b.amin(1).neg_()]).amax(0)
    exponent = torch.frexp(largest)[1].neg_()
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
    """int64 ``[P, 2]``: the unordered pairs ``found`` in both orientations, sorted."""
    if not found:
        return torch.zeros((0, 2), dtype=torch.int64, device=device)
    pairs = torch.cat(list(found))
    pairs = torch.cat([pairs, pairs.flip(1)])
    return pairs[torch.argsort(pairs[:, 0] * count + pairs[:, 1])]


def rounding_pairs(
    grid: Grid, places: Places, check: Callable[[Tensor, Tensor], Tensor], sizes: AuditSizes
) -> Tensor:
    """int64 ``[P, 2]``: the pairs of classes that are copies up to rounding, both
    orientations, sorted; ``check(a, b)``: :func:`within` of their first rows."""
    found = []
    for a, b in candidates(grid, places, sizes):
        if a.numel():
            ok = check(a, b)
            found.append(torch.stack([a[ok], b[ok]], dim=1))
    return both_orientations(found, places.key.shape[0], places.key.device)
