"""Per-query outcomes of a ranking, gathered across processes (``query_outcomes()``).

:func:`rank_outcomes` ranks every direction as :func:`recall_at_k.ranking.rank.rank_shared`
does -- each process its contiguous share of the queries when the states are gathered --
but keeps each query's outcome record (:func:`recall_at_k._kernel.query_outcomes`)
instead of summing them, and gathers the shares so that every process holds every
query's record, in the order of the direction's queries. The per-query counts do not
depend on how queries are grouped into tiles, threads or processes, so the records are
those of one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k import _collectives, _kernel
from recall_at_k._embedding_checks import nan_scores_error
from recall_at_k._kernel import TieCounts
from recall_at_k.ranking.bands import RankOptions, Route
from recall_at_k.ranking.gallery import Side
from recall_at_k.ranking.rank import ProcessGroup, rank


def rank_outcomes(
    embeddings: Tensor,
    labels: Tensor,
    groups: Tensor,
    directions: Sequence[tuple[Side, Side] | None],
    options: RankOptions,
    route: Route,
    shared: ProcessGroup | None,
) -> list[Tensor | None]:
    """Each direction's outcome records, one per query of its side, in the side's order.

    Returns:
        Per direction, the records of :func:`recall_at_k._kernel.query_outcomes` (int64
        ``[Q]`` bins, or float64 ``[Q, max_k + 1]`` for ``"expected"``), or None where
        the direction is None. Collective under DDP (``shared`` given): every process
        calls it and receives every record.
    """
    world, me, group = 1, 0, None
    if shared is not None and dist.is_available() and dist.is_initialized():
        group = shared.group
        world, me = dist.get_world_size(group), dist.get_rank(group)
    results: list[Tensor | None] = []
    for sides in directions:
        if sides is None:
            results.append(None)
            continue
        queries, gallery = sides
        num = queries.rows.shape[0]
        lo, hi = num * me // world, num * (me + 1) // world
        share = Side(queries.rows[lo:hi], queries.identity[lo:hi])
        records = _empty_records(hi - lo, options, embeddings.device)
        failure: Exception | None = None
        nan = 0

        def collect(positions: Tensor, counts: TieCounts, out: Tensor = records) -> None:
            out[positions] = _kernel.query_outcomes(counts, options.ties, options.max_k)

        try:
            counts = rank(embeddings, labels, groups, share, gallery, options, route, None, collect)
            nan = int(counts.nan_queries)
        except Exception as err:
            if world == 1:
                raise
            failure = err  # take part in the collectives below, then raise everywhere
        flags = torch.tensor([int(failure is not None), nan], device=embeddings.device)
        if world > 1:
            _collectives.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
        if failure is not None:
            raise failure
        if int(flags[0]):
            raise RuntimeError(
                "EmbeddingRecallAtK.query_outcomes() failed on another process; see its error"
            )
        if int(flags[1]):
            raise nan_scores_error(int(flags[1]))
        if world > 1:
            records = _gather_shares(records, num, world, group)
        results.append(records)
    return results


def _empty_records(rows: int, options: RankOptions, device: torch.device) -> Tensor:
    if options.ties == "expected":
        return torch.zeros(rows, options.max_k + 1, dtype=torch.float64, device=device)
    return torch.zeros(rows, dtype=torch.int64, device=device)


def _gather_shares(records: Tensor, num: int, world: int, group: Any) -> Tensor:
    """Every process's share (process r holds ``num * r // world`` up to
    ``num * (r + 1) // world``), concatenated in process order."""
    sizes = [num * (r + 1) // world - num * r // world for r in range(world)]
    widest = max(sizes)
    padded = records.new_zeros((widest, *records.shape[1:]))
    padded[: records.shape[0]] = records
    parts = [torch.empty_like(padded) for _ in range(world)]
    _collectives.all_gather(parts, padded, group=group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])
