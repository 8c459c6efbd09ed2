"""Per-query partial top-K state for the flat ``(preds, target, indexes)`` form, and its merge.

In the flat form a query's items may arrive over several ``update`` calls and several
processes. Recall@K for every K up to max K, under every tie policy, is decided exactly
by a small per-query summary (the notation of :mod:`recall_at_k._kernel`), a *partial*:

- ``best``: the best valid positive score s* seen so far (``-inf`` when none);
- ``tied``: the number of valid positives scored exactly ``best`` (0: no positive yet);
- ``top``: the max K largest valid negative scores, descending, ``-inf`` padded, of which
  ``kept`` (at most max K) are real;
- ``boundary``: the number of valid negatives equal to the smallest kept one,
  ``top[kept - 1]``, *including those that were not kept*. The tied block at s* may
  extend past the kept list; this count keeps the ``"expected"`` policy exact.

Two partials of one query merge exactly: ``best`` is the larger (tie counts add when
equal), ``top`` is the top max K of the union, and the new boundary value ``v`` (the
smallest newly kept) is counted as ``part.boundary`` in each part whose smallest kept
equals ``v`` and as the number of kept entries equal to ``v`` in every other part. That
is exact because a part whose list is full has its smallest kept at or below ``v``, and
every negative of a part above that part's smallest kept is kept.

At compute, with s* = ``best``: g_> is the number of kept above s* (when all max K kept
are above s*, g_> >= max K and the query misses at every K), and e is the number of
kept equal to s*, except when the list is full and its smallest kept equals s*, where e
is ``boundary``.

Everything is vectorised: one sort by query id (skipped when the ids already arrive
grouped, as data loaders over (query, item) pairs deliver them), segment reductions with
``scatter_reduce``, and a per-segment top-K either by ``topk`` over a padded
``[queries, longest]`` matrix (balanced segments) or by a sort on (id, -score).

States are int64 tensors ``[rows, 5 + max K]`` (a query id, the three counts and the
``float64`` bit patterns of ``best`` and ``top``) so that a dtype cast of the module, such
as Lightning's half precision, can never round a score.

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

__all__ = [
    "COMPACT_SLACK_BYTES",
    "PADDED_FILL",
    "Partials",
    "SegmentPath",
    "choose_path",
    "compact",
    "compact_slack",
    "flat_outcomes",
    "flat_partials",
    "flat_rank_histogram",
    "merge",
    "summarise",
    "summarise_rows",
    "tie_counts",
]

_ID, _TIED, _KEPT, _BOUNDARY, _BEST = 0, 1, 2, 3, 4
ROW_PREFIX = _BEST + 1
"""Columns of a packed state row before the ``max_k`` top scores."""
# A padded [segments, longest] matrix is used for the per-segment top-K while it holds
# at most this many cells per item; beyond that (one huge query among many small ones)
# a sort on (id, -score) costs less memory.
PADDED_FILL = 4
COMPACT_SLACK_BYTES = 1024 * (ROW_PREFIX + 10) * 8
"""compact() merges the state into one block once it holds more than twice the rows of
its first block plus :func:`compact_slack` rows: rows of at most this many bytes in all
(1,024 rows at max K = 10; 15 at max K = 1,000) wait for a merge, so small updates merge
rarely (each merge costs ~30 operations; at 8 queries x 100 items an update, 1,024 rather
than 256 rows saved 4-6 us of ~65 us a call) and a large max K does not keep more bytes
waiting."""


def compact_slack(max_k: int) -> int:
    """The rows that may wait for a merge at ``max_k`` (:data:`COMPACT_SLACK_BYTES`)."""
    return max(1, COMPACT_SLACK_BYTES // (8 * (ROW_PREFIX + max_k)))


SegmentPath = Literal["auto", "padded", "sorted"]
"""How :func:`segment_top` finds each segment's top K: ``"auto"`` chooses by
:func:`choose_path`; ``"padded"`` and ``"sorted"`` force one way (every way gives the
same result; the choice is a private switch for tests)."""

_NEG_INF = float("-inf")
# A matrix of at most this many cells costs the dispatch of its tensor operations rather
# than their arithmetic: it is counted through a bool comparison.
_SMALL_MATRIX = 2**15
# Up to this many segments :func:`_grouping` reads the ids and counts on the host.
_FEW_SEGMENTS = 64


class Partials(NamedTuple):
    """Per-query partial state of the flat form (one row per query, or per query part).

    ``ids`` int64 ``[n]``; ``best`` float ``[n]``; ``tied``, ``kept`` and ``boundary``
    int64 ``[n]``; ``top`` float ``[n, max_k]`` (see the module docstring).
    """

    ids: Tensor
    best: Tensor
    tied: Tensor
    top: Tensor
    kept: Tensor
    boundary: Tensor


# ---------------------------------------------------------------------------- checks


def check_structure(
    preds: Tensor, target: Tensor, indexes: Tensor, ignore: Tensor | None = None
) -> None:
    """Shapes, dtypes and devices of a flat ``(preds, target, indexes)`` triple.

    Reads no tensor values (no host-device synchronisation).
    """
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


def check_values(preds: Tensor, target: Tensor, ignore_index: int | None) -> None:
    """Value checks of a flat batch after dropping ``ignore_index`` items (host reads)."""
    check_no_nan(preds, name="preds")
    hint = (
        f" (items whose target equals `ignore_index`={ignore_index} are dropped)"
        if ignore_index is not None
        else " (pass `ignore_index` to drop items with a given target value)"
    )
    check_binary(target, "`target` values", hint)


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
    """Validate a flat batch and summarise it into packed state rows.

    Returns:
        int64 ``[queries in the batch, 5 + max_k]`` (see :func:`pack`), or ``None`` when
        no item is left after dropping ``ignore_index`` items.
    """
    check_structure(preds, target, indexes, ignore)
    preds = preds.detach()
    if preds.dim() != 1:
        preds, target, indexes = preds.reshape(-1), target.reshape(-1), indexes.reshape(-1)
    if ignore_index is not None:
        keep = target != ignore_index
        if not bool(keep.all()):
            preds, target, indexes = preds[keep], target[keep], indexes[keep]
    if validate_args:
        check_values(preds, target, ignore_index)
    if preds.numel() == 0:
        return None
    positive = target if target.dtype == torch.bool else target != 0
    return summarise_rows(preds, positive, indexes.to(torch.int64), max_k, path=path)


# ----------------------------------------------------------------- segment operations


def _is_sorted(values: Tensor) -> bool:
    """Whether a 1-D tensor is non-decreasing (one pass, one host read)."""
    return values.numel() < 2 or bool((values[1:] >= values[:-1]).all())


def _scores_dtype(values: Tensor) -> Tensor:
    """Half precision scores as float32 (exact; every kernel supports it)."""
    if values.dtype in (torch.float16, torch.bfloat16):
        return values.to(torch.float32)
    return values


def _gather_column(matrix: Tensor, column: Tensor) -> Tensor:
    """``matrix[i, column[i]]`` for every row, ``column`` clamped to the valid range."""
    index = column.clamp(min=0, max=matrix.shape[1] - 1).unsqueeze(1)
    return matrix.gather(1, index).squeeze(1)


def _count_equal(matrix: Tensor, value: Tensor, keepdim: bool = False) -> Tensor:
    """Row-wise ``(matrix == value).sum(1)`` as int64 (``[rows, 1]`` with ``keepdim``).

    The comparison is written into a float buffer (see :func:`recall_at_k._kernel.count_dtype`),
    except in a small matrix, where fewer operations matter more.
    """
    if matrix.numel() <= _SMALL_MATRIX:
        return (matrix == value).sum(dim=1, keepdim=keepdim)
    out = torch.empty(
        matrix.shape, dtype=_kernel.count_dtype(matrix.shape[1]), device=matrix.device
    )
    torch.eq(matrix, value, out=out)
    return out.sum(dim=1, keepdim=keepdim).to(torch.int64)


def choose_path(
    counts: Tensor, n: int, width: int | None = None
) -> Literal["equal", "padded", "sorted"]:
    """The way ``"auto"`` finds the per-segment top K of ``n`` values in these segments.

    ``"equal"``: every segment has the same length (the values already form the matrix);
    ``"padded"``: a ``[segments, longest]`` matrix of at most :data:`PADDED_FILL` cells
    per value; ``"sorted"`` otherwise (one huge segment among many small ones).
    ``width``: the longest segment, when the caller has read it already.
    """
    cells = counts.numel() * (int(counts.max()) if width is None else width)
    if cells == n:
        return "equal"
    return "padded" if cells <= PADDED_FILL * n else "sorted"


def segment_top(
    counts: Tensor,
    values: Tensor,
    max_k: int,
    kept: Tensor | None = None,
    *,
    path: SegmentPath = "auto",
) -> tuple[Tensor, Tensor | None]:
    """The ``max_k`` largest values of each segment, descending, ``-inf`` padded.

    Args:
        counts: int64 ``[segments]`` number of values in each segment, each at least one;
            the values are grouped: segment 0's first, then segment 1's, and so on.
        values: float ``[n]``; entries that must not count are ``-inf``.
        max_k: how many to keep.
        kept: optional int64 ``[segments]``, how many of each row of the result are real.
        path: the way to compute it (see :data:`SegmentPath`).

    Returns:
        ``top``, ``[segments, max_k]`` of the dtype of ``values``, and, when ``kept`` is
        given, the number of ``values`` of each segment equal to ``top[kept - 1]``
        (``-inf`` entries included).
    """
    n, segments = values.numel(), counts.numel()
    device = values.device
    width = int(counts.max())
    padding: Tensor | None = None
    way = choose_path(counts, n, width) if path == "auto" else path
    if way == "equal":
        # Every segment has the same length: the grouped values already form the matrix.
        matrix = values.view(segments, width)
    elif way == "padded":
        seg = torch.repeat_interleave(torch.arange(segments, device=device), counts)
        rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[seg]
        matrix = torch.full((segments, width), _NEG_INF, dtype=values.dtype, device=device)
        matrix[seg, rank] = values
        padding = width - counts
    else:
        return _sorted_segment_top(counts, values, max_k, kept)
    top = matrix.topk(min(max_k, width), dim=1).values
    if top.shape[1] < max_k:
        top = torch.cat([top, top.new_full((segments, max_k - top.shape[1]), _NEG_INF)], dim=1)
    if kept is None:
        return top, None
    boundary_value = _gather_column(top, kept - 1)
    equal = _count_equal(matrix, boundary_value.unsqueeze(1))
    if padding is not None:
        equal = equal - torch.where(boundary_value == _NEG_INF, padding, 0)
    return top, equal


def _sorted_segment_top(
    counts: Tensor, values: Tensor, max_k: int, kept: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """:func:`segment_top` for unbalanced segments: a sort on (segment, -value)."""
    n, segments = values.numel(), counts.numel()
    device = values.device
    seg = torch.repeat_interleave(torch.arange(segments, device=device), counts)
    order = torch.argsort(values, descending=True, stable=True)
    order = order[torch.argsort(seg[order], stable=True)]
    # The values are grouped, so after the sort ``seg`` is unchanged: only ranks move.
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[seg]
    keep = rank < max_k
    top = torch.full((segments, max_k), _NEG_INF, dtype=values.dtype, device=device)
    top[seg[keep], rank[keep]] = values[order][keep]
    if kept is None:
        return top, None
    boundary_value = _gather_column(top, kept - 1)
    at_boundary = (values == boundary_value[seg]).to(torch.int64)
    return top, torch.zeros_like(counts).scatter_add_(0, seg, at_boundary)


def _sort_key(indexes: Tensor) -> tuple[Tensor, Tensor | int]:
    """Ids as int32 offsets from the smallest when they span less than 2**31 (sorts faster).

    Returns:
        The key and the offset to add back to a sorted key to get ids.
    """
    low, high = torch.aminmax(indexes)
    if int(high) - int(low) < 2**31:
        return (indexes - low).to(torch.int32), low
    return indexes, 0


# The operator under torch.unique_consecutive's Python wrapper (not in torch's stubs).
_UNIQUE_CONSECUTIVE: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = getattr(
    torch._C._VariableFunctions, "unique_consecutive", None
)


def _runs(values: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.unique_consecutive(values, return_counts=True)``, without the Python
    wrapper around the operator where there is one (about half the cost of a small
    batch's call)."""
    if _UNIQUE_CONSECUTIVE is None:
        runs, counts = torch.unique_consecutive(values, return_counts=True)
    else:
        runs, _, counts = _UNIQUE_CONSECUTIVE(values, False, True, None)
    return runs, counts


