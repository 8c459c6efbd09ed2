"""A block of queries' fast scores against a block of gallery items: what each query's
band needs, without a Python loop over queries. The band is ``[s*_f - 2B, s*_f + 2B]``,
``s*_f`` the best fast score of the query's valid positives (``|fast - canonical| <= B``,
:mod:`~recall_at_k.ranking.score`).

- :func:`positives` gathers each query's positives (its label's run of columns): ``s*_f``,
  whether it has a valid positive, and its positives in the band (the best always);
- :func:`hide_own_labels` and :func:`hide_ignored` write a *hole* over the items no count
  may see (the query's own label, itself, its group under ``exclude="same_group"``):
  ``-inf`` for the built-in similarities (finite scores), NaN for a callable's;
- :func:`scan_square` counts each query's items surely above the band and finds the pairs
  inside it, comparing only the rows whose largest score reaches the band; :class:`Stack`
  gathers the reaching rows of many CPU panels to compare them together;
- a :class:`Near` scan does the same for the near-duplicate threshold ``t``: items above
  ``t + B`` are surely at or above it, those within ``B`` of it are re-scored."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from recall_at_k._kernel import Workspace
from recall_at_k.ranking.budget import CPU_STACK_BYTES


class Found(NamedTuple):
    """Pairs found: block rows (queries), gallery columns, a callable's kept scores (or None)."""

    rows: Tensor
    columns: Tensor
    values: Tensor | None


def joined(parts: list[Found], device: torch.device) -> Found:
    """The pairs of several scans in one :class:`Found`."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return Found(empty, empty, None)
    values = None
    if parts[0].values is not None:
        values = torch.cat([p.values for p in parts if p.values is not None])
    return Found(torch.cat([p.rows for p in parts]), torch.cat([p.columns for p in parts]), values)


def edges(centre: Tensor, half: Tensor, dtype: torch.dtype) -> Tensor:
    """``[T, 2]`` bands ``[lo, hi]``: ``lo <= centre - half``, ``hi >= centre + half`` in
    ``dtype``, rounded outwards."""
    lo_wide, hi_wide = centre - half, centre + half
    lo, hi = lo_wide.to(dtype), hi_wide.to(dtype)
    down, up = lo.new_tensor(-math.inf), hi.new_tensor(math.inf)
    lo = torch.where(lo.to(torch.float64) > lo_wide, torch.nextafter(lo, down), lo)
    hi = torch.where(hi.to(torch.float64) < hi_wide, torch.nextafter(hi, up), hi)
    return torch.cat((lo, hi), 1)


def band_edges(best: Tensor, bound: Tensor, has_positive: Tensor, hole: float) -> Tensor:
    """``[T, 2]`` bands ``lo <= s*_f - 2B``, ``hi >= s*_f + 2B`` in the scores' dtype, ``lo``
    kept above a built-in similarity's -inf ``hole`` (else a band would hold holes); +inf for
    a query without a valid positive (nothing reaches its band)."""
    band = edges(best.to(torch.float64), 2 * bound, best.dtype)
    if hole == -math.inf:
        band[:, :1].clamp_(min=torch.finfo(band.dtype).min)
    return band.masked_fill_(~has_positive.view(-1, 1), math.inf)


class Positives(NamedTuple):
    """What a block's label runs tell of its queries."""

    best: Tensor  # [T, 1] s*_f (-inf: no valid positive)
    has_positive: Tensor  # [T] bool
    band: Tensor  # [T, 2] their bands (:func:`band_edges`)
    found: Found  # the valid positives within 2B of s*_f
    runs: Tensor | None  # each row's run (:func:`run_columns`), for :func:`hide_own_labels`


POSITIVE_SLOTS = ("block_columns", "block", "block_valid", "block_marks")
"""The workspace slots of :func:`positives` and :func:`hide_own_labels`."""


