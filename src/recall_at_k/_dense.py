"""The dense form: checks of ``[Q, G]`` scores and their per-query tie counts, by exact and
equal paths: a ``[Q]`` index target gathers s*, then compares; a ``[Q, G]`` mask without
``ignore`` uses bool comparisons in a small batch (:func:`_mask_counts_small`) and
cache-sized blocks of byte arithmetic on CPU (:func:`_mask_counts_in_blocks`); otherwise
two selects of the positives' and negatives' scores."""

from __future__ import annotations

import torch
from torch import Tensor

from recall_at_k._checks import (
    SIGNED_INTEGER_DTYPES,
    check_binary,
    check_no_nan,
    check_same_device,
    check_tensors,
    describe,
)
from recall_at_k._kernel import (
    NeededCounts,
    TieCounts,
    Workspace,
    constant,
    count_dtype,
    no_positive_counts,
    scratch,
)
from recall_at_k.ranking.budget import DENSE_BLOCK_BYTES, DENSE_FEW_TARGETS, DENSE_SMALL_BATCH


def check_structure(scores: Tensor, target: Tensor, ignore: Tensor | None) -> None:
    """Types, shapes, dtypes and devices of ``(scores, target, ignore)`` (no value read)."""
    if not (
        isinstance(scores, Tensor)
        and isinstance(target, Tensor)
        and (ignore is None or isinstance(ignore, Tensor))
    ):
        check_tensors(scores=scores, target=target, ignore=ignore)
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(
            f"`scores` must be a floating point tensor of shape [Q, G], got {describe(scores)}"
        )
    num_queries, gallery = scores.shape
    if target.dim() == 1:
        if target.shape[0] != num_queries or target.dtype not in SIGNED_INTEGER_DTYPES:
            raise ValueError(
                "`target` of one dimension must be a signed integer (int64) tensor of shape"
                f" [Q] = [{num_queries}] holding each query's true column (-1 for none),"
                f" got {describe(target)}"
            )
    elif target.dim() == 2:
        if tuple(target.shape) != (num_queries, gallery) or target.is_complex():
            raise ValueError(
                "`target` of two dimensions must be a bool, 0/1 integer or 0./1. float"
                f" tensor of the same shape as `scores` [{num_queries}, {gallery}],"
                f" got {describe(target)}"
            )
    else:
        raise ValueError(
            "`target` must be a [Q, G] bool/0-1 mask or a [Q] int64 column index,"
            f" got {describe(target)}"
        )
    if ignore is not None and (
        ignore.dtype != torch.bool or tuple(ignore.shape) != (num_queries, gallery)
    ):
        raise ValueError(
            "`ignore` must be a bool tensor of the same shape as `scores`"
            f" [{num_queries}, {gallery}], got {describe(ignore)}"
        )
    device = scores.device
    if target.device != device or (ignore is not None and ignore.device != device):
        check_same_device(scores=scores, target=target, ignore=ignore)


def check_query_ids(query_ids: Tensor, scores: Tensor) -> None:
    """``query_ids``: an integer ``[Q]`` tensor on the scores' device."""
    check_tensors(query_ids=query_ids)
    num_queries = scores.shape[0]
    if tuple(query_ids.shape) != (num_queries,) or query_ids.dtype not in SIGNED_INTEGER_DTYPES:
        raise ValueError(
            f"`query_ids` must be an integer (int64) tensor of shape [Q] = [{num_queries}],"
            f" one id per row of `scores`, got {describe(query_ids)}"
        )
    check_same_device(preds=scores, query_ids=query_ids)


def check_values(scores: Tensor, target: Tensor) -> None:
    """Target values (index range, 0/1 mask); reads values on the host."""
    if target.dim() == 1 and target.numel():
        gallery = scores.shape[1]
        if target.numel() <= DENSE_FEW_TARGETS:
            values = target.tolist()  # one host read of a few values
            low, high = min(values), max(values)
        else:
            extremes = torch.aminmax(target)
            low, high = int(extremes.min), int(extremes.max)
        if low < -1 or high >= gallery:
            raise ValueError(
                f"`target` column indices must lie in [-1, {gallery}) (the gallery has"
                f" {gallery} items; -1 = no true item), got values in [{low}, {high}]"
            )
    elif target.dim() == 2:
        check_binary(target, "`target` mask values")