def _grouping(ids: Tensor, counts: Tensor) -> tuple[bool, int]:
    """Whether the runs of ``unique_consecutive`` are ascending ids (each id one run, in
    order), and the longest run, in one host read."""
    if ids.numel() < 2:
        return True, int(counts[0])
    if ids.numel() <= _FEW_SEGMENTS:
        # Two small host reads cost less than the tensor operations that combine them.
        id_list, count_list = ids.tolist(), counts.tolist()
        ascending_list = all(a < b for a, b in itertools.pairwise(id_list))
        return ascending_list, max(count_list)
    ascending = (ids[1:] > ids[:-1]).all().to(counts.dtype)
    flag, width = torch.stack([ascending, counts.max()]).tolist()
    return bool(flag), int(width)


def summarise(
    preds: Tensor,
    positive: Tensor,
    indexes: Tensor,
    max_k: int,
    *,
    path: SegmentPath = "auto",
) -> Partials:
    """Partials of one batch of items: one row per distinct id, ids ascending
    (:func:`summarise_rows`, unpacked)."""
    return unpack(summarise_rows(preds, positive, indexes, max_k, path=path))


def summarise_rows(
    preds: Tensor,
    positive: Tensor,
    indexes: Tensor,
    max_k: int,
    *,
    path: SegmentPath = "auto",
) -> Tensor:
    """Packed state rows (:func:`pack`) of one batch of items: one row per distinct id,
    ids ascending.

    Items that arrive grouped by id in ascending order (the usual layout of a data
    loader over (query, item) pairs) are not sorted again (one host read tells); otherwise
    one sort of the ids and one gather of the scores and targets group them. Balanced
    segments are then summarised as one ``[segments, longest]`` matrix (the grouped items
    themselves when every segment has the same length), in a fixed number of tensor
    operations; one huge segment among many small ones by a sort on (id, -score).

    Args:
        preds: float ``[n]`` scores (no NaN), ``n >= 1``.
        positive: bool ``[n]`` relevance.
        indexes: int64 ``[n]`` query ids.
        max_k: the largest K.
        path: the way :func:`segment_top` goes.
    """
    values = _scores_dtype(preds)
    ids, counts = _runs(indexes)
    grouped, width = _grouping(ids, counts)
    if not grouped:
        key, offset = _sort_key(indexes)
        # Within a query the order does not matter: an unstable sort will do.
        sorted_key, order = torch.sort(key)
        values, positive = values[order], positive[order]
        ids, counts = _runs(sorted_key)
        ids = ids.to(torch.int64) + offset
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
    """:func:`summarise` of grouped items as a ``[segments, width]`` matrix (``-inf``
    and not positive in the padding of shorter segments), as packed rows (:func:`pack`).

    Every per-segment count is kept as a ``[segments, 1]`` column, so that the packed
    rows are one concatenation (a small batch costs the dispatch of its operations).
    """
    segments, device = ids.numel(), values.device
    if values.numel() <= _SMALL_MATRIX:
        # A small batch works in float64 from the start (exact: every comparison and
        # maximum of the converted scores is that of the scores), which saves the
        # conversion and a concatenation when packing.
        values = values.to(torch.float64)
    neg_inf = _kernel.constant(_NEG_INF, values.dtype, device)
    nan = _kernel.constant(float("nan"), values.dtype, device)
    if equal:
        matrix, pos = values.view(segments, width), positive.view(segments, width)
        # The negatives' scores, NaN elsewhere (NaN equals nothing): the boundary count.
        counted = torch.where(pos, nan, matrix)
        num_items: Tensor | int = width
    else:
        seg = torch.repeat_interleave(torch.arange(segments, device=device), counts)
        rank = torch.arange(values.numel(), device=device) - (counts.cumsum(0) - counts)[seg]
        matrix = torch.full((segments, width), _NEG_INF, dtype=values.dtype, device=device)
        matrix[seg, rank] = values
        pos = torch.zeros((segments, width), dtype=torch.bool, device=device)
        pos[seg, rank] = positive
        counted = torch.full((segments, width), float("nan"), dtype=values.dtype, device=device)
        counted[seg, rank] = torch.where(positive, nan, values)
        num_items = counts.unsqueeze(1)
    negatives = torch.where(pos, neg_inf, matrix)
    best = torch.where(pos, matrix, neg_inf).amax(dim=1, keepdim=True)
    num_pos = pos.sum(dim=1, keepdim=True)
    tied = (pos & (matrix == best)).sum(dim=1, keepdim=True)
    top = negatives.topk(min(max_k, width), dim=1).values
    if top.shape[1] < max_k:
        top = torch.cat([top, top.new_full((segments, max_k - top.shape[1]), _NEG_INF)], dim=1)
    kept = (num_items - num_pos).clamp_(max=max_k)
    # The smallest kept negative (top[0] = -inf when none is kept, and then no
    # negative is counted: the segment gets boundary 0), as a column.
    boundary_value = top.gather(1, (kept - 1).clamp_(min=0))
    boundary = _count_equal(counted, boundary_value, keepdim=True)
    counts_and_id = [ids.unsqueeze(1), tied, kept, boundary]
    if values.dtype == torch.float64:
        return torch.cat([*counts_and_id, best.view(torch.int64), top.view(torch.int64)], dim=1)
    # best and top in float64 through one conversion
    scores = torch.cat([best, top], dim=1).to(torch.float64).view(torch.int64)
    return torch.cat([*counts_and_id, scores], dim=1)


