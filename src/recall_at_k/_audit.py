"""The protocol audit of :class:`recall_at_k.EmbeddingRecallAtK`: pure functions, no Metric.

What :meth:`~recall_at_k.EmbeddingRecallAtK.protocol_report` counts, per direction:

- ``identical_positive`` / ``identical_negative``: counted queries whose gallery holds a
  non-ignored item (not the query's own sample, not excluded by ``exclude``) with a
  bitwise-equal embedding, of the query's label / another label;
- ``rounding_positive`` / ``rounding_negative``: the same for an item equal to the query
  up to float rounding (:data:`ROUNDING_TOLERANCE`) but not bitwise;
- ``duplicate_gallery_items``: gallery items bitwise-equal to an earlier gallery item
  (gallery items are distinct samples: ids repeated within a role count once);
  ``rounding_duplicate_gallery_items``: the other gallery items equal up to rounding to
  an earlier gallery item;
- with a ``near_duplicate`` threshold, ``near_positive`` / ``near_negative`` (a
  non-ignored gallery item whose score -- the canonical score of the ranking -- is at or
  above it; identical items and rounding copies count too, even where they score below
  it) and
  ``near_hits_at_1`` (queries whose rank-1 hit scores at or above it).

The identical and duplicate counts need no scores: one sort of the embeddings' bit
patterns gives each item the class of its bitwise-equal rows, and composite keys
(class, label, group) turn "is there such an item in my gallery" into counts looked up
per query. Everything is O(N log N) sorts and O(N) gathers, whatever the data (every
embedding equal included): no loop over queries, no pairs.

The rounding copies need pairs, but only the few candidate pairs that one sort finds:
:func:`rounding_pairs` sorts the classes into the cells of a grid over random
projections of their normalised embeddings, in which a rounding copy cannot lie
further than the next cell (whatever the rounding of the projections), and checks the
candidates of neighbouring cells by the definition. Only the classes in such pairs are
looked at again per query. On ordinary data there are none; the work is O(N D) for the
projections, a sort, and O(candidates x D) for the checks.
:func:`recall_at_k._audit_sharded.sharded_codes` computes the same codes from the same
parts over rows sharded across processes, no process holding them all.

Memory: the audit keeps per item only its codes (:func:`code_dtype`: int32 up to
:data:`CODE32_LIMIT` items) -- the class, the label and, where ``exclude`` needs it,
the group (8-12 bytes an item) -- besides, while they are made, the 62-bit hashes
(8 bytes), each class's place in the grid and first item (14 bytes a class) and the
sorted cells (12 bytes a class); composite keys (class and label, ...) are made one at
a time when counted. Every sort runs in parts of about ``block_bytes / SORT_BYTES``
items (:func:`sorted_parts`) and every float64 copy of rows (the hash's words, the
projections, the rounding check) a block of ``block_bytes`` at a time, at most
``chunk_bytes / AUDIT_SHARE`` (:class:`AuditOptions`) whatever the dimension; each
phase's buffers are freed before the next phase's (:meth:`Blocks.release`), so the
audit adds about one block beside its per-item arrays.

The near counts need a score per (query, gallery item): the ranking counts them in its
own tiles (:func:`recall_at_k.ranking.rank.rank` with ``near_duplicate``), decided on the
same canonical scores as the ranking, with the identical items found here passed in as
known near items. This module turns them into the report.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k import _collectives
from recall_at_k._kernel import Workspace
from recall_at_k.ranking.workers import Workers, worker_count

Result = TypeVar("Result")


class Codes(NamedTuple):
    """Per item, codes in ``[0, N)`` (:func:`code_dtype`): equal codes = equal keys. The
    composite keys (class and label, ...) are made when a count needs them
    (:func:`composite`), one at a time, never kept."""

    klass: Tensor  # the class of bitwise-equal embeddings
    label: Tensor
    group: Tensor
    adjacent: Tensor  # int64 [P, 2] class pairs equal up to rounding (rounding_pairs)


CODE32_LIMIT = 2**31 - 1
"""Codes of up to this many items are int32 (4 bytes an item), int64 beyond."""


def code_dtype(num: int) -> torch.dtype:
    """The dtype of the codes of ``num`` items: int32 where they fit."""
    return torch.int32 if num <= CODE32_LIMIT else torch.int64


class DirectionAudit(NamedTuple):
    """The audit of one direction's queries, per query (``[Q]`` bool)."""

    counted: Tensor  # counted by compute() under empty_target_action
    identical_positive: Tensor
    identical_negative: Tensor
    duplicate_gallery_items: int
    rounding_positive: Tensor
    rounding_negative: Tensor
    rounding_duplicate_gallery_items: int

    def known(self) -> Tensor:
        """bool ``[2, Q]``: queries whose near positive / near negative is certain (an
        identical item or a rounding copy), whatever its score (``rank``'s ``known``)."""
        return torch.stack(
            [
                self.identical_positive | self.rounding_positive,
                self.identical_negative | self.rounding_negative,
            ]
        )


_COMPARE_BYTES = 2**20
"""Rows are hashed and compared this many bytes at a time (never the whole set), unless
the caller gives a ``block_bytes`` (the metric: a share of its ``chunk_bytes``,
:data:`AUDIT_SHARE`)."""

AUDIT_SHARE = 4
"""The metric's audit works on blocks of ``chunk_bytes / AUDIT_SHARE`` (each block's
copies -- bit patterns, float64 rows, projections -- together within it)."""


BLOCKS_PER_WORKER = 4
"""On several threads the rows are cut into at least this many blocks a worker thread
(hashed, compared, projected and checked side by side), so that the threads finish
together."""