def tie_counts(
    scores: Tensor,
    target: Tensor,
    ignore: Tensor | None,
    needed: NeededCounts,
    validate_args: bool,
    workspace: Workspace | None = None,
    block_bytes: int = DENSE_BLOCK_BYTES,
    small_batch: int = DENSE_SMALL_BATCH,
) -> TieCounts:
    """Checks, then :func:`dense_tie_counts`, then the NaN check (``validate_args``)."""
    check_structure(scores, target, ignore)
    if validate_args:
        check_values(scores, target)
    counts = dense_tie_counts(scores, target, ignore, needed, workspace, block_bytes, small_batch)
    if validate_args:
        check_no_nan(scores, nan_rows=counts.nan_rows)
    return counts


def dense_tie_counts(
    scores: Tensor,
    target: Tensor,
    ignore: Tensor | None,
    needed: NeededCounts,
    workspace: Workspace | None = None,
    block_bytes: int = DENSE_BLOCK_BYTES,
    small_batch: int = DENSE_SMALL_BATCH,
) -> TieCounts:
    """Per-query g_>, g_> + e and p of float ``[Q, G]`` scores, a ``[Q, G]`` 0/1 mask or
    integer ``[Q]`` column ``target`` (-1: none) and an optional bool ``[Q, G]`` ``ignore``
    (items neither positive nor negative); ``workspace``: scratch buffers to reuse."""
    scores = scores.detach()
    num_queries, gallery = scores.shape
    if gallery == 0 or num_queries == 0:
        return no_positive_counts(num_queries, scores.device)
    if target.dim() == 1:
        small = scores.numel() <= small_batch
        return _index_counts(scores, target.long(), ignore, needed, workspace, small, block_bytes)
    if ignore is None and scores.numel() <= small_batch:
        return _mask_counts_small(scores, target, needed)
    if ignore is None and scores.device.type in ("cpu", "meta"):
        return _mask_counts_in_blocks(scores, target, needed, workspace, block_bytes)
    return _mask_counts_by_selects(scores, target, ignore, needed, workspace, block_bytes)


def _constant(value: float, like: Tensor) -> Tensor:
    return constant(value, like.dtype, like.device)