def _summarise_sorted(
    ids: Tensor, counts: Tensor, values: Tensor, positive: Tensor, max_k: int
) -> Partials:
    """:func:`summarise` of grouped items through :func:`_sorted_segment_top`."""
    segments = ids.numel()
    # Positives are few: work on their positions only. Negatives keep their scores,
    # positives become -inf (they never count among the negatives).
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
    top, equal = _sorted_segment_top(counts, negatives, max_k, kept)
    assert equal is not None
    # ``equal`` counted the positives too when the boundary value is -inf.
    boundary_value = _gather_column(top, kept - 1)
    boundary = equal - torch.where(boundary_value == _NEG_INF, num_pos, 0)
    boundary = torch.where(kept > 0, boundary, 0)
    return Partials(ids, best.to(torch.float64), tied, top.to(torch.float64), kept, boundary)


def merge(
    parts: Partials,
    max_k: int,
    complete_queries: bool = False,
    *,
    path: SegmentPath = "auto",
) -> Partials:
    """Merge rows that share a query id into one row per id (ids ascending), exactly.

    With ``complete_queries`` every row already summarises a whole query, so rows that
    share an id are repeats of one query (DistributedSampler padding): the first is kept.
    """
    rows = parts.ids.numel()
    if rows == 0:
        return parts
    if complete_queries:
        return Partials(*(field[_kernel.first_of_each_id(parts.ids)] for field in parts))
    if not _is_sorted(parts.ids):
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
    top, _ = segment_top(counts * max_k, values, max_k, path=path)
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