def run_columns(start: Tensor, count: Tensor, width: int, workspace: Workspace) -> Tensor:
    """``[T, widest]`` columns of each row's run of ``count`` from ``start``: its last column
    repeated past its end, ``start`` for an empty run, all within ``[0, width)``."""
    rows, device = start.shape[0], start.device
    widest = int(count.max()) if count.numel() else 0
    columns = workspace.get("block_columns", (rows, widest), torch.int64, device)
    last = (count - 1).clamp_(min=0).unsqueeze(1)
    torch.minimum(torch.arange(widest, device=device).unsqueeze(0), last, out=columns)
    return columns.add_(start.unsqueeze(1)).clamp_(min=0, max=max(width - 1, 0))


def positives(
    scores: Tensor,
    start: Tensor,
    count: Tensor,
    groups: tuple[Tensor, Tensor] | None,
    bound: Tensor,
    hole: float,
    keep_values: bool,
    workspace: Workspace,
) -> Positives:
    """Each row's positives: the ``count`` columns from ``start`` (ignored items holed);
    ``groups``: rows' and columns' under ``exclude="same_label_and_group"`` (junk), else None."""
    rows, device = scores.shape[0], scores.device
    if not count.numel() or int(count.max()) == 0:
        best = torch.full((rows, 1), -math.inf, dtype=scores.dtype, device=device)
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        none = torch.zeros(rows, dtype=torch.bool, device=device)
        band = band_edges(best, bound, none, hole)
        return Positives(best, none, band, Found(empty, empty, None), None)
    columns = run_columns(start, count, scores.shape[1], workspace)
    shape = tuple(columns.shape)
    values = torch.gather(
        scores, 1, columns, out=workspace.get("block", shape, scores.dtype, device)
    )
    marks = workspace.get("block_marks", shape, torch.bool, device)
    valid = None  # a built-in similarity's -inf holes lie below every band: no mask alone
    if hole != -math.inf or groups is not None:  # a callable's holes are NaN
        valid = workspace.get("block_valid", shape, torch.bool, device)
        if hole == -math.inf:  # neither the hole nor NaN
            torch.gt(values, hole, out=valid)
        else:
            torch.eq(values, values, out=valid)
        if groups is not None:
            valid.logical_and_(groups[1][columns] != groups[0].unsqueeze(1))
        values.masked_fill_(torch.logical_not(valid, out=marks), -math.inf)
    empty = (count == 0).unsqueeze(1)  # its columns are not its run: nothing valid
    best = values.amax(dim=1, keepdim=True).masked_fill_(empty, -math.inf)
    # (any valid value of a built-in similarity is above the -inf hole)
    has_positive = best.view(-1) > hole if valid is None or hole == -math.inf else valid.any(1)
    has_positive.masked_fill_(empty.view(-1), False)
    band = band_edges(best, bound, has_positive, hole)
    torch.ge(values, band[:, :1], out=marks)
    row, step = (marks if valid is None else marks.logical_and_(valid)).nonzero(as_tuple=True)
    once = step < count[row]  # a run's last column is repeated past its end
    row, step = row[once], step[once]
    kept = values[row, step] if keep_values else None
    return Positives(best, has_positive, band, Found(row, columns[row, step], kept), columns)


def hide_own_labels(scores: Tensor, runs: Tensor | None, count: Tensor, hole: float) -> None:
    """Write ``hole`` over each row's own label run of ``count`` columns, ``runs`` (its
    :func:`run_columns`; None: no row has one); an empty run's one column is kept."""
    if runs is not None:  # (the empty runs' columns written back as they are)
        values = scores.gather(1, runs[:, :1]).masked_fill_((count > 0).unsqueeze(1), hole)
        scores.scatter_(1, runs, values.expand(runs.shape))


def hide_ignored(
    scores: Tensor,
    self_column: Tensor,
    row_groups: Tensor | None,
    column_groups: Tensor | None,
    hole: float,
) -> None:
    """Write ``hole`` at each row's own column (``self_column``; outside ``scores``: nothing)
    and, with groups (``exclude="same_group"``), over the columns of the row's group."""
    inside = (self_column >= 0) & (self_column < scores.shape[1])
    if bool(inside.any()):
        rows = inside.nonzero().view(-1)
        scores[rows, self_column[rows].long()] = hole
    if row_groups is not None and column_groups is not None:
        same = row_groups.unsqueeze(1) == column_groups.unsqueeze(0)
        scores.masked_fill_(same, hole)


