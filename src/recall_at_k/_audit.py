"""The protocol audit of :class:`recall_at_k.EmbeddingRecallAtK`: pure functions, no Metric.

What :meth:`~recall_at_k.EmbeddingRecallAtK.protocol_report` counts, per direction:

- ``identical_positive`` / ``identical_negative``: counted queries whose gallery holds a
  non-ignored item (not the query's own sample, not excluded by ``exclude``) with a
  bitwise-equal embedding, of the query's label / another label;
- ``duplicate_gallery_items``: gallery items bitwise-equal to an earlier gallery item
  (gallery items are distinct samples: ids repeated within a role count once);
- with a ``near_duplicate`` threshold, ``near_positive`` / ``near_negative`` (a
  non-ignored gallery item whose score -- the canonical score of the ranking -- is at or
  above it; identical items count too, even where they score below it) and
  ``near_hits_at_1`` (queries whose rank-1 hit scores at or above it).

The identical and duplicate counts need no scores: one sort of the embeddings' bit
patterns gives each item the class of its bitwise-equal rows, and composite keys
(class, label, group) turn "is there such an item in my gallery" into counts looked up
per query. Everything is O(N log N) sorts and O(N) gathers, whatever the data (every
embedding equal included): no loop over queries, no pairs.

The near counts need a score per (query, gallery item): the ranking counts them in its
own tiles (:func:`recall_at_k.ranking.rank.rank` with ``near_duplicate``), decided on the
same canonical scores as the ranking, with the identical items found here passed in as
known near items. This module turns them into the report.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import Tensor


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

    def known(self) -> Tensor:
        """bool ``[2, Q]``: queries whose near positive / near negative is certain (an
        identical item), whatever its score (``rank``'s ``known``)."""
        return torch.stack([self.identical_positive, self.identical_negative])


_COMPARE_BYTES = 2**20
"""Rows are hashed and compared this many bytes at a time (never the whole set)."""


def bitwise_classes(embeddings: Tensor, hashes: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """int64 ``[N]``: rows with the same bit pattern share a class (``0..C-1``).

    Bitwise equality is stricter than ``==``: ``-0.0`` and ``0.0`` differ, and so do
    NaN payloads (embeddings are finite when ``validate_args=True``).

    Each row's bits, read as 16-bit words, get a 62-bit hash (two sums of the words
    times fixed coefficients, modulo a prime: integers, exact in any order); rows are
    sorted by hash and the neighbours that share one are compared bit for bit. Equal
    hashes of different rows (chance about ``N^2 / 2^62``) fall back to an exact sort
    of the rows (``torch.unique(dim=0)``, several times slower, on a whole copy).
    O(N log N + N D); rows are hashed and compared :data:`_COMPARE_BYTES` at a time.
    ``hashes``: the row hash (tests pass colliding ones).
    """
    num, width = embeddings.shape
    if num == 0 or width == 0:
        return torch.zeros(num, dtype=torch.int64, device=embeddings.device)
    step = max(1, _COMPARE_BYTES // max(1, width * embeddings.element_size()))
    hash_of = _row_hashes if hashes is None else hashes
    keys = torch.cat(
        [hash_of(_words(embeddings[start : start + step])) for start in range(0, num, step)]
    )
    sorted_keys, order = torch.sort(keys)
    same = (sorted_keys[1:] == sorted_keys[:-1]).nonzero().view(-1)
    for start in range(0, same.shape[0], step):
        pairs = same[start : start + step]
        first = embeddings.index_select(0, order[pairs])
        second = embeddings.index_select(0, order[pairs + 1])
        if not bool(torch.equal(_words(first), _words(second))):  # a collision: exact, slower
            words = _words(embeddings)
            return cast(Tensor, torch.unique(words, dim=0, return_inverse=True)[1])
    classes = torch.empty_like(order)
    classes[order] = torch.unique_consecutive(sorted_keys, return_inverse=True)[1]
    return classes


def _words(rows: Tensor) -> Tensor:
    """The rows' bits as int16 words ``[m, W]`` (every float dtype)."""
    return rows.contiguous().view(torch.int16)


_HASH_PRIME = 2**21 - 9
_HASH_ROW_BYTES = 2**20
"""Rows are hashed this many bytes of float64 words at a time."""
_HASH_MAX_TERMS = 2**15
"""Words summed before a reduction modulo the prime: each term is an integer below
2^37, so a sum of up to 2^16 of them is exact in float64, in any order."""


def _row_hashes(words: Tensor) -> Tensor:
    """int64 ``[N]`` in ``[0, 2^63)``: equal rows of int16 ``words`` get equal values.

    Three sums of the words (shifted to ``[0, 2^16)``) times fixed coefficients below a
    prime ``p`` of 21 bits, each modulo ``p``: a matrix product in float64 whose every
    partial sum is an integer below 2^53, hence exact whatever the blocking or device.
    """
    num, width = words.shape
    device, wide = words.device, torch.float64
    generator = torch.Generator().manual_seed(20261203)
    coefficients = torch.randint(1, _HASH_PRIME, (width, 3), generator=generator)
    coefficients = coefficients.to(device=device, dtype=wide)
    hashes = torch.zeros((num, 3), dtype=wide, device=device)
    step = max(1, min(num, _HASH_ROW_BYTES // (8 * width)))
    buffer = torch.empty((step, width), dtype=wide, device=device)  # reused, chunk after chunk
    for start in range(0, num, step):
        rows = buffer[: min(step, num - start)]
        rows.copy_(words[start : start + step]).add_(2**15)  # [0, 2^16)
        target = hashes[start : start + step]
        for first in range(0, width, _HASH_MAX_TERMS):
            stop = first + _HASH_MAX_TERMS
            target.addmm_(rows[:, first:stop], coefficients[first:stop]).remainder_(_HASH_PRIME)
    keys = hashes.to(torch.int64)
    return (keys[:, 0] * _HASH_PRIME + keys[:, 1]) * _HASH_PRIME + keys[:, 2]


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


# ------------------------------------------------------------------ options


class AuditOptions(NamedTuple):
    """The metric's options that the audit reads."""

    exclude: str
    empty_target_action: str
    near_duplicate: float | None  # the threshold; None: no near-duplicate counts
    names: tuple[str, ...] = ("",)  # the direction names ("" for one direction)


def options_of(metric: Any) -> AuditOptions:
    """The audit options of an :class:`~recall_at_k.EmbeddingRecallAtK`."""
    return AuditOptions(
        metric.exclude,
        metric.empty_target_action,
        metric.near_duplicate,
        tuple(metric.directions) if metric.bidirectional else ("",),
    )


Sides = tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]


def audit_directions(
    stored: tuple[Tensor, Tensor], directions: Sequence[Sides | None], options: AuditOptions
) -> list[DirectionAudit | None]:
    """:func:`audit_direction` of each direction (None where it is None; a direction with
    the same sides as the one before is audited once).

    Args:
        stored: the stored embeddings ``[N, D]`` (bit patterns compared as stored) and
            metadata ``[N, >= 2]`` (label, group first).
        directions: ``((query rows, identity), (gallery rows, identity))`` per
            direction, or None for a direction without queries or gallery.
        options: the metric's options.
    """
    if all(sides is None for sides in directions):
        return [None for _ in directions]
    keys = codes(stored[0], stored[1][:, 0], stored[1][:, 1])
    audits: list[DirectionAudit | None] = []
    previous: Sides | None = None
    for sides in directions:
        if sides is None:
            audits.append(None)
            continue
        if previous is not None and all(
            torch.equal(a[0], b[0]) for a, b in zip(previous, sides, strict=True)
        ):
            audits.append(audits[-1])
            continue
        previous = sides
        audits.append(
            audit_direction(keys, sides[0], sides[1], options.exclude, options.empty_target_action)
        )
    return audits


def stale_anywhere(metric: Any, stale: bool) -> bool:
    """Whether the metric's report is stale on any process that its ``compute()`` syncs
    with (all of them then audit again, together); ``stale`` alone otherwise."""
    available = metric.distributed_available_fn
    if not (metric._to_sync and callable(available) and available()):
        return stale
    flag = torch.tensor([int(stale)], dtype=torch.int64, device=metric.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=metric.process_group)
    return bool(flag)


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


def counted_queries(
    histograms: Sequence[tuple[Tensor, Tensor] | None], empty_target_action: str
) -> list[int | None]:
    """The counted queries of each direction, from the ranking's query counts (with,
    without a valid positive), by the rule of ``compute()``."""
    skip = empty_target_action in ("skip", "error")
    return [None if h is None else int(h[1][0]) + (0 if skip else int(h[1][1])) for h in histograms]


def protocol_reports(
    audits: Sequence[DirectionAudit | None],
    near: Sequence[Tensor | None],
    counted: Sequence[int | None],
    options: AuditOptions,
) -> list[dict[str, int]]:
    """The report of each direction (identical on every process: its parts are).

    Args:
        audits: each direction's :func:`audit_direction`, or None for a direction
            without queries or gallery.
        near: each direction's near-duplicate counts from the ranking
            (:data:`recall_at_k.ranking.rank.NEAR_COUNTS`, summed over processes), or
            None (no threshold, or not ranked).
        counted: the counted queries of each direction as ``compute()`` found them, or
            None to count them here (by the same rule).
        options: the metric's options.
    """
    reports: list[dict[str, int]] = []
    with_near = options.near_duplicate is not None
    for audit, near_counts, queries in zip(audits, near, counted, strict=True):
        if audit is None:
            reports.append(empty_report(with_near))
            continue
        queries = int(audit.counted.sum()) if queries is None else queries
        found = near_counts if with_near else None
        reports.append(report(queries, audit, found, options.empty_target_action))
    return reports


def report(
    queries: int, audit: DirectionAudit, near: Tensor | None, empty_target_action: str
) -> dict[str, int]:
    """One direction's report, its keys in the documented order (``near``: the ranking's
    near counts, zeros where it could not count them)."""
    result = {
        "queries": queries,
        "identical_positive": int(audit.identical_positive.sum()),
        "identical_negative": int(audit.identical_negative.sum()),
    }
    if near is not None:
        positive, negative, negative_alone, hits = (int(v) for v in near.tolist())
        result["near_positive"] = positive
        counts_all = empty_target_action not in ("skip", "error")
        result["near_negative"] = negative + (negative_alone if counts_all else 0)
        result["near_hits_at_1"] = hits
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
