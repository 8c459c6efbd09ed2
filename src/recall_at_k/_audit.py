"""The protocol audit of :class:`recall_at_k.EmbeddingRecallAtK`: pure functions, no Metric.

What :meth:`~recall_at_k.EmbeddingRecallAtK.protocol_report` counts, per direction:

- ``identical_positive`` / ``identical_negative``: counted queries whose gallery holds a
  non-ignored item (not the query's own sample, not excluded by ``exclude``) with a
  bitwise-equal embedding, of the query's label / another label;
- ``duplicate_gallery_items``: gallery items bitwise-equal to an earlier gallery item
  (gallery items are distinct samples: ids repeated within a role count once);
- with a ``near_duplicate`` threshold, ``near_positive`` / ``near_negative`` (a
  non-ignored gallery item scored at or above it; identical items count too, even where
  rounding scores them below it) and
  ``near_hits_at_1`` (queries whose rank-1 hit scores at or above it).

The identical and duplicate counts need no scores: one sort of the embeddings' bit
patterns gives each item the class of its bitwise-equal rows, and composite keys
(class, label, group) turn "is there such an item in my gallery" into counts looked up
per query. Everything is O(N log N) sorts and O(N) gathers, whatever the data (every
embedding equal included): no loop over queries, no pairs.

The near counts need a score per (query, gallery item). :func:`near_counts` computes
them in a separate pass over tiles of at most ``chunk_bytes`` of scores (never the
whole query x gallery matrix); it is not (yet) part of the ranking's own tiles, so it
costs about one more ranking, and its scores are its own product's (which may differ
from the ranking's in the last bit: a score within rounding of the threshold or of s*
may be counted differently than the ranking would).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k._types import Similarity

CPU_TILE_BYTES = 32 * 2**20
"""On CPU, a near-duplicate tile holds at most this many bytes of scores."""
CPU_PANEL_BYTES = 2 * 2**20
"""On CPU, a tile's columns outside its label blocks are scored in panels of this size."""

_BITS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


class Codes(NamedTuple):
    """Per item, int64 codes in ``[0, N)``: equal codes = equal keys."""

    klass: Tensor  # the class of bitwise-equal embeddings
    label: Tensor
    group: Tensor
    label_group: Tensor
    class_label: Tensor
    class_group: Tensor
    class_label_group: Tensor


class DirectionAudit(NamedTuple):
    """The audit of one direction's queries, per query (``[Q]`` bool)."""

    counted: Tensor  # counted by compute() under empty_target_action
    identical_positive: Tensor
    identical_negative: Tensor
    duplicate_gallery_items: int


def bitwise_classes(embeddings: Tensor) -> Tensor:
    """int64 ``[N]``: rows with the same bit pattern share a class (``0..C-1``).

    Bitwise equality is stricter than ``==``: ``-0.0`` and ``0.0`` differ, and so do
    NaN payloads (embeddings are finite when ``validate_args=True``).
    """
    num, width = embeddings.shape
    if num == 0 or width == 0:
        return torch.zeros(num, dtype=torch.int64, device=embeddings.device)
    bits = embeddings.contiguous().view(_BITS[embeddings.dtype])
    return cast(Tensor, torch.unique(bits, dim=0, return_inverse=True)[1])


def _code(values: Tensor) -> Tensor:
    return cast(Tensor, torch.unique(values, return_inverse=True)[1])


def _pair(a: Tensor, b: Tensor) -> Tensor:
    """The code of the pair (a, b) of codes in ``[0, N)`` (no int64 overflow: < N^2)."""
    if a.numel() == 0:
        return a.clone()
    return _code(a * (int(b.max()) + 1) + b)


def codes(embeddings: Tensor, labels: Tensor, groups: Tensor) -> Codes:
    """The composite keys the audit counts with, over every stored item."""
    klass = bitwise_classes(embeddings)
    label, group = _code(labels), _code(groups)
    class_label = _pair(klass, label)
    return Codes(
        klass,
        label,
        group,
        _pair(label, group),
        class_label,
        _pair(klass, group),
        _pair(class_label, group),
    )


