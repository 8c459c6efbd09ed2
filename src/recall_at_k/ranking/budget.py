"""Every size derived from ``chunk_bytes``, and every other byte, share or row count the
package works in: one module, so that one test can add them up.

``EmbeddingRecallAtK.compute()`` adds one copy of the embeddings in the ranking's order;
everything else comes out of ``chunk_bytes``: the per-item bookkeeping
(:func:`bookkeeping_bytes`), then the scratch (:func:`scratch_bytes`), cut into the
shares of :class:`Budget`, which sum to less than the scratch (tiles and their scans'
buffers, pairs waiting to be decided, a sharded gallery's run passing by). Preparing the
rows and each direction's gallery statistics come before the ranking, a block of
:attr:`Budget.row_block_bytes` at a time. Below :func:`least_chunk_bytes` the ranking
takes the least scratch. Results never depend on any size here."""

from __future__ import annotations

from typing import NamedTuple

import torch

# --- the bookkeeping beside the scratch

BOOKKEEPING_BYTES_PER_ITEM = 128
"""What a ranking keeps per item, at most (labels, groups, sides, orders, per-query state)."""
RESERVED_BYTES = 3 * 2**18
"""Held back for what no tensor accounts for (Python objects, C heap blocks)."""
MIN_SCRATCH_BYTES = 2**18
"""The least scratch of a ranking (unless ``chunk_bytes`` itself is smaller) ..."""
MIN_SCRATCH_BYTES_PER_ITEM = 8
"""... or this many bytes an item, if more (a fixed scratch would cut into tiny blocks)."""
MIN_BLOCK_ROWS = 16
"""Rows are copied, normalised and audited in blocks of at least this many rows."""

# --- the shares of the scratch while the ranking runs (their sum is at most 1)

TILE_SHARE = 4
"""All worker threads' tiles: ``scratch / TILE_SHARE``; their scans' buffers as much again."""
PENDING_SHARE = 16
"""Pairs waiting for their canonical score; deciding them takes as much again."""
CANONICAL_SHARE = 32
"""A canonical batch's gathered rows (two float64 sides and the rows' dtype: 2.5 batches)."""
RUN_SHARE = 8
"""A sharded gallery's run (its rows and their prepared copy: twice that) ..."""
RUN_MIN_ROWS = 8
"""... of at least this many float32 rows (each run costs a step per tile of queries)."""
ROW_BLOCK_SHARE = 4
"""Before the ranking: rows copied, normalised and audited (copies included) at a time."""
PAIR_BYTES = 24
"""A waiting pair: query and gallery row (int64 each) and a callable's score."""

# --- the score forms

DENSE_BLOCK_BYTES = 2**20
"""The dense form scores a CPU thread's block of rows in about this many bytes (cached)."""
DENSE_SMALL_BATCH = 2**15
"""Dense batches of at most this many scores take the fewest operations (not the blocks)."""
DENSE_FEW_TARGETS = 64
"""A dense ``[Q]`` target of at most this many values is range-checked on the host."""
PAIRED_TERMS = 2**16
"""The exact McNemar tail adds this many of its terms at a time (float64 each)."""
FLAT_SLACK_BYTES = 1024 * (5 + 10) * 8
"""Bytes of packed flat rows (1,024 of 5 columns + K = 10) that may wait for a merge."""

# --- speed on CPU: sizes that buy nothing larger (none is a bound on memory)

