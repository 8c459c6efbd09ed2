"""What an :class:`~recall_at_k.EmbeddingRecallAtK` carries between calls (never metric
state): the processes its next ranking sees, the protocol report and its warning; and
the audit each ranking runs beside it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from recall_at_k import audit
from recall_at_k.audit.report import AuditOptions
from recall_at_k.ranking import budget, engine, plan
from recall_at_k.ranking.blocks import Processes
from recall_at_k.ranking.stored import BroadcastRows


class Synced(NamedTuple):
    """The group the next ranking sees, and (in ``sync_context``) this process's own states."""

    group: Any
    local: tuple[list[Tensor], list[Tensor]] | None


class Lifecycle:
    """The state object of an instance's calls."""

    __slots__ = ("keep_rows", "report", "synced", "warning")

    def __init__(self) -> None:
        self.keep_rows = False  # inside sync_context: the next sync keeps rows in place
        self.synced: Synced | None = None  # set by sync(), until unsync()
        self.report: tuple[list[dict[str, int]], bool] | None = None  # and whether synced
        self.warning: str | None = None  # the audit's: None, its text until compute() shows it, ""


def audits_for(
    life: Lifecycle,
    options: AuditOptions,
    planned: plan.Plan,
    sharded: bool,
    group: Processes | None,
) -> list[audit.DirectionAudit | None] | None:
    """Each direction's protocol audit, or None while the kept report counted the local data."""
    kept = life.report
    if kept is not None and group is None and not kept[1]:
        return None
    options = options._replace(sizes=budget.audit_sizes(planned.budget.row_block_bytes))
    stored: tuple[Tensor, Tensor] | Callable[[], audit.Codes]
    if sharded:
        rows = planned.rows
        assert isinstance(rows, BroadcastRows)
        groups = planned.groups if options.exclude != "none" else None

        def stored() -> audit.Codes:
            held = rows.local.blocks, rows.counts, planned.labels, groups, rows.group
            return audit.sharded_codes(*held, budget.sharded_audit_sizes())
    else:
        assert planned.embeddings is not None
        stored = planned.embeddings, torch.stack([planned.labels, planned.groups], dim=1)
    return audit.audit_directions(stored, planned.directions, options)


def keep_report(
    life: Lifecycle,
    options: AuditOptions,
    audits: Sequence[audit.DirectionAudit | None] | None,
    ranked: Sequence[engine.Ranked | None],
    sides: Sequence[plan.Direction | None],
    synced: bool,
) -> None:
    """Keep the report of ``audits`` (None: the one there is) and its warning about identical
    positives or repeated gallery items, for ``compute()`` to show once."""
    if audits is not None or life.report is None:
        audits = [None] * len(ranked) if audits is None else audits
        near = [None if r is None else r.near for r in ranked]
        hists = [None if r is None else (r.hist, r.queries) for r in ranked]
        counted = audit.counted_queries(hists, options.empty_target_action)
        life.report = audit.protocol_reports(audits, near, counted, options), synced
    message = audit.warning_message(options.names, life.report[0], sides)
    if message is not None and life.warning is None:
        life.warning = message