def audit_direction(
    keys: Codes,
    queries: tuple[Tensor, Tensor],
    gallery: tuple[Tensor, Tensor],
    exclude: str,
    empty_target_action: str,
) -> DirectionAudit:
    """Identical positives / negatives of each query and the gallery's duplicates.

    Each count is "gallery items with the query's key" (a ``bincount`` of the gallery's
    codes, read at the query's code), by inclusion-exclusion over the ignore rules,
    minus the query's own sample when it is in the gallery and would be counted.

    Args:
        keys: :func:`codes` of every item.
        queries: ``(rows, identity)`` of the queries (rows into the items).
        gallery: ``(rows, identity)`` of the gallery, each sample once.
        exclude: ``"none"``, ``"same_group"`` or ``"same_label_and_group"``.
        empty_target_action: which queries ``compute()`` counts.
    """
    q_rows, q_identity = queries
    g_rows, g_identity = gallery
    num = keys.klass.shape[0]

    def in_gallery(code: Tensor) -> Tensor:
        """Per query: the gallery items that share the query's ``code``."""
        return torch.bincount(code[g_rows], minlength=num)[code[q_rows]]

    # The query's own sample in the gallery (the ranking ignores it), where it is there.
    has_self = torch.zeros_like(q_rows, dtype=torch.bool)
    self_row = q_rows
    if g_identity.numel():
        ident_sorted, order = torch.sort(g_identity)
        position = torch.searchsorted(ident_sorted, q_identity)
        position = position.clamp(max=ident_sorted.shape[0] - 1)
        has_self = ident_sorted[position] == q_identity
        self_row = g_rows[order[position]]
    same_class = has_self & (keys.klass[self_row] == keys.klass[q_rows])
    same_label = keys.label[self_row] == keys.label[q_rows]
    same_group = keys.group[self_row] == keys.group[q_rows]
    grouped = exclude != "none"  # both rules ignore same-group items of the same label
    # Valid positives (which queries compute() counts), then the identical ones.
    self_positive = has_self & same_label & ~(same_group & grouped)
    positives = in_gallery(keys.label) - self_positive.long()
    identical_pos = in_gallery(keys.class_label) - (self_positive & same_class).long()
    if grouped:
        positives -= in_gallery(keys.label_group)
        identical_pos -= in_gallery(keys.class_label_group)
    # Identical negatives: another label; only "same_group" ignores negatives.
    group_rule = exclude == "same_group"
    self_negative = same_class & ~same_label & ~(same_group & group_rule)
    identical_neg = in_gallery(keys.klass) - in_gallery(keys.class_label)
    identical_neg -= self_negative.long()
    if group_rule:
        identical_neg -= in_gallery(keys.class_group) - in_gallery(keys.class_label_group)
    if empty_target_action in ("skip", "error"):
        counted = positives > 0
    else:
        counted = torch.ones_like(positives, dtype=torch.bool)
    gallery_classes = torch.bincount(keys.klass[g_rows], minlength=num)
    duplicates = int(g_rows.shape[0]) - int((gallery_classes > 0).sum())
    return DirectionAudit(
        counted, counted & (identical_pos > 0), counted & (identical_neg > 0), duplicates
    )


# ------------------------------------------------------------------ near-duplicates


class AuditOptions(NamedTuple):
    """The metric's options that the audit reads."""

    exclude: str
    empty_target_action: str
    near_duplicate: float | None  # the threshold; None: no near-duplicate pass
    similarity: Similarity
    ties: str
    chunk_bytes: int
    names: tuple[str, ...] = ("",)  # the direction names ("" for one direction)


def options_of(metric: Any) -> AuditOptions:
    """The audit options of an :class:`~recall_at_k.EmbeddingRecallAtK`."""
    return AuditOptions(
        metric.exclude,
        metric.empty_target_action,
        metric.near_duplicate,
        metric.similarity,
        metric.ties,
        metric.chunk_bytes,
        tuple(metric.directions) if metric.bidirectional else ("",),
    )


