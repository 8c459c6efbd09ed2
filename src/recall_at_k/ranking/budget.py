"""How a ranking spends ``chunk_bytes``: the one budget for all it holds beside the one
copy of the embeddings.

``compute()`` adds one copy of the stored (or gathered) embeddings, in the ranking's
order (:mod:`~recall_at_k.ranking.ordered`), and everything else it holds comes out of
``chunk_bytes``: per item, the labels, sides, orders and per-query counts of the
bookkeeping (about :data:`BOOKKEEPING_BYTES_PER_ITEM` bytes); the C heap's and the
interpreter's share (:data:`RESERVED_BYTES`); and what is left, the scratch
(:func:`scratch_bytes`), sizes every tile, panel, block, waiting band and re-scoring
batch (:class:`~recall_at_k.ranking.bands.RankOptions` ``chunk_bytes``) and the blocks
that the ordered copy and the protocol audit read.

When ``chunk_bytes`` is too small to hold the bookkeeping of ``N`` items and
:data:`MIN_SCRATCH_BYTES`, the scratch is :data:`MIN_SCRATCH_BYTES` (or ``chunk_bytes``,
if smaller) and ``compute()`` adds more than ``chunk_bytes``: :func:`least_chunk_bytes` says how much ``chunk_bytes``
the bound needs. Results never depend on it.
"""

from __future__ import annotations

BOOKKEEPING_BYTES_PER_ITEM = 96
"""What the ranking keeps per item while it runs, at most: labels, sides, the queries'
label blocks and positions, their bounds, band edges and counts."""

RESERVED_BYTES = 2**19
"""Held back from ``chunk_bytes`` for what no tensor accounts for: Python objects made
during ``compute()`` and freed blocks below the C library's mmap threshold that stay
resident while a later block lies above them."""

MIN_SCRATCH_BYTES = 2**18
"""The least scratch a ranking takes, whatever ``chunk_bytes``."""


def bookkeeping_bytes(items: int) -> int:
    """What the bookkeeping of ``items`` items may take, :data:`RESERVED_BYTES`
    included."""
    return BOOKKEEPING_BYTES_PER_ITEM * max(0, items) + RESERVED_BYTES


def scratch_bytes(chunk_bytes: int, items: int) -> int:
    """The scratch of a ranking of ``items`` items within ``chunk_bytes``: what the
    bookkeeping leaves, at least :data:`MIN_SCRATCH_BYTES` (or ``chunk_bytes`` itself,
    if smaller: a ``chunk_bytes`` below it sizes the tiles as it says)."""
    return max(chunk_bytes - bookkeeping_bytes(items), min(chunk_bytes, MIN_SCRATCH_BYTES))


def least_chunk_bytes(items: int) -> int:
    """The smallest ``chunk_bytes`` that holds the bookkeeping of ``items`` items and
    :data:`MIN_SCRATCH_BYTES` of scratch."""
    return bookkeeping_bytes(items) + MIN_SCRATCH_BYTES
