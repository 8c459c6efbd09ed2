"""Per-query partial top-K state for the flat ``(preds, target, indexes)`` form, and its merge.

A query's items may arrive over several updates and processes. Recall@K for every K up
to max K, under every tie policy, is decided exactly by a small per-query *partial*
(notation of :mod:`recall_at_k._kernel`):

- ``best``: the best valid positive score s* (``-inf`` when none); ``tied``: the valid
  positives scored exactly ``best``;
- ``top``: the max K largest valid negative scores, descending, ``-inf`` padded, ``kept``
  of them real;
- ``boundary``: the valid negatives equal to the smallest kept one, unkept included
  (``"expected"`` needs the whole tied block at s*).

Two partials merge exactly: the larger ``best`` (tie counts add when equal), the top max
K of the union, and the new boundary value ``v`` counted as ``boundary`` in each part
whose smallest kept equals ``v``, as its kept entries equal to ``v`` otherwise. At
compute, g_> is the number kept above s*, e the number kept equal to s* (``boundary``
when the list is full and its smallest kept equals s*). States are int64 rows ``[id,
tied, kept, boundary, best, top...]`` (scores as float64 bits): a cast never rounds them.

Example:
    Query 7 arrives in two parts; with max K = 2 neither part keeps all of the negatives
    tied with the positive at 0.5, yet the merged counts are exact (g_> = 1 negative
    above, e = 4 tied, p = 1 tied positive; ``at_or_above`` holds g_> + e):

    >>> import torch
    >>> from recall_at_k import _flat
    >>> first = _flat.summarise(torch.tensor([0.9, 0.5, 0.5]),
    ...                         torch.tensor([False, False, True]), torch.tensor([7, 7, 7]), 2)
    >>> second = _flat.summarise(torch.tensor([0.5, 0.5, 0.5]),
    ...                          torch.tensor([False, False, False]), torch.tensor([7, 7, 7]), 2)
    >>> both = _flat.Partials(*(torch.cat([a, b]) for a, b in zip(first, second)))
    >>> merged = _flat.merge(both, 2)
    >>> merged.top, merged.boundary
    (tensor([[0.9000, 0.5000]], dtype=torch.float64), tensor([4]))
    >>> counts = _flat.tie_counts(merged, 2)
    >>> counts.greater, counts.at_or_above, counts.tied_positives
    (tensor([1]), tensor([5]), tensor([1]))
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from recall_at_k import _kernel
from recall_at_k._checks import (
    check_binary,
    check_no_nan,
    check_same_device,
    check_tensors,
    describe,
)
from recall_at_k.ranking.budget import FLAT_SLACK_BYTES

_ID, _TIED, _KEPT, _BOUNDARY, _BEST = 0, 1, 2, 3, 4
ROW_PREFIX = _BEST + 1  # columns of a packed state row before the max_k top scores
# Most cells a value of a padded [segments, longest] matrix; beyond, a sort finds the top K.
PADDED_FILL = 4
# How the per-segment top K is found ("auto": choose_path); each gives the same result.
SegmentPath = Literal["auto", "padded", "sorted"]

_NEG_INF = float("-inf")
_SMALL_MATRIX = 2**15  # cells up to which dispatch, not arithmetic, costs: bool counts
_FEW_SEGMENTS = 64  # segments up to which _grouping reads ids and counts on the host
_UNIQUE_CONSECUTIVE: Callable[..., tuple[Tensor, Tensor, Tensor]] = (
    torch._C._VariableFunctions.unique_consecutive  # type: ignore[attr-defined]
)


def compact_slack(max_k: int) -> int:
    """The rows that may wait for a merge at ``max_k`` (``budget.FLAT_SLACK_BYTES``)."""
    return max(1, FLAT_SLACK_BYTES // (8 * (ROW_PREFIX + max_k)))


class Partials(NamedTuple):
    """Per-query partial state, one row per query (part): int64 ``ids``, ``tied``,
    ``kept``, ``boundary`` ``[n]``; float ``best`` ``[n]`` and ``top`` ``[n, max_k]``."""

    ids: Tensor
    best: Tensor
    tied: Tensor
    top: Tensor
    kept: Tensor
    boundary: Tensor


def check_structure(
    preds: Tensor, target: Tensor, indexes: Tensor, ignore: Tensor | None = None
) -> None:
    """Shapes, dtypes and devices of a flat ``(preds, target, indexes)`` triple (no value read)."""
    if not (
        isinstance(preds, Tensor) and isinstance(target, Tensor) and isinstance(indexes, Tensor)
    ):
        check_tensors(preds=preds, target=target, indexes=indexes)
    if ignore is not None:
        raise ValueError(
            "`ignore` is the dense form's [Q, G] mask and cannot be combined with `indexes`;"
            " in the flat form leave ignored items out of the batch, or give them the"
            " target value `ignore_index`"
        )
    if not preds.is_floating_point():
        raise ValueError(
            f"`preds` must be a floating point tensor of item scores, got {describe(preds)}"
        )
    if target.is_complex():
        raise ValueError(
            "`target` must be a bool, 0/1 integer or 0./1. float tensor of relevance,"
            f" got {describe(target)}"
        )
    if indexes.is_floating_point() or indexes.is_complex() or indexes.dtype == torch.bool:
        raise ValueError(
            f"`indexes` must be an integer (int64) tensor of query ids, got {describe(indexes)}"
        )
    if preds.dim() == 0 or not (preds.shape == target.shape == indexes.shape):
        raise ValueError(
            "`preds`, `target` and `indexes` must be 1-D tensors of equal length (one entry"
            " per item; tensors of one same shape are flattened), got shapes"
            f" {list(preds.shape)}, {list(target.shape)} and {list(indexes.shape)}"
        )
    device = preds.device
    if target.device != device or indexes.device != device:
        check_same_device(preds=preds, target=target, indexes=indexes)


def flat_partials(
    preds: Tensor,
    target: Tensor,
    indexes: Tensor,
    ignore: Tensor | None,
    *,
    max_k: int,
    ignore_index: int | None,
    validate_args: bool,
    path: SegmentPath = "auto",
) -> Tensor | None:
    """A flat batch, checked, as packed state rows (one per query; :func:`pack`), or
    ``None`` when no item is left after dropping ``ignore_index`` items."""
    check_structure(preds, target, indexes, ignore)
    preds = preds.detach()
    if preds.dim() != 1:
        preds, target, indexes = preds.reshape(-1), target.reshape(-1), indexes.reshape(-1)
    if ignore_index is not None:
        keep = target != ignore_index
        if not bool(keep.all()):
            preds, target, indexes = preds[keep], target[keep], indexes[keep]
    if validate_args:
        check_no_nan(preds, name="preds")
        hint = (
            f" (items whose target equals `ignore_index`={ignore_index} are dropped)"
            if ignore_index is not None
            else " (pass `ignore_index` to drop items with a given target value)"
        )
        check_binary(target, "`target` values", hint)
    if preds.numel() == 0:
        return None
    positive = target if target.dtype == torch.bool else target != 0
    return summarise_rows(preds, positive, indexes.to(torch.int64), max_k, path=path)


def _gather_column(matrix: Tensor, column: Tensor) -> Tensor:
    """``matrix[i, column[i]]`` for every row, ``column`` clamped to the valid range."""
    index = column.clamp(min=0, max=matrix.shape[1] - 1).unsqueeze(1)
    return matrix.gather(1, index).squeeze(1)


def _count_equal(matrix: Tensor, value: Tensor) -> Tensor:
    """Row-wise ``(matrix == value).sum(1, keepdim=True)`` as int64, through a float buffer
    (:func:`recall_at_k._kernel.count_dtype`) except in a small matrix."""
    if matrix.numel() <= _SMALL_MATRIX:
        return (matrix == value).sum(dim=1, keepdim=True)
    out = matrix.new_empty(matrix.shape, dtype=_kernel.count_dtype(matrix.shape[1]))
    torch.eq(matrix, value, out=out)
    return out.sum(dim=1, keepdim=True).to(torch.int64)


def choose_path(
    counts: Tensor, n: int, width: int | None = None
) -> Literal["equal", "padded", "sorted"]:
    """How ``"auto"`` finds the top K of ``n`` values in segments of these ``counts``
    (``width``: the longest, when already read): ``"equal"`` when every segment has the
    same length, ``"padded"`` up to :data:`PADDED_FILL` cells a value, else ``"sorted"``."""
    cells = counts.numel() * (int(counts.max()) if width is None else width)
    if cells == n:
        return "equal"
    return "padded" if cells <= PADDED_FILL * n else "sorted"


def _padded(counts: Tensor, width: int, *columns: tuple[Tensor, float | bool]) -> list[Tensor]:
    """Each grouped ``[n]`` column (segment 0's values first, ...) as a ``[segments,
    width]`` matrix, the rows of shorter segments padded with the column's fill value."""
    segments, device = counts.numel(), counts.device
    seg = torch.repeat_interleave(torch.arange(segments, device=device), counts)
    rank = torch.arange(seg.numel(), device=device) - (counts.cumsum(0) - counts)[seg]
    matrices = []
    for values, fill in columns:
        matrix = torch.full((segments, width), fill, dtype=values.dtype, device=device)
        matrix[seg, rank] = values
        matrices.append(matrix)
    return matrices