def near_counts(
    prepared: Tensor,
    labels: Tensor,
    groups: Tensor,
    queries: tuple[Tensor, Tensor],
    gallery: tuple[Tensor, Tensor],
    options: AuditOptions,
) -> Tensor:
    """bool ``[3, Q]``: whether each query has a near positive, a near negative, a near
    hit at 1.

    A separate pass over tiles of queries (at most ``chunk_bytes`` of scores, and on
    CPU ``CPU_TILE_BYTES``): a query's near items are
    its non-ignored gallery items scored at or above ``options.near_duplicate``; its
    rank-1 hit is near when it is a hit at rank 1 (no valid negative scored above its
    best valid positive s*, nor equal to it unless ``ties="optimistic"``: a certain hit
    under ``"expected"``) and s* is at or above the threshold. Only queries
    ``compute()`` counts are counted.

    As in the ranking, the gallery's columns are sorted by label, so a query's
    positives (and the label-and-group junk) are one block of columns, read with a
    gather; the full-width work is the product and one row maximum (the best negative:
    the block set to -inf). On CPU the queries go in label order, so a tile's blocks
    form one run of columns, scored first; the other columns follow in panels of about
    ``CPU_PANEL_BYTES``, reduced while still in the core's cache.

    Args:
        prepared: embeddings from :func:`recall_at_k._embedding.prepare` (normalised for
            ``"cosine"``), every item.
        labels: int64 ``[N]``; groups: int64 ``[N]``.
        queries: ``(rows, identity)`` of the queries this process counts.
        gallery: ``(rows, identity)`` of the whole gallery.
        options: threshold, similarity, exclusion, ties, empty-target rule, tile size.
    """
    assert options.near_duplicate is not None
    threshold = options.near_duplicate
    device = prepared.device
    found = torch.zeros(3, queries[0].shape[0], dtype=torch.bool, device=device)
    if queries[0].numel() == 0 or gallery[0].numel() == 0:
        return found
    # The gallery in label order, the queries too (a tile's blocks are then one run of
    # columns); each query's block of columns and its own column.
    g_labels, order = torch.sort(labels[gallery[0]], stable=True)
    g_rows, g_identity = gallery[0][order], gallery[1][order]
    g_embeddings, g_groups = prepared[g_rows], groups[g_rows]
    num_gallery = g_rows.shape[0]
    q_labels, q_order = torch.sort(labels[queries[0]], stable=True)
    q_rows, q_identity = queries[0][q_order], queries[1][q_order]
    q_groups = groups[q_rows]
    block_labels, block_counts = torch.unique_consecutive(g_labels, return_counts=True)
    block_starts = torch.cumsum(block_counts, dim=0) - block_counts
    block = torch.searchsorted(block_labels, q_labels).clamp(max=block_labels.shape[0] - 1)
    q_start = block_starts[block]
    q_count = torch.where(block_labels[block] == q_labels, block_counts[block], 0)
    identity_sorted, identity_column = torch.sort(g_identity)
    position = torch.searchsorted(identity_sorted, q_identity).clamp(max=num_gallery - 1)
    is_self = identity_sorted[position] == q_identity
    self_column = torch.where(is_self, identity_column[position], -1)
    g_neg_sq = None
    if options.similarity == "euclidean":
        g_neg_sq = g_embeddings.square().sum(dim=1).neg_().unsqueeze(0)
    counts_all = options.empty_target_action not in ("skip", "error")
    budget = options.chunk_bytes
    panels = device.type == "cpu" and not callable(options.similarity)
    if device.type == "cpu":
        budget = min(budget, CPU_TILE_BYTES)
    rows_per_tile = max(1, budget // max(1, num_gallery * prepared.element_size()))

    def scored(tile: slice, first: int, stop: int) -> Tensor:
        """Scores of the tile's queries against columns ``first:stop``, -inf where
        ignored (the query itself, its group under "same_group")."""
        queries_tile = prepared[q_rows[tile]]
        if callable(options.similarity):
            out = options.similarity(queries_tile, g_embeddings).detach().clone()
        elif g_neg_sq is not None:
            out = torch.addmm(
                g_neg_sq[:, first:stop], queries_tile, g_embeddings[first:stop].T, alpha=2
            )
            out.sub_(queries_tile.square().sum(dim=1, keepdim=True))
        else:
            out = queries_tile @ g_embeddings[first:stop].T
        own = self_column[tile] - first
        inside = (self_column[tile] >= 0) & (own >= 0) & (own < stop - first)
        out[torch.arange(own.shape[0], device=device)[inside], own[inside]] = float("-inf")
        if options.exclude == "same_group":
            same = q_groups[tile].unsqueeze(1) == g_groups[first:stop].unsqueeze(0)
            out.masked_fill_(same, float("-inf"))
        return out

    for start in range(0, q_rows.shape[0], rows_per_tile):
        tile = slice(start, start + rows_per_tile)
        count = q_count[tile]
        lo, hi = 0, num_gallery
        if panels:  # first the run of columns holding every block of the tile
            present = count > 0
            lo = int(torch.where(present, q_start[tile], num_gallery).min())
            hi = max(lo, int(torch.where(present, q_start[tile] + count, 0).max()))
        scores = scored(tile, lo, hi)
        # The block: steps past a query's count repeat its block's columns (so every
        # column written below is in the block), and a query without a block reads one
        # column that it writes back unchanged.
        steps = torch.arange(max(1, int(count.max())), device=device)
        in_block = steps.unsqueeze(0) < count.unsqueeze(1)
        columns = q_start[tile].unsqueeze(1) + steps % count.clamp(min=1).unsqueeze(1)
        local = (columns - lo).clamp_(0, max(hi - lo - 1, 0))
        block_scores = scores.gather(1, local) if hi > lo else local.to(prepared.dtype)
        # Valid positives from the rules, not from the scores (a score may be -inf).
        valid = in_block & (columns != self_column[tile].unsqueeze(1))
        if options.exclude != "none":
            valid &= g_groups[columns.clamp(max=num_gallery - 1)] != q_groups[tile].unsqueeze(1)
        best = torch.where(valid, block_scores, float("-inf")).amax(dim=1)
        has_positive = valid.any(dim=1)
        near_positive = (valid & (block_scores >= threshold)).any(dim=1)
        # The best negative: the block set to -inf, the rest of the row as it is (an
        # ignored item is -inf and so never reaches the threshold, or s* above it).
        if hi > lo:
            has_block = (count > 0).unsqueeze(1)
            scores.scatter_(1, local, torch.where(has_block, float("-inf"), block_scores))
            best_negative = scores.amax(dim=1)
        else:
            best_negative = torch.full_like(best, float("-inf"))
        # The other columns, in panels reduced while still in the core's cache.
        width = max(1, CPU_PANEL_BYTES // (max(1, count.shape[0]) * prepared.element_size()))
        outside = [(a, min(a + width, lo)) for a in range(0, lo, width)]
        outside += [(a, min(a + width, num_gallery)) for a in range(hi, num_gallery, width)]
        for first, stop in outside:
            best_negative = torch.maximum(best_negative, scored(tile, first, stop).amax(dim=1))
        beaten = best_negative > best if options.ties == "optimistic" else best_negative >= best
        counted = torch.ones_like(has_positive) if counts_all else has_positive
        near_hit = has_positive & ~beaten & (best >= threshold)
        flags = torch.stack([near_positive, best_negative >= threshold, near_hit]) & counted
        found[:, q_order[tile]] = flags
    return found


def shard(num: int, group: Any | None) -> slice:
    """This process's contiguous share of ``num`` queries (all without ``group``)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return slice(0, num)
    world, me = dist.get_world_size(group.group), dist.get_rank(group.group)
    return slice(num * me // world, num * (me + 1) // world)


def stale_anywhere(metric: Any, stale: bool) -> bool:
    """Whether the metric's report is stale on any process that its ``compute()`` syncs
    with (all of them then audit again, together); ``stale`` alone otherwise."""
    available = metric.distributed_available_fn
    if not (metric._to_sync and callable(available) and available()):
        return stale
    flag = torch.tensor([int(stale)], dtype=torch.int64, device=metric.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=metric.process_group)
    return bool(flag)


def sum_shares(counts: Tensor, group: Any | None) -> Tensor:
    """``counts`` summed over the processes of ``group`` (unchanged without one)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return counts
    if dist.get_world_size(group.group) > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group.group)
    return counts


# ------------------------------------------------------------------ report, warning


def check_near_duplicate(value: object) -> float | None:
    """``near_duplicate``: None or a finite real threshold (in the metric's similarity)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            "`near_duplicate` must be None or a finite float (a threshold in the metric's"
            f" own similarity, such as 0.95 for cosine), got {value!r}"
        )
    if not torch.isfinite(torch.tensor(float(value), dtype=torch.float64)):
        raise ValueError(f"`near_duplicate` must be finite, got {value!r}")
    return float(value)


Sides = tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]


def counted_queries(
    histograms: Sequence[tuple[Tensor, Tensor] | None], empty_target_action: str
) -> list[int | None]:
    """The counted queries of each direction, from the ranking's query counts (with,
    without a valid positive), by the rule of ``compute()``."""
    skip = empty_target_action in ("skip", "error")
    return [None if h is None else int(h[1][0]) + (0 if skip else int(h[1][1])) for h in histograms]


def protocol_reports(
    stored: tuple[Tensor, Tensor],
    prepared: Tensor | None,
    directions: Sequence[Sides | None],
    counted: Sequence[int | None],
    options: AuditOptions,
    group: Any | None,
) -> list[dict[str, int]]:
    """The report of each direction, identical on every process.

    Args:
        stored: the stored embeddings ``[N, D]`` (bit patterns compared as stored) and
            metadata ``[N, >= 2]`` (label, group first).
        prepared: the embeddings as scored (needed for the near-duplicate pass).
        directions: ``((query rows, identity), (gallery rows, identity))`` per
            direction, or None for a direction without queries or gallery.
        counted: the counted queries of each direction as ``compute()`` found them, or
            None to count them here (by the same rule).
        options: the metric's options.
        group: the process group to share the near pass over (None: all queries here).
    """
    embeddings, labels, groups = stored[0], stored[1][:, 0], stored[1][:, 1]
    near = options.near_duplicate is not None and prepared is not None
    keys = codes(embeddings, labels, groups)
    reports: list[dict[str, int]] = []
    previous: Sides | None = None
    for sides, queries in zip(directions, counted, strict=False):
        if sides is None:
            reports.append(empty_report(options.near_duplicate is not None))
            continue
        if previous is not None and all(
            torch.equal(a[0], b[0]) for a, b in zip(previous, sides, strict=True)
        ):
            reports.append(dict(reports[-1]))
            continue
        previous = sides
        audit = audit_direction(
            keys, sides[0], sides[1], options.exclude, options.empty_target_action
        )
        found = None
        if near and prepared is not None:
            # The near pass on this process's share; identical items count as near.
            share = shard(sides[0][0].shape[0], group)
            queries_share = (sides[0][0][share], sides[0][1][share])
            flags = near_counts(prepared, labels, groups, queries_share, sides[1], options)
            flags[0] |= audit.identical_positive[share]
            flags[1] |= audit.identical_negative[share]
            found = sum_shares(flags.sum(dim=1), group)
        queries = int(audit.counted.sum()) if queries is None else queries
        reports.append(report(queries, audit, found))
    return reports


def report(queries: int, audit: DirectionAudit, near: Tensor | None) -> dict[str, int]:
    """One direction's report, its keys in the documented order."""
    result = {
        "queries": queries,
        "identical_positive": int(audit.identical_positive.sum()),
        "identical_negative": int(audit.identical_negative.sum()),
    }
    if near is not None:
        near_positive, near_negative, near_hits = (int(v) for v in near.tolist())
        result["near_positive"] = near_positive
        result["near_negative"] = near_negative
        result["near_hits_at_1"] = near_hits
    result["duplicate_gallery_items"] = audit.duplicate_gallery_items
    return result