def pooled(
    workspace: Workspace,
    slot: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    cap_bytes: int = 0,
) -> Tensor:
    """A buffer of ``shape`` from ``workspace``, its slot a power of two long (allocated a few
    times a ranking, not once a block), taken at ``cap_bytes``, the most it will hold, on CPU
    (:class:`~recall_at_k._kernel.Workspace`)."""
    least = 1 << max(0, math.prod(shape) - 1).bit_length()
    return workspace.get(slot, shape, dtype, device, least, cap_bytes // dtype.itemsize)


def scan_square(
    scores: Tensor,
    peaks: Tensor,
    bands: Tensor,
    firsts: tuple[int, int],
    workspace: Workspace,
    buffer_bytes: int,
    keep_values: bool = False,
) -> tuple[Tensor, Tensor, Found] | None:
    """Scan a square's rows and, where ``peaks`` goes on past them, its columns (read down)
    in one compare. ``peaks``: their largest scores, rows first (NaN reaches, is never
    counted or found); ``bands``: their ``[lo, hi]``; ``firsts``: the positions of the
    square's first row and column. Only the queries reaching their band are compared, in
    ~``buffer_bytes``. Those queries (positions), their counts above it (float), the pairs
    inside it (scores too where ``keep_values``); None when none reaches."""
    height, width = scores.shape
    reaching = (peaks < bands[:, 0]).logical_not_().nonzero().view(-1)
    if (total := reaching.shape[0]) == 0:
        return None
    down = int(torch.searchsorted(reaching, height))  # rows before, columns from here
    length = max(width, height) if peaks.shape[0] > height else width
    queries = reaching + firsts[0]
    queries[down:].add_(firsts[1] - firsts[0] - height)
    dtype, device, itemsize = scores.dtype, scores.device, scores.element_size()
    step = max(1, min(total, buffer_bytes // max(1, compared_row_bytes(length, itemsize))))
    counts, pairs = [], []
    for a in range(0, total, step):
        b = min(a + step, total)
        split = min(max(down, a), b) - a  # compared rows [0, split) are the square's rows
        candidates = pooled(workspace, "scan_values", (b - a, length), dtype, device, buffer_bytes)
        # each query's scores against its items, padded with -inf (never in or above a band)
        if split > 0:
            torch.index_select(scores, 0, reaching[a : a + split], out=candidates[:split, :width])
        if split < b - a:  # the columns' queries (read down), as rows of the transpose
            index = reaching[a + split : b] - height
            torch.index_select(scores.T, 0, index, out=candidates[split:, :height])
        for rows, size in ((slice(0, split), width), (slice(split, None), height)):
            if size < length:
                candidates[rows, size:] = -math.inf
        lo, hi = torch.split(bands.index_select(0, reaching[a:b]), 1, dim=1)
        above, row, column = compare(candidates, lo, hi, workspace, buffer_bytes)
        counts.append(above)
        if row.numel():
            item = column + torch.where(row < split, firsts[1], firsts[0])
            value = candidates[row, column] if keep_values else None
            pairs.append(Found(queries[a:b][row], item, value))
    return queries, counts[0] if len(counts) == 1 else torch.cat(counts), joined(pairs, device)


def mark_dtype(length: int) -> torch.dtype:
    """0/1 marks whose sums over ``length`` are exact: float (comparisons write float marks
    several times faster than bool on CPU, and float sums need no int64 copy of them)."""
    return torch.float32 if length <= 2**24 else torch.float64


def compared_row_bytes(length: int, itemsize: int) -> int:
    """The bytes a compared row of ``length`` values takes: the values and the two marks
    :func:`compare` writes for them."""
    return length * (itemsize + 2 * mark_dtype(length).itemsize)


def compare(
    candidates: Tensor, lo: Tensor, hi: Tensor, workspace: Workspace, cap_bytes: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Per row the count of ``candidates`` above ``hi`` (float, exact), and the positions
    (row, column) of those in ``[lo, hi]``; ``cap_bytes``: :func:`pooled`'s, of the marks."""
    device, shape = candidates.device, tuple(candidates.shape)
    marks = mark_dtype(candidates.shape[1])
    above = pooled(workspace, "marks_above", shape, marks, device, cap_bytes)
    inside = pooled(workspace, "marks_inside", shape, marks, device, cap_bytes)
    torch.gt(candidates, hi, out=above)
    torch.ge(candidates, lo, out=inside)  # (marks at or above lo, above hi: above <= inside)
    # Rows with a pair inside are few: only theirs are searched (a search costs far more).
    some = (inside.sum(dim=1) > (counts := above.sum(dim=1))).nonzero().view(-1)
    if some.numel() == 0:
        return counts, some, some
    pairs = inside.index_select(0, some).sub_(above.index_select(0, some))  # 1 in [lo, hi]
    whole = torch.int32 if marks == torch.float32 else torch.int64  # 0.0 is all zero bits
    row, column = pairs.view(whole).nonzero(as_tuple=True)
    return counts, some[row], column


class Near(NamedTuple):
    """A near-duplicate scan: the threshold's band ``[T, 2]`` (``t - B``, ``t + B``,
    rounded outwards), the count of items surely at or above it, the pairs within."""

    band: Tensor
    sure: Tensor
    found: list[Found]


def near_band(threshold: float, bound: Tensor, dtype: torch.dtype) -> Tensor:
    """The near-duplicate threshold's band ``[t - B, t + B]`` (rounded outwards) of queries
    with bounds ``bound``, as :func:`edges` gives it."""
    return edges(torch.full_like(bound, threshold), bound, dtype)


def saturate(band: Tensor, greater: Tensor, max_k: int) -> None:
    """Stop scanning queries with at least ``max_k`` items surely above ``s*`` (a miss at every
    K): their ``band`` becomes +inf, so no item of theirs is counted or found again (rows
    compared later, in a :class:`Stack` or an earlier square, would be both)."""
    band.masked_fill_(greater.view(-1, 1) >= max_k, math.inf)


class Stack:
    """Rows of successive CPU panels that reach their band, copied aside and compared together."""

    def __init__(
        self,
        band: Tensor,
        greater: Tensor,
        found: list[Found],
        width: int,
        workspace: Workspace,
        buffer_bytes: int,
    ) -> None:
        self.band, self.greater, self.found = band, greater, found
        self.workspace = workspace
        stack_bytes = min(CPU_STACK_BYTES, buffer_bytes)
        row_bytes = compared_row_bytes(width, band.element_size())
        capacity = max(band.shape[0], stack_bytes // max(1, row_bytes))
        self.buffer = workspace.get("stack", (capacity, width), band.dtype, band.device)
        self.used = 0
        self.rows: list[Tensor] = []
        self.firsts: list[int] = []

    def add(self, scores: Tensor, peak: Tensor, first: int) -> bool:
        """Copy the rows of a panel (columns ``first:``) that reach their band (a
        narrower panel padded with -inf); whether the rows before were compared first."""
        rows = (peak < self.band[:, :1]).logical_not_().view(-1).nonzero().view(-1)
        if (count := rows.shape[0]) == 0:
            return False
        flushed = self.used + count > self.buffer.shape[0]
        if flushed:
            self.flush()
        target = self.buffer[self.used : self.used + count]
        if scores.shape[1] == target.shape[1]:
            torch.index_select(scores, 0, rows, out=target)
        else:
            target[:, : scores.shape[1]] = scores.index_select(0, rows)
            target[:, scores.shape[1] :] = -math.inf
        self.used += count
        self.rows.append(rows)
        self.firsts.append(first)
        return flushed

    def flush(self) -> None:
        """Compare every row copied so far with its band."""
        if not self.rows:
            return
        rows = torch.cat(self.rows)
        lengths = torch.tensor([r.shape[0] for r in self.rows], device=rows.device)
        firsts = torch.tensor(self.firsts, device=rows.device).repeat_interleave(lengths)
        candidates, band = self.buffer[: self.used], self.band.index_select(0, rows)
        above, row, column = compare(candidates, band[:, :1], band[:, 1:], self.workspace)
        self.greater.index_add_(0, rows, above.to(self.greater.dtype))
        if row.numel():
            self.found.append(Found(rows[row], firsts[row] + column, None))
        self.used = 0
        self.rows, self.firsts = [], []
