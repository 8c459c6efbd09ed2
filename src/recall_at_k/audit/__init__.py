"""The protocol audit of ``EmbeddingRecallAtK`` (pure functions): per direction, the queries
whose gallery holds a non-ignored item, another sample, bitwise equal to them
(``identical_*``) or equal up to float rounding (``rounding_*``), and the gallery items
equal to an earlier one; the ranking counts the ``near_*`` keys."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k import _collectives as collectives
from recall_at_k.audit import sharded
from recall_at_k.audit.report import AuditOptions, audit_direction
from recall_at_k.audit.report import Codes as Codes
from recall_at_k.audit.report import DirectionAudit as DirectionAudit
from recall_at_k.audit.report import counted_queries as counted_queries
from recall_at_k.audit.report import protocol_reports as protocol_reports
from recall_at_k.audit.report import warning_message as warning_message
from recall_at_k.audit.sharded import sharded_codes as sharded_codes
from recall_at_k.ranking import budget


def options_of(metric: Any) -> AuditOptions:
    """The audit options of an :class:`~recall_at_k.EmbeddingRecallAtK`."""
    names = tuple(metric.directions) if metric.bidirectional else ("",)
    sizes = budget.audit_sizes(metric.chunk_bytes // budget.AUDIT_SHARE)
    rules = metric.exclude, metric.empty_target_action, metric.near_duplicate
    return AuditOptions(*rules, names, sizes)


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
    """:func:`sharded_codes` of one process's ``embeddings``, ``labels``, ``groups`` (or None)."""
    shard = sharded.Shard([embeddings], [embeddings.shape[0]], False, sizes, embeddings.device)
    return shard.codes(labels, groups)


def audit_directions(
    stored: tuple[Tensor, Tensor] | Callable[[], Codes],
    directions: Sequence[Any],
    options: AuditOptions,
) -> list[DirectionAudit | None]:
    """Each direction's audit (``((query rows, identity), (gallery rows, identity))`` or None) of
    ``stored`` ``[N, D]`` and ``meta`` ``[N, >= 2]``, or of a :func:`codes` maker (sharded)."""
    if all(sides is None for sides in directions):
        return [None for _ in directions]
    if callable(stored):
        keys = stored()
    else:
        groups = stored[1][:, 1] if options.exclude != "none" else None
        keys = codes(stored[0], stored[1][:, 0], groups, options.sizes)
    audits: list[DirectionAudit | None] = []
    for sides, before in zip(directions, [None, *directions], strict=False):
        if sides is None:
            audits.append(None)
        elif before is not None and all(
            map(torch.equal, (b[0] for b in before), (s[0] for s in sides))
        ):
            audits.append(audits[-1])
        else:
            audits.append(audit_direction(keys, sides, options))
    return audits


def stale_anywhere(metric: Any, stale: bool) -> bool:
    """Whether the metric's report is stale on any process that its ``compute()`` syncs
    with (all of them then audit again, together); ``stale`` alone otherwise."""
    available = metric.distributed_available_fn
    if not (metric.sync_on_compute and callable(available) and available()):
        return stale
    flag = torch.tensor([int(stale)], dtype=torch.int64, device=metric.device)
    collectives.all_reduce(flag, op=dist.ReduceOp.MAX, group=metric.process_group)
    return bool(flag)