def empty_report(near: bool) -> dict[str, int]:
    """The report of a direction without queries or gallery: every count 0."""
    keys = ["queries", "identical_positive", "identical_negative"]
    keys += ["near_positive", "near_negative", "near_hits_at_1"] if near else []
    return dict.fromkeys([*keys, "duplicate_gallery_items"], 0)


def warning_message(
    names: Sequence[str], reports: Sequence[dict[str, int]], directions: Sequence[Sides | None]
) -> str | None:
    """The warning about identical positives or duplicate gallery items, or None.

    Args:
        names: the direction names (``""`` for a metric with one direction).
        reports: the report of each direction.
        directions: each direction's sides, or None.
    """
    gallery = [0 if d is None else int(d[1][0].shape[0]) for d in directions]
    reports_named = list(zip(names, reports, strict=False))
    findings = []
    for (name, found), size in zip(reports_named, gallery, strict=False):
        where = f"direction {name!r}: " if name else ""
        identical, queries = found["identical_positive"], found["queries"]
        duplicates = found["duplicate_gallery_items"]
        if identical:
            findings.append(
                f"{where}{identical} of {queries} counted queries ({identical / queries:.1%})"
                " have a bitwise-identical item of their own label in their gallery, a"
                " guaranteed hit (leakage)"
            )
        if duplicates:
            findings.append(
                f"{where}{duplicates} of {size} gallery items ({duplicates / max(size, 1):.1%})"
                " are bitwise-identical to another gallery item, so every query ranks each"
                " repeat again"
            )
    if not findings:
        return None
    return (
        "EmbeddingRecallAtK: "
        + "; ".join(findings)
        + ". Fixes: pass `ids=` so that repeats of one sample (a caption-indexed loader"
        " repeating its images, DistributedSampler padding, a query that is also in the"
        " gallery) count once; pass `groups=` with exclude='same_group' to ignore items of"
        " the query's own source; or de-duplicate the gallery. protocol_report() has the"
        " counts. (Shown once per metric instance.)"
    )
