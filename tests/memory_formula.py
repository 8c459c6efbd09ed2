"""The memory that ``EmbeddingRecallAtK.compute()`` may add, in one place.

``docs/large-galleries.md`` states this formula, ``tests/test_memory.py`` measures
``compute()`` against it, ``tests/test_large_galleries_page.py`` checks the page against
these constants, and ``benchmarks/scale.py`` projects large evaluations with them. To
change the bound, change it here: the tests then say which sentence of the page to
rewrite.

The peak ``compute()`` adds on top of the stored embeddings is at most::

    COPIES x embedding bytes          (stored, or gathered under DDP)
  + SCRATCH_TILES x tile              (tile = chunk_bytes, on CPU at most CPU_TILE_BYTES)
  + BYTES_PER_ITEM x N
  + FIXED_BYTES
"""

from __future__ import annotations

COPIES = 1
"""Copies of the stored (one process) or gathered (DDP) embeddings: the ranking's
ordered copy, the gallery a view of it."""

SCRATCH_TILES = 4
"""Tiles of scratch (a tile: ``chunk_bytes``, at most ``CPU_TILE_BYTES`` on CPU) that a
ranking adds: its tiles of scores hold a quarter of ``chunk_bytes``
(``recall_at_k.ranking.rank.SCRATCH_SHARE``) with their queries' copies, the panels,
their stack and the symmetric blocks are sized from them, the canonical re-scoring's
buffers from ``chunk_bytes / 16``; the audit, the ordered copy and ``"cosine"``'s
normalisation work on blocks of ``chunk_bytes / 4``. Measured in one process, what that
scratch and the bookkeeping add is 0.9-2.0 MiB (1.8-3.9x ``chunk_bytes``) for
1,600 x 2,048 items and a 512 KiB chunk, and 4.8-7.4 MiB (1.2x ``chunk_bytes`` for
query/gallery, 1.9x for leave-one-out) with 24,000 x 256 items and a 4 MiB chunk:
per-item bookkeeping, the audit's codes, the symmetric route's pending pairs and small
buffers that stay in the C heap."""

BYTES_PER_ITEM = 256
"""Bookkeeping per item: metadata, orders, sides, bands."""

FIXED_BYTES = 4 * 2**20
"""Blocks of at least 16 rows (``recall_at_k._audit.BLOCK_MIN_ROWS``, their float64
copies: 512 KiB at D = 2,048, whatever ``chunk_bytes``), and temporaries below the C
library's mmap threshold (128 KiB here) that, once freed, stay in the heap while a later
allocation lies above them: measured up to about 3 MiB after the audit of 1,600 x 2,048
items (``"euclidean"`` leave-one-out), returned to the system later in ``compute()``."""

CPU_TILE_BYTES = 32 * 2**20
"""On CPU a tile never exceeds this (``recall_at_k.ranking.rank.CPU_TILE_BYTES``)."""

DEFAULT_CHUNK_BYTES = 256 * 2**20
"""``EmbeddingRecallAtK``'s default ``chunk_bytes``."""

SHARDED_PASSES = 2
"""With ``sharded=True`` the gallery goes round the processes this many times (each
query's best positive score, then the negatives above it): each pass computes the products of a process's
queries with every gallery block and moves every block once."""


ALLOWANCE_BYTES = 2**20
"""The issue's bound -- stored (or gathered) bytes + ``chunk_bytes`` -- is given this on
top for the interpreter and the C allocator, whatever the sizes: Python objects made
during ``compute()`` (frames, named tuples of small tensors, the workers' queues) and
temporaries below the C library's mmap threshold (128 KiB when measured), which stay
resident while a later allocation lies above them (the heap grows in steps of 128 KiB,
glibc's ``M_TOP_PAD``). ``tests/test_memory.py`` checks :func:`chunk_bound` where it
holds (``WITHIN_CHUNK``)."""


def chunk_bound(embedding_bytes: int, chunk_bytes: int) -> int:
    """The issue's bound on what ``compute()`` adds: one copy of the embeddings, plus
    ``chunk_bytes``, plus :data:`ALLOWANCE_BYTES`."""
    return embedding_bytes + chunk_bytes + ALLOWANCE_BYTES


def tile_bytes(chunk_bytes: int, device: str) -> int:
    """The tile of a ranking on ``device`` for a ``chunk_bytes``."""
    return chunk_bytes if device == "cuda" else min(chunk_bytes, CPU_TILE_BYTES)


def compute_bound(embedding_bytes: int, items: int, tile: int) -> int:
    """What the formula allows ``compute()`` to add: ``embedding_bytes`` are the stored
    (or gathered) embeddings of ``items`` items, ``tile`` from :func:`tile_bytes`."""
    return COPIES * embedding_bytes + SCRATCH_TILES * tile + BYTES_PER_ITEM * items + FIXED_BYTES


def ring_bytes_received(items: int, dim: int, world: int, element: int = 4) -> int:
    """Embedding bytes a process receives with ``sharded=True``: in each of the
    ``SHARDED_PASSES`` passes, the blocks of every other process."""
    return SHARDED_PASSES * (items - items // world) * dim * element


def gathered_bytes_received(items: int, dim: int, world: int, element: int = 4) -> int:
    """Embedding bytes a process receives under DDP without sharding: every other
    process's embeddings, once."""
    return (items - items // world) * dim * element
