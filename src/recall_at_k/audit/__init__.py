"""The protocol audit of :class:`recall_at_k.EmbeddingRecallAtK`: pure functions, no Metric.

What :meth:`~recall_at_k.EmbeddingRecallAtK.protocol_report` counts, per direction:
``identical_positive`` / ``identical_negative`` (counted queries whose gallery holds a
non-ignored item, another sample, with a bitwise-equal embedding, of their label / of
another), ``rounding_positive`` / ``rounding_negative`` (the same for an item equal up to
float rounding, :data:`~recall_at_k.audit.rounding.TOLERANCE`, but not bitwise),
``duplicate_gallery_items`` (bitwise-equal to an earlier gallery item) and
``rounding_duplicate_gallery_items`` (the others equal up to rounding to an earlier
one); with a ``near_duplicate`` threshold the ranking counts ``near_positive`` /
``near_negative`` / ``near_hits_at_1`` in its own tiles, this audit's copies passed in as
known near items (:meth:`DirectionAudit.known`).

The parts: :mod:`~recall_at_k.audit.bitwise` (classes of bitwise-equal rows, codes,
sorts in parts), :mod:`~recall_at_k.audit.rounding` (pairs of classes equal up to
rounding), :mod:`~recall_at_k.audit.report` (per-direction counts from the codes, the
report and the warning) and :mod:`~recall_at_k.audit.sharded` (the same codes over rows
sharded across processes, with collectives). Memory: per item its codes (class, label,
group: 4 bytes each up to 2^31 items) and, while they are made, its hash (8 bytes);
rows are read a block at a time, every size from :class:`AuditOptions` ``sizes``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k.audit import bitwise, rounding
from recall_at_k.audit.report import (
    Codes,
    DirectionAudit,
    audit_direction,
    codes_of,
    counted_queries,
    direction_report,
    empty_report,
    warning_message,
)
from recall_at_k.audit.sharded import sharded_codes
from recall_at_k.ranking import budget
from recall_at_k.ranking.budget import AuditSizes

__all__ = [
    "AuditOptions",
    "Codes",
    "DirectionAudit",
    "audit_directions",
    "check_near_duplicate",
    "codes",
    "counted_queries",
    "options_of",
    "protocol_reports",
    "sharded_codes",
    "stale_anywhere",
    "warning_message",
]


class AuditOptions(NamedTuple):
    """The metric's options that the audit reads, and the sizes it works in."""

    exclude: str
    empty_target_action: str
    near_duplicate: float | None  # the threshold; None: no near-duplicate counts
    names: tuple[str, ...]  # the direction names ("" for one direction)
    sizes: AuditSizes


def options_of(metric: Any) -> AuditOptions:
    """The audit options of an :class:`~recall_at_k.EmbeddingRecallAtK` (blocks of a share
    of its ``chunk_bytes``)."""
    return AuditOptions(
        metric.exclude,
        metric.empty_target_action,
        metric.near_duplicate,
        tuple(metric.directions) if metric.bidirectional else ("",),
        budget.audit_sizes(metric.chunk_bytes // budget.AUDIT_SHARE),
    )


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


def codes(
    embeddings: Tensor,
    labels: Tensor,
    groups: Tensor | None,
    sizes: AuditSizes,
    *,
    hashes: Callable[[Tensor], Tensor] | None = None,
) -> Codes:
    """The keys the audit counts with, of every row of ``embeddings`` ``[N, D]`` (bit
    patterns as stored) and its ``labels`` / ``groups`` ``[N]`` (None: no group codes):
    rows read a block at a time on the worker threads. ``hashes``: the row hash (tests)."""
    num, device = embeddings.shape[0], embeddings.device
    with bitwise.Blocks(device, sizes) as blocks:
        hashed = bitwise.hash_rows(embeddings, sizes, blocks, hashes)
        same = bitwise.same_rows(embeddings, blocks)
        klass, first = (
            bitwise.bitwise_classes(hashed, same, sizes) if num else (labels[:0], labels[:0])
        )
        del hashed
        adjacent = rounding.rounding_pairs(embeddings, first, sizes, blocks)
    return codes_of(klass.to(bitwise.code_dtype(num)), adjacent, labels, groups, sizes)


Sides = tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]


def audit_directions(
    stored: tuple[Tensor, Tensor] | Callable[[], Codes],
    directions: Sequence[Sides | None],
    options: AuditOptions,
) -> list[DirectionAudit | None]:
    """The audit of each direction (None where it is None; a direction with the same sides
    as the one before is audited once).

    Args:
        stored: the stored embeddings ``[N, D]`` and metadata ``[N, >= 2]`` (label, group
            first); or a function that makes their :func:`codes` (a sharded gallery's).
        directions: ``((query rows, identity), (gallery rows, identity))`` per direction,
            or None for a direction without queries or gallery.
        options: the metric's options.
    """
    if all(sides is None for sides in directions):
        return [None for _ in directions]
    if callable(stored):
        keys = stored()
    else:
        embeddings, meta = stored
        groups = meta[:, 1] if options.exclude != "none" else None
        keys = codes(embeddings, meta[:, 0], groups, options.sizes)
    audits: list[DirectionAudit | None] = []
    previous: Sides | None = None
    for sides in directions:
        if (
            sides is not None
            and previous is not None
            and all(torch.equal(a[0], b[0]) for a, b in zip(previous, sides, strict=True))
        ):
            audits.append(audits[-1])
        elif sides is not None:
            previous = sides
            action, sizes = options.empty_target_action, options.sizes
            audits.append(audit_direction(keys, sides, options.exclude, action, sizes))
        else:
            audits.append(None)
    return audits


def protocol_reports(
    audits: Sequence[DirectionAudit | None],
    near: Sequence[Tensor | None],
    counted: Sequence[int | None],
    options: AuditOptions,
) -> list[dict[str, int]]:
    """The report of each direction (identical on every process: its parts are).

    Args:
        audits: each direction's audit, or None for one without queries or gallery.
        near: each direction's near counts from the ranking (summed over processes), or None.
        counted: the counted queries of each direction as ``compute()`` found them, or
            None to count them here (by the same rule).
        options: the metric's options.
    """
    with_near = options.near_duplicate is not None
    return [
        empty_report(with_near)
        if audit is None
        else direction_report(
            int(audit.counted.sum()) if queries is None else queries,
            audit,
            found if with_near else None,
            options.empty_target_action,
        )
        for audit, found, queries in zip(audits, near, counted, strict=True)
    ]


def stale_anywhere(metric: Any, stale: bool) -> bool:
    """Whether the metric's report is stale on any process that its ``compute()`` syncs
    with (all of them then audit again, together); ``stale`` alone otherwise."""
    available = metric.distributed_available_fn
    if not (metric._to_sync and callable(available) and available()):
        return stale
    flag = torch.tensor([int(stale)], dtype=torch.int64, device=metric.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=metric.process_group)
    return bool(flag)
