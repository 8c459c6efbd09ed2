"""How a ranking spends ``chunk_bytes``: the one budget for all it holds beside the one
copy of the embeddings.

``compute()`` adds one copy of the stored (or gathered) embeddings, in the ranking's
order (:mod:`~recall_at_k.ranking.ordered`); everything else it holds comes out of
``chunk_bytes``: per item, the labels, sides, orders and per-query counts of the
bookkeeping (at most :data:`BOOKKEEPING_BYTES_PER_ITEM` bytes); the C heap's and the
interpreter's share (:data:`RESERVED_BYTES`); and what is left, the scratch
(:func:`scratch_bytes`), which sizes every tile, panel, block, waiting band and
re-scoring batch (:class:`~recall_at_k.ranking.bands.RankOptions` ``chunk_bytes``), and
the blocks that the ordered copy and the protocol audit read (:func:`block_bytes`).

A ``chunk_bytes`` too small to hold the bookkeeping of ``N`` items and the least
scratch cannot bound what ``compute()`` adds: :func:`least_chunk_bytes` is the smallest
that can. Results never depend on any of it.
"""

from __future__ import annotations

from typing import NamedTuple

BOOKKEEPING_BYTES_PER_ITEM = 128
"""What the ranking keeps per item while it runs, at most: labels, sides, the queries'
label blocks and positions, their bounds, band edges and counts."""

RESERVED_BYTES = 3 * 2**18
"""Held back from ``chunk_bytes`` for what no tensor accounts for: Python objects made
during ``compute()`` and freed blocks below the C library's mmap threshold that stay
resident while a later block lies above them."""

MIN_SCRATCH_BYTES = 2**18
"""The least scratch a ranking takes (unless ``chunk_bytes`` itself is smaller)..."""

MIN_SCRATCH_BYTES_PER_ITEM = 8
"""... or this many bytes an item, if more: with a scratch fixed whatever ``N`` the
blocks, spans and tiles of a large ranking are many and small, and their small buffers
land all over the C heap's free holes, each a page to touch (measured at 100,000 x 128
items, leave-one-out cosine, in one process: with 256 KiB of scratch ``compute()`` added
7.9-9.5 MiB or 13.2-16.2 MiB beyond the copy from run to run; with 800,000 bytes,
7.9-9.6 MiB)."""

BLOCK_SHARE = 4
"""The ordered copy, ``"cosine"``'s normalisation and the protocol audit read rows in
blocks of ``scratch / BLOCK_SHARE`` (their float64 and bit-pattern copies)..."""

MIN_BLOCK_ROWS = 16
"""... of at least this many rows (a float64 copy of a row: 8 bytes a value, and one
more working copy)."""


def bookkeeping_bytes(items: int) -> int:
    """What the bookkeeping of ``items`` items may take, :data:`RESERVED_BYTES`
    included."""
    return BOOKKEEPING_BYTES_PER_ITEM * max(0, items) + RESERVED_BYTES


def min_scratch_bytes(items: int) -> int:
    """The least scratch of a ranking of ``items`` items: :data:`MIN_SCRATCH_BYTES`, or
    :data:`MIN_SCRATCH_BYTES_PER_ITEM` an item if more."""
    return max(MIN_SCRATCH_BYTES, MIN_SCRATCH_BYTES_PER_ITEM * max(0, items))


def scratch_bytes(chunk_bytes: int, items: int) -> int:
    """The scratch of a ranking of ``items`` items within ``chunk_bytes``: what the
    bookkeeping leaves, at least :func:`min_scratch_bytes` (or ``chunk_bytes`` itself,
    if smaller: such a ``chunk_bytes`` sizes the tiles as it says)."""
    least = min(chunk_bytes, min_scratch_bytes(items))
    return max(chunk_bytes - bookkeeping_bytes(items), least)


def block_bytes(scratch: int, width: int) -> int:
    """The blocks of rows of ``width`` read by the ordered copy, the normalisation and
    the audit: a share of ``scratch``, at least :data:`MIN_BLOCK_ROWS` rows."""
    return max(1, scratch // BLOCK_SHARE, MIN_BLOCK_ROWS * 16 * width)


def least_chunk_bytes(items: int, width: int) -> int:
    """The smallest ``chunk_bytes`` that holds the bookkeeping of ``items`` items and a
    scratch whose blocks of rows of ``width`` are within their share."""
    least_scratch = max(min_scratch_bytes(items), BLOCK_SHARE * MIN_BLOCK_ROWS * 16 * width)
    return bookkeeping_bytes(items) + least_scratch


# --- the protocol audit

AUDIT_SHARE = 4
"""The audit of one process reads rows in blocks of at most ``chunk_bytes / AUDIT_SHARE``."""

AUDIT_SORT_BYTES = 40
"""Bytes an item of a sort of int64 keys (sorted copy, order, scratch): sizes a sort part."""

AUDIT_SORT_MIN_ITEMS = 1024
"""The fewest keys a part of the audit's sort in parts sorts at a time."""

AUDIT_SORT_MAX_PASSES = 1024
"""The most passes over the keys that the audit's sort in parts makes."""

AUDIT_CANDIDATE_BYTES = 256
"""Bytes a candidate pair of rounding copies takes while enumerated: sizes the pairs at a time."""

AUDIT_CANDIDATE_PAIRS = (64, 2**16)
"""The fewest and most candidate pairs of rounding copies enumerated and checked at a time."""

AUDIT_BLOCKS_PER_WORKER = 4
"""Blocks of rows each worker thread gets at least, so that the threads finish together."""

AUDIT_SHARDED_BLOCK_BYTES = 2**20
"""A sharded audit's rows hashed, compared or sent at a time: a fixed cost beside its codes."""

AUDIT_SHARDED_PROJECT_BYTES = 2**17
"""A sharded audit's rows (and their float64 copies) projected at a time."""

AUDIT_SHARDED_CANDIDATE_PAIRS = 2**13
"""A sharded audit's candidate pairs enumerated at a time (every process the same chunks)."""


class AuditSizes(NamedTuple):
    """Every size the protocol audit (:mod:`recall_at_k.audit`) works in."""

    block_bytes: int  # rows hashed, compared or checked at a time, all threads together
    project_bytes: int  # rows projected at a time (a copy and a float64 copy)
    sort_items: int  # keys sorted (or scattered) at a time
    sort_passes: int  # passes over the keys of one sort in parts, at most
    candidate_pairs: int  # pairs (or queries) enumerated and checked at a time
    blocks_per_worker: int  # blocks each worker thread gets at least


def audit_sizes(block_bytes: int) -> AuditSizes:
    """The audit's sizes in one process, its rows read ``block_bytes`` at a time."""
    least, most = AUDIT_CANDIDATE_PAIRS
    return AuditSizes(
        block_bytes=max(1, block_bytes),
        project_bytes=max(1, block_bytes),
        sort_items=max(AUDIT_SORT_MIN_ITEMS, block_bytes // AUDIT_SORT_BYTES),
        sort_passes=AUDIT_SORT_MAX_PASSES,
        candidate_pairs=max(least, min(most, block_bytes // AUDIT_CANDIDATE_BYTES)),
        blocks_per_worker=AUDIT_BLOCKS_PER_WORKER,
    )


def sharded_audit_sizes() -> AuditSizes:
    """The audit's sizes over rows sharded across processes: fixed buffers."""
    return audit_sizes(AUDIT_SHARDED_BLOCK_BYTES)._replace(
        project_bytes=AUDIT_SHARDED_PROJECT_BYTES,
        candidate_pairs=AUDIT_SHARDED_CANDIDATE_PAIRS,
    )
