"""The protocol audit of :class:`recall_at_k.EmbeddingRecallAtK`: pure functions, no Metric.

Per direction, :meth:`~recall_at_k.EmbeddingRecallAtK.protocol_report` counts the queries
whose gallery holds a non-ignored item, another sample, with a bitwise-equal embedding
(``identical_positive`` / ``identical_negative``: of their label / another) or one equal
up to float rounding but not bitwise (``rounding_positive`` / ``rounding_negative``,
:data:`~recall_at_k.audit.rounding.TOLERANCE`), and the gallery items equal to an earlier
one, bitwise (``duplicate_gallery_items``) or else up to rounding
(``rounding_duplicate_gallery_items``). With a ``near_duplicate`` threshold the ranking
counts ``near_positive`` / ``near_negative`` / ``near_hits_at_1`` in its own tiles, the
copies found here passed in as known (:meth:`DirectionAudit.known`).

:mod:`~recall_at_k.audit.bitwise` makes the classes of bitwise-equal rows (and the codes
and sorts in parts), :mod:`~recall_at_k.audit.rounding` the pairs of classes equal up to
rounding, :mod:`~recall_at_k.audit.report` the counts of each direction, the report and
the warning; :mod:`~recall_at_k.audit.sharded` the same codes over rows sharded across
processes. Memory: per item its codes (class, label, group) and, while they are made,
its hash; rows are read a block at a time; every size from :class:`AuditOptions`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k.audit import sharded
from recall_at_k.audit.report import (
    Codes,
    DirectionAudit,
    audit_direction,
    direction_report,
)
from recall_at_k.audit.report import counted_queries as counted_queries
from recall_at_k.audit.report import warning_message as warning_message
from recall_at_k.audit.sharded import sharded_codes as sharded_codes
from recall_at_k.ranking import budget

__all__ = ["AuditOptions", "Codes", "DirectionAudit", "audit_directions", "codes"]


class AuditOptions(NamedTuple):
    """The metric's options that the audit reads, and the sizes it works in."""

    exclude: str
    empty_target_action: str
    near_duplicate: float | None  # the threshold; None: no near-duplicate counts
    names: tuple[str, ...]  # the direction names ("" for one direction)
    sizes: budget.AuditSizes


def options_of(metric: Any) -> AuditOptions:
    """The audit options of an :class:`~recall_at_k.EmbeddingRecallAtK`."""
    names = tuple(metric.directions) if metric.bidirectional else ("",)
    sizes = budget.audit_sizes(metric.chunk_bytes // budget.AUDIT_SHARE)
    return AuditOptions(
        metric.exclude, metric.empty_target_action, metric.near_duplicate, names, sizes
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
    embeddings: Tensor, labels: Tensor, groups: Tensor | None, sizes: budget.AuditSizes
) -> Codes:
    """The keys the audit counts with, of the rows of ``embeddings`` ``[N, D]`` (bit
    patterns as stored) and their ``labels`` / ``groups`` ``[N]`` (None: no group codes):
    :func:`sharded_codes` of one process on its own."""
    shard = sharded.Shard([embeddings], [embeddings.shape[0]], False, sizes, embeddings.device)
    return shard.codes(labels, groups)


Sides = tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]


def audit_directions(
    stored: tuple[Tensor, Tensor] | Callable[[], Codes],
    directions: Sequence[Sides | None],
    options: AuditOptions,
) -> list[DirectionAudit | None]:
    """The audit of each direction (None where it is None; a direction with the same sides
    as the one before is audited once). ``stored``: the embeddings ``[N, D]`` and metadata
    ``[N, >= 2]`` (label, group first), or a function making their :func:`codes` (a
    sharded gallery's); ``directions``: ``((query rows, identity), (gallery rows,
    identity))`` per direction, or None for one without queries or gallery."""
    if all(sides is None for sides in directions):
        return [None for _ in directions]
    if callable(stored):
        keys = stored()
    else:
        groups = stored[1][:, 1] if options.exclude != "none" else None
        keys = codes(stored[0], stored[1][:, 0], groups, options.sizes)
    audits: list[DirectionAudit | None] = []
    for index, sides in enumerate(directions):
        before = directions[index - 1] if index else None
        if (
            sides is not None
            and before is not None
            and all(torch.equal(a[0], b[0]) for a, b in zip(before, sides, strict=True))
        ):
            audits.append(audits[-1])
        else:
            action, sizes = options.empty_target_action, options.sizes
            audit = sides and audit_direction(keys, sides, options.exclude, action, sizes)
            audits.append(audit)
    return audits


def protocol_reports(
    audits: Sequence[DirectionAudit | None],
    near: Sequence[Tensor | None],
    counted: Sequence[int | None],
    options: AuditOptions,
) -> list[dict[str, int]]:
    """The report of each direction (the same on every process: its parts are), from its
    audit (None: without queries or gallery), the ranking's near counts (summed over
    processes; None: none) and the queries ``compute()`` counted (None: count here)."""
    with_near, zeros = options.near_duplicate is not None, torch.zeros(4, dtype=torch.int64)
    return [
        direction_report(
            (0 if audit is None else int(audit.counted.sum())) if queries is None else queries,
            audit,
            (zeros if audit is None else found) if with_near else None,
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