# ------------------------------------------------------------------- packed state rows


def pack(parts: Partials) -> Tensor:
    """Partials as int64 ``[n, 5 + max_k]``: id, tied, kept, boundary, then the float64
    bit patterns of ``best`` and ``top``."""
    ints = torch.stack([parts.ids, parts.tied, parts.kept, parts.boundary], dim=1)
    scores = torch.cat([parts.best.unsqueeze(1), parts.top], dim=1)
    if scores.dtype != torch.float64:
        scores = scores.to(torch.float64)
    return torch.cat([ints, scores.view(torch.int64)], dim=1)


def unpack(rows: Tensor) -> Partials:
    """Inverse of :func:`pack`."""
    scores = rows[:, _BEST:].view(torch.float64)
    return Partials(
        rows[:, _ID],
        scores[:, 0],
        rows[:, _TIED],
        scores[:, 1:],
        rows[:, _KEPT],
        rows[:, _BOUNDARY],
    )


def _as_rows(state: Tensor | Sequence[Tensor], max_k: int) -> Tensor | None:
    """The state (a list of blocks, or one tensor after a sync) as one block, or None."""
    blocks = [state] if isinstance(state, Tensor) else list(state)
    # A process without flat data contributes an empty placeholder of any shape.
    blocks = [block for block in blocks if block.numel()]
    if not blocks:
        return None
    rows = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return rows.reshape(-1, ROW_PREFIX + max_k)