CPU_TILE_BYTES = 32 * 2**20
"""On CPU, tiles hold at most this many bytes of scores."""
CPU_WORKER_BYTES = 2**20
"""On CPU, worker threads share a task only where each gets this many bytes of it at a time."""
CPU_PANEL_BYTES = 2 * 2**20
"""On CPU a tile's scores beyond its label blocks come in cache-sized panels of columns ..."""
CPU_PANEL_COLUMNS = 512
"""... at most this many columns wide (the BLAS packs the widest panel)."""
PRODUCT_COLUMNS = 8
"""Products are widened to a multiple of this many columns where the tile holds them."""
CPU_STACK_BYTES = 4 * 2**20
"""Panel rows that reach their band are stacked aside in about this many bytes."""
CPU_SQUARE_BYTES = 4 * 2**20
"""Leave-one-out on CPU: the product in square blocks of about this many bytes."""
SQUARE_MIN_ROWS = 64
"""Square blocks of fewer rows (but not every item) cost more than tiles."""
CPU_WIDE_ROWS_BYTES = 2**21
"""On CPU rows are widened to float64 (normalised, hashed, projected) this many bytes at a
time, in cache."""
CANONICAL_BATCH_BYTES = 2**20
"""A canonical batch never takes more than this, whatever the scratch (in cache)."""
CANONICAL_DIM_BLOCK = 64
"""Canonical re-scoring gathers this many dimensions at a time (in the order ``d = 0..D-1``)."""
NORM_DIM_BLOCK = 16
"""Cosine norms square this many dimensions at a time (buffer: ``17/16`` float64 row)."""
PENDING_PAIRS = 2**16
"""Pairs are decided once this many wait (or the pending share is full, or at the end)."""


