"""The maths of Recall@K: per-query tie counts, tie policies and rank histograms.

Everything here is vectorised torch that never reads a tensor value on the host, so it
runs unchanged on CPU, CUDA and the ``meta`` device. Nothing in this module imports
anything else of the package.

Notation (DESIGN section 1), per query: ``s*`` is the best score among the valid
positives, ``g_>`` the number of valid negatives scored above ``s*``, ``e`` the number of
valid negatives scored exactly ``s*`` and ``p`` the number of valid positives scored
exactly ``s*`` (at least one when the query has a valid positive).

Comparisons write into floating point buffers rather than ``bool`` tensors: on CPU the
``bool``-output kernels of torch are several times slower than the float ones, and a sum
over 0/1 floats is exact while the row holds fewer than 2**24 (float32) items. Selects
write into reused buffers (:class:`Workspace`): a fresh multi-megabyte temporary costs
a page fault per 4 KiB on CPU. On CPU a ``[Q, G]`` mask target without ignore avoids
``torch.where`` altogether (:func:`_mask_target_counts_by_blocks`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

TIES = ("pessimistic", "optimistic", "expected")
EMPTY_TARGET_ACTIONS = ("neg", "pos", "skip", "error")

_FLOAT32_EXACT_COUNT = 2**24


class TieCounts(NamedTuple):
    """Per-query counts that decide Recall@K exactly under every tie policy.

    ``greater`` is g_>, ``equal`` is e, ``tied_positives`` is p and ``has_positive`` tells
    whether the query has any valid positive (when it has none the counts are meaningless).
    Any of the first three may be ``None`` when the policy at hand does not need it.
    ``nan_rows`` (bool ``[Q]``) is set only by a path whose own passes reveal which rows
    hold a NaN score (see :func:`reveals_nan`); the counts of such rows are meaningless.
    """

    greater: Tensor | None
    equal: Tensor | None
    tied_positives: Tensor | None
    has_positive: Tensor
    nan_rows: Tensor | None = None


class Workspace:
    """Scratch buffers that the dense kernel reuses from one batch to the next.

    Not metric state: a metric keeps one so that its updates do not allocate fresh
    ``[Q, G]`` temporaries every batch (on CPU a fresh multi-megabyte allocation costs a
    page fault per 4 KiB, several times the arithmetic itself). Each slot grows to the
    largest batch seen; :meth:`clear` frees them.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}

    def get(self, slot: int, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialised tensor of ``shape`` from ``slot`` (grown when too small)."""
        numel = shape.numel()
        key = (slot, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)

    def clear(self) -> None:
        self._buffers.clear()


def _scratch(
    workspace: Workspace | None, slot: int, like: Tensor, dtype: torch.dtype | None = None
) -> Tensor:
    dtype = like.dtype if dtype is None else dtype
    if workspace is None:
        return torch.empty(like.shape, dtype=dtype, device=like.device)
    return workspace.get(slot, like.shape, dtype, like.device)


_COUNT_SLOT, _NEGATIVES_SLOT, _POSITIVES_SLOT, _SIGNS_SLOT = 0, 1, 2, 3

# The CPU mask path works on blocks of rows of about this many bytes of scores, so that
# each block and its one scratch block stay in the core's L2 cache between the passes.
_CPU_BLOCK_BYTES = 512 * 2**10


def _constant(value: float, like: Tensor) -> Tensor:
    return torch.full((), value, dtype=like.dtype, device=like.device)


def _count_dtype(scores: Tensor) -> torch.dtype:
    """Float dtype in which 0/1 comparison results of a row are summed exactly."""
    if scores.shape[-1] < _FLOAT32_EXACT_COUNT:
        return torch.float32
    return torch.float64


def reveals_nan(scores: Tensor, target: Tensor, ignore: Tensor | None) -> bool:
    """Whether :func:`dense_tie_counts` will report NaN rows in ``nan_rows`` itself.

    The CPU mask path takes the maximum over every item of each row (NaN propagates
    through it), so a separate NaN check of the scores would read them once more.
    """
    return _takes_block_path(scores, target, ignore) and scores.shape[-1] > 0


def _takes_block_path(scores: Tensor, target: Tensor, ignore: Tensor | None) -> bool:
    return target.dim() == 2 and ignore is None and scores.device.type in ("cpu", "meta")


def _count(
    op: str, values: Tensor, threshold: Tensor, dtype: torch.dtype, workspace: Workspace | None
) -> Tensor:
    """Row-wise count of ``values >= threshold`` (``"ge"``) or ``values > threshold``."""
    out = _scratch(workspace, _COUNT_SLOT, values, dtype)
    if op == "ge":
        torch.ge(values, threshold, out=out)
    else:
        torch.gt(values, threshold, out=out)
    return out.sum(dim=-1).to(torch.int64)


def dense_tie_counts(
    scores: Tensor,
    target: Tensor,
    ignore: Tensor | None,
    need: tuple[bool, bool, bool],
    workspace: Workspace | None = None,
) -> TieCounts:
    """Per-query g_>, e and p from a dense ``[Q, G]`` score matrix.

    Args:
        scores: float ``[Q, G]``, no NaN.
        target: bool/0-1 integer ``[Q, G]`` relevance mask, or integer ``[Q]`` column of
            the single true item (``-1``: none in this gallery).
        ignore: optional bool ``[Q, G]``; ignored items are neither positive nor negative.
        need: which of (``greater``, ``greater + equal``, ``tied_positives``) to compute.
            The second slot is returned in the ``equal`` field as ``g_> + e`` (the number
            of valid negatives at or above ``s*``), which is what the pessimistic policy
            uses; :func:`split_equal` turns it into ``e``.

    Returns:
        :class:`TieCounts` (int64 ``[Q]`` tensors and a bool ``has_positive``).
    """
    scores = scores.detach()
    num_queries, gallery = scores.shape
    device = scores.device
    want_gt, want_ge, want_p = need
    if gallery == 0:
        zeros = torch.zeros(num_queries, dtype=torch.int64, device=device)
        none = torch.zeros(num_queries, dtype=torch.bool, device=device)
        return TieCounts(zeros, zeros, zeros, none)
    count_dtype = _count_dtype(scores)

    if target.dim() == 1:
        return _index_target_counts(scores, target, ignore, need, count_dtype, workspace)
    if _takes_block_path(scores, target, ignore):
        return _mask_target_counts_by_blocks(scores, target, need, count_dtype, workspace)

    # Two selects over the batch: positives_only keeps the valid positives' scores (-inf
    # elsewhere) for s*; negatives_only keeps the valid negatives' scores and puts NaN
    # elsewhere, which compares false with everything, so no count needs a correction.
    relevant = target if target.dtype == torch.bool else target != 0
    valid_pos = relevant if ignore is None else relevant & ~ignore
    not_negative = relevant if ignore is None else relevant | ignore
    positives_only = torch.where(
        valid_pos,
        scores,
        _constant(float("-inf"), scores),
        out=_scratch(workspace, _POSITIVES_SLOT, scores),
    )
    best = positives_only.amax(dim=-1, keepdim=True)
    negatives_only = torch.where(
        not_negative,
        _constant(float("nan"), scores),
        scores,
        out=_scratch(workspace, _NEGATIVES_SLOT, scores),
    )
    greater = at_or_above = None
    if want_gt:
        greater = _count("gt", negatives_only, best, count_dtype, workspace)
    if want_ge:
        at_or_above = _count("ge", negatives_only, best, count_dtype, workspace)
    has_pos = _any_per_row(valid_pos)

    tied = None
    if want_p:
        # Positives at or above s* are exactly the ones tied at s*. When s* = -inf every
        # entry of positives_only is >= s*, but then every valid positive is tied.
        tied = _count("ge", positives_only, best, count_dtype, workspace)
        num_pos = valid_pos.sum(dim=-1)
        tied = torch.where(best.squeeze(-1) == float("-inf"), num_pos, tied)
    return TieCounts(greater, at_or_above, tied, has_pos)


def _mask_target_counts_by_blocks(
    scores: Tensor,
    target: Tensor,
    need: tuple[bool, bool, bool],
    count_dtype: torch.dtype,
    workspace: Workspace | None,
) -> TieCounts:
    """:func:`dense_tie_counts` for a ``[Q, G]`` mask target without ignore, on CPU.

    ``torch.where`` with a ``bool`` condition is not vectorised on CPU (several times the
    cost of a float comparison), so the mask enters the float domain through byte
    arithmetic and one int8-to-float conversion instead: ``signs`` is +1 for a negative
    and -1 for a positive, ``signs * -inf`` is -inf / +inf, and clamping the scores to
    that from above keeps the positives' scores (-inf elsewhere) exactly, infinities
    included. Then:

    - s* = the row maximum of that; ``greater`` = #(scores > s*) (no positive is above
      s*); ``p`` = #(kept >= s*), the positives tied at s*; ``g_> + e`` = #(scores >= s*)
      minus p;
    - when s* = -inf (every valid positive scored -inf, or none) the kept row is all
      -inf, so p and g_> + e come from the number of positives, the sum of ``signs``.

    Rows go in blocks that stay in the core's cache between these passes
    (``_CPU_BLOCK_BYTES``), with one scratch block that each pass overwrites in turn.
    """
    num_queries, gallery = scores.shape
    device = scores.device
    want_gt, want_ge, want_p = need
    relevant = target if target.dtype == torch.bool else target != 0
    # 1 + 254 * mask wraps to 255 (int8 -1) for a positive and is 1 for a negative.
    signs_u8 = _scratch(workspace, _SIGNS_SLOT, relevant, torch.uint8)
    one = torch.ones((), dtype=torch.uint8, device=device)
    torch.add(one, relevant.view(torch.uint8), alpha=254, out=signs_u8)
    rows = max(1, _CPU_BLOCK_BYTES // (gallery * scores.element_size()))
    rows = min(rows, num_queries)
    kept_buffer = _scratch(workspace, _POSITIVES_SLOT, scores[:rows])
    best = torch.empty((num_queries, 1), dtype=scores.dtype, device=device)
    sign_sum = torch.empty(num_queries, dtype=count_dtype, device=device)
    greater_f = torch.empty(num_queries, dtype=count_dtype, device=device)
    at_or_above_f = torch.empty(num_queries, dtype=count_dtype, device=device)
    kept_f = torch.empty(num_queries, dtype=count_dtype, device=device)
    blocks = zip(
        torch.split(scores, rows),
        torch.split(signs_u8.view(torch.int8), rows),
        torch.split(best, rows),
        torch.split(sign_sum, rows),
        torch.split(at_or_above_f, rows),
        torch.split(kept_f, rows),
        torch.split(greater_f, rows),
        strict=True,
    )
    for block, signs, row_best, row_signs, row_ge, row_kept, row_gt in blocks:
        n = block.shape[0]
        kept = kept_buffer if n == rows else kept_buffer[:n]
        kept.copy_(signs)
        torch.sum(kept, dim=-1, dtype=count_dtype, out=row_signs)
        kept.mul_(float("-inf"))
        torch.clamp(block, max=kept, out=kept)  # min(score, +-inf); NaN-free
        torch.amax(kept, dim=-1, keepdim=True, out=row_best)
        # The comparisons reuse the one scratch block: the kept scores go first.
        if want_ge or want_p:
            kept.ge_(row_best)
            torch.sum(kept, dim=-1, dtype=count_dtype, out=row_kept)
        if want_ge:
            torch.ge(block, row_best, out=kept)
            torch.sum(kept, dim=-1, dtype=count_dtype, out=row_ge)
        if want_gt:
            torch.gt(block, row_best, out=kept)
            torch.sum(kept, dim=-1, dtype=count_dtype, out=row_gt)
    num_pos = ((gallery - sign_sum) * 0.5).to(torch.int64)
    all_minus_inf = best.squeeze(-1) == float("-inf")
    tied = None
    if want_ge or want_p:
        tied = torch.where(all_minus_inf, num_pos, kept_f.to(torch.int64))
    greater = greater_f.to(torch.int64) if want_gt else None
    at_or_above = None
    if want_ge:
        assert tied is not None
        at_or_above = torch.where(
            all_minus_inf, gallery - num_pos, at_or_above_f.to(torch.int64) - tied
        )
    # The clamp keeps a NaN score and the row maximum propagates it: s* is NaN exactly
    # when the row holds a NaN.
    nan_rows = torch.isnan(best.squeeze(-1))
    return TieCounts(greater, at_or_above, tied if want_p else None, num_pos > 0, nan_rows)


def _any_per_row(mask: Tensor) -> Tensor:
    """``mask.any(dim=-1)``, through a byte view where possible (faster on CPU)."""
    if mask.is_contiguous():
        return mask.view(torch.uint8).amax(dim=-1) > 0
    return mask.any(dim=-1)


def _index_target_counts(
    scores: Tensor,
    target: Tensor,
    ignore: Tensor | None,
    need: tuple[bool, bool, bool],
    count_dtype: torch.dtype,
    workspace: Workspace | None,
) -> TieCounts:
    """:func:`dense_tie_counts` for a ``[Q]`` column-index target (one positive a row)."""
    want_gt, want_ge, want_p = need
    column = target.clamp(min=0).unsqueeze(-1)
    best = scores.gather(-1, column)
    has_pos = target >= 0
    values = scores
    if ignore is not None:
        has_pos = has_pos & ~ignore.gather(-1, column).squeeze(-1)
        values = torch.where(
            ignore,
            _constant(float("nan"), scores),
            scores,
            out=_scratch(workspace, _NEGATIVES_SLOT, scores),
        )
    greater = _count("gt", values, best, count_dtype, workspace) if want_gt else None
    at_or_above = None
    if want_ge:
        # The positive itself is >= s*; subtract it (an ignored positive: no positive).
        at_or_above = _count("ge", values, best, count_dtype, workspace) - 1
    tied = torch.ones_like(target, dtype=torch.int64) if want_p else None
    return TieCounts(greater, at_or_above, tied, has_pos)


def needs_for(ties: str) -> tuple[bool, bool, bool]:
    """Which counts :func:`dense_tie_counts` must produce for a tie policy."""
    if ties == "pessimistic":
        return (False, True, False)
    if ties == "optimistic":
        return (True, False, False)
    return (True, True, True)


def split_equal(counts: TieCounts) -> TieCounts:
    """Turn the ``equal`` field from ``g_> + e`` (as computed) into ``e``."""
    assert counts.greater is not None and counts.equal is not None
    return counts._replace(equal=counts.equal - counts.greater)


def first_hit_rank(counts: TieCounts, ties: str) -> Tensor:
    """1-based first-hit rank under a deterministic policy; 0 for no valid positive."""
    ahead = counts.equal if ties == "pessimistic" else counts.greater
    assert ahead is not None
    return torch.where(counts.has_positive, ahead + 1, 0)


def expected_hit_probability(
    greater: Tensor, equal: Tensor, tied_positives: Tensor, max_k: int
) -> Tensor:
    """P(hit@K) for K = 1..max_k under a uniformly random order of the tied items.

    DESIGN section 1: with m = K - g_>, the probability is 0 if m <= 0, 1 if m > e, and
    otherwise 1 - C(e, m) / C(e + p, m). The ratio is the product over i < m of
    (e - i) / (e + p - i), summed in log space with ``log1p`` so that galleries of
    millions of tied items neither overflow nor lose precision.

    Returns:
        float64 ``[Q, max_k]``; column ``j`` holds P(hit@(j + 1)).
    """
    device = greater.device
    e = equal.to(torch.float64).unsqueeze(-1)
    p = tied_positives.to(torch.float64).unsqueeze(-1)
    steps = torch.arange(max_k, dtype=torch.float64, device=device)
    # log((e - i) / (e + p - i)) = log1p(-p / (e + p - i)); only i < e is ever used.
    terms = torch.log1p(-p / (e + p - steps).clamp(min=1.0))
    log_ratio = terms.cumsum(dim=-1)
    m = (steps + 1) - greater.to(torch.float64).unsqueeze(-1)
    index = (m - 1).clamp(min=0, max=max_k - 1).to(torch.int64)
    miss_all_tied = torch.exp(log_ratio.gather(-1, index))
    prob = torch.where(m > e, 1.0, 1.0 - miss_all_tied)
    return torch.where(m <= 0, 0.0, prob)


def query_outcomes(counts: TieCounts, ties: str, max_k: int) -> Tensor:
    """What each query contributes to the rank histogram, one record a query.

    Returns:
        For ``"pessimistic"`` / ``"optimistic"``: int64 ``[Q]`` bins, ``r - 1`` for a
        first hit at rank ``r <= max_k``, ``max_k`` for a later hit and ``max_k + 1`` for
        a query without a valid positive. For ``"expected"``: float64 ``[Q, max_k + 1]``,
        the probabilities of a first hit at ranks 1..max_k, then 1.0 for a query without
        a valid positive (whose probabilities are 0).
    """
    has_pos = counts.has_positive
    if ties == "expected":
        counts = split_equal(counts)
        assert counts.greater is not None and counts.equal is not None
        assert counts.tied_positives is not None
        cdf = expected_hit_probability(counts.greater, counts.equal, counts.tied_positives, max_k)
        pmf = torch.diff(cdf, dim=-1, prepend=torch.zeros_like(cdf[..., :1]))
        pmf = torch.where(has_pos.unsqueeze(-1), pmf, 0.0)
        return torch.cat([pmf, (~has_pos).to(pmf.dtype).unsqueeze(-1)], dim=-1)
    rank = first_hit_rank(counts, ties)
    return torch.where(has_pos, (rank - 1).clamp(max=max_k), max_k + 1)


def histogram_of(outcomes: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
    """Sum :func:`query_outcomes` records into the metric state.

    Returns:
        ``hist``: ``[max_k]``, entry ``r - 1`` is the number (int64) or, for
        ``"expected"``, the expected number (float64) of queries whose first hit is at
        rank ``r``; queries ranked later, or without a positive, are not in it.
        ``queries``: int64 ``[2]``: (queries with a valid positive, queries without).
    """
    if outcomes.is_floating_point():
        hist = outcomes[:, :max_k].sum(dim=0)
        without = outcomes[:, max_k].sum().to(torch.int64)
        return hist, torch.stack([outcomes.shape[0] - without, without])
    bins = torch.zeros(max_k + 2, dtype=torch.int64, device=outcomes.device)
    bins.scatter_add_(0, outcomes, torch.ones_like(outcomes))
    return bins[:max_k], torch.stack([bins[: max_k + 1].sum(), bins[max_k + 1]])


def rank_histogram(counts: TieCounts, ties: str, max_k: int) -> tuple[Tensor, Tensor]:
    """A batch's contribution to the metric state (see :func:`histogram_of`)."""
    return histogram_of(query_outcomes(counts, ties, max_k), max_k)


def first_of_each_id(ids: Tensor) -> Tensor:
    """Positions of the first occurrence of every distinct id, in order of the ids."""
    order = torch.sort(ids, stable=True).indices
    sorted_ids = ids[order]
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    return order[first]


def recall_from_histogram(
    hist: Tensor, queries: Tensor, ks: tuple[int, ...], empty_target_action: str
) -> tuple[Tensor, int, int]:
    """Recall@K for each K from a rank histogram and the query counts.

    Returns:
        float64 ``[len(ks)]`` recalls (NaN when no query is counted), the number of
        counted queries and the number of queries without a valid positive. Callers
        decide how to warn or raise; this function reads two integers on the host.
    """
    cumulative = hist.cumsum(dim=0).to(torch.float64)
    index = torch.tensor([k - 1 for k in ks], device=hist.device)
    hits = cumulative.gather(0, index)
    with_pos, without_pos = (int(v) for v in queries.tolist())
    if empty_target_action == "pos":
        hits = hits + without_pos
    counted = with_pos if empty_target_action in ("skip", "error") else with_pos + without_pos
    if counted == 0:
        return torch.full_like(hits, float("nan")), 0, without_pos
    return hits / counted, counted, without_pos