def _merged(
    state: Tensor | Sequence[Tensor], max_k: int, complete_queries: bool, path: SegmentPath
) -> Partials | None:
    """The state (blocks, or one tensor after a sync) merged into one row per query id,
    or ``None`` when it is empty."""
    rows = _as_rows(state, max_k)
    if rows is None:
        return None
    return merge(unpack(rows), max_k, complete_queries, path=path)


def compact(
    state: list[Tensor],
    max_k: int,
    complete_queries: bool = False,
    *,
    path: SegmentPath = "auto",
    slack: int | None = None,
    rows: int | None = None,
) -> list[Tensor]:
    """Merge the state blocks into one once they hold too many rows.

    Merging happens when the blocks hold more than twice the rows of the first block
    (the result of the last merge) plus a small slack, so the state stays within about
    twice the number of distinct queries and the merges cost O(1) amortised per row.
    ``rows``: the blocks' row count, when the caller keeps it; ``slack``: the rows that
    may wait (default :func:`compact_slack`).
    """
    if len(state) < 2:
        return state
    if slack is None:
        slack = compact_slack(max_k)
    total = sum(block.shape[0] for block in state) if rows is None else rows
    if total <= 2 * state[0].shape[0] + slack:
        return state
    joined = _as_rows(state, max_k)
    if joined is None:
        return []
    return [pack(merge(unpack(joined), max_k, complete_queries, path=path))]


def flat_rank_histogram(
    state: Tensor | Sequence[Tensor],
    ties: str,
    max_k: int,
    complete_queries: bool = False,
    *,
    path: SegmentPath = "auto",
) -> tuple[Tensor, Tensor] | None:
    """The flat state's contribution to the rank histogram, as ``rank_histogram`` gives.

    Returns:
        ``(hist, queries)`` or ``None`` when the state is empty.
    """
    parts = _merged(state, max_k, complete_queries, path)
    if parts is None:
        return None
    return _kernel.rank_histogram(tie_counts(parts, max_k), ties, max_k)


def flat_outcomes(
    state: Tensor | Sequence[Tensor],
    ties: str,
    max_k: int,
    complete_queries: bool = False,
    *,
    path: SegmentPath = "auto",
) -> tuple[Tensor, Tensor] | None:
    """Each flat query's id (ascending) and outcome record
    (:func:`recall_at_k._kernel.query_outcomes`), or ``None`` when the state is empty."""
    parts = _merged(state, max_k, complete_queries, path)
    if parts is None:
        return None
    return parts.ids, _kernel.query_outcomes(tie_counts(parts, max_k), ties, max_k)