def block_rows(num_queries: int, gallery: int, element_size: int, block_bytes: int) -> int:
    """Rows a block on the CPU paths: about ``block_bytes`` of scores per torch thread
    (each thread's share of an operation stays in its core's cache), at least one."""
    per_row = max(1, gallery * element_size)
    return min(max(1, block_bytes * torch.get_num_threads() // per_row), num_queries)


def _counts(
    values: Tensor,
    threshold: Tensor,
    ops: tuple[str, ...],
    workspace: Workspace | None,
    small: bool,
    block_bytes: int = DENSE_BLOCK_BYTES,
) -> list[Tensor]:
    """Row-wise counts of ``values >= threshold`` (``"ge"``) or ``>`` (``"gt"``), one per op: bool
    comparisons when ``small``, else a float buffer, on CPU in cache-sized blocks of rows."""
    if small:
        return [(values >= threshold if op == "ge" else values > threshold).sum(-1) for op in ops]
    num_queries, gallery = values.shape
    sum_dtype = count_dtype(gallery)
    rows = num_queries
    if values.device.type == "cpu":
        rows = block_rows(num_queries, gallery, values.element_size(), block_bytes)
    buffer = scratch(workspace, "count", (rows, gallery), sum_dtype, values.device)
    out = torch.empty((len(ops), num_queries), dtype=sum_dtype, device=values.device)
    for start in range(0, num_queries, rows):
        stop = min(start + rows, num_queries)
        block, row_threshold = values[start:stop], threshold[start:stop]
        above = buffer[: stop - start]
        for i, op in enumerate(ops):
            compare = torch.ge if op == "ge" else torch.gt
            compare(block, row_threshold, out=above)
            torch.sum(above, dim=-1, out=out[i, start:stop])
    return list(out.to(torch.int64).unbind(0))


def _index_counts(
    scores: Tensor,
    target: Tensor,
    ignore: Tensor | None,
    needed: NeededCounts,
    workspace: Workspace | None,
    small: bool,
    block_bytes: int = DENSE_BLOCK_BYTES,
) -> TieCounts:
    """Counts for an int64 ``[Q]`` column-index target (one positive a row)."""
    column = target.clamp(min=0).unsqueeze(-1)
    best = scores.gather(-1, column)
    has_pos = target >= 0
    values = scores
    if ignore is not None:
        has_pos = has_pos & ~ignore.gather(-1, column).squeeze(-1)
        # NaN compares false with everything: ignored items count nowhere.
        out = scratch(workspace, "negatives", tuple(scores.shape), scores.dtype, scores.device)
        values = torch.where(ignore, _constant(float("nan"), scores), scores, out=out)
    ops = ("gt",) * needed.greater + ("ge",) * needed.at_or_above
    found = _counts(values, best, ops, workspace, small, block_bytes)
    greater = found[0] if needed.greater else None
    # The positive itself is >= s*; subtract it (an ignored positive: none).
    at_or_above = found[-1] - 1 if needed.at_or_above else None
    tied = torch.ones_like(target) if needed.tied_positives else None
    return TieCounts(greater, at_or_above, tied, has_pos)


def _mask_counts_by_selects(
    scores: Tensor,
    target: Tensor,
    ignore: Tensor | None,
    needed: NeededCounts,
    workspace: Workspace | None,
    block_bytes: int,
) -> TieCounts:
    """Counts for a ``[Q, G]`` mask through two selects: the valid positives' scores
    (-inf elsewhere) give s*; the valid negatives' scores (NaN elsewhere, which compares
    false with everything) the counts, without a correction."""
    shape = tuple(scores.shape)
    relevant = target if target.dtype == torch.bool else target != 0
    valid_pos = relevant if ignore is None else relevant & ~ignore
    not_negative = relevant if ignore is None else relevant | ignore
    out = scratch(workspace, "positives", shape, scores.dtype, scores.device)
    positives_only = torch.where(valid_pos, scores, _constant(float("-inf"), scores), out=out)
    best = positives_only.amax(dim=-1, keepdim=True)
    out = scratch(workspace, "negatives", shape, scores.dtype, scores.device)
    negatives_only = torch.where(not_negative, _constant(float("nan"), scores), scores, out=out)
    ops = ("gt",) * needed.greater + ("ge",) * needed.at_or_above
    found = _counts(negatives_only, best, ops, workspace, False, block_bytes)
    greater = found[0] if needed.greater else None
    at_or_above = found[-1] if needed.at_or_above else None
    tied = None
    if needed.tied_positives:
        # Positives at or above s* are exactly those tied at s* (all of them when s* = -inf).
        (tied,) = _counts(positives_only, best, ("ge",), workspace, False, block_bytes)
        tied = torch.where(best.squeeze(-1) == float("-inf"), valid_pos.sum(dim=-1), tied)
    return TieCounts(greater, at_or_above, tied, _any_per_row(valid_pos))


def _mask_counts_small(scores: Tensor, target: Tensor, needed: NeededCounts) -> TieCounts:
    """Counts for a small ``[Q, G]`` mask without ignore: with ``at`` the items at or above s*,
    ``at > relevant`` are the negatives among them and ``at & relevant`` the positives tied
    at s* (all items when s* = -inf)."""
    relevant = target if target.dtype == torch.bool else target != 0
    best = torch.where(relevant, scores, _constant(float("-inf"), scores)).amax(-1, keepdim=True)
    greater = (scores > best).sum(dim=-1) if needed.greater else None
    at_or_above = tied = None
    if needed.at_or_above or needed.tied_positives:
        at = scores >= best
        at_or_above = (at > relevant).sum(dim=-1) if needed.at_or_above else None
        tied = (at & relevant).sum(dim=-1) if needed.tied_positives else None
    return TieCounts(greater, at_or_above, tied, relevant.any(dim=-1))


def _any_per_row(mask: Tensor) -> Tensor:
    """``mask.any(dim=-1)``, through a byte view where possible (faster on CPU)."""
    if mask.is_contiguous():
        return mask.view(torch.uint8).amax(dim=-1) > 0
    return mask.any(dim=-1)


WORDS_PER_LANE_SUM = 127  # int64 words of 0/1 bytes summed without a carry out of a byte


def _positives_per_row(mask: Tensor) -> Tensor | None:
    """Per-row int64 number of true values of a bool ``[Q, G]`` mask, or ``None`` where its
    layout does not allow it: the mask as int64 words summed :data:`WORDS_PER_LANE_SUM` at a
    time (each byte position apart, no carry), then the sums' bytes."""
    num_queries, gallery = mask.shape
    words = gallery // 8
    if (
        gallery % 8
        or mask.stride(-1) != 1
        or mask.storage_offset() % 8
        or mask.stride(0) % 8  # checked by the int64 view even for one row
    ):
        return None
    # The most words (dividing a row's) a lane sum takes; fewer than 16 make byte sums costly.
    chunk = next(c for c in range(min(words, WORDS_PER_LANE_SUM), 0, -1) if words % c == 0)
    if chunk < min(words, 16):
        return None
    lanes = mask.view(torch.int64).view(num_queries, words // chunk, chunk).sum(dim=-1)
    return lanes.view(torch.uint8).sum(dim=-1)


def _mask_counts_in_blocks(
    scores: Tensor,
    target: Tensor,
    needed: NeededCounts,
    workspace: Workspace | None,
    block_bytes: int,
) -> TieCounts:
    """Counts for a ``[Q, G]`` mask target without ignore, on CPU, with NaN rows. The mask
    enters the float domain by byte arithmetic (``torch.where`` is slow on CPU): clamping the
    scores from above to ``signs * -inf`` (+1 negative, -1 positive) keeps the positives'.
    s* is its row maximum (NaN rows: ``nan_rows``); g_> = #(scores > s*); p = #(kept >= s*);
    g_> + e = #(scores >= s*) - p (s* = -inf: from the positives). Blocks of ``block_bytes``."""
    num_queries, gallery = scores.shape
    device = scores.device
    sum_dtype = count_dtype(gallery)
    relevant = target if target.dtype == torch.bool else target != 0
    relevant_u8 = relevant.view(torch.uint8)
    one = constant(1, torch.uint8, device)
    rows = block_rows(num_queries, gallery, scores.element_size(), block_bytes)
    # 1 + 254 * mask wraps to 255 (int8 -1) for a positive and is 1 for a negative.
    signs_block = scratch(workspace, "signs", (rows, gallery), torch.uint8, device)
    kept_block = scratch(workspace, "positives", (rows, gallery), scores.dtype, device)
    best = torch.empty((num_queries, 1), dtype=scores.dtype, device=device)
    # The per-row sums of the signs, the kept scores >= s*, scores >= s*, scores > s*.
    sums = torch.empty((4, num_queries), dtype=sum_dtype, device=device)
    sign_sum, kept_f, at_or_above_f, greater_f = sums.unbind(0)
    tied_needed = needed.at_or_above or needed.tied_positives
    num_pos = _positives_per_row(relevant)
    minus_inf = float("-inf")
    for start in range(0, num_queries, rows):
        stop = min(start + rows, num_queries)
        block, row_best = scores[start:stop], best[start:stop]
        kept, signs = kept_block[: stop - start], signs_block[: stop - start]
        torch.add(one, relevant_u8[start:stop], alpha=254, out=signs)
        kept.copy_(signs.view(torch.int8))
        if num_pos is None:
            torch.sum(kept, dim=-1, dtype=sum_dtype, out=sign_sum[start:stop])
        kept.mul_(minus_inf)
        torch.clamp(block, max=kept, out=kept)  # min(score, +-inf)
        torch.amax(kept, dim=-1, keepdim=True, out=row_best)
        # The comparisons reuse the one scratch block: the kept scores go first.
        if tied_needed:
            kept.ge_(row_best)
            torch.sum(kept, dim=-1, dtype=sum_dtype, out=kept_f[start:stop])
        if needed.at_or_above:
            torch.ge(block, row_best, out=kept)
            torch.sum(kept, dim=-1, dtype=sum_dtype, out=at_or_above_f[start:stop])
        if needed.greater:
            torch.gt(block, row_best, out=kept)
            torch.sum(kept, dim=-1, dtype=sum_dtype, out=greater_f[start:stop])
    if num_pos is None:
        num_pos = ((gallery - sign_sum) * 0.5).to(torch.int64)
    row_best = best.squeeze(-1)
    tied = at_or_above = None
    if tied_needed:
        all_minus_inf = row_best == constant(minus_inf, scores.dtype, device)
        tied = torch.where(all_minus_inf, num_pos, kept_f.to(torch.int64))
        if needed.at_or_above:
            at_or_above = torch.where(
                all_minus_inf, gallery - num_pos, at_or_above_f.to(torch.int64) - tied
            )
    greater = greater_f.to(torch.int64) if needed.greater else None
    tied = tied if needed.tied_positives else None
    return TieCounts(greater, at_or_above, tied, num_pos > 0, torch.isnan(row_best))
