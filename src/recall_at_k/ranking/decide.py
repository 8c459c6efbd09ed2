"""Deciding the in-band pairs on canonical scores: s*, the ties and the order at s*, and
the near-duplicate counts, for the queries of successive tiles at once."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from recall_at_k._kernel import TieCounts, Workspace
from recall_at_k.ranking.bands import NEAR_COUNTS, Band, Pairs, RankOptions
from recall_at_k.ranking.gallery import Gallery, Queries
from recall_at_k.ranking.score import CANONICAL_BATCH_BYTES, canonical_scores

CANONICAL_SHARE = 16
"""The canonical re-scoring's batches take ``chunk_bytes / CANONICAL_SHARE`` (at most
``CANONICAL_BATCH_BYTES``): their buffers, 2.5 batches, stay in the workspace."""


class Decided(NamedTuple):
    """The counts of decided tiles: ``g_>``, ``g_> + e``, ``p`` per query, the pairs
    re-scored, and the near-duplicate counts (:data:`NEAR_COUNTS`)."""

    counts: TieCounts
    rescored: Tensor
    near: Tensor


def decide(
    embeddings: Tensor,
    gallery: Gallery,
    tiles: list[tuple[Queries, Band]],
    options: RankOptions,
    known: Tensor | None,
    workspace: Workspace,
) -> Decided:
    """g_>, g_> + e and p of each query of ``tiles``, decided on canonical scores.

    The in-band pairs are re-scored canonically (a callable's scores are kept as they
    are): s* is the best canonical score of the in-band valid positives (the positive
    with the best fast score is always among them, and every positive outside the band
    scores below it), p counts those equal to it, and the in-band valid negatives add to
    g_> (canonical score above s*) or to e (equal). Label-and-group junk is dropped.

    With a near-duplicate threshold t: a query has a near positive when s* >= t, a near
    negative when an item was surely at or above t (fast score above t + B) or one
    within B of t has a canonical score >= t (the pairs of the tile's label blocks,
    positives and junk, are dropped), a near hit at 1 when s* >= t and no negative
    scores at s* or above (above, under ``"optimistic"``).
    """
    tile = Queries._make(torch.cat(fields) for fields in zip(*(t for t, _ in tiles), strict=True))
    offsets = [0]
    for part, _ in tiles[:-1]:
        offsets.append(offsets[-1] + part.rows.shape[0])
    bands = [band for _, band in tiles]
    rows, columns, values = joined([band.pairs for band in bands], offsets)
    if callable(options.similarity) and values is None:
        values = torch.zeros(0, dtype=torch.float64, device=rows.device)
    positive = gallery.labels[columns] == tile.labels[rows]
    if options.exclude == "same_label_and_group":
        keep = ~positive | (gallery.groups[columns] != tile.groups[rows])
        rows, columns, positive = rows[keep], columns[keep], positive[keep]
        values = None if values is None else values[keep]
    threshold = options.near_duplicate
    near_rows = near_columns = near_values = None
    if threshold is not None:
        parts = [band.near_pairs for band in bands if band.near_pairs is not None]
        near_rows, near_columns, near_values = joined(parts, offsets)
        negative = gallery.labels[near_columns] != tile.labels[near_rows]
        near_rows, near_columns = near_rows[negative], near_columns[negative]
        near_values = None if near_values is None else near_values[negative]
        num_band = rows.shape[0]
        rows_all, columns_all = torch.cat([rows, near_rows]), torch.cat([columns, near_columns])
        if values is not None:
            extra = near_values if near_values is not None else values[:0]
            values = torch.cat([values.to(torch.float64), extra.to(torch.float64)])
    else:
        num_band, rows_all, columns_all = rows.shape[0], rows, columns
    if values is not None:
        scores_all = values.to(torch.float64)
    else:
        scores_all = canonical_scores(
            embeddings,
            tile.rows[rows_all],
            gallery.rows[columns_all],
            options.similarity,
            workspace,
            min(CANONICAL_BATCH_BYTES, options.chunk_bytes // CANONICAL_SHARE),
        )
    scores = scores_all[:num_band]
    num_rows = tile.rows.shape[0]
    best = torch.full((num_rows,), -math.inf, dtype=torch.float64, device=scores.device)
    best.scatter_reduce_(0, rows[positive], scores[positive], reduce="amax")
    at = best[rows]
    tied = torch.zeros(num_rows, dtype=torch.int64, device=scores.device)
    tied.index_add_(0, rows, (positive & (scores == at)).to(torch.int64))
    negative = ~positive
    greater = torch.cat([band.greater.to(torch.int64) for band in bands])
    greater.index_add_(0, rows, (negative & (scores > at)).to(torch.int64))
    at_or_above = greater.clone()
    at_or_above.index_add_(0, rows, (negative & (scores == at)).to(torch.int64))
    has_positive = torch.cat([band.has_positive for band in bands])
    rescored = torch.tensor(rows_all.shape[0], dtype=torch.int64, device=scores.device)
    counts = TieCounts(greater, at_or_above, tied, has_positive)
    near = torch.zeros(len(NEAR_COUNTS), dtype=torch.int64, device=scores.device)
    if threshold is not None and near_rows is not None:
        reached = torch.cat([band.near_sure for band in bands if band.near_sure is not None])
        reached = reached.to(torch.int64)
        reached.index_add_(0, near_rows, (scores_all[num_band:] >= threshold).to(torch.int64))
        near_negative = reached > 0
        near_positive = has_positive & (best >= threshold)
        if known is not None:
            near_positive |= known[0, tile.position]
            near_negative |= known[1, tile.position]
        beaten = greater if options.ties == "optimistic" else at_or_above
        near_hit = has_positive & (best >= threshold) & (beaten == 0)
        near = torch.stack(
            [
                near_positive.sum(),
                (near_negative & has_positive).sum(),
                (near_negative & ~has_positive).sum(),
                near_hit.sum(),
            ]
        )
    return Decided(counts, rescored, near)


def joined(parts: list[Pairs], offsets: list[int]) -> tuple[Tensor, Tensor, Tensor | None]:
    """The pairs of successive tiles, rows counted from the first tile's first row."""
    rows = torch.cat([pairs.rows + offset for pairs, offset in zip(parts, offsets, strict=True)])
    columns = torch.cat([pairs.columns for pairs in parts])
    kept = [pairs.values for pairs in parts if pairs.values is not None]
    return rows, columns, torch.cat(kept) if kept else None
