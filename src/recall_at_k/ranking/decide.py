"""Deciding the pairs in band on canonical scores: ``s*``, the ties and the order at ``s*``.

The scans hand in a query's valid positives within ``2B`` of ``s*_f``, its negatives in
its band, and its negatives within ``B`` of the near-duplicate threshold; they are
re-scored canonically in one pass for many tiles, positives first (so ``s*`` is final
when a negative is compared). Every count is an integer sum of per-pair facts,
independent of how pairs are grouped."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from recall_at_k._kernel import Workspace
from recall_at_k.ranking.blocks import Gallery, Source
from recall_at_k.ranking.budget import PAIR_BYTES, PENDING_PAIRS, Budget
from recall_at_k.ranking.scan import Found

POSITIVE, NEGATIVE, NEAR = range(3)
"""The kinds of pairs."""


class Decided(NamedTuple):
    """Per query: ``s*`` (float64, -inf: none), ``p``, negatives at ``s*``, a near negative."""

    best: Tensor
    tied: Tensor
    equal: Tensor
    near: Tensor | None


class Decider:
    """The pairs of ``count`` queries waiting for canonical scores, and what they decided so far."""

    def __init__(
        self,
        greater: Tensor,
        source: Source,
        near_threshold: float | None,
        budget: Budget,
        workspace: Workspace,
    ) -> None:
        count, device = greater.shape[0], greater.device
        self.source, self.threshold, self.workspace = source, near_threshold, workspace
        self.greater = greater  # [Q] negatives above s*: those decided here are added
        self.best = torch.full((count,), -math.inf, dtype=torch.float64, device=device)
        counts = torch.int32 if budget.items < 2**31 else torch.int64  # exact: at most N
        self.tied = torch.zeros(count, dtype=counts, device=device)
        self.equal = torch.zeros(count, dtype=counts, device=device)
        near = near_threshold is not None
        self.near = torch.zeros_like(self.best, dtype=torch.bool) if near else None
        self.rescored = 0
        self.batch_bytes = budget.canonical_bytes
        self.limit = max(1, min(PENDING_PAIRS, budget.pending_bytes // PAIR_BYTES))
        self.pending = [_Waiting(device) for _ in range(3)]

    def add(self, kind: int, found: Found, offset: int = 0) -> None:
        """Pairs of ``kind``, their rows counted from query ``offset``."""
        if found.rows.numel():
            self.pending[kind].add(found, offset)

    def full(self) -> bool:
        """Whether enough pairs wait to decide them now."""
        return sum(waiting.size for waiting in self.pending) >= self.limit

    def flush(self, gallery: Gallery, last: bool = False) -> None:
        """Decide every waiting pair (all of ``gallery``): positives first. ``last``: none comes
        after, so a query's positives are re-scored only where a negative of it waits (or the
        near-duplicate threshold reads ``s*``): else its counts already tell its first hit."""
        for kind in (POSITIVE, NEGATIVE, NEAR):
            waiting = self.pending[kind]
            if waiting.size == 0:
                continue
            rows, columns, scores = waiting.take()
            if kind == POSITIVE and last and self.threshold is None:
                held = self.pending[NEGATIVE]
                negatives = rows[:0] if held.buffer is None else held.buffer[0, : held.size].long()
                asked = torch.isin(rows, negatives)
                rows, columns = rows[asked], columns[asked]
                scores = None if scores is None else scores[asked]
            if scores is None:  # else a callable's scores, kept
                scores = self.source.canonical(
                    gallery, rows, columns, self.workspace, self.batch_bytes
                )
            self.rescored += int(rows.shape[0])
            if kind == POSITIVE:
                self._positives(rows, scores)
            elif kind == NEGATIVE:
                at = self.best[rows]
                self.greater.index_add_(0, rows, (scores > at).to(self.greater.dtype))
                self.equal.index_add_(0, rows, (scores == at).to(self.equal.dtype))
            elif self.near is not None and self.threshold is not None:
                self.near[rows[scores >= self.threshold]] = True

    def _positives(self, rows: Tensor, scores: Tensor) -> None:
        """Merge positives' scores into each touched query's best and its count."""
        touched, inverse = torch.unique(rows, return_inverse=True)
        before = self.best[touched]
        best = torch.full_like(before, -math.inf).scatter_reduce_(0, inverse, scores, "amax")
        merged = torch.maximum(before, best)
        count = torch.zeros(touched.shape[0], dtype=self.tied.dtype, device=rows.device)
        count.index_add_(0, inverse, (scores == merged[inverse]).to(count.dtype))
        self.tied[touched] = self.tied[touched].masked_fill_(merged > before, 0).add_(count)
        self.best[touched] = merged

    def result(self) -> Decided:
        """What was decided; the waiting buffers are let go (every pair is decided)."""
        self.pending = []
        return Decided(self.best, self.tied, self.equal, self.near)


class _Waiting:
    """The waiting pairs of one kind, in one buffer grown by half as needed (many small
    tensors kept among the blocks' temporaries would fragment the C heap)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer: Tensor | None = None  # [3, capacity] float64: rows, columns, values
        self.size = 0
        self.kept = False  # whether values are kept (a callable's scores)

    def add(self, found: Found, offset: int) -> None:
        count = int(found.rows.shape[0])
        need = self.size + count
        if self.buffer is None or need > self.buffer.shape[1]:
            capacity = max(16, need + need // 2)
            grown = torch.empty((3, capacity), dtype=torch.float64, device=self.device)
            if self.buffer is not None:
                grown[:, : self.size] = self.buffer[:, : self.size]
            self.buffer = grown
        part = self.buffer[:, self.size : need]
        part[0] = found.rows  # exact: positions below 2**53
        part[0] += offset
        part[1] = found.columns
        if found.values is not None:
            part[2] = found.values
            self.kept = True
        self.size = need

    def take(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """The pairs so far (rows and columns int64), emptied."""
        assert self.buffer is not None
        rows, columns, values = self.buffer[:, : self.size]
        out = rows.long(), columns.long(), (values.clone() if self.kept else None)
        self.size = 0
        return out