class Blocks:
    """The audit's block work on the ranking's worker threads
    (:class:`~recall_at_k.ranking.workers.Workers`: ``torch.get_num_threads()`` of them on
    CPU, each running torch on one thread; one, the caller, elsewhere). Use as a context
    manager. Each block's result depends on its rows alone and the results come in the
    blocks' order, so the audit is the same for every thread count."""

    def __init__(self, device: torch.device, count: int | None = None) -> None:
        self.count = worker_count(device) if count is None else count
        self.workers: Workers[Callable[[Workspace], Any], Any]
        self.workers = Workers(_call, self.count, Workspace())

    def __enter__(self) -> Blocks:
        self.workers.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.workers.__exit__(*exc)

    def map(
        self, function: Callable[[Any, Workspace], Result], items: Iterable[Any]
    ) -> Iterator[Result]:
        """``function(item, workspace)`` for each item, in order (``workspace``: the
        thread's own scratch)."""
        tasks = (functools.partial(function, item) for item in items)
        return cast(Iterator[Result], self.workers.map(tasks))

    def release(self) -> None:
        """Free every thread's scratch: a phase's buffers (the hash's, the projections'
        float64 rows) are not kept beside the next phase's blocks."""
        self.workers.workspace.clear()
        self.workers.local = threading.local()  # the threads' workspaces go with it

    def step(self, num: int, step: int) -> int:
        """``step`` rows a block, fewer where that makes under :data:`BLOCKS_PER_WORKER`
        blocks a worker (one block on one thread)."""
        if self.count == 1:
            return step
        return max(1, min(step, -(-num // (BLOCKS_PER_WORKER * self.count))))


def _call(task: Callable[[Workspace], Result], workspace: Workspace) -> Result:
    return task(workspace)


def _serial(blocks: Blocks | None, device: torch.device) -> Blocks:
    """``blocks``, or every block in the calling thread."""
    return Blocks(device, 1) if blocks is None else blocks


def bitwise_classes(
    embeddings: Tensor,
    hashes: Callable[[Tensor], Tensor] | None = None,
    block_bytes: int = _COMPARE_BYTES,
    blocks: Blocks | None = None,
) -> Tensor:
    """``[N]`` codes (:func:`code_dtype`): rows with the same bit pattern share a class
    (``0..C-1``).

    Bitwise equality is stricter than ``==``: ``-0.0`` and ``0.0`` differ, and so do
    NaN payloads (embeddings are finite when ``validate_args=True``).

    Each row's bits, read as 16-bit words, get a 62-bit hash (two sums of the words
    times fixed coefficients, modulo a prime: integers, exact in any order); rows are
    sorted by hash and the neighbours that share one are compared bit for bit. Equal
    hashes of different rows (chance about ``N^2 / 2^62``) fall back to an exact sort
    of the rows (``torch.unique(dim=0)``, several times slower, on a whole copy).
    O(N log N + N D); rows are hashed and compared ``block_bytes`` at a time
    (``blocks``: on which threads; together within ``block_bytes``).
    ``hashes``: the row hash (tests pass colliding ones).
    """
    num, width = embeddings.shape
    if num == 0 or width == 0:
        return torch.zeros(num, dtype=code_dtype(num), device=embeddings.device)
    blocks = _serial(blocks, embeddings.device)
    keys = hash_rows(embeddings, hashes, block_bytes, blocks)
    # Two copies a block: the pairs' rows.
    step = compare_step(embeddings, block_bytes // (2 * blocks.count))

    def equal(pairs: Tensor, workspace: Workspace) -> bool:
        first = embeddings.index_select(0, pairs[0])
        second = embeddings.index_select(0, pairs[1])
        return bool(torch.equal(_words(first), _words(second)))

    def neighbours(order: Tensor, values: Tensor) -> Iterator[Tensor]:
        same = (values[1:] == values[:-1]).nonzero().view(-1)
        part_step = blocks.step(same.shape[0], step)
        for start in range(0, same.shape[0], part_step):
            pairs = same[start : start + part_step]
            yield torch.stack([order[pairs], order[pairs + 1]])

    classes = torch.empty(num, dtype=code_dtype(num), device=embeddings.device)
    offset = 0
    for order, values in sorted_parts(keys, block_bytes):
        if not all(blocks.map(equal, neighbours(order, values))):  # a collision: exact, slower
            del keys, order, values, classes
            return _code_rows(_words(embeddings))
        offset = _number_runs(order, values, classes, offset)
    return classes


SORT_BYTES = 40
"""A sort of int64 keys takes about this many bytes an item: their sorted copy, the
order and torch's scratch."""

SORT_MAX_PASSES = 1024
""":func:`sorted_parts` makes at most this many passes over the keys."""

SORT_MIN_ITEMS = 1024
""":func:`sorted_parts` sorts at least this many items at a time."""


def sorted_parts(
    keys: Tensor, block_bytes: int = _COMPARE_BYTES
) -> Iterator[tuple[Tensor, Tensor]]:
    """The stable ascending sort of integer ``keys`` ``[N]``, in consecutive parts
    ``(order, values)`` (int64 item indices, their keys): each part sorts the items of
    one range of keys, so that equal keys never straddle two parts, about ``block_bytes
    / SORT_BYTES`` items at a time (not the whole set) where the keys allow.

    The ranges come from a regular sample of the keys: a key that fills a range alone
    gets a part of its own (no sort; its values one key broadcast, not an array: every
    item of a collapsed model); between two such keys, the keys strictly between.
    Each part costs a pass over the keys (a comparison of each, one byte an item)."""
    num = keys.shape[0]
    most = max(SORT_MIN_ITEMS, block_bytes // SORT_BYTES)
    if num <= most:
        values, order = torch.sort(keys, stable=True)
        yield order, values
        return
    passes = min(SORT_MAX_PASSES, -(-num // most))
    stride = max(1, num // (64 * passes))  # about 64 samples a pass
    sample = torch.sort(keys[::stride])[0]
    at = torch.arange(1, passes, device=keys.device) * sample.shape[0] // passes
    splitters = torch.unique_consecutive(sample[at]).tolist()
    lowest: int | None = None
    for splitter in [*splitters, None]:
        # The keys strictly between the previous splitter and this one.
        mask = torch.ones(num, dtype=torch.bool, device=keys.device)
        if lowest is not None:
            torch.gt(keys, lowest, out=mask)
        if splitter is not None:
            mask &= keys < splitter
        index = mask.nonzero().view(-1)
        if index.numel():
            values, order = torch.sort(keys[index], stable=True)
            yield index[order], values
            del values, order
        del index
        if splitter is not None:  # the keys equal to the splitter: in item order
            torch.eq(keys, splitter, out=mask)
            index = mask.nonzero().view(-1)
            del mask
            if index.numel():
                yield index, keys.new_full((1,), splitter).expand(index.shape[0])
            del index
            lowest = splitter


def _number_runs(order: Tensor, values: Tensor, codes: Tensor, offset: int) -> int:
    """Write ``offset + r`` at ``codes[order]`` for the run ``r`` (0, 1, ...) of each
    of the ascending ``values``; the next offset."""
    if values.numel() == 0:
        return offset
    starts = torch.ones(values.shape[0], dtype=torch.bool, device=values.device)
    torch.ne(values[1:], values[:-1], out=starts[1:])
    run = torch.cumsum(starts, dim=0, dtype=codes.dtype)
    del starts
    run += offset - 1
    codes[order] = run
    return int(run[-1]) + 1


def compare_step(rows: Tensor, block_bytes: int = _COMPARE_BYTES) -> int:
    """The rows of ``rows`` that ``block_bytes`` hold (at least one)."""
    return max(1, block_bytes // max(1, rows.shape[1] * rows.element_size()))


def hash_rows(
    rows: Tensor,
    hashes: Callable[[Tensor], Tensor] | None = None,
    block_bytes: int = _COMPARE_BYTES,
    blocks: Blocks | None = None,
) -> Tensor:
    """int64 ``[m]``: each row's hash (:func:`_row_hashes` of its bits, or ``hashes``),
    a block of rows at a time (their float64 words within ``block_bytes``: four times
    their bytes), written into one array. A row's hash depends on its bits alone."""
    if rows.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int64, device=rows.device)
    if hashes is None:  # one call: its coefficients made once, its buffers reused
        return _row_hashes(_words(rows), block_bytes, blocks)
    hash_of = hashes
    step = compare_step(rows, block_bytes // 4)
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device)
    for start in range(0, rows.shape[0], step):
        out[start : start + step] = hash_of(_words(rows[start : start + step]))
    return out


def same_bits(first: Tensor, second: Tensor) -> Tensor:
    """bool per pair of rows (``[m, D]`` each, one dtype): the same bit pattern."""
    return (_words(first) == _words(second)).all(dim=1)


def _words(rows: Tensor) -> Tensor:
    """The rows' bits as int16 words ``[m, W]`` (every float dtype)."""
    return rows.contiguous().view(torch.int16)


_ROWS_SLOT = "audit_rows"
"""The workspace slot of a block's float64 rows: the hash's, then the projections'
(one buffer, not one each)."""

_HASH_PRIME = 2**21 - 9
_HASH_ROW_BYTES = 2**20
"""Rows are hashed this many bytes of float64 words at a time."""
_HASH_MAX_TERMS = 2**15
"""Words summed before a reduction modulo the prime: each term is an integer below
2^37, so a sum of up to 2^16 of them is exact in float64, in any order."""


def _row_hashes(
    words: Tensor, block_bytes: int = _HASH_ROW_BYTES, blocks: Blocks | None = None
) -> Tensor:
    """int64 ``[N]`` in ``[0, 2^63)``: equal rows of int16 ``words`` get equal values.

    Three sums of the words (shifted to ``[0, 2^16)``) times fixed coefficients below a
    prime ``p`` of 21 bits, each modulo ``p``: a matrix product in float64 whose every
    partial sum is an integer below 2^53, hence exact whatever the blocking or device.
    Rows are widened to float64 ``block_bytes`` at a time (``blocks``: on which threads,
    each reusing its own buffer; together within ``block_bytes``).
    """
    num, width = words.shape
    device, wide = words.device, torch.float64
    generator = torch.Generator().manual_seed(20261203)
    coefficients = torch.randint(1, _HASH_PRIME, (width, 3), generator=generator)
    coefficients = coefficients.to(device=device, dtype=wide)
    blocks = _serial(blocks, device)
    step = max(1, min(num, block_bytes // (8 * width * blocks.count)))
    step = blocks.step(num, step)

    out = torch.empty(num, dtype=torch.int64, device=device)

    def hash_block(start: int, workspace: Workspace) -> None:
        rows = workspace.get(_ROWS_SLOT, (min(step, num - start), width), wide, device)
        rows.copy_(words[start : start + step]).add_(2**15)  # [0, 2^16)
        target = torch.zeros((rows.shape[0], 3), dtype=wide, device=device)
        for first in range(0, width, _HASH_MAX_TERMS):
            stop = first + _HASH_MAX_TERMS
            target.addmm_(rows[:, first:stop], coefficients[first:stop]).remainder_(_HASH_PRIME)
        keys = target.to(torch.int64)
        # (k0 p + k1) p + k2, into the block's part of the output.
        part = torch.mul(keys[:, 0], _HASH_PRIME, out=out[start : start + rows.shape[0]])
        part.add_(keys[:, 1]).mul_(_HASH_PRIME).add_(keys[:, 2])

    for _ in blocks.map(hash_block, range(0, num, step)):
        pass
    blocks.release()
    return out


ROUNDING_TOLERANCE = 2.0**-12
"""Two finite embeddings ``x``, ``y`` with different bits are *equal up to float
rounding* when ``|x - y|_2 <= 2^-12 max(|x|_2, |y|_2)``, as stored (before any
normalisation), decided in float64: ``sum_d (x_d - y_d)^2 <= 2^-24 max(sum_d x_d^2,
sum_d y_d^2)``, each sum accumulated in the order ``d = 0 .. D-1`` (both rows first
scaled by the same power of two, which changes nothing but keeps the squares from
underflowing), so the decision is the same on every device, thread and process.

Why ``2^-12``: the same input run through a model in another batch shape (another
BLAS or cuDNN kernel, another summation order) differs by a few float32 units
``u = 2^-24`` (measured, relative distance: at most 8 u for ``nn.Linear`` from 64 to
2,048 inputs, batches of 1, 3, 7 against 10; 3 u for a small convolutional net), so the
tolerance leaves a factor 512; a float16 output (16-bit mixed precision) differs in the
few coordinates whose rounding flips, by one float16 unit each (measured: 0.3 x 2^-12).
Embeddings further apart are never copies: two distinct points of an integer grid
differ by at least 1, so grid rows of norm below 4,096 steps (int8 codes of up to 1,040
dimensions, binary or ternary codes of up to 16 million) are never copies. A bfloat16
unit (``2^-8``) is coarser: such copies need ``ids=``."""

ROUNDING_CHUNK = 2**16
"""Candidate pairs are enumerated and checked this many at a time."""

IN_ORDER_MARGIN = 2.0**-30
"""Pairs whose sums taken in any order lie within this relative distance of the boundary
are summed again in the fixed order (a sum of D non-negative float64 terms in any order
is within ``gamma64_D``, far below it, of the fixed-order one)."""

_PROJECTIONS = 3
"""Rounding copies are looked for among the rows in neighbouring cells of a grid over
this many random projections of the normalised rows."""

_FILTERS = 8
"""Random projections in all (the grid's first): a candidate pair is checked in full
only when each projection of the two is within a cell width."""


def rounding_pairs(
    embeddings: Tensor,
    classes: Tensor,
    block_bytes: int = _COMPARE_BYTES,
    blocks: Blocks | None = None,
) -> Tensor:
    """int64 ``[P, 2]``: the pairs ``(a, b)``, ``a != b``, of bitwise classes whose
    embeddings are equal up to float rounding (:data:`ROUNDING_TOLERANCE`), both
    orientations, sorted.

    No pair can be missed: a copy ``y`` of ``x`` has ``|x/|x| - y/|y|| <= 2 tau /
    (1 - tau)`` (``tau`` the tolerance), so each projection ``w . x/|x|`` of the two
    differs by at most ``h = |w| 2 tau / (1 - tau)`` (Cauchy-Schwarz), widened to cover
    the float64 rounding of every step. With cells of width ``h`` per projection, the
    two rows lie in the same or neighbouring cells in each of the projections (a copy
    cannot straddle more than one cell edge a projection): the rows of each cell are
    paired with those of its own cell and of the 13 neighbouring cells of one half-space
    (each pair of cells once); the candidates whose other projections also lie within a
    cell width of each other are checked, in float64, by the definition. Rows that are
    not finite have no copies; all-zero rows are copies of each other (``-0.0``). The
    result depends on the stored values alone.

    The parts: :func:`rounding_grid` (the projections and the cell width),
    :func:`project` (each class's first row), :func:`rounding_candidates` (the pairs
    of neighbouring cells), :func:`_within` (the check) and :func:`both_orientations`;
    rows are projected and checked ``block_bytes`` at a time (``blocks``: on which
    threads; together within ``block_bytes``).
    """
    device = embeddings.device
    num, width = embeddings.shape
    if num < 2:
        return both_orientations([], 0, device)
    blocks = _serial(blocks, device)
    block_bytes = max(1, block_bytes // blocks.count)  # each thread's share
    count = int(classes.max()) + 1
    first = first_items(classes, count, block_bytes)
    grid = rounding_grid(width, device)
    # Each row's copy and its float64 copy.
    step = project_step(width, block_bytes, 8 + embeddings.element_size())
    step = blocks.step(count, step)
    places = GridPlaces.empty(count, device)

    def project_block(start: int, workspace: Workspace, into: GridPlaces = places) -> None:
        rows = embeddings.index_select(0, first[start : start + step])
        wide = workspace.get(_ROWS_SLOT, tuple(rows.shape), torch.float64, device)
        into.place(grid, project(grid, rows, wide), start)

    for _ in blocks.map(project_block, range(0, count, step)):
        pass
    blocks.release()
    del project_block
    cells = _cells(grid, places, block_bytes)  # its own sorted keys: the places' freed here
    del places
    if cells is None:
        return both_orientations([], count, device)
    chunk = max(64, min(ROUNDING_CHUNK, block_bytes // 256))  # ~200 bytes a candidate
    rows = cells.members.shape[0]
    row_step = blocks.step(rows, _row_step(chunk))

    def check(start: int, workspace: Workspace) -> list[Tensor]:
        found = []
        for a, b in _neighbours(cells, start, min(rows, start + row_step), chunk):
            within = _within(embeddings, first[a], first[b], block_bytes)
            found.append(torch.stack([a[within], b[within]], dim=1))
        return found

    found = [pairs for part in blocks.map(check, range(0, rows, row_step)) for pairs in part]
    return both_orientations(found, count, device)


def first_items(classes: Tensor, count: int, block_bytes: int = _COMPARE_BYTES) -> Tensor:
    """``[C]`` (the codes' dtype): each class's first item, ``block_bytes`` of items at a
    time (no whole-set index array)."""
    num = classes.shape[0]
    first = torch.full((count,), num, dtype=classes.dtype, device=classes.device)
    step = max(1024, block_bytes // 16)
    for start in range(0, num, step):
        stop = min(num, start + step)
        where = torch.arange(start, stop, dtype=classes.dtype, device=classes.device)
        first.scatter_reduce_(0, classes[start:stop].long(), where, reduce="amin")
    return first


class RoundingGrid(NamedTuple):
    """The random projections of :func:`rounding_pairs` and the width of a cell."""

    weights: Tensor  # float64 [D, _FILTERS]
    cell: float


def rounding_grid(width: int, device: torch.device) -> RoundingGrid:
    """The projections of rows of ``width`` coordinates (fixed, the same everywhere) and
    the cell width: the bound on a copy's distance in a projection of the unit rows,
    widened (by 2^-20 relative and a float64 rounding term per step) to cover every
    rounding, so that it holds whatever the device, batch shape or process computing
    each projection."""
    tau = ROUNDING_TOLERANCE
    generator = torch.Generator().manual_seed(20261204)
    weights = torch.randn((width, _FILTERS), generator=generator, dtype=torch.float64)
    weights = weights.to(device)
    rounding = 8 * _gamma64(width + 2)
    cell = float(weights.norm(dim=0).max()) * (2 * tau / (1 - tau) + rounding) * (1 + 2.0**-20)
    return RoundingGrid(weights, cell)


def project_step(width: int, block_bytes: int = _HASH_ROW_BYTES, per_value: int = 8) -> int:
    """The rows projected (or checked) at a time: ``per_value`` bytes a coordinate
    (a float64 copy by default) within ``block_bytes``."""
    return max(1, block_bytes // (per_value * max(1, width)))


def project(grid: RoundingGrid, rows: Tensor, scratch: Tensor | None = None) -> Tensor:
    """float64 ``[m, _FILTERS]``: the projections of the normalised ``rows`` (NaN for a
    row that is not finite: it has no copies). One float64 copy of ``rows`` (into
    ``scratch``, float64 ``[m, D]``, where given), scaled and normalised in place."""
    rows = rows.to(torch.float64, copy=True) if scratch is None else scratch.copy_(rows)
    finite = _scale_in_place(rows).unsqueeze(1)  # (isfinite() would copy the rows)
    norms = rows.norm(dim=1, keepdim=True)
    unit = rows.div_(norms.clamp(min=1e-300)).masked_fill_(~(norms > 0), 0.0)
    return torch.where(finite, unit @ grid.weights, torch.nan)


def rounding_candidates(
    grid: RoundingGrid,
    places: GridPlaces,
    chunk_pairs: int = ROUNDING_CHUNK,
    block_bytes: int = _COMPARE_BYTES,
) -> Iterator[tuple[Tensor, Tensor]]:
    """The candidate pairs ``(a, b)`` of classes (rows of ``places``, each class's
    :func:`project` placed in the grid), each unordered pair once, in chunks of at most
    ``chunk_pairs`` (:data:`ROUNDING_CHUNK`): the rows in the same or neighbouring cells
    whose every other projection lies in the same or a neighbouring cell (the keys
    sorted ``block_bytes`` at a time, :func:`sorted_parts`). Deterministic
    (the same chunks wherever ``places`` is the same): processes that hold the same
    places check the same candidates together."""
    cells = _cells(grid, places, block_bytes)
    if cells is None:
        return
    # The neighbouring cells' runs, of a few rows at a time: their index arrays hold one
    # entry per row and cell (14 a row), at most chunk_pairs, never one for every row.
    rows, row_step = cells.members.shape[0], _row_step(chunk_pairs)
    for row_start in range(0, rows, row_step):
        yield from _neighbours(cells, row_start, min(rows, row_start + row_step), chunk_pairs)


_NOT_FINITE = 2**63 - 1
"""The cell key of a row that is not finite (it has no copies): above every other."""


class GridPlaces(NamedTuple):
    """Each row's place in the grid of :func:`rounding_pairs`, 10 bytes a row instead
    of its eight float64 projections: the cell of its first :data:`_PROJECTIONS`
    projections as one int64 key (:data:`_NOT_FINITE` for a row that is not finite),
    and the cell index of each other projection modulo 8, three bits each, in one int16.
    Two rows within a cell width of each other have indices at most 1 apart, so
    differences modulo 8 in ``{7, 0, 1}``: a weaker filter than the projections
    themselves (about 3/8 of unrelated rows pass each), as sound."""

    key: Tensor  # int64 [C]
    others: Tensor  # int16 [C]: (index_j mod 8) << 3 j, j < _FILTERS - _PROJECTIONS

    @staticmethod
    def empty(count: int, device: torch.device) -> GridPlaces:
        key = torch.empty(count, dtype=torch.int64, device=device)
        others = torch.empty(count, dtype=torch.int16, device=device)
        return GridPlaces(key, others)

    def place(self, grid: RoundingGrid, projected: Tensor, start: int) -> None:
        """Write the places of :func:`project`'s rows ``projected`` as rows
        ``start...`` (a block's: the cell indices of its float64 projections)."""
        radix, cell = _radix(grid)
        stop = start + projected.shape[0]
        finite = projected.isfinite().all(dim=1)
        index = projected.div_(cell).floor_().masked_fill_(~finite.unsqueeze(1), 0.0)
        key = self.key[start:stop].zero_()
        for k in range(_PROJECTIONS):
            key.mul_(radix).add_(index[:, k].to(torch.int64) + radix // 2)
        key.masked_fill_(~finite, _NOT_FINITE)
        low = index[:, _PROJECTIONS:].remainder_(8)  # integers: exact
        self.others[start:stop] = (low @ _other_weights(low)).to(torch.int16)

    def fail(self) -> None:
        """Every row not finite (a process whose projection failed: nobody's
        candidates)."""
        self.key.fill_(_NOT_FINITE)


def _other_weights(like: Tensor) -> Tensor:
    """``8^j`` per other projection ``j`` (the packing of :class:`GridPlaces`)."""
    count = _FILTERS - _PROJECTIONS
    return torch.tensor([8.0**j for j in range(count)], dtype=like.dtype, device=like.device)


def _close_others(a: Tensor, b: Tensor) -> Tensor:
    """bool per pair of packed ``others`` (int16): every index modulo 8 within 1."""
    shifts = 3 * torch.arange(_FILTERS - _PROJECTIONS, dtype=torch.int32, device=a.device)
    low_a = (a.to(torch.int32).unsqueeze(1) >> shifts) & 7
    low_b = (b.to(torch.int32).unsqueeze(1) >> shifts) & 7
    return (((low_a - low_b + 1) & 7) <= 2).all(dim=1)


def _radix(grid: RoundingGrid) -> tuple[int, float]:
    """The grid's radix of the cell key and the cell width compared."""
    cell = grid.cell
    if not cell > 0:  # no coordinates: every projection 0
        return 8, 4.0
    radix = int(2 / cell) + 8  # cell indices lie in (-1/cell - 1, 1/cell + 1)
    if radix**_PROJECTIONS >= 2**62:  # D beyond any embedding: one cell per projection
        radix, cell = 8, 4.0
    return radix, cell


class _Cells(NamedTuple):
    """The finite rows of :func:`rounding_candidates` sorted by their cell."""

    key: Tensor  # int64, each sorted row's cell, ascending
    members: Tensor  # the rows of ``places`` (code_dtype), in that order
    offsets: list[int]  # the neighbouring cells' key offsets (0 first)
    others: Tensor  # int16 [C]: each row's (not each sorted row's) other cells, packed


def _cells(
    grid: RoundingGrid, places: GridPlaces, block_bytes: int = _COMPARE_BYTES
) -> _Cells | None:
    """The rows of ``places`` that are finite, sorted by cell (None: fewer than 2),
    sorted in parts (:func:`sorted_parts`)."""
    radix, _ = _radix(grid)
    count = places.key.shape[0]
    key = torch.empty_like(places.key)
    members = torch.empty(count, dtype=code_dtype(count), device=key.device)
    at = 0
    for order, values in sorted_parts(places.key, block_bytes):
        key[at : at + order.shape[0]] = values
        members[at : at + order.shape[0]] = order
        at += order.shape[0]
    finite = int(torch.searchsorted(key, torch.tensor(_NOT_FINITE, device=key.device)))
    if finite < 2:
        return None
    key, order = key[:finite], members[:finite]
    offsets = []
    for shift in _half_space_shifts():
        offset = 0
        for delta in shift:
            offset = offset * radix + delta
        offsets.append(offset)
    return _Cells(key, order, offsets, places.others)


def _row_step(chunk_pairs: int) -> int:
    """Rows whose neighbouring cells' runs are enumerated together: one entry a row and
    cell, at most ``chunk_pairs``."""
    return max(1, chunk_pairs // len(_half_space_shifts()))


def _neighbours(
    cells: _Cells, row_start: int, row_stop: int, chunk_pairs: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """:func:`rounding_candidates` of the sorted rows ``row_start:row_stop`` (each
    with the rows after it in its cell and those of the neighbouring cells), in chunks
    of at most ``chunk_pairs``."""
    key, members, others = cells.key, cells.members, cells.others
    position = torch.arange(row_start, row_stop, device=key.device)
    own = key[position]
    starts, counts = [], []
    for offset in cells.offsets:
        if offset == 0:  # the row's own cell: the rows after it
            stop = torch.searchsorted(key, own, right=True)
            starts.append(position + 1)
            counts.append(stop - position - 1)
        else:
            lo = torch.searchsorted(key, own + offset)
            starts.append(lo)
            counts.append(torch.searchsorted(key, own + offset, right=True) - lo)
    begin = torch.stack(starts, dim=1).view(-1)
    size = torch.stack(counts, dim=1).view(-1)
    owner = position.repeat_interleave(len(starts))
    ends = torch.cumsum(size, dim=0)
    total = int(ends[-1])
    for chunk in range(0, total, chunk_pairs):
        pair = torch.arange(chunk, min(chunk + chunk_pairs, total), device=key.device)
        at = torch.searchsorted(ends, pair, right=True)
        a = members[owner[at]].long()
        b = members[begin[at] + pair - (ends[at] - size[at])].long()
        close = _close_others(others[a], others[b])
        yield a[close], b[close]


def both_orientations(found: Sequence[Tensor], count: int, device: torch.device) -> Tensor:
    """int64 ``[P, 2]``: the pairs of ``found`` (``[m, 2]`` blocks, each unordered pair
    once) in both orientations, sorted (classes below ``count``)."""
    if not found:
        return torch.zeros((0, 2), dtype=torch.int64, device=device)
    pairs = torch.cat(list(found))
    pairs = torch.cat([pairs, pairs.flip(1)])
    return pairs[torch.argsort(pairs[:, 0] * count + pairs[:, 1])]


def _half_space_shifts() -> list[tuple[int, ...]]:
    """The cell offsets in ``{-1, 0, 1}^k`` that are ``>= 0`` lexicographically (the
    zero offset first): each pair of neighbouring cells is visited from one side."""
    shifts: list[tuple[int, ...]] = [()]
    for _ in range(_PROJECTIONS):
        shifts = [(*s, d) for s in shifts for d in (-1, 0, 1)]
    zero = (0,) * _PROJECTIONS
    return sorted((s for s in shifts if s >= zero), key=lambda s: s != zero)


def _scale_in_place(rows: Tensor) -> Tensor:
    """Multiply each float64 row by the power of two that brings its largest absolute
    coordinate into ``[0.5, 1)`` (exact; zero and non-finite rows as they are): what
    ``torch.ldexp`` computes (``rows * 2^e``), without a copy, and for every finite row
    (subnormal float64 rows too, whose ``2^e`` alone overflows). bool ``[m]``: which
    rows are finite (no copy of the rows, unlike ``isfinite()``)."""
    if rows.shape[1] == 0:
        return torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    largest = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_())  # NaN propagates
    finite = largest.isfinite()
    exponent = torch.frexp(torch.where(finite, largest, 1.0))[1]
    _times_power_of_two(rows, exponent.neg_())
    return finite


_EXPONENT_STEP = 1022
"""The largest ``|e|`` of one factor ``2^e`` of :func:`_times_power_of_two` (both
``2^1022`` and ``2^-1022`` are normal float64 numbers)."""


def _times_power_of_two(rows: Tensor, exponent: Tensor) -> None:
    """``rows[i] *= 2^exponent[i]`` in place (float64 rows, int32 exponents): one exact
    factor where ``|exponent| <= 1022``, else two (a subnormal row's scaling reaches
    ``2^1073``, beyond the float64 range as one factor)."""
    first = exponent.clamp(-_EXPONENT_STEP, _EXPONENT_STEP)
    rows.mul_(torch.pow(2.0, first.unsqueeze(1).to(rows.dtype)))
    rest = exponent - first
    if bool(rest.any()):
        rows.mul_(torch.pow(2.0, rest.unsqueeze(1).to(rows.dtype)))


def _within(
    embeddings: Tensor, rows_a: Tensor, rows_b: Tensor, block_bytes: int = _HASH_ROW_BYTES
) -> Tensor:
    """bool per pair of rows (indices into ``embeddings``): :func:`within` of the two,
    a block of pairs at a time (their float64 copies, some eight, within ``block_bytes``)."""
    out = torch.empty(rows_a.shape[0], dtype=torch.bool, device=rows_a.device)
    step = project_step(embeddings.shape[1], block_bytes, 64)
    for start in range(0, rows_a.shape[0], step):
        stop = start + step
        out[start:stop] = within(embeddings[rows_a[start:stop]], embeddings[rows_b[start:stop]])
    return out


def within(first: Tensor, second: Tensor) -> Tensor:
    """bool per pair of rows (``[m, D]`` each): equal up to rounding
    (:data:`ROUNDING_TOLERANCE`), the sums in the order ``d = 0 .. D-1`` (both rows
    scaled by one power of two).

    The sums are first taken in any order (a relative error below ``gamma64_D``, all
    terms being non-negative); only the pairs within ``IN_ORDER_MARGIN`` of the boundary
    are summed again in the fixed order. So the decision depends on the two rows alone,
    not on the other pairs, the batch shape, the device or the process computing it."""
    if first.shape[1] == 0:
        return torch.ones(first.shape[0], dtype=torch.bool, device=first.device)
    a = first.to(torch.float64, copy=True)  # scaled in place: never the caller's rows
    b = second.to(torch.float64, copy=True)
    largest = torch.maximum(
        torch.maximum(a.amax(dim=1), a.amin(dim=1).neg_()),
        torch.maximum(b.amax(dim=1), b.amin(dim=1).neg_()),
    )
    exponent = torch.frexp(largest)[1].neg_()
    _times_power_of_two(a, exponent)
    _times_power_of_two(b, exponent)
    gap = torch.sub(a, b).square_().sum(dim=1)
    # Row norms as dot products (no squared copies); any order, as the gap.
    norms = torch.maximum(_row_dots(a), _row_dots(b))
    scale = norms.mul_(ROUNDING_TOLERANCE**2)
    decided = gap <= scale
    unsure = ((gap - scale).abs() <= IN_ORDER_MARGIN * scale).nonzero().view(-1)
    if unsure.numel():
        decided[unsure] = _within_in_order(a[unsure], b[unsure])
    return decided


def _row_dots(rows: Tensor) -> Tensor:
    """``[m]``: each row's dot product with itself (a batched product, no copy)."""
    return torch.bmm(rows.unsqueeze(1), rows.unsqueeze(2)).view(-1)


def _within_in_order(a: Tensor, b: Tensor) -> Tensor:
    """:func:`_within` of scaled float64 rows, every sum in the order ``d = 0 .. D-1``."""
    a, b = a.T.contiguous(), b.T.contiguous()
    gap = torch.zeros(a.shape[1], dtype=torch.float64, device=a.device)
    norm_a, norm_b, term = torch.zeros_like(gap), torch.zeros_like(gap), torch.empty_like(gap)
    for d in range(a.shape[0]):
        gap.add_(torch.sub(a[d], b[d], out=term).square_())
        norm_a.add_(torch.square(a[d], out=term))
        norm_b.add_(torch.square(b[d], out=term))
    return gap <= ROUNDING_TOLERANCE**2 * torch.maximum(norm_a, norm_b)


def _gamma64(terms: int) -> float:
    unit = 2.0**-53
    return terms * unit / (1 - terms * unit)


def _code(values: Tensor, block_bytes: int = _COMPARE_BYTES) -> Tensor:
    """The codes ``0..K-1`` of integer ``values`` (:func:`code_dtype`), in the order of
    the values (those of ``torch.unique``), sorted in parts (:func:`sorted_parts`)."""
    codes = torch.empty(values.shape[0], dtype=code_dtype(values.shape[0]), device=values.device)
    offset = 0
    keys = values if values.dtype in (torch.int32, torch.int64) else values.to(torch.int64)
    for order, ascending in sorted_parts(keys, block_bytes):
        offset = _number_runs(order, ascending, codes, offset)
    return codes


def _code_rows(rows: Tensor) -> Tensor:
    """The codes of the rows of ``rows`` (exact, by an exact sort of a whole copy)."""
    inverse: Tensor = torch.unique(rows, dim=0, return_inverse=True)[1]
    return inverse.to(code_dtype(rows.shape[0]))


def _pair(a: Tensor, b: Tensor, block_bytes: int = _COMPARE_BYTES) -> Tensor:
    """The code of the pair (a, b) of codes in ``[0, N)`` (no int64 overflow: < N^2),
    through an int32 key where the pairs fit one (4 bytes an item, not 8)."""
    if a.numel() == 0:
        return a.clone()
    radix = int(b.max()) + 1
    fits = (int(a.max()) + 1) * radix <= CODE32_LIMIT + 1
    key = a.to(torch.int32 if fits else torch.int64) * radix
    return _code(key.add_(b.to(key.dtype)), block_bytes)


def composite(*parts: Tensor, block_bytes: int = _COMPARE_BYTES) -> Tensor:
    """The code of the tuple of codes ``parts`` (each ``[N]`` in ``[0, N)``), made
    pair by pair (each step coded back into ``[0, N)``): a transient array."""
    code = parts[0]
    for part in parts[1:]:
        code = _pair(code, part, block_bytes)
    return code


def codes(
    embeddings: Tensor,
    labels: Tensor,
    groups: Tensor,
    hashes: Callable[[Tensor], Tensor] | None = None,
    block_bytes: int = _COMPARE_BYTES,
    with_groups: bool = True,
) -> Codes:
    """The keys the audit counts with, over every stored item (``hashes``: the row hash
    of :func:`bitwise_classes`, for tests), its rows read ``block_bytes`` at a time, in
    blocks on the worker threads (:class:`Blocks`). ``with_groups``: whether to code
    the groups (``exclude`` other than ``"none"``; else ``group`` is empty)."""
    with Blocks(embeddings.device) as blocks:
        klass = bitwise_classes(embeddings, hashes, block_bytes, blocks)
        adjacent = rounding_pairs(embeddings, klass, block_bytes, blocks)
        return codes_of(klass, adjacent, labels, groups if with_groups else None, block_bytes)


def codes_of(
    klass: Tensor,
    adjacent: Tensor,
    labels: Tensor,
    groups: Tensor | None,
    block_bytes: int = _COMPARE_BYTES,
) -> Codes:
    """:class:`Codes` from the bitwise classes, their rounding pairs and the metadata
    (``groups`` None: an empty group code; sorted ``block_bytes`` at a time)."""
    dtype = code_dtype(klass.shape[0])
    group = _code(groups, block_bytes) if groups is not None else torch.zeros(0, dtype=dtype)
    return Codes(klass.to(dtype), _code(labels, block_bytes), group.to(klass.device), adjacent)


def audit_direction(
    keys: Codes,
    queries: tuple[Tensor, Tensor],
    gallery: tuple[Tensor, Tensor],
    exclude: str,
    empty_target_action: str,
    block_bytes: int = _COMPARE_BYTES,
) -> DirectionAudit:
    """Identical positives / negatives of each query and the gallery's duplicates.

    Each count is "gallery items with the query's key" (a tally of the gallery's codes,
    :func:`_tally`, read at the query's code), by inclusion-exclusion over the ignore
    rules, minus the query's own sample (:func:`own_samples`) when it is in the gallery
    and would be counted. Per item, int32 arrays (:func:`code_dtype`) made one at a time.

    Args:
        keys: :func:`codes` of every item.
        queries: ``(rows, identity)`` of the queries (rows into the items).
        gallery: ``(rows, identity)`` of the gallery, each sample once.
        exclude: ``"none"``, ``"same_group"`` or ``"same_label_and_group"``.
        empty_target_action: which queries ``compute()`` counts.
        block_bytes: the keys are sorted this many bytes at a time (:func:`sorted_parts`).
    """
    q_rows, q_identity = queries
    g_rows, g_identity = gallery
    num = keys.klass.shape[0]

    counts = code_dtype(g_rows.shape[0])  # a count of gallery items fits
    # A side of every item in order (leave-one-out) reads the codes as they are.
    q_every, g_every = _every_row(q_rows, num), _every_row(g_rows, num)

    def of_queries(code: Tensor) -> Tensor:
        return code if q_every else code[q_rows]

    def in_gallery(code: Tensor) -> Tensor:
        """Per query: the gallery items that share the query's ``code``."""
        return _tally(code, None if g_every else g_rows, counts)[of_queries(code)]

    has_self, self_row = own_samples(q_rows, q_identity, g_rows, g_identity, num, block_bytes)
    if self_row is q_rows:  # each query's own sample is its own row
        same_class, same_label = has_self.clone(), torch.ones_like(has_self)
    else:
        same_class = has_self & (keys.klass[self_row] == of_queries(keys.klass))
        same_label = keys.label[self_row] == of_queries(keys.label)
    grouped = exclude != "none"  # both rules ignore same-group items of the same label
    group_rule = exclude == "same_group"
    same_group = torch.zeros_like(same_label)
    label_group = class_label_group = None
    if grouped:  # the composite keys with the group, each made once
        if keys.group.shape[0] != num:
            raise ValueError(f"exclude={exclude!r} needs the codes made with_groups")
        if self_row is q_rows:
            same_group = torch.ones_like(has_self)
        else:
            same_group = keys.group[self_row] == of_queries(keys.group)
        label_group = composite(keys.label, keys.group, block_bytes=block_bytes)
    # Valid positives (which queries compute() counts), then the identical ones; each
    # count turned into flags before the next (one key a time besides the codes).
    self_positive = has_self & same_label & ~(same_group & grouped)
    positives = in_gallery(keys.label).sub_(self_positive.to(counts))
    if label_group is not None:
        positives -= in_gallery(label_group)
    if empty_target_action in ("skip", "error"):
        counted = positives > 0
    else:
        counted = torch.ones_like(positives, dtype=torch.bool)
    del positives
    class_label = composite(keys.klass, keys.label, block_bytes=block_bytes)
    identical_pos = in_gallery(class_label).sub_((self_positive & same_class).to(counts))
    if label_group is not None:
        class_label_group = composite(class_label, keys.group, block_bytes=block_bytes)
        identical_pos -= in_gallery(class_label_group)
    identical_positive = counted & (identical_pos > 0)
    del identical_pos
    # Identical negatives: another label; only "same_group" ignores negatives.
    self_negative = same_class & ~same_label & ~(same_group & group_rule)
    identical_neg = in_gallery(keys.klass).sub_(in_gallery(class_label))
    del class_label
    identical_neg -= self_negative.to(counts)
    if group_rule and class_label_group is not None:
        identical_neg += in_gallery(class_label_group)
        identical_neg -= in_gallery(composite(keys.klass, keys.group, block_bytes=block_bytes))
    identical_negative = counted & (identical_neg > 0)
    del identical_neg, class_label_group
    gallery_classes = _tally(keys.klass, None if g_every else g_rows, counts)
    duplicates = int(g_rows.shape[0]) - int(torch.count_nonzero(gallery_classes))
    del gallery_classes
    rounding_pos, rounding_neg = torch.zeros_like(counted), torch.zeros_like(counted)
    rounding_duplicates = 0
    if keys.adjacent.numel():
        selves = (has_self, self_row)
        rounding_pos, rounding_neg = _rounding_flags(
            keys, q_rows, g_rows, selves, exclude, label_group
        )
        rounding_duplicates = _rounding_duplicates(keys, g_rows)
    return DirectionAudit(
        counted,
        identical_positive,
        identical_negative,
        duplicates,
        counted & rounding_pos,
        counted & rounding_neg,
        rounding_duplicates,
    )


def _every_row(rows: Tensor, num: int) -> bool:
    """Whether the distinct ``rows`` are ``0..num-1`` in order."""
    if rows.shape[0] != num:
        return False
    return num < 2 or bool((rows[1:] > rows[:-1]).all())


def _tally(code: Tensor, rows: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``[num]`` (``dtype``): how many of the ``rows`` (None: every item) have each
    code (``bincount``, without its int64 array and the codes' copy for every item)."""
    num = code.shape[0]
    table = torch.zeros(num, dtype=dtype, device=code.device)
    values = code if rows is None else code[rows]
    one = torch.ones(1, dtype=dtype, device=code.device)
    return table.index_add_(0, values, one.expand(values.shape[0]))


def own_samples(
    q_rows: Tensor,
    q_identity: Tensor,
    g_rows: Tensor,
    g_identity: Tensor,
    num: int,
    block_bytes: int = _COMPARE_BYTES,
) -> tuple[Tensor, Tensor]:
    """The query's own sample in the gallery (the ranking ignores it), where it is
    there: bool ``[Q]`` whether it is, and its row (:func:`code_dtype` of ``num``; the
    query's own row where it is not). The gallery's identities are distinct.

    Identities in ``[0, num)`` (the metric's: ``0..n-1``) are looked up in a table of
    ``num`` gallery positions (4 bytes an item); others through a sort of the gallery's
    identities, in parts (:func:`sorted_parts`)."""
    dtype = code_dtype(num)
    size = g_identity.shape[0]
    if size == 0 or q_identity.shape[0] == 0:
        return torch.zeros_like(q_rows, dtype=torch.bool), q_rows.to(dtype)
    if (
        q_rows.dtype == dtype
        and torch.equal(q_rows, g_rows)
        and torch.equal(q_identity, g_identity)
    ):
        return torch.ones_like(q_rows, dtype=torch.bool), q_rows  # leave-one-out
    device = g_identity.device
    low = min(int(g_identity.min()), int(q_identity.min()))
    high = max(int(g_identity.max()), int(q_identity.max()))
    if low >= 0 and high < num:
        position = torch.full((num,), -1, dtype=code_dtype(size), device=device)
        position[g_identity] = torch.arange(size, dtype=position.dtype, device=device)
        position = position[q_identity]
        has_self = position >= 0
    else:
        ident_sorted = torch.empty(size, dtype=torch.int64, device=device)
        order = torch.empty(size, dtype=code_dtype(size), device=device)
        at = 0
        for part, values in sorted_parts(g_identity.to(torch.int64), block_bytes):
            ident_sorted[at : at + part.shape[0]] = values
            order[at : at + part.shape[0]] = part
            at += part.shape[0]
        found = torch.searchsorted(ident_sorted, q_identity, out_int32=size <= CODE32_LIMIT)
        found.clamp_(max=size - 1)
        has_self = ident_sorted[found] == q_identity
        del ident_sorted
        position = order[found]
        del order, found
    self_row = torch.where(has_self, g_rows[position.clamp_(min=0)], q_rows).to(dtype)
    return has_self, self_row


def _rounding_flags(
    keys: Codes,
    q_rows: Tensor,
    g_rows: Tensor,
    selves: tuple[Tensor, Tensor],
    exclude: str,
    label_group: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """bool ``[Q]`` twice: the queries whose gallery holds a non-ignored item, another
    sample, of a class equal to the query's up to rounding (not its own class), of the
    query's label / of another label.

    Per (query, adjacent class ``b``) pair -- none on ordinary data -- the gallery items
    of class ``b`` with the query's key are counted by binary search in the gallery's
    sorted composite keys, with the ignore rules by inclusion-exclusion as in
    :func:`audit_direction`, less the query's own sample where it is of class ``b``."""
    num = keys.klass.shape[0]
    device = q_rows.device
    positive = torch.zeros(q_rows.shape, dtype=torch.bool, device=device)
    negative = torch.zeros_like(positive)
    adjacent = keys.adjacent
    starts = adjacent[:, 0].contiguous()
    q_class = keys.klass[q_rows]
    begin = torch.searchsorted(starts, q_class)
    degree = torch.searchsorted(starts, q_class, right=True) - begin
    ends = torch.cumsum(degree, dim=0)
    total = int(ends[-1]) if ends.numel() else 0
    if total == 0:
        return positive, negative

    def table(*codes: Tensor) -> Tensor:
        key = codes[0][g_rows].to(torch.int64)
        for code in codes[1:]:
            key = key * num + code[g_rows]
        return torch.sort(key)[0]

    def count(sorted_keys: Tensor, key: Tensor) -> Tensor:
        right = torch.searchsorted(sorted_keys, key, right=True)
        return right - torch.searchsorted(sorted_keys, key)

    by_class, by_label = table(keys.klass), table(keys.klass, keys.label)
    grouped, group_rule = exclude != "none", exclude == "same_group"
    if grouped:
        assert label_group is not None
        by_label_group = table(keys.klass, label_group)
    if group_rule:
        by_group = table(keys.klass, keys.group)
    has_self, self_row = selves
    for start in range(0, total, ROUNDING_CHUNK):
        pair = torch.arange(start, min(start + ROUNDING_CHUNK, total), device=device)
        query = torch.searchsorted(ends, pair, right=True)
        other = adjacent[begin[query] + pair - (ends[query] - degree[query]), 1]
        row = q_rows[query]
        label = keys.label[row]
        same = count(by_label, other * num + label)
        pos = same.clone()
        neg = count(by_class, other) - same
        own = self_row[query]
        same_group = torch.zeros_like(own, dtype=torch.bool)
        if grouped:
            assert label_group is not None
            pair_code = other * num + label_group[row]
            pos -= count(by_label_group, pair_code)
            same_group = keys.group[own] == keys.group[row]
        if group_rule:
            neg -= count(by_group, other * num + keys.group[row])
            neg += count(by_label_group, pair_code)
        mine = has_self[query] & (keys.klass[own] == other)
        same_label = keys.label[own] == label
        pos -= (mine & same_label & ~(same_group & grouped)).long()
        neg -= (mine & ~same_label & ~(same_group & group_rule)).long()
        positive[query[pos > 0]] = True
        negative[query[neg > 0]] = True
    return positive, negative


def _rounding_duplicates(keys: Codes, g_rows: Tensor) -> int:
    """Gallery items whose class first appears in the gallery after a class equal to it
    up to rounding (the bitwise repeats are ``duplicate_gallery_items``)."""
    num, size = keys.klass.shape[0], g_rows.shape[0]
    first = torch.full((num,), size, dtype=code_dtype(size), device=g_rows.device)
    positions = torch.arange(size, dtype=first.dtype, device=g_rows.device)
    first.scatter_reduce_(0, keys.klass[g_rows].long(), positions, reduce="amin")
    a, b = keys.adjacent[:, 0], keys.adjacent[:, 1]
    later = (first[a] < first[b]) & (first[b] < size)
    flagged = torch.zeros(num, dtype=torch.bool, device=g_rows.device)
    flagged[b[later]] = True
    return int(flagged.sum())


# ------------------------------------------------------------------ options


class AuditOptions(NamedTuple):
    """The metric's options that the audit reads."""

    exclude: str
    empty_target_action: str
    near_duplicate: float | None  # the threshold; None: no near-duplicate counts
    names: tuple[str, ...] = ("",)  # the direction names ("" for one direction)
    block_bytes: int = _COMPARE_BYTES  # rows are read this many bytes at a time
    share: int = _COMPARE_BYTES  # but never more than this (chunk_bytes / AUDIT_SHARE)


def options_of(metric: Any) -> AuditOptions:
    """The audit options of an :class:`~recall_at_k.EmbeddingRecallAtK`."""
    return AuditOptions(
        metric.exclude,
        metric.empty_target_action,
        metric.near_duplicate,
        tuple(metric.directions) if metric.bidirectional else ("",),
        max(1, metric.chunk_bytes // AUDIT_SHARE),
        max(1, metric.chunk_bytes // AUDIT_SHARE),
    )


Sides = tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]


def audit_directions(
    stored: tuple[Tensor, Tensor] | Callable[[], Codes],
    directions: Sequence[Sides | None],
    options: AuditOptions,
) -> list[DirectionAudit | None]:
    """:func:`audit_direction` of each direction (None where it is None; a direction with
    the same sides as the one before is audited once).

    Args:
        stored: the stored embeddings ``[N, D]`` (bit patterns compared as stored) and
            metadata ``[N, >= 2]`` (label, group first); or a function that makes their
            :func:`codes` (a sharded gallery's, whose rows no process holds whole).
        directions: ``((query rows, identity), (gallery rows, identity))`` per
            direction, or None for a direction without queries or gallery.
        options: the metric's options.
    """
    if all(sides is None for sides in directions):
        return [None for _ in directions]
    block = min(options.block_bytes, options.share)  # whatever the rows' width
    if callable(stored):
        keys = stored()
    else:
        embeddings, meta = stored
        keys = codes(
            embeddings, meta[:, 0], meta[:, 1], None, block, with_groups=options.exclude != "none"
        )
    audits: list[DirectionAudit | None] = []
    previous: Sides | None = None
    for sides in directions:
        if sides is None:
            audits.append(None)
            continue
        if previous is not None and all(
            torch.equal(a[0], b[0]) for a, b in zip(previous, sides, strict=True)
        ):
            audits.append(audits[-1])
            continue
        previous = sides
        audits.append(
            audit_direction(
                keys, sides[0], sides[1], options.exclude, options.empty_target_action, block
            )
        )
    return audits


def stale_anywhere(metric: Any, stale: bool) -> bool:
    """Whether the metric's report is stale on any process that its ``compute()`` syncs
    with (all of them then audit again, together); ``stale`` alone otherwise."""
    available = metric.distributed_available_fn
    if not (metric._to_sync and callable(available) and available()):
        return stale
    flag = torch.tensor([int(stale)], dtype=torch.int64, device=metric.device)
    _collectives.all_reduce(flag, op=dist.ReduceOp.MAX, group=metric.process_group)
    return bool(flag)


# ------------------------------------------------------------------ report, warning


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


def counted_queries(
    histograms: Sequence[tuple[Tensor, Tensor] | None], empty_target_action: str
) -> list[int | None]:
    """The counted queries of each direction, from the ranking's query counts (with,
    without a valid positive), by the rule of ``compute()``."""
    skip = empty_target_action in ("skip", "error")
    return [None if h is None else int(h[1][0]) + (0 if skip else int(h[1][1])) for h in histograms]


def protocol_reports(
    audits: Sequence[DirectionAudit | None],
    near: Sequence[Tensor | None],
    counted: Sequence[int | None],
    options: AuditOptions,
) -> list[dict[str, int]]:
    """The report of each direction (identical on every process: its parts are).

    Args:
        audits: each direction's :func:`audit_direction`, or None for a direction
            without queries or gallery.
        near: each direction's near-duplicate counts from the ranking
            (:data:`recall_at_k.ranking.rank.NEAR_COUNTS`, summed over processes), or
            None (no threshold, or not ranked).
        counted: the counted queries of each direction as ``compute()`` found them, or
            None to count them here (by the same rule).
        options: the metric's options.
    """
    reports: list[dict[str, int]] = []
    with_near = options.near_duplicate is not None
    for audit, near_counts, queries in zip(audits, near, counted, strict=True):
        if audit is None:
            reports.append(empty_report(with_near))
            continue
        queries = int(audit.counted.sum()) if queries is None else queries
        found = near_counts if with_near else None
        reports.append(report(queries, audit, found, options.empty_target_action))
    return reports


def report(
    queries: int, audit: DirectionAudit, near: Tensor | None, empty_target_action: str
) -> dict[str, int]:
    """One direction's report, its keys in the documented order (``near``: the ranking's
    near counts, zeros where it could not count them)."""
    result = {
        "queries": queries,
        "identical_positive": int(audit.identical_positive.sum()),
        "identical_negative": int(audit.identical_negative.sum()),
        "rounding_positive": int(audit.rounding_positive.sum()),
        "rounding_negative": int(audit.rounding_negative.sum()),
    }
    if near is not None:
        positive, negative, negative_alone, hits = (int(v) for v in near.tolist())
        result["near_positive"] = positive
        counts_all = empty_target_action not in ("skip", "error")
        result["near_negative"] = negative + (negative_alone if counts_all else 0)
        result["near_hits_at_1"] = hits
    result["duplicate_gallery_items"] = audit.duplicate_gallery_items
    result["rounding_duplicate_gallery_items"] = audit.rounding_duplicate_gallery_items
    return result


def empty_report(near: bool) -> dict[str, int]:
    """The report of a direction without queries or gallery: every count 0."""
    keys = ["queries", "identical_positive", "identical_negative"]
    keys += ["rounding_positive", "rounding_negative"]
    keys += ["near_positive", "near_negative", "near_hits_at_1"] if near else []
    keys += ["duplicate_gallery_items", "rounding_duplicate_gallery_items"]
    return dict.fromkeys(keys, 0)


def warning_message(
    names: Sequence[str], reports: Sequence[dict[str, int]], directions: Sequence[Sides | None]
) -> str | None:
    """The warning about identical positives, duplicate gallery items or their rounding
    copies, or None.

    Args:
        names: the direction names (``""`` for a metric with one direction).
        reports: the report of each direction.
        directions: each direction's sides, or None.
    """
    gallery = [0 if d is None else int(d[1][0].shape[0]) for d in directions]
    reports_named = list(zip(names, reports, strict=False))
    findings = []
    for (name, found), size in zip(reports_named, gallery, strict=False):
        where = f"direction {name!r}: " if name else ""
        queries = found["queries"]
        for key, what in (
            ("identical_positive", "a bitwise-identical item of their own label"),
            ("rounding_positive", "an item of their own label equal to them up to float rounding"),
        ):
            if found[key]:
                findings.append(
                    f"{where}{found[key]} of {queries} counted queries"
                    f" ({found[key] / queries:.1%}) have {what} in their gallery, a"
                    f" guaranteed hit (leakage) [{key}]"
                )
        for key, what in (
            ("duplicate_gallery_items", "bitwise-identical to"),
            ("rounding_duplicate_gallery_items", "equal up to float rounding to"),
        ):
            if found[key]:
                findings.append(
                    f"{where}{found[key]} of {size} gallery items"
                    f" ({found[key] / max(size, 1):.1%}) are {what} another gallery item, so"
                    f" every query ranks each repeat again [{key}]"
                )
    if not findings:
        return None
    return (
        "EmbeddingRecallAtK: "
        + "; ".join(findings)
        + ". Fixes: pass `ids=` so that repeats of one sample (a caption-indexed loader"
        " repeating its images, DistributedSampler padding, a query that is also in the"
        " gallery) count once; pass `groups=` with exclude='same_group' to ignore items of"
        " the query's own source; or de-duplicate the gallery. protocol_report() has the"
        " counts. (Shown once per metric instance.)"
    )
