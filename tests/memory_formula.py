"""The memory that ``EmbeddingRecallAtK.compute()`` may add, in one place.

``docs/large-galleries.md`` states this formula, ``tests/test_memory.py`` measures
``compute()`` against it, ``tests/test_large_galleries_page.py`` checks the page against
these constants, and ``benchmarks/scale.py`` projects large evaluations with them. To
change the bound, change it here (and in :mod:`recall_at_k.ranking.budget`, which the
ranking sizes its scratch by): the tests then say which sentence of the page to rewrite.

The peak ``compute()`` adds on top of the stored embeddings is at most::

    COPIES x embedding bytes          (stored, or gathered under DDP)
  + max(chunk_bytes, least_chunk_bytes(N, D))

Everything beside the one copy -- tiles, panels, blocks, waiting bands, the canonical
re-scoring's batches, the protocol audit's blocks and the bookkeeping of every item --
comes out of ``chunk_bytes`` (:func:`recall_at_k.ranking.budget.scratch_bytes`). A
``chunk_bytes`` too small for the bookkeeping of ``N`` items cannot hold it: then the
least that can, :func:`least_chunk_bytes`.
"""

from __future__ import annotations

from recall_at_k.ranking import budget

COPIES = 1
"""Copies of the stored (one process) or gathered (DDP) embeddings: the ranking's
ordered copy, the gallery a view of it."""

BOOKKEEPING_BYTES_PER_ITEM = budget.BOOKKEEPING_BYTES_PER_ITEM
"""Bookkeeping per item that ``chunk_bytes`` must hold beside the scratch."""

CPU_TILE_BYTES = 32 * 2**20
"""On CPU a tile never exceeds this (``recall_at_k.ranking.budget.CPU_TILE_BYTES``)."""

DEFAULT_CHUNK_BYTES = 256 * 2**20
"""``EmbeddingRecallAtK``'s default ``chunk_bytes``."""

SHARDED_SCRATCH_TILES = 4
"""With ``sharded=True`` a process's scratch is about this many tiles of ``chunk_bytes``
(on CPU at most ``CPU_TILE_BYTES``), beside its bookkeeping: the projection's."""

SHARDED_PASSES = 2
"""With ``sharded=True`` the gallery goes round the processes this many times (each
query's best positive score, then the negatives above it): each pass computes the
products of a process's queries with every gallery block and moves every block once."""


def least_chunk_bytes(items: int, width: int) -> int:
    """The smallest ``chunk_bytes`` within which ``compute()`` keeps everything beside
    the copy, for ``items`` items of ``width``."""
    return budget.least_chunk_bytes(items, width)


def chunk_bound(embedding_bytes: int, chunk_bytes: int, items: int, width: int) -> int:
    """What ``compute()`` may add: one copy of the embeddings (``embedding_bytes``, of
    ``items`` items of ``width``), plus ``chunk_bytes`` or, if larger, the least that
    holds their bookkeeping."""
    return COPIES * embedding_bytes + max(chunk_bytes, least_chunk_bytes(items, width))


def ring_bytes_received(items: int, dim: int, world: int, element: int = 4) -> int:
    """Embedding bytes a process receives with ``sharded=True``: in each of the
    ``SHARDED_PASSES`` passes, the blocks of every other process."""
    return SHARDED_PASSES * (items - items // world) * dim * element


def gathered_bytes_received(items: int, dim: int, world: int, element: int = 4) -> int:
    """Embedding bytes a process receives under DDP without sharding: every other
    process's embeddings, once."""
    return (items - items // world) * dim * element