def _top(matrix: Tensor, max_k: int) -> Tensor:
    """The ``max_k`` largest values of each row, descending, ``-inf`` padded."""
    top = matrix.topk(min(max_k, matrix.shape[1]), dim=1).values
    if top.shape[1] < max_k:
        top = torch.cat([top, top.new_full((top.shape[0], max_k - top.shape[1]), _NEG_INF)], 1)
    return top


def segment_top(counts: Tensor, values: Tensor, max_k: int, path: SegmentPath) -> Tensor:
    """The ``max_k`` largest of each segment of grouped ``values``, descending, ``-inf``
    padded: ``[segments, max_k]``, ``counts`` (each at least one) values a segment."""
    width = int(counts.max())
    way = choose_path(counts, values.numel(), width) if path == "auto" else path
    if way == "sorted":
        return _sorted_segment_top(counts, values, max_k)[0]
    if way == "equal":
        return _top(values.view(counts.numel(), width), max_k)
    return _top(_padded(counts, width, (values, _NEG_INF))[0], max_k)


def _sorted_segment_top(counts: Tensor, values: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
    """:func:`segment_top` by a sort on (segment, -value), and each value's segment."""
    n, segments, device = values.numel(), counts.numel(), values.device
    seg = torch.repeat_interleave(torch.arange(segments, device=device), counts)
    order = torch.argsort(values, descending=True, stable=True)
    order = order[torch.argsort(seg[order], stable=True)]
    # The values are grouped, so after the sort ``seg`` is unchanged: only ranks move.
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[seg]
    keep = rank < max_k
    top = torch.full((segments, max_k), _NEG_INF, dtype=values.dtype, device=device)
    top[seg[keep], rank[keep]] = values[order][keep]
    return top, seg


def _runs(values: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.unique_consecutive(values, return_counts=True)`` without the Python wrapper."""
    runs, _, counts = _UNIQUE_CONSECUTIVE(values, False, True, None)
    return runs, counts


def _grouping(ids: Tensor, counts: Tensor) -> tuple[bool, int]:
    """Whether ``unique_consecutive`` runs are ascending ids, and the longest run (one read)."""
    if ids.numel() < 2:
        return True, int(counts[0])
    if ids.numel() <= _FEW_SEGMENTS:
        return all(a < b for a, b in itertools.pairwise(ids.tolist())), max(counts.tolist())
    ascending = (ids[1:] > ids[:-1]).all().to(counts.dtype)
    flag, width = torch.stack([ascending, counts.max()]).tolist()
    return bool(flag), int(width)


def summarise(
    preds: Tensor, positive: Tensor, indexes: Tensor, max_k: int, *, path: SegmentPath = "auto"
) -> Partials:
    """:func:`summarise_rows`, unpacked."""
    return unpack(summarise_rows(preds, positive, indexes, max_k, path=path))


def summarise_rows(
    preds: Tensor, positive: Tensor, indexes: Tensor, max_k: int, *, path: SegmentPath = "auto"
) -> Tensor:
    """Packed state rows (:func:`pack`) of float ``preds`` (no NaN), bool ``positive`` and
    int64 ``indexes`` ``[n >= 1]``: one row per distinct id, ids ascending. Items grouped
    by ascending id (as loaders deliver them) are not sorted again."""
    values = preds.float() if preds.dtype in (torch.float16, torch.bfloat16) else preds
    ids, counts = _runs(indexes)
    grouped, width = _grouping(ids, counts)
    if not grouped:
        # Ids as int32 offsets where they fit (faster); the order within a query is free.
        low, high = torch.aminmax(indexes)
        narrow = int(high) - int(low) < 2**31
        sorted_key, order = torch.sort((indexes - low).to(torch.int32) if narrow else indexes)
        values, positive = values[order], positive[order]
        ids, counts = _runs(sorted_key)
        ids = ids.to(torch.int64) + (low if narrow else 0)
        width = int(counts.max())
    way = choose_path(counts, values.numel(), width) if path == "auto" else path
    if way == "sorted":
        return pack(_summarise_sorted(ids, counts, values, positive, max_k))
    return _summarise_matrix(ids, counts, width, values, positive, max_k, way == "equal")


def _summarise_matrix(
    ids: Tensor,
    counts: Tensor,
    width: int,
    values: Tensor,
    positive: Tensor,
    max_k: int,
    equal: bool,
) -> Tensor:
    """Packed rows of grouped items through a ``[segments, width]`` matrix, each count a
    ``[segments, 1]`` column so that packing is one concatenation."""
    segments, device = ids.numel(), values.device
    if values.numel() <= _SMALL_MATRIX:
        # Exact, and saves a conversion and a concatenation when packing.
        values = values.to(torch.float64)
    neg_inf = _kernel.constant(_NEG_INF, values.dtype, device)
    nan = _kernel.constant(float("nan"), values.dtype, device)
    # ``counted``: the negatives' scores, NaN elsewhere (NaN equals nothing).
    if equal:
        matrix, pos = values.view(segments, width), positive.view(segments, width)
        counted = torch.where(pos, nan, matrix)
        num_items: Tensor | int = width
    else:
        counted = torch.where(positive, nan, values)
        columns = (values, _NEG_INF), (positive, False), (counted, float("nan"))
        matrix, pos, counted = _padded(counts, width, *columns)
        num_items = counts.unsqueeze(1)
    best = torch.where(pos, matrix, neg_inf).amax(dim=1, keepdim=True)
    tied = (pos & (matrix == best)).sum(dim=1, keepdim=True)
    top = _top(torch.where(pos, neg_inf, matrix), max_k)
    kept = (num_items - pos.sum(dim=1, keepdim=True)).clamp_(max=max_k)
    # With no negative kept, top[0] = -inf matches no counted value: boundary 0.
    boundary = _count_equal(counted, top.gather(1, (kept - 1).clamp_(min=0)))
    counts_and_id = [ids.unsqueeze(1), tied, kept, boundary]
    if values.dtype == torch.float64:
        return torch.cat([*counts_and_id, best.view(torch.int64), top.view(torch.int64)], dim=1)
    scores = torch.cat([best, top], dim=1).to(torch.float64).view(torch.int64)
    return torch.cat([*counts_and_id, scores], dim=1)


def _summarise_sorted(
    ids: Tensor, counts: Tensor, values: Tensor, positive: Tensor, max_k: int
) -> Partials:
    """Partials of grouped items through :func:`_sorted_segment_top` (unbalanced segments)."""
    segments = ids.numel()
    # Positives are few: work on their positions; they become -inf among the negatives.
    pos_index = positive.nonzero().squeeze(1)
    pos_values = values[pos_index]
    negatives = values.index_fill(0, pos_index, _NEG_INF)
    pos_seg = torch.searchsorted(counts.cumsum(0), pos_index, right=True)
    best = torch.full((segments,), _NEG_INF, dtype=values.dtype, device=values.device)
    best.scatter_reduce_(0, pos_seg, pos_values, "amax")
    num_pos = torch.bincount(pos_seg, minlength=segments)
    tied = torch.zeros_like(num_pos).scatter_add_(
        0, pos_seg, (pos_values == best[pos_seg]).to(torch.int64)
    )
    kept = (counts - num_pos).clamp(max=max_k)
    top, seg = _sorted_segment_top(counts, negatives, max_k)
    at_boundary = (negatives == _gather_column(top, kept - 1)[seg]) & ~positive
    boundary = torch.zeros_like(counts).scatter_add_(0, seg, at_boundary.to(torch.int64))
    return Partials(ids, best.to(torch.float64), tied, top.to(torch.float64), kept, boundary)


def merge(
    parts: Partials, max_k: int, complete_queries: bool = False, *, path: SegmentPath = "auto"
) -> Partials:
    """Rows that share a query id merged into one per id (ids ascending), exactly; with
    ``complete_queries`` they are repeats of one whole query: the first is kept."""
    rows = parts.ids.numel()
    if rows == 0:
        return parts
    if complete_queries:
        first = _kernel.first_of_each_id(parts.ids)
        return Partials(*(field[first] for field in parts))
    if rows > 1 and not bool((parts.ids[1:] >= parts.ids[:-1]).all()):
        order = torch.argsort(parts.ids, stable=True)
        parts = Partials(*(field[order] for field in parts))
    ids, seg, counts = torch.unique_consecutive(parts.ids, return_inverse=True, return_counts=True)
    queries = ids.numel()
    if queries == rows:
        return parts
    device = parts.ids.device

    best = torch.full((queries,), _NEG_INF, dtype=parts.best.dtype, device=device)
    best.scatter_reduce_(0, seg, parts.best, "amax")
    tied = torch.zeros(queries, dtype=torch.int64, device=device).scatter_add_(
        0, seg, torch.where(parts.best == best[seg], parts.tied, 0)
    )

    valid = torch.arange(max_k, device=device) < parts.kept.unsqueeze(1)
    values = torch.where(valid, parts.top, _NEG_INF).reshape(-1)
    top = segment_top(counts * max_k, values, max_k, path)
    kept = torch.zeros_like(tied).scatter_add_(0, seg, parts.kept).clamp(max=max_k)

    boundary_value = _gather_column(top, kept - 1)[seg]
    part_min = _gather_column(parts.top, parts.kept - 1)
    at_min = (parts.kept > 0) & (part_min == boundary_value)
    in_kept = (valid & (parts.top == boundary_value.unsqueeze(1))).sum(dim=1)
    boundary = torch.zeros_like(tied).scatter_add_(
        0, seg, torch.where(at_min, parts.boundary, in_kept)
    )
    return Partials(ids, best, tied, top, kept, boundary)


def tie_counts(parts: Partials, max_k: int) -> _kernel.TieCounts:
    """g_>, g_> + e and p of each (merged) query, as ``dense_tie_counts`` returns them."""
    valid = torch.arange(max_k, device=parts.top.device) < parts.kept.unsqueeze(1)
    best = parts.best.unsqueeze(1)
    greater = (valid & (parts.top > best)).sum(dim=1)
    equal = (valid & (parts.top == best)).sum(dim=1)
    # A full list whose smallest kept is s* may hide more negatives tied at s*.
    hidden_ties = (parts.kept == max_k) & (parts.top[:, -1] == parts.best)
    equal = torch.where(hidden_ties, parts.boundary, equal)
    return _kernel.TieCounts(greater, greater + equal, parts.tied, parts.tied > 0)


def pack(parts: Partials) -> Tensor:
    """Partials as int64 ``[n, 5 + max_k]``: id, tied, kept, boundary, bits of ``best``, ``top``."""
    ints = torch.stack([parts.ids, parts.tied, parts.kept, parts.boundary], dim=1)
    scores = torch.cat([parts.best.unsqueeze(1), parts.top], dim=1).to(torch.float64)
    return torch.cat([ints, scores.view(torch.int64)], dim=1)


def unpack(rows: Tensor) -> Partials:
    """Inverse of :func:`pack`."""
    scores = rows[:, _BEST:].view(torch.float64)
    ids, tied, kept, boundary = (rows[:, column] for column in (_ID, _TIED, _KEPT, _BOUNDARY))
    return Partials(ids, scores[:, 0], tied, scores[:, 1:], kept, boundary)


def _merged(
    state: Tensor | Sequence[Tensor], max_k: int, complete_queries: bool, path: SegmentPath
) -> Partials | None:
    """The state (blocks, or a synced tensor) merged to one row per query id; ``None`` if empty."""
    # A process without flat data contributes an empty placeholder of any shape.
    blocks = [block for block in ([state] if isinstance(state, Tensor) else state) if block.numel()]
    if not blocks:
        return None
    rows = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return merge(unpack(rows.reshape(-1, ROW_PREFIX + max_k)), max_k, complete_queries, path=path)


def compact(
    state: list[Tensor],
    max_k: int,
    complete_queries: bool,
    path: SegmentPath,
    slack: int | None,
    rows: int,
) -> list[Tensor]:
    """The state blocks (``rows`` in all) merged into one once they exceed twice the first
    (the last merge's result) plus ``slack`` (:func:`compact_slack`): O(1) amortised a row."""
    slack = compact_slack(max_k) if slack is None else slack
    if len(state) < 2 or rows <= 2 * state[0].shape[0] + slack:
        return state
    parts = _merged(state, max_k, complete_queries, path)
    return [] if parts is None else [pack(parts)]


def flat_tie_counts(
    state: Tensor | Sequence[Tensor],
    max_k: int,
    complete_queries: bool = False,
    *,
    path: SegmentPath = "auto",
) -> tuple[Tensor, _kernel.TieCounts] | None:
    """Each flat query's id (ascending) and :func:`tie_counts`; ``None`` for an empty state."""
    parts = _merged(state, max_k, complete_queries, path)
    return None if parts is None else (parts.ids, tie_counts(parts, max_k))