class Budget(NamedTuple):
    """The sizes of one ranking of ``items`` items of width ``width`` within ``chunk_bytes``."""

    items: int
    width: int
    scratch: int
    tile_bytes: int  # all workers' tiles together
    pending_bytes: int
    canonical_bytes: int
    run_bytes: int  # a sharded gallery's run
    row_block_bytes: int

    def shares(self, sharded: bool = False) -> dict[str, int]:
        """What the ranking holds at once beside the bookkeeping, by share: their sum is
        at most :attr:`scratch` (``tests/test_budget.py`` holds it for every size)."""
        return {
            "tiles": self.tile_bytes,
            "scans": self.tile_bytes,
            "pending": self.pending_bytes,
            "decisions": self.pending_bytes + 5 * self.canonical_bytes // 2,
            "run": 2 * self.run_bytes if sharded else 0,
        }

    def tile_for(self, device: torch.device, workers: int = 1) -> int:
        """The bytes of one worker's tile on ``device`` (CPU: at most :data:`CPU_TILE_BYTES`)."""
        tile = min(self.tile_bytes, CPU_TILE_BYTES) if device.type == "cpu" else self.tile_bytes
        return max(1, tile // max(1, workers))

    def row_block_rows(self, bytes_per_value: int = 16) -> int:
        """Rows copied, normalised or audited at a time (``bytes_per_value``: per value)."""
        return max(1, self.row_block_bytes // (bytes_per_value * max(1, self.width)))


def workers_within(threads: int, work_bytes: int, least: int = CPU_WORKER_BYTES) -> int:
    """How many of ``threads`` CPU worker threads share work of ``work_bytes`` at a time
    (all threads together): at most one per ``least`` bytes, at least one."""
    return max(1, min(threads, work_bytes // max(1, least)))


def wide_rows(width: int, rows: int, device: torch.device) -> int:
    """Of ``rows`` rows of ``width`` values, how many to widen to float64 at a time: on CPU
    within :data:`CPU_WIDE_ROWS_BYTES` (in cache), elsewhere all; at most ``rows``, at
    least one."""
    if device.type != "cpu":
        return max(1, rows)
    return max(1, min(rows, CPU_WIDE_ROWS_BYTES // max(1, 8 * width)))


def bookkeeping_bytes(items: int) -> int:
    """What the bookkeeping of ``items`` items may take, :data:`RESERVED_BYTES` included."""
    return BOOKKEEPING_BYTES_PER_ITEM * max(0, items) + RESERVED_BYTES


def min_scratch_bytes(items: int) -> int:
    """The least scratch of a ranking of ``items`` items."""
    return max(MIN_SCRATCH_BYTES, MIN_SCRATCH_BYTES_PER_ITEM * max(0, items))


def scratch_bytes(chunk_bytes: int, items: int) -> int:
    """What ``chunk_bytes`` leaves beside the bookkeeping of ``items`` items, at least
    :func:`min_scratch_bytes` (or ``chunk_bytes`` itself, if smaller)."""
    least = min(chunk_bytes, min_scratch_bytes(items))
    return max(chunk_bytes - bookkeeping_bytes(items), least)


def least_chunk_bytes(items: int, width: int) -> int:
    """The smallest ``chunk_bytes`` that holds the bookkeeping of ``items`` items and a
    scratch whose row blocks hold :data:`MIN_BLOCK_ROWS` rows of ``width``."""
    least_scratch = max(min_scratch_bytes(items), ROW_BLOCK_SHARE * MIN_BLOCK_ROWS * 16 * width)
    return bookkeeping_bytes(items) + least_scratch


def budget(chunk_bytes: int, items: int, width: int) -> Budget:
    """The sizes of a ranking of ``items`` items of width ``width``."""
    scratch = scratch_bytes(chunk_bytes, items)
    tiles, pending, run = (max(1, scratch // s) for s in (TILE_SHARE, PENDING_SHARE, RUN_SHARE))
    run = max(run, RUN_MIN_ROWS * 4 * width)
    canonical = max(1, min(CANONICAL_BATCH_BYTES, scratch // CANONICAL_SHARE))
    row_block = max(1, scratch // ROW_BLOCK_SHARE, MIN_BLOCK_ROWS * 16 * width)
    return Budget(items, width, scratch, tiles, pending, canonical, run, row_block)


# --- the protocol audit

AUDIT_SHARE = 4
"""The audit of one process reads rows in blocks of at most ``chunk_bytes / AUDIT_SHARE``."""
AUDIT_HASH_DIM_BLOCK = 2**15
"""The audit's row hash sums this many dimensions at a time (an exact float64 product)."""
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
AUDIT_SHARDED_BLOCK_BYTES = 2**20
"""A sharded audit's rows hashed, compared or sent at a time: a fixed cost beside its codes."""
AUDIT_SHARDED_PROJECT_BYTES = 2**17
"""A sharded audit's rows (and their float64 copies) projected at a time."""
AUDIT_SHARDED_CANDIDATE_PAIRS = 2**13
"""A sharded audit's candidate pairs enumerated at a time (every process the same chunks)."""


class AuditSizes(NamedTuple):
    """Every size the protocol audit (:mod:`recall_at_k.audit`) works in."""

    block_bytes: int  # rows hashed, compared or checked at a time
    project_bytes: int  # rows projected at a time (a copy and a float64 copy)
    sort_items: int  # keys sorted (or scattered) at a time
    sort_passes: int  # passes over the keys of one sort in parts, at most
    candidate_pairs: int  # pairs (or queries) enumerated and checked at a time


def audit_sizes(block_bytes: int) -> AuditSizes:
    """The audit's sizes in one process, its rows read ``block_bytes`` at a time."""
    least, most = AUDIT_CANDIDATE_PAIRS
    return AuditSizes(
        block_bytes=max(1, block_bytes),
        project_bytes=max(1, block_bytes),
        sort_items=max(AUDIT_SORT_MIN_ITEMS, block_bytes // AUDIT_SORT_BYTES),
        sort_passes=AUDIT_SORT_MAX_PASSES,
        candidate_pairs=max(least, min(most, block_bytes // AUDIT_CANDIDATE_BYTES)),
    )


def sharded_audit_sizes() -> AuditSizes:
    """The audit's sizes over rows sharded across processes: fixed buffers."""
    return audit_sizes(AUDIT_SHARDED_BLOCK_BYTES)._replace(
        project_bytes=AUDIT_SHARDED_PROJECT_BYTES, candidate_pairs=AUDIT_SHARDED_CANDIDATE_PAIRS
    )
