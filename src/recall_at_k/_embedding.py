"""Ranking embeddings against a gallery in tiles: pure functions, no Metric.

The metric (:class:`recall_at_k.EmbeddingRecallAtK`) and the one-shot function
(:func:`recall_at_k.functional.embedding_recall_at_k`) describe their items the same way
-- embeddings, labels, groups, a sample identity and the role each item plays -- and
call :func:`rank` for each direction; under DDP the metric hands each process its share
of the queries.

**The score.** A query's gallery is ranked by one canonical score per pair, a function
of the stored embeddings alone (the same for every tiling, thread count, process count
and device):

- embeddings are first brought to float32 (float64 stays float64); for ``"cosine"`` each
  row ``x`` becomes ``n = fl32(x / sqrt(S))``, where ``S`` is the float64 sum of
  ``x_d ** 2`` accumulated in the order ``d = 0 .. D-1`` (``sqrt(S)`` clamped to at least
  1e-12), every operation elementwise, so a row's value never depends on its batch;
- ``"cosine"`` and ``"dot"``: the float64 sum over ``d = 0 .. D-1``, in that order, of
  ``q_d * g_d`` (a product of two float32 values is exact in float64);
- ``"euclidean"``: minus the float64 sum over ``d = 0 .. D-1``, in that order, of
  ``(q_d - g_d) ** 2`` (each difference and square rounded to float64);
- a callable: its scores as returned, per tile (outside the guarantee: they may depend
  on the tile's shape).

Embeddings stored in float64 (``set_dtype``) have inexact products; the fixed order and
separate multiply and add still give one value per pair on every device. (For float32
rows the canonical dot product uses a fused multiply-add per ``d``: the product being
exact, it rounds exactly like a multiply then an add.)

**Fast path and certificate.** The canonical scores are not what is computed for every
pair: each tile (or panel) of scores is one float32 matrix product, the *fast* score.
For each query a bound ``B`` with ``|fast - canonical| <= B`` for every gallery item is
known in advance (:func:`_bound_coefficient`): for a dot product of length D,
``|fl(q.g) - q.g| <= gamma_D * sum_d |q_d g_d| <= gamma_D |q| |g|`` with
``gamma_D = D u / (1 - D u)`` whatever the order or blocking of the sum, so
``B = 2 (gamma32_D + gamma64_D) |q| max_g |g|`` (the factor 2 covers the norms' own
rounding and the band's edges). With ``s*_f`` the best fast score of a query's valid
positives, an item whose fast score exceeds ``s*_f + 2B`` is surely above the canonical
``s*``, one below ``s*_f - 2B`` surely below; the items inside that band -- the positives
near ``s*`` among them, the best always -- are re-scored canonically, and ``s*``, the
ties and the order at ``s*`` are decided on those canonical scores. The result is thus
exactly the ranking by canonical scores, and only the band costs more than the product.

``"euclidean"`` is computed on vectors centred on the gallery's mean ``m``:
``q' = fl(q - m)``, ``g' = fl(g - m)``, fast score ``2 q'.g' - |q'|^2 - |g'|^2``, so a
common offset of every vector cancels before any product (no catastrophic cancellation).
Its bound, over the centring's rounding (``|fl(a) - a| <= u |a|`` per coordinate, so the
squared distance moves by at most ``u (2 + u) (|a| + |b|)^2``), the product and both
squared norms (``gamma_{D+1}`` each), the two final additions and the canonical sum's
own rounding: ``B = 2 (2 gamma32_{D+1} + 5 u32 + gamma64_{D+3}) (|q'| + max_g |g'|)^2``.

On CUDA with ``torch.get_float32_matmul_precision() != "highest"`` (TF32 or bfloat16
products) the bound adds ``2 u_in + u_in^2`` per product for the inputs' unit roundoff
``u_in`` (2**-11 for ``"high"``, 2**-8 for ``"medium"``): the band is wider, the answer
the same. Where float32 products could overflow (``"dot"``/``"euclidean"`` on huge
values) the fast path runs in float64; the canonical scores do not change.

Counts are integers; ``ties="expected"`` adds per-query probabilities, each rounded to a
multiple of ``2**-(52 - bit_length(N))`` (N the items), so that their float64 sums are
exact, hence the same, however tiles, threads and processes group the queries.

Per tile, a query's positives are read from a small block: the gallery's columns are its
items sorted by label, which puts the items of each label in one run of adjacent
columns, so a query's positives are the ``block_count`` columns from ``block_start`` on
(a gather of adjacent values). Ignored items (the query itself, same-group items) are
written as NaN into the tile, and NaN compares false with everything. Beyond the matrix
product, the full-width work is one read per panel (each row's largest score); only the
rows that reach their band are compared with its edges. When a tile's label blocks are
wide (few, large classes) the tile goes through full relevance and ignore masks
instead; every route gives the same counts.

On CPU the block route never holds a tile's full score rows: queries are ranked in label
order, so a tile's label blocks form one run of columns, scored first; the remaining
columns follow in panels, each read while it is still in the core's cache; the rows of
successive panels that reach their band are copied aside and compared together.

Leave-one-out on CPU (the queries are the gallery) takes the symmetric route
(:func:`_symmetric`): each query's band first, from its label block; then the product in
square blocks ``(I, J)``, ``J >= I``, each scanned by rows (block I's queries) and by
columns (block J's): every score is computed once for both of its items.

**Near-duplicate counts** (the protocol audit's, with a threshold ``t``) are made in the
same tiles: each row's largest score (read anyway) is compared with ``t - B``; the rare
rows that reach it are compared with ``t - B`` and ``t + B``, items above ``t + B`` are
surely near, those in between re-scored canonically with the band's pairs. A positive is
near when s* is (decided canonically anyway).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k import _kernel
from recall_at_k._checks import (
    check_choice,
    check_id_vector,
    check_same_device,
    check_tensors,
    describe,
)
from recall_at_k._kernel import TieCounts, Workspace, count_dtype
from recall_at_k._types import SIMILARITIES, Similarity

CPU_TILE_BYTES = 32 * 2**20
"""On CPU, tiles hold at most this many bytes of scores, whatever ``chunk_bytes`` allows:
larger tiles buy nothing (the product is as fast in 32 MiB tiles) and cost memory."""
CPU_COUNT_BLOCK_BYTES = 2 * 2**20
"""Rows of a tile are counted this many bytes at a time on CPU: a block that stays in the
core's cache between its comparison and its sum."""
CPU_PANEL_BYTES = 2 * 2**20
"""On CPU a tile's scores are computed in panels of columns of about this many bytes."""
SPARSE_MAX_BLOCK_FRACTION = 0.25
"""A tile takes a label-block route while its widest label block is at most this share
of the gallery; above it the dense masks are cheaper than gathering the blocks."""
CANONICAL_BATCH_BYTES = 4 * 2**20
"""Pairs are re-scored canonically in batches whose gathered float64 rows (each side)
take about this many bytes."""
PREPARE_CHUNK_BYTES = 2**20
"""Rows are normalised in float64 this many bytes at a time (one reused buffer)."""
CPU_STACK_BYTES = 4 * 2**20
"""On CPU the panel rows that reach their band are copied, panel after panel, into a
buffer of about this many bytes, then compared with the band's edges at once."""
PENDING_PAIRS = 2**16
"""In-band pairs of successive tiles are re-scored together once this many wait (or at
the end): one canonical pass over D for many tiles."""
SYMMETRIC_BLOCK_BYTES = 4 * 2**20
"""Leave-one-out on CPU: scores are computed in square blocks of about this many bytes,
each block once for the queries of its rows and those of its columns."""
SYMMETRIC_MIN_ROWS = 64
"""The symmetric route is taken (``"auto"``) when its blocks have at least this many rows
(or hold every item): smaller blocks cost more than they save."""
SYMMETRIC_PENDING_PAIRS = 2**22
"""The symmetric route keeps the in-band pairs found for queries of later blocks; when
more than this many wait, the remaining queries are ranked by the other routes."""
SAFETY = 2.0
"""Factor on the certified rounding bound (covers the float64 norms' own rounding)."""


class Route(NamedTuple):
    """How tiles are counted; every route gives the same counts.

    ``"auto"`` chooses: on CPU (built-in similarity, no NaN check) the symmetric route
    for leave-one-out (:func:`_symmetric`, where label blocks are narrow and its blocks
    have ``SYMMETRIC_MIN_ROWS`` rows), then per tile panels of columns, elsewhere whole
    tiles, and dense masks when the tile's widest label block exceeds
    ``SPARSE_MAX_BLOCK_FRACTION`` of the gallery. Tests force the others:
    ``"symmetric"`` (wherever it can run, blocks of any size; the rest as ``"auto"``),
    ``"panels"`` (CPU only; falls back to ``"tiles"`` where panels cannot be used),
    ``"tiles"`` (whole tiles through label blocks, as on a GPU) and ``"dense"``.
    """

    mode: Literal["auto", "symmetric", "panels", "tiles", "dense"] = "auto"
    panel_bytes: int = CPU_PANEL_BYTES
    block_bytes: int = SYMMETRIC_BLOCK_BYTES
    pending_pairs: int = SYMMETRIC_PENDING_PAIRS


AUTO_ROUTE = Route()


def tile_mode(
    route: Route, widest: int, num_gallery: int, panels_possible: bool
) -> Literal["panels", "tiles", "dense"]:
    """How one tile is counted: the route's mode, or for ``"auto"`` (and the tiles that
    ``"symmetric"`` leaves) dense masks when the tile's widest label block (``widest``
    gallery items) exceeds ``SPARSE_MAX_BLOCK_FRACTION`` of the gallery, else panels
    where possible, else tiles."""
    mode: Literal["panels", "tiles", "dense"]
    if route.mode == "auto" or route.mode == "symmetric":
        narrow = widest <= SPARSE_MAX_BLOCK_FRACTION * num_gallery
        mode = ("panels" if panels_possible else "tiles") if narrow else "dense"
    else:
        mode = route.mode
    if mode == "panels" and not panels_possible:
        mode = "tiles"
    return mode


class Side(NamedTuple):
    """The items that play one role, each sample once: rows into the item tensors and
    the sample identity of each."""

    rows: Tensor
    identity: Tensor


class RankOptions(NamedTuple):
    """What a ranking needs to know besides the items."""

    similarity: Similarity
    exclude: str
    ties: str
    max_k: int
    chunk_bytes: int
    check_nan: bool
    near_duplicate: float | None = None  # a threshold: count the near items (the audit)


class RankCounts(NamedTuple):
    """A ranking's contribution: ``hist`` ``[max K]`` and int64 ``queries``
    (with, without a valid positive), ``nan_queries`` (queries whose scores held NaN),
    ``rescored`` (int64, the (query, item) pairs re-scored canonically) and ``near``
    (int64 ``[4]``, zeros without ``near_duplicate``; see :data:`NEAR_COUNTS`)."""

    hist: Tensor
    queries: Tensor
    nan_queries: Tensor
    rescored: Tensor
    near: Tensor


NEAR_COUNTS = (
    "near_positive",  # queries with a valid positive whose s* is at or above the threshold
    "near_negative_with_positive",  # ... with a valid negative at or above it
    "near_negative_without_positive",  # queries without a valid positive, with such a negative
    "near_hits_at_1",  # queries whose rank-1 hit (certain: no negative at s*) is at or above it
)
"""What ``RankCounts.near`` counts, in order, on canonical scores (queries flagged in
``known`` count as near positive / near negative too)."""


class _Gallery(NamedTuple):
    """A direction's gallery, prepared for scoring.

    Its columns are the gallery's items sorted by label (stable), so that each label's
    items are one run of adjacent columns: a query's positives are read as a contiguous
    block of its score row.
    """

    rows: Tensor  # [G] rows of the prepared embeddings, in column order
    embeddings: Tensor  # [G, D] in column order (centred for "euclidean")
    centre: Tensor | None  # [D] the mean subtracted, for "euclidean"
    neg_sq_norms: Tensor | None  # [1, G] negated squared norms, for "euclidean"
    bound: float  # B / |q| ("dot", "cosine"), B / (|q| + max |g|)^2 ("euclidean")
    max_norm: float  # max_g |g| (of the centred vectors for "euclidean")
    labels: Tensor  # [G], ascending
    groups: Tensor  # [G]
    block_labels: Tensor  # [C] distinct labels, ascending
    block_starts: Tensor  # [C] the first column of each label's run
    block_counts: Tensor  # [C] the run's length
    identity_sorted: Tensor  # [G] identities, ascending
    identity_column: Tensor  # [G] column of each entry of ``identity_sorted``


class _Pairs(NamedTuple):
    """(query, item) pairs to decide on canonical scores."""

    rows: Tensor  # [M] tile row of each pair
    columns: Tensor  # [M] gallery column of each pair
    values: Tensor | None  # [M] the pair's score, kept for a callable similarity


Found = list[tuple[Tensor, Tensor, Tensor | None]]
"""Pairs found by a scan, a part per scanned block: (tile rows, gallery columns, values)."""


class _Band(NamedTuple):
    """What one tile's scanning yields, per query of the tile."""

    greater: (
        Tensor  # [T] (a float count dtype) valid negatives surely above s* (fast score above hi)
    )
    has_positive: Tensor  # [T] bool
    pairs: _Pairs  # the in-band pairs: fast score within 2B of s*_f
    near_sure: Tensor | None  # [T] items surely at or above the near threshold (no positive)
    near_pairs: _Pairs | None  # items whose fast score lies within B of the threshold


class _Queries(NamedTuple):
    """Queries in gallery terms, in label order."""

    rows: Tensor  # [Q] rows of the prepared embeddings
    labels: Tensor
    groups: Tensor
    block_start: Tensor  # [Q] first column of the query's label run
    block_count: Tensor  # [Q] its length (0: no item of that label in the gallery)
    self_column: Tensor  # [Q] column of the query itself in the gallery, -1 if absent
    position: Tensor  # [Q] the query's index in the side it came from


# ---------------------------------------------------------------- items and roles


def identities(ids: Tensor, has_id: Tensor) -> Tensor:
    """A sample identity per item: items sharing an id share it, an item without id is
    alone. Identities are ``0..n-1`` with the ids' in ascending order first."""
    num = ids.shape[0]
    identity = torch.empty(num, dtype=torch.int64, device=ids.device)
    sorted_ids, order = torch.sort(ids[has_id])
    distinct, inverse_sorted = torch.unique_consecutive(sorted_ids, return_inverse=True)
    inverse = torch.empty_like(inverse_sorted)
    inverse[order] = inverse_sorted
    identity[has_id] = inverse
    without = (~has_id).nonzero().squeeze(1)
    identity[without] = distinct.shape[0] + torch.arange(without.shape[0], device=ids.device)
    return identity


def select(plays_role: Tensor, identity: Tensor) -> Side:
    """Items playing a role, keeping the first item of each identity (dedupe by id)."""
    num = identity.shape[0]
    rows = plays_role.nonzero().squeeze(1)
    ident = identity[rows]
    first = torch.full((num,), num, dtype=torch.int64, device=identity.device)
    first.scatter_reduce_(0, ident, rows, reduce="amin")
    keep = first[ident] == rows
    return Side(rows[keep], ident[keep])


def prepare(embeddings: Tensor, similarity: Similarity) -> Tensor:
    """Embeddings in a float dtype of at least 32 bits; L2-normalised for ``"cosine"``.

    The cosine normalisation is computed once per row, elementwise and in a fixed order
    (the float64 sum of squares over ``d = 0 .. D-1``), so a row's normalised value is
    the same in every batch, process and device. Always a copy of its own (callers may
    write into it).
    """
    dtype = torch.promote_types(embeddings.dtype, torch.float32)
    if similarity != "cosine":
        return embeddings.to(dtype, copy=True)
    columns = embeddings.T.contiguous()  # [D, N]
    total = torch.zeros(columns.shape[1], dtype=torch.float64, device=columns.device)
    term = torch.empty_like(total)
    for column in columns:
        term.copy_(column)  # exact
        total.add_(term.mul_(term))
    total.sqrt_().clamp_min_(1e-12)
    out = torch.empty(embeddings.shape, dtype=dtype, device=embeddings.device)
    step = max(1, PREPARE_CHUNK_BYTES // (8 * max(1, embeddings.shape[1])))
    step = max(1, min(step, embeddings.shape[0]))
    wide = torch.empty((step, embeddings.shape[1]), dtype=torch.float64, device=out.device)
    for start in range(0, embeddings.shape[0], step):
        rows = wide[: min(step, embeddings.shape[0] - start)]
        rows.copy_(embeddings[start : start + step])
        out[start : start + step] = rows.div_(total[start : start + step].unsqueeze(1))
    return out


def canonical_scores(
    embeddings: Tensor,
    query_rows: Tensor,
    gallery_rows: Tensor,
    similarity: Similarity,
    workspace: Workspace | None = None,
) -> Tensor:
    """The canonical float64 score of each pair ``(query_rows[i], gallery_rows[i])``.

    The sum over ``d = 0 .. D-1`` in that order, one elementwise multiply (or difference
    and square) and one add per ``d``: never a BLAS product or a reduction whose order
    could depend on shapes, threads or the device.
    """
    num, dim = query_rows.shape[0], embeddings.shape[1]
    device, wide = embeddings.device, torch.float64
    workspace = Workspace() if workspace is None else workspace
    out = torch.empty(num, dtype=wide, device=device)
    exact_products = torch.finfo(embeddings.dtype).bits <= 32
    step = max(1, min(num, CANONICAL_BATCH_BYTES // (8 * max(1, dim))))
    for start in range(0, num, step):
        count = min(step, num - start)
        pair = workspace.get("canonical_rows", (count, dim), embeddings.dtype, device)
        q = workspace.get("canonical_q", (dim, count), wide, device)
        g = workspace.get("canonical_g", (dim, count), wide, device)
        torch.index_select(embeddings, 0, query_rows[start : start + count], out=pair)
        q.copy_(pair.T)  # [D, m], exact
        torch.index_select(embeddings, 0, gallery_rows[start : start + count], out=pair)
        g.copy_(pair.T)
        total = torch.zeros(count, dtype=wide, device=device)
        term = torch.empty_like(total)
        for d in range(dim):
            if similarity == "euclidean":
                torch.sub(q[d], g[d], out=term)
                total.add_(term.mul_(term))
            elif exact_products:
                # A float32 x float32 product is exact in float64, so a fused
                # multiply-add rounds exactly like a multiply then an add.
                total.addcmul_(q[d], g[d])
            else:
                total.add_(torch.mul(q[d], g[d], out=term))
        out[start : start + count] = total.neg_() if similarity == "euclidean" else total
    return out


def _gamma(terms: int, unit: float) -> float:
    """gamma_n = n u / (1 - n u), the relative bound of a sum of n rounded terms."""
    if terms * unit >= 1:
        return math.inf
    return terms * unit / (1 - terms * unit)


def _input_unit(dtype: torch.dtype, device: torch.device) -> float:
    """The unit roundoff of a product's inputs when the matrix product rounds them
    (TF32 or bfloat16 under ``torch.set_float32_matmul_precision``); 0 otherwise."""
    if dtype != torch.float32 or device.type != "cuda":
        return 0.0
    precision = torch.get_float32_matmul_precision()
    return {"highest": 0.0, "high": 2.0**-11}.get(precision, 2.0**-8)


def _bound_coefficient(
    similarity: Similarity, dim: int, dtype: torch.dtype, device: torch.device
) -> float:
    """``B`` per unit of ``|q| max |g|`` (dot, cosine) or ``(|q| + max |g|)^2``
    (euclidean): the certified distance between a fast and a canonical score."""
    if callable(similarity):
        return 0.0
    unit = float(torch.finfo(dtype).eps) / 2
    unit64 = float(torch.finfo(torch.float64).eps) / 2
    inputs = _input_unit(dtype, device)
    rounded_inputs = 2 * inputs + inputs * inputs
    if similarity == "euclidean":
        fast = 2 * (_gamma(dim + 1, unit) + rounded_inputs) + 5 * unit
        return SAFETY * (fast + _gamma(dim + 3, unit64))
    return SAFETY * (_gamma(dim, unit) + rounded_inputs + _gamma(dim, unit64))


def may_produce_nan(embeddings: Tensor, similarity: Similarity) -> bool:
    """Whether scores could be NaN although the embeddings are finite (reads one value)."""
    if callable(similarity):
        return True
    if similarity == "cosine" or embeddings.numel() == 0:
        return False
    # dot / euclidean overflow to inf (and inf - inf = NaN) only for huge values.
    largest = float(embeddings.abs().amax())
    bound = 4.0 * embeddings.shape[1] * largest * largest
    return bound >= torch.finfo(embeddings.dtype).max / 4


# ------------------------------------------------------------------------ ranking


def rank(
    embeddings: Tensor,
    labels: Tensor,
    groups: Tensor,
    queries: Side,
    gallery_side: Side,
    options: RankOptions,
    route: Route = AUTO_ROUTE,
    known: Tensor | None = None,
) -> RankCounts:
    """Rank ``queries`` against ``gallery_side`` in tiles; the summed rank histogram.

    Args:
        embeddings: ``[N, D]`` from :func:`prepare`, every item of both sides.
        labels: int64 ``[N]``; a gallery item is relevant to a query with its label.
        groups: int64 ``[N]``, read by ``options.exclude``.
        queries: the queries (all, or this process's share).
        gallery_side: the gallery (all of it on every process).
        options: similarity, exclusion, tie policy, largest K, tile size, NaN check,
            near-duplicate threshold.
        route: how tiles are counted (tests choose; every route gives the same counts).
        known: bool ``[2, Q]`` (in the order of ``queries``): queries known to have a
            near positive / a near negative whatever their scores (the audit's identical
            items); read only with ``options.near_duplicate``.
    """
    device = embeddings.device
    if queries.rows.numel() == 0:
        return _Tally(embeddings, None, options, None).result()
    overflow = embeddings.dtype == torch.float32 and not callable(options.similarity)
    if overflow and may_produce_nan(embeddings, options.similarity):
        # Float32 products could overflow: the fast path runs in float64 (exact
        # copies; the canonical scores are the same).
        embeddings = embeddings.to(torch.float64)
    gallery = _gallery(embeddings, labels, groups, gallery_side, options.similarity)
    num_gallery = gallery.embeddings.shape[0]
    share = _queries(labels, groups, queries, gallery)
    tally = _Tally(embeddings, gallery, options, known)
    tile_bytes = options.chunk_bytes
    if device.type == "cpu":
        tile_bytes = min(tile_bytes, CPU_TILE_BYTES)
    itemsize = gallery.embeddings.element_size()
    rows_per_tile = max(1, tile_bytes // max(1, num_gallery * itemsize))
    panels_possible = (
        device.type == "cpu" and not callable(options.similarity) and not options.check_nan
    )
    near = options.near_duplicate is not None
    done = 0
    if panels_possible and _symmetric_possible(share, gallery, route):
        done = _symmetric(gallery, share, options, route, tile_bytes, tally)
    num_queries = share.rows.shape[0]
    for start in range(done, num_queries, rows_per_tile):
        tile = _Queries._make(t[start : start + rows_per_tile] for t in share)
        tile_embeddings = embeddings.index_select(0, tile.rows)
        if gallery.centre is not None:
            tile_embeddings.sub_(gallery.centre)
        bound = _bounds(tile_embeddings, gallery, options.similarity)
        widest = int(tile.block_count.max()) if tile.block_count.numel() else 0
        mode = tile_mode(route, widest, num_gallery, panels_possible and widest > 0)
        if widest == 0 and not options.check_nan and not near:
            # No query of the tile has an item of its label in the gallery.
            tally.add_counts(_kernel.no_positive_counts(tile.rows.shape[0], device))
            continue
        if mode == "panels":
            workspace = tally.workspace
            band = _panel_band(tile_embeddings, tile, gallery, bound, options, route, workspace)
        else:
            scores = _scores(tile_embeddings, gallery, options.similarity, tally.workspace)
            if options.check_nan:
                tally.nan += torch.isnan(scores).any(dim=1).sum()
            _ignore_in_place(scores, tile, gallery, options.exclude)
            if mode == "dense":
                band = _dense_band(scores, tile, gallery, bound, options, tally.workspace)
            else:
                band = _block_band(
                    scores, tile, gallery.groups, gallery.labels, bound, options, tally.workspace
                )
        tally.add_band(tile, band)
    return tally.result()


def _symmetric_possible(share: _Queries, gallery: _Gallery, route: Route) -> bool:
    """Whether the queries are the gallery's items, in its order, each ignoring only
    itself by identity (leave-one-out), with narrow label blocks (``"auto"``)."""
    if route.mode not in ("auto", "symmetric"):
        return False
    rows = share.rows
    if rows.shape != gallery.rows.shape or not torch.equal(rows, gallery.rows):
        return False
    own = torch.arange(rows.shape[0], device=rows.device)
    if not torch.equal(share.self_column, own):
        return False
    widest = int(share.block_count.max()) if rows.numel() else 0
    return route.mode == "symmetric" or widest <= SPARSE_MAX_BLOCK_FRACTION * rows.shape[0]


def _symmetric(
    gallery: _Gallery,
    share: _Queries,
    options: RankOptions,
    route: Route,
    tile_bytes: int,
    tally: _Tally,
) -> int:
    """Rank leave-one-out queries (the gallery's own items, in its order) computing each
    score once for both of its items: the product in square blocks ``(I, J)``,
    ``J >= I``, whose rows are queries of block I and whose columns, read down, are
    queries of block J. Returns the number of queries ranked (the first ones): all, or
    fewer when more than ``route.pending_pairs`` in-band pairs wait for later blocks
    (or none when the blocks would be too small); :func:`rank` ranks the rest.

    First each query's s*_f and band edges, from its label block (as in
    :func:`_block_scan`); then the blocks, each scanned by rows and by columns with
    those edges. A score of a block may differ in its last bits from the same pair's
    score in the label block's product; both are within B of the canonical score, so
    the band (2B around s*_f) is still certain. The blocks hide every item of the
    query's own label (the query itself, its positives -- their band pairs come from the
    label blocks --, label-and-group junk) and same-group items (``"same_group"``) as
    -inf: they scan negatives only, and a query's scan stops once ``max_k`` of them are
    surely above s*.
    """
    num = gallery.embeddings.shape[0]
    embeddings = gallery.embeddings  # the queries, centred like the gallery
    size = math.isqrt(max(1, min(route.block_bytes, tile_bytes) // embeddings.element_size()))
    if route.mode == "auto" and size < min(SYMMETRIC_MIN_ROWS, num):
        return 0
    size = max(1, size)
    starts = list(range(0, num, size))
    workspace, device, dtype = tally.workspace, embeddings.device, embeddings.dtype
    bound = _bounds(embeddings, gallery, options.similarity)
    greater = torch.zeros(num, dtype=count_dtype(num), device=device)
    has_positive = torch.zeros(num, dtype=torch.bool, device=device)
    lo = torch.full((num, 1), math.inf, dtype=dtype, device=device)
    hi = torch.full((num, 1), math.inf, dtype=dtype, device=device)
    positives: list[Found] = [[] for _ in starts]
    for index, start in enumerate(starts):
        tile = _Queries._make(t[start : start + size] for t in share)
        present = tile.block_count > 0
        if not bool(present.any()):
            continue
        first = int(torch.where(present, tile.block_start, num).min())
        stop = int(torch.where(present, tile.block_start + tile.block_count, 0).max())
        scores = _product(
            embeddings[start : start + size], gallery, first, stop, options.similarity, workspace
        )
        _ignore_in_place(scores, tile, gallery, options.exclude, first)
        block_tile = tile._replace(block_start=tile.block_start - first)
        block = _block_best(
            scores, block_tile, gallery.groups[first:stop], options.exclude, workspace
        )
        edges = _band_edges(block.best, bound[start : start + size], block.has_positive)
        lo[start : start + size], hi[start : start + size] = edges
        has_positive[start : start + size] = block.has_positive
        # The valid positives in the band (all of them are at most hi): the blocks below
        # find only negatives, so that a query's scan may stop early.
        row, step = (block.valid & (block.values >= edges[0])).nonzero(as_tuple=True)
        positives[index].append((row, tile.block_start[row] + step, None))
    # Above -inf, which the blocks write where an item is ignored (scores are finite).
    lo.clamp_(min=torch.finfo(dtype).min)
    near = _near_scan(options.near_duplicate, bound, lo, num)
    found: list[Found] = [[] for _ in starts]
    near_found: list[Found] = [[] for _ in starts]
    for index, start in enumerate(starts):
        rows = slice(start, min(start + size, num))
        for later, column in enumerate(starts[index:], start=index):
            columns = slice(column, min(column + size, num))
            scores = _product(
                embeddings[rows], gallery, column, columns.stop, options.similarity, workspace
            )
            _ignore_in_block(scores, gallery, options.exclude, rows, columns)
            if later > index:  # read down: the column's queries against the rows' items
                down = scores.T
                peak = down.amax(dim=1, keepdim=True)
                if near is not None:
                    labels = gallery.labels[columns], gallery.labels[rows]
                    _near_block(down, peak, _near_part(near, columns, near_found[later]),
                                labels, start, False)  # fmt: skip
                _scan_down(scores, peak, lo[columns], hi[columns], start, greater[columns],
                           found[later], workspace)  # fmt: skip
                _saturate(lo[columns], greater[columns], options.max_k)
            peak = scores.amax(dim=1, keepdim=True)
            if near is not None:
                labels = gallery.labels[rows], gallery.labels[columns]
                _near_block(scores, peak, _near_part(near, rows, near_found[index]),
                            labels, column, False)  # fmt: skip
            _scan(scores, lo[rows], hi[rows], column, greater[rows], found[index],
                  False, workspace, peak=peak)  # fmt: skip
            _saturate(lo[rows], greater[rows], options.max_k)
        tile = _Queries._make(t[rows] for t in share)
        near_pairs = None if near is None else _pairs(near_found[index], device)
        band_pairs = _pairs(positives[index] + found[index], device)
        band = _Band(
            greater[rows],
            has_positive[rows],
            band_pairs,
            None if near is None else near.sure[rows],
            near_pairs,
        )
        found[index], near_found[index], positives[index] = [], [], []
        tally.add_band(tile, band)
        lists = found + near_found + positives
        waiting = sum(part[0].shape[0] for parts in lists for part in parts)
        if waiting > route.pending_pairs:
            return min(num, start + size)
    return num


def _scan_down(
    scores: Tensor,
    peak: Tensor,
    lo: Tensor,
    hi: Tensor,
    first: int,
    greater: Tensor,
    found: Found,
    workspace: Workspace,
) -> None:
    """:func:`_scan` of the columns of ``scores`` (each column a query, its rows items
    ``first:``), whose largest scores are ``peak`` ``[C, 1]``; ``scores`` is kept. Only
    the columns that reach ``lo`` are gathered, in the scores' memory order."""
    columns = (peak < lo).logical_not_().view(-1).nonzero().view(-1)
    if columns.numel() == 0:
        return
    shape = (scores.shape[0], columns.shape[0])
    candidates = workspace.get("down", shape, scores.dtype, scores.device)
    torch.index_select(scores, 1, columns, out=candidates)
    column_lo = lo.index_select(0, columns).view(1, -1)
    column_hi = hi.index_select(0, columns).view(1, -1)
    above = torch.gt(candidates, column_hi)
    greater.index_add_(0, columns, above.sum(dim=0, dtype=greater.dtype))
    inside = torch.ge(candidates, column_lo).logical_and_(above.logical_not_())
    row, column = inside.nonzero(as_tuple=True)
    if row.numel():
        found.append((columns[column], row + first, None))


def _saturate(lo: Tensor, greater: Tensor, max_k: int) -> None:
    """Stop scanning the queries with at least ``max_k`` negatives surely above s*: a
    miss at every K whatever else is found (their ``lo`` becomes +inf, which no score
    reaches). Only negatives are scanned after the band's positives are found."""
    lo.masked_fill_(greater.unsqueeze(1) >= max_k, math.inf)


def _near_part(near: _Near, rows: slice, found: Found) -> _Near:
    """The near-duplicate scan of the queries ``rows`` (views of ``near``'s tensors)."""
    return _Near(near.lo[rows], near.hi[rows], near.sure[rows], found)


def _ignore_in_block(
    scores: Tensor, gallery: _Gallery, exclude: str, rows: slice, columns: slice
) -> None:
    """Write -inf over the items of a block of leave-one-out scores (queries ``rows``
    against items ``columns``, both gallery positions) that its scan must not see: every
    item of the query's own label -- the query itself, its positives (their band pairs
    come from the label blocks), label-and-group junk -- and its group under
    ``"same_group"``.

    The gallery is in label order, so an item's label is a run of positions: in a block
    off the diagonal at most one label (a run from the rows' last position to the
    columns' first) has items on both sides, one rectangle. -inf, below every band's
    ``lo`` (finite or +inf) and the threshold's, is never counted or found -- like NaN
    elsewhere, but it leaves each row's largest score meaningful."""
    labels = gallery.labels
    if rows == columns:
        same_label = labels[rows].unsqueeze(1) == labels[columns].unsqueeze(0)
        scores.masked_fill_(same_label, -math.inf)
    else:
        last = labels[rows.stop - 1]
        if bool(labels[columns.start] == last):
            block = int(torch.searchsorted(gallery.block_labels, last))
            run_start = int(gallery.block_starts[block])
            run_stop = run_start + int(gallery.block_counts[block])
            top = max(run_start, rows.start) - rows.start  # the run ends past rows.stop
            right = min(run_stop, columns.stop) - columns.start  # it starts before columns
            scores[top:, :right] = -math.inf
    if exclude == "same_group":
        same = gallery.groups[rows].unsqueeze(1) == gallery.groups[columns].unsqueeze(0)
        scores.masked_fill_(same, -math.inf)


class _Tally:
    """What :func:`rank` adds up, tile after tile: each tile's counts once its in-band
    pairs are decided (the pairs of successive tiles wait, up to ``PENDING_PAIRS``, to
    be re-scored in one canonical pass)."""

    def __init__(
        self,
        embeddings: Tensor,
        gallery: _Gallery | None,
        options: RankOptions,
        known: Tensor | None,
    ) -> None:
        device = embeddings.device
        hist_dtype = torch.float64 if options.ties == "expected" else torch.int64
        self.hist = torch.zeros(options.max_k, dtype=hist_dtype, device=device)
        self.queries = torch.zeros(2, dtype=torch.int64, device=device)
        self.nan = torch.zeros((), dtype=torch.int64, device=device)
        self.rescored = torch.zeros((), dtype=torch.int64, device=device)
        self.near = torch.zeros(len(NEAR_COUNTS), dtype=torch.int64, device=device)
        self.embeddings, self.gallery, self.options, self.known = (
            embeddings,
            gallery,
            options,
            known,
        )
        self.grid = _probability_grid(embeddings.shape[0])
        self.workspace = Workspace()
        self.pending: list[tuple[_Queries, _Band]] = []
        self.pending_pairs = 0

    def add_counts(self, counts: TieCounts) -> None:
        """A tile counted without pairs to decide."""
        hist, query_counts = _histogram(counts, self.options, self.grid)
        self.hist += hist
        self.queries += query_counts

    def add_band(self, tile: _Queries, band: _Band) -> None:
        """A scanned tile; decided with the pending ones once enough pairs wait."""
        self.pending.append((tile, band))
        self.pending_pairs += band.pairs.rows.shape[0]
        if band.near_pairs is not None:
            self.pending_pairs += band.near_pairs.rows.shape[0]
        if self.pending_pairs >= PENDING_PAIRS:
            self.flush()

    def flush(self) -> None:
        """Decide the pending tiles."""
        if not self.pending:
            return
        assert self.gallery is not None
        decided = _decide(
            self.embeddings, self.gallery, self.pending, self.options, self.known, self.workspace
        )
        self.rescored += decided.rescored
        self.near += decided.near
        self.add_counts(decided.counts)
        self.pending, self.pending_pairs = [], 0

    def result(self) -> RankCounts:
        self.flush()
        return RankCounts(self.hist, self.queries, self.nan, self.rescored, self.near)


def _probability_grid(num_items: int) -> float:
    """``2**k`` such that sums of up to ``num_items`` probabilities, each a multiple of
    ``2**-k``, are exact in float64 in any order (tiles, threads, processes)."""
    return 2.0 ** max(0, 52 - num_items.bit_length())


def _histogram(counts: TieCounts, options: RankOptions, grid: float) -> tuple[Tensor, Tensor]:
    """:func:`recall_at_k._kernel.rank_histogram`, with each query's ``"expected"``
    probabilities rounded to a multiple of ``1 / grid`` (an error below ``N * 2**-53``
    a query), so that their sums are the same however the queries are grouped."""
    outcomes = _kernel.query_outcomes(counts, options.ties, options.max_k)
    if outcomes.is_floating_point():
        outcomes = outcomes.mul(grid).round_().div_(grid)
    return _kernel.histogram_of(outcomes, options.max_k)


def _gallery(
    embeddings: Tensor, labels: Tensor, groups: Tensor, side: Side, similarity: Similarity
) -> _Gallery:
    labels_sorted, label_order = torch.sort(labels[side.rows], stable=True)
    rows = side.rows[label_order]
    gallery_embeddings = embeddings[rows]
    centre = neg_sq_norms = None
    if similarity == "euclidean":
        # Centred on the gallery's mean: a common offset of every vector cancels here,
        # not in the product. Any centre is exact (the bound covers its rounding).
        centre = gallery_embeddings.mean(dim=0)
        gallery_embeddings.sub_(centre)
        neg_sq_norms = gallery_embeddings.square().sum(dim=1).neg_().unsqueeze(0)
    max_norm = 0.0
    if gallery_embeddings.numel():
        # In the embeddings' own dtype, then raised past its rounding (relative error
        # at most gamma_{D+2}): an upper bound of the exact largest norm.
        norms = torch.linalg.vector_norm(gallery_embeddings, dim=1)
        unit = float(torch.finfo(gallery_embeddings.dtype).eps) / 2
        max_norm = float(norms.max()) * (1 + 2 * _gamma(embeddings.shape[1] + 2, unit))
    bound = _bound_coefficient(similarity, embeddings.shape[1], embeddings.dtype, embeddings.device)
    block_labels, block_counts = torch.unique_consecutive(labels_sorted, return_counts=True)
    block_starts = torch.cumsum(block_counts, dim=0) - block_counts
    identity_sorted, identity_column = torch.sort(side.identity[label_order])
    return _Gallery(
        rows,
        gallery_embeddings,
        centre,
        neg_sq_norms,
        bound,
        max_norm,
        labels_sorted,
        groups[rows],
        block_labels,
        block_starts,
        block_counts,
        identity_sorted,
        identity_column,
    )


def _bounds(queries: Tensor, gallery: _Gallery, similarity: Similarity) -> Tensor:
    """``[T, 1]`` float64: each query's bound ``B`` on ``|fast - canonical|``."""
    # In the queries' dtype, raised past its rounding: an upper bound of each norm.
    unit = float(torch.finfo(queries.dtype).eps) / 2
    norms: Tensor = torch.linalg.vector_norm(queries, dim=1, keepdim=True).to(torch.float64)
    norms.mul_(1 + 2 * _gamma(queries.shape[1] + 2, unit))
    if similarity == "euclidean":
        norms = norms.add_(gallery.max_norm).square_().mul_(gallery.bound)
    else:
        norms.mul_(gallery.max_norm * gallery.bound)
    return norms


def _queries(labels: Tensor, groups: Tensor, side: Side, gallery: _Gallery) -> _Queries:
    """The queries in label order: a tile's label blocks are then adjacent and together
    one run of columns (what :func:`_panel_counts` computes first)."""
    query_labels, order = torch.sort(labels[side.rows], stable=True)
    side = Side(side.rows[order], side.identity[order])
    block = torch.searchsorted(gallery.block_labels, query_labels)
    block = block.clamp(max=gallery.block_labels.shape[0] - 1)
    found = gallery.block_labels[block] == query_labels
    block_start = gallery.block_starts[block]
    block_count = torch.where(found, gallery.block_counts[block], 0)
    position = torch.searchsorted(gallery.identity_sorted, side.identity)
    position = position.clamp(max=gallery.identity_sorted.shape[0] - 1)
    is_self = gallery.identity_sorted[position] == side.identity
    self_column = torch.where(is_self, gallery.identity_column[position], -1)
    return _Queries(
        side.rows, query_labels, groups[side.rows], block_start, block_count, self_column, order
    )


def _scores(
    queries: Tensor, gallery: _Gallery, similarity: Similarity, workspace: Workspace
) -> Tensor:
    """Scores ``[T, G]`` of a tile, ours to write into."""
    num_rows, num_gallery = queries.shape[0], gallery.embeddings.shape[0]
    if not callable(similarity):
        return _product(queries, gallery, 0, num_gallery, similarity, workspace)
    scores = similarity(queries, gallery.embeddings)
    if (
        not isinstance(scores, Tensor)
        or tuple(scores.shape) != (num_rows, num_gallery)
        or not scores.is_floating_point()
    ):
        shape = list(scores.shape) if isinstance(scores, Tensor) else type(scores)
        raise ValueError(
            f"`similarity` must return floating point scores of shape"
            f" [{num_rows}, {num_gallery}] for a tile of queries, got {shape}"
        )
    # A private copy: the tile is written to below.
    return scores.detach().clone(memory_format=torch.contiguous_format)


def _product(
    queries: Tensor,
    gallery: _Gallery,
    first: int,
    stop: int,
    similarity: Similarity,
    workspace: Workspace,
) -> Tensor:
    """Fast scores ``[T, stop - first]`` of a tile against the gallery columns
    ``first:stop``, in the workspace's tile buffer (for ``"euclidean"`` the queries
    are centred like the gallery)."""
    num_rows, width = queries.shape[0], stop - first
    out = workspace.get("tile", (num_rows, width), queries.dtype, queries.device)
    gallery_t = gallery.embeddings[first:stop].T
    if similarity == "euclidean":
        assert gallery.neg_sq_norms is not None
        # -(|q'|^2 - 2 q'.g' + |g'|^2)
        torch.addmm(gallery.neg_sq_norms[:, first:stop], queries, gallery_t, alpha=2, out=out)
        out.sub_(queries.square().sum(dim=1, keepdim=True))
    else:
        torch.matmul(queries, gallery_t, out=out)
    return out


def _edges(centre: Tensor, half: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``lo <= centre - half`` and ``hi >= centre + half`` (float64 ``[T, 1]``) in
    ``dtype``, rounded outwards."""
    lo_wide, hi_wide = centre - half, centre + half
    lo, hi = lo_wide.to(dtype), hi_wide.to(dtype)
    lo = torch.where(
        lo.to(torch.float64) > lo_wide, torch.nextafter(lo, lo.new_tensor(-math.inf)), lo
    )
    hi = torch.where(
        hi.to(torch.float64) < hi_wide, torch.nextafter(hi, hi.new_tensor(math.inf)), hi
    )
    return lo, hi


def _band_edges(best: Tensor, bound: Tensor, has_positive: Tensor) -> tuple[Tensor, Tensor]:
    """``[T, 1]`` edges ``lo <= s*_f - 2B`` and ``hi >= s*_f + 2B`` in the scores' dtype
    (rounded outwards); +inf for a query without a valid positive (its counts are not
    read)."""
    lo, hi = _edges(best.to(torch.float64), 2 * bound, best.dtype)
    missing = ~has_positive.unsqueeze(1)
    return lo.masked_fill_(missing, math.inf), hi.masked_fill_(missing, math.inf)


def _scan(
    scores: Tensor,
    lo: Tensor,
    hi: Tensor,
    first: int,
    greater: Tensor,
    found: Found,
    keep_values: bool,
    workspace: Workspace,
    every_row: bool = False,
    peak: Tensor | None = None,
    preserve: bool = False,
) -> None:
    """Add to ``greater`` (per row of ``scores``, a float dtype from
    :func:`recall_at_k._kernel.count_dtype`) the count of scores above ``hi``, and to
    ``found`` the positions (rows, gallery columns ``first + j``) with
    ``lo <= score <= hi``; NaN, an ignored item, is neither. Overwrites ``scores``
    unless ``keep_values`` or ``preserve``. ``peak``: each row's largest score, where
    the caller has it already.

    The full-width work is one read: each row's largest score (NaN where the row holds
    an ignored item), in blocks of rows of about ``CPU_COUNT_BLOCK_BYTES`` on CPU. Only
    the rows reaching ``lo`` (or holding a NaN) are copied and compared with ``lo``
    and ``hi`` (written as 0/1 into float buffers and summed, on CPU faster than a
    ``bool`` result, :func:`recall_at_k._kernel.count_dtype`), and only the rows whose
    two counts differ, those with band items, are searched. With ``every_row`` (every
    row holds its best positive, so reaches ``lo``), or when most rows reach ``lo``,
    the block is compared whole instead.
    """
    num_rows, width = scores.shape
    sum_dtype = greater.dtype
    step = num_rows
    if scores.device.type == "cpu":
        step = max(1, CPU_COUNT_BLOCK_BYTES // max(1, width * scores.element_size()))
    for start in range(0, num_rows, step):
        block, block_lo, block_hi, block_peak = scores, lo, hi, peak
        if step < num_rows:
            stop = start + step
            block, block_lo, block_hi = scores[start:stop], lo[start:stop], hi[start:stop]
            block_peak = None if peak is None else peak[start:stop]
        if every_row:
            rows = None
        else:
            if block_peak is None:
                block_peak = block.amax(dim=1, keepdim=True)
            rows = (block_peak < block_lo).logical_not_().view(-1).nonzero().view(-1)
            if rows.numel() == 0:
                continue
            if 2 * rows.shape[0] > block.shape[0]:
                rows = None  # most rows: compare them all rather than copy them
        if rows is None:
            marks = workspace.get("marks", tuple(block.shape), scores.dtype, scores.device)
            reach = torch.ge(block, block_lo, out=marks).sum(dim=1, dtype=sum_dtype)
            if keep_values or preserve:
                upper = workspace.get("upper", tuple(block.shape), scores.dtype, scores.device)
                above = torch.gt(block, block_hi, out=upper)
            else:
                above = block.gt_(block_hi)  # the scores are not read again
            # marks: score >= lo and not above hi (no bool temporaries).
            marks.sub_(above)
            above = above.sum(dim=1, dtype=sum_dtype)
            greater[start : start + block.shape[0]] += above
            if torch.equal(reach, above):
                continue
            rows = (reach > above).nonzero().view(-1)
            inside = marks if rows.shape[0] == block.shape[0] else marks.index_select(0, rows)
            row, column = inside.nonzero(as_tuple=True)
            if inside is not marks:
                row = rows[row]
            value = block[row, column] if keep_values else None
            found.append((row + start, column + first, value))
        else:
            rows += start
            shape = (rows.shape[0], width)
            candidates = workspace.get("candidates", shape, scores.dtype, scores.device)
            torch.index_select(scores, 0, rows, out=candidates)
            marks = workspace.get("marks", shape, scores.dtype, scores.device)
            reach = torch.ge(candidates, lo.index_select(0, rows), out=marks)
            reach = reach.sum(dim=1, dtype=sum_dtype)
            above = candidates.gt_(hi.index_select(0, rows)).sum(dim=1, dtype=sum_dtype)
            greater.index_add_(0, rows, above)
            if torch.equal(reach, above):
                continue
            rows = rows[reach > above]
            candidates = scores.index_select(0, rows)
            inside = (candidates >= lo.index_select(0, rows)) & (
                candidates <= hi.index_select(0, rows)
            )
            row, column = inside.nonzero(as_tuple=True)
            value = candidates[row, column] if keep_values else None
            found.append((rows[row], column + first, value))


def _pairs(found: Found, device: torch.device) -> _Pairs:
    """The pairs of a scan's parts, in one tensor each."""
    if not found:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return _Pairs(empty, empty, None)
    values = None
    if found[0][2] is not None:
        values = torch.cat([v for _, _, v in found if v is not None])
    rows = torch.cat([r for r, _, _ in found])
    columns = torch.cat([c for _, c, _ in found])
    return _Pairs(rows, columns, values)


class _Near(NamedTuple):
    """A tile's near-duplicate scan: the threshold's edges ``[T, 1]`` (``t - B``,
    ``t + B`` rounded outwards), the count of items surely at or above it, the pairs
    within the edges."""

    lo: Tensor
    hi: Tensor
    sure: Tensor
    found: Found


def _near_scan(threshold: float | None, bound: Tensor, like: Tensor, total: int) -> _Near | None:
    """The empty near-duplicate scan of a tile (None without a threshold): ``like`` gives
    the scores' dtype and the tile's rows, ``total`` the gallery's size."""
    if threshold is None:
        return None
    centre = torch.full_like(bound, threshold)
    lo, hi = _edges(centre, bound, like.dtype)
    sure = torch.zeros(like.shape[0], dtype=count_dtype(total), device=like.device)
    return _Near(lo, hi, sure, [])


def _near_block(
    scores: Tensor,
    peak: Tensor | None,
    near: _Near,
    labels: tuple[Tensor, Tensor],
    first: int,
    keep_values: bool,
) -> None:
    """Add a block of scores (columns ``first:``) to a near-duplicate scan: per row, the
    items of another label scored above ``near.hi`` (surely at or above the threshold)
    to ``near.sure``, those within the edges to ``near.found``. ``peak``: each row's
    largest score (or None); ``labels``: those of the rows and of the columns.

    Only the rows whose largest score reaches ``near.lo`` are copied (a positive is near
    when s* is; its label's items are set aside here); NaN, an ignored item, is neither.
    """
    if peak is None:  # NaN (an ignored item) taken as -inf: never near
        peak = torch.where(scores.isnan(), -math.inf, scores).amax(dim=1, keepdim=True)
    rows = (peak < near.lo).logical_not_().view(-1).nonzero().view(-1)
    if rows.numel() == 0:
        return
    if scores.stride(0) == 1 and scores.stride(1) != 1:  # a transposed block: gather its rows
        candidates = scores.T.index_select(1, rows).T  # column by column in memory order
    else:
        candidates = scores.index_select(0, rows)
    same_label = labels[0].index_select(0, rows).unsqueeze(1) == labels[1].unsqueeze(0)
    candidates.masked_fill_(same_label, math.nan)
    lo, hi = near.lo.index_select(0, rows), near.hi.index_select(0, rows)
    near.sure.index_add_(0, rows, (candidates > hi).sum(dim=1, dtype=near.sure.dtype))
    row, column = ((candidates >= lo) & (candidates <= hi)).nonzero(as_tuple=True)
    if row.numel():
        value = candidates[row, column] if keep_values else None
        near.found.append((rows[row], column + first, value))


def _gather_band(
    greater: Tensor, has_positive: Tensor, found: Found, near: _Near | None = None
) -> _Band:
    device = greater.device
    if near is None:
        return _Band(greater, has_positive, _pairs(found, device), None, None)
    return _Band(
        greater, has_positive, _pairs(found, device), near.sure, _pairs(near.found, device)
    )


class _Block(NamedTuple):
    """The label blocks of a tile's queries, ``[T, widest]``."""

    best: Tensor  # [T, 1] s*_f, the best fast score of a valid positive (-inf: none)
    has_positive: Tensor  # [T] bool
    values: Tensor  # the scores (label-and-group rule), else -inf where not valid
    in_block: Tensor  # bool: the entry is in the query's block
    valid: Tensor  # bool: the entry is a valid positive


def _block_best(
    scores: Tensor, tile: _Queries, groups: Tensor, exclude: str, workspace: Workspace
) -> _Block:
    """s*_f, whether a valid positive exists, and each query's label block: its values
    (for the label-and-group rule; otherwise -inf where not a valid positive), which
    entries are in the block, which are valid positives.

    ``groups`` are the groups of the columns of ``scores``; ``tile.block_start`` counts
    in those columns. The block's buffers come from ``workspace``.
    """
    device = scores.device
    widest = int(tile.block_count.max()) if tile.block_count.numel() else 0
    shape = (scores.shape[0], widest)
    if widest == 0:  # no query of the tile has an item of its label in the gallery
        nothing = torch.zeros(shape, dtype=torch.bool, device=device)
        best = torch.full((shape[0], 1), -math.inf, dtype=scores.dtype, device=device)
        return _Block(best, nothing.any(dim=1), scores.new_empty(shape), nothing, nothing)
    steps = torch.arange(widest, device=device)
    in_block = steps.unsqueeze(0) < tile.block_count.unsqueeze(1)
    # Rows without a block (block_count 0) may start anywhere: keep them in range.
    columns = workspace.get("block_columns", shape, torch.int64, device)
    torch.add(tile.block_start.unsqueeze(1), steps.unsqueeze(0), out=columns)
    columns.clamp_(min=0, max=max(scores.shape[1] - 1, 0))
    block = torch.gather(
        scores, 1, columns, out=workspace.get("block", shape, scores.dtype, device)
    )
    valid = in_block & ~torch.isnan(block)
    if exclude == "same_label_and_group":
        valid &= groups[columns] != tile.groups.unsqueeze(1)
        best = torch.where(valid, block, float("-inf")).amax(dim=1, keepdim=True)
    else:
        best = block.masked_fill_(~valid, float("-inf")).amax(dim=1, keepdim=True)
    return _Block(best, valid.any(dim=1), block, in_block, valid)


class _TileScan(NamedTuple):
    """A tile's scan in progress: the counts and pairs so far, the band's edges."""

    greater: Tensor  # [T] valid negatives surely above s* so far
    has_positive: Tensor  # [T] bool
    found: Found  # in-band pairs so far
    lo: Tensor  # [T, 1] the band's edges
    hi: Tensor
    near: _Near | None  # the near-duplicate scan so far

    def band(self) -> _Band:
        return _gather_band(self.greater, self.has_positive, self.found, self.near)


def _block_scan(
    scores: Tensor,
    tile: _Queries,
    groups: Tensor,
    column_labels: Tensor,
    bound: Tensor,
    options: RankOptions,
    workspace: Workspace,
    first: int = 0,
    num_gallery: int | None = None,
) -> _TileScan:
    """The scan of a tile (or of the columns ``first:`` holding every label block of
    it, ``num_gallery`` columns in all) whose positives are read from their label
    blocks.

    ``scores`` already holds NaN where an item is ignored (the query itself, same-group
    items). Every item sharing the query's label lies in its block; no valid positive
    scores above ``hi``, so the block's items above ``hi`` are label-and-group junk,
    taken off the count of negatives surely above s*. ``groups`` and ``column_labels``
    are those of the columns. The near-duplicate scan (with a threshold) comes first.
    """
    best, has_positive, block, in_block, _ = _block_best(
        scores, tile, groups, options.exclude, workspace
    )
    lo, hi = _band_edges(best, bound, has_positive)
    total = scores.shape[1] if num_gallery is None else num_gallery
    greater = torch.zeros(scores.shape[0], dtype=count_dtype(total), device=scores.device)
    found: Found = []
    keep = callable(options.similarity)
    near = _near_scan(options.near_duplicate, bound, scores, total)
    if near is not None:
        labels = tile.labels, column_labels
        _near_block(scores, None, near, labels, first, keep)
    _scan(scores, lo, hi, first, greater, found, keep, workspace, True)
    if options.exclude == "same_label_and_group":
        greater -= ((block > hi) & in_block).sum(dim=1)
    return _TileScan(greater, has_positive, found, lo, hi, near)


def _block_band(
    scores: Tensor,
    tile: _Queries,
    groups: Tensor,
    labels: Tensor,
    bound: Tensor,
    options: RankOptions,
    workspace: Workspace,
) -> _Band:
    """The band of a whole tile whose positives are read from their label blocks."""
    return _block_scan(scores, tile, groups, labels, bound, options, workspace).band()


def _panel_band(
    queries: Tensor,
    tile: _Queries,
    gallery: _Gallery,
    bound: Tensor,
    options: RankOptions,
    route: Route,
    workspace: Workspace,
) -> _Band:
    """:func:`_block_band` of a tile whose scores never exist all at once (CPU).

    The tile's queries are in label order, so their label blocks together are one
    run of columns ``[lo, hi)``: those scores come first and give each query's s*_f and
    band; the other columns follow in panels of about ``route.panel_bytes``, each
    scanned while still in cache.
    """
    num_rows, num_gallery = queries.shape[0], gallery.embeddings.shape[0]
    present = tile.block_count > 0
    lo = int(torch.where(present, tile.block_start, num_gallery).min())
    hi = int(torch.where(present, tile.block_start + tile.block_count, 0).max())
    scores = _product(queries, gallery, lo, hi, options.similarity, workspace)
    _ignore_in_place(scores, tile, gallery, options.exclude, lo)
    block_tile = tile._replace(block_start=tile.block_start - lo)
    scan = _block_scan(
        scores,
        block_tile,
        gallery.groups[lo:hi],
        gallery.labels[lo:hi],
        bound,
        options,
        workspace,
        lo,
        num_gallery,
    )
    width = max(1, route.panel_bytes // (num_rows * queries.element_size()))
    panels = [(a, min(a + width, lo)) for a in range(0, lo, width)]
    panels += [(a, min(a + width, num_gallery)) for a in range(hi, num_gallery, width)]
    # Each query lies in its own label block, so only same-group exclusion, or an id
    # shared by items of different labels, ignores anything outside [lo, hi).
    self_outside = (tile.self_column >= 0) & ((tile.self_column < lo) | (tile.self_column >= hi))
    ignore_outside = options.exclude == "same_group" or bool(self_outside.any())
    widest_panel = max((stop - first for first, stop in panels), default=0)
    stack = _Stack(scan.lo, scan.hi, scan.greater, scan.found, widest_panel, workspace)
    for first, stop in panels:
        scores = _product(queries, gallery, first, stop, options.similarity, workspace)
        if ignore_outside:
            _ignore_in_place(scores, tile, gallery, options.exclude, first)
        # The rows that reach lo (or hold an ignored item): one read of the panel.
        peak = scores.amax(dim=1, keepdim=True)
        if scan.near is not None:
            labels = tile.labels, gallery.labels[first:stop]
            _near_block(scores, peak, scan.near, labels, first, False)
        _panel_rows(scores, peak, first, scan, stack, workspace)
        _saturate(scan.lo, scan.greater, options.max_k)  # panels hold no positive
    stack.flush()
    return scan.band()


def _panel_rows(
    scores: Tensor, peak: Tensor, first: int, scan: _TileScan, stack: _Stack, workspace: Workspace
) -> None:
    """Scan a panel of scores (columns ``first:``; no positive among them) whose rows'
    largest scores are ``peak`` for the band: the rows that reach it go to ``stack``,
    or the whole panel when most do (overwriting it)."""
    rows = (peak < scan.lo).logical_not_().view(-1).nonzero().view(-1)
    if 2 * rows.shape[0] > scores.shape[0]:  # most rows: compare the whole panel
        _scan(scores, scan.lo, scan.hi, first, scan.greater, scan.found, False, workspace, True)
    elif rows.shape[0]:
        stack.add(scores, rows, first)


class _Stack:
    """Copies of the panel rows that reach their band, from successive panels of one
    tile and of one width, compared with the band's edges together (fewer, larger
    operations than per panel)."""

    def __init__(
        self,
        lo: Tensor,
        hi: Tensor,
        greater: Tensor,
        found: Found,
        width: int,
        workspace: Workspace,
    ) -> None:
        self.lo, self.hi, self.greater, self.found = lo, hi, greater, found
        self.workspace = workspace
        capacity = max(lo.shape[0], CPU_STACK_BYTES // max(1, width * lo.element_size()))
        self.buffer = workspace.get("stack", (capacity, width), lo.dtype, lo.device)
        self.used = 0
        self.rows: list[Tensor] = []
        self.firsts: list[int] = []

    def add(self, scores: Tensor, rows: Tensor, first: int) -> None:
        """Copy ``rows`` of a panel whose first gallery column is ``first`` (a narrower
        panel is padded with -inf, which no band reaches)."""
        count = rows.shape[0]
        if self.used + count > self.buffer.shape[0]:
            self.flush()
        target = self.buffer[self.used : self.used + count]
        if scores.shape[1] == target.shape[1]:
            torch.index_select(scores, 0, rows, out=target)
        else:
            narrow = self.workspace.get(
                "narrow", (count, scores.shape[1]), target.dtype, rows.device
            )
            target[:, : scores.shape[1]] = torch.index_select(scores, 0, rows, out=narrow)
            target[:, scores.shape[1] :] = -math.inf
        self.used += count
        self.rows.append(rows)
        self.firsts.append(first)

    def flush(self) -> None:
        """What :func:`_scan` does, on every row copied so far."""
        if not self.rows:
            return
        candidates = self.buffer[: self.used]
        rows = torch.cat(self.rows)
        counts = torch.tensor([r.shape[0] for r in self.rows], device=rows.device)
        firsts = torch.tensor(self.firsts, device=rows.device).repeat_interleave(counts)
        lo, hi = self.lo.index_select(0, rows), self.hi.index_select(0, rows)
        marks = self.workspace.get("marks", tuple(candidates.shape), lo.dtype, lo.device)
        dtype = self.greater.dtype
        reach = torch.ge(candidates, lo, out=marks).sum(dim=1, dtype=dtype)
        above = candidates.gt_(hi)
        marks.sub_(above)  # score >= lo and not above hi
        above = above.sum(dim=1, dtype=dtype)
        self.greater.index_add_(0, rows, above)
        if not torch.equal(reach, above):
            banded = (reach > above).nonzero().view(-1)
            row, column = marks.index_select(0, banded).nonzero(as_tuple=True)
            self.found.append((rows[banded][row], firsts[banded][row] + column, None))
        self.used = 0
        self.rows, self.firsts = [], []


def _ignore_in_place(
    scores: Tensor, tile: _Queries, gallery: _Gallery, exclude: str, first: int = 0
) -> None:
    """Write NaN over the items each query must ignore in the gallery columns
    ``first:first + scores.shape[1]``, except the label-and-group junk, which lies
    inside the label blocks and is handled there."""
    width = scores.shape[1]
    rows = torch.arange(scores.shape[0], device=scores.device)
    local = tile.self_column - first
    inside = (tile.self_column >= 0) & (local >= 0) & (local < width)
    column = local.clamp(min=0, max=max(width - 1, 0))
    current = scores[rows, column]
    scores[rows, column] = torch.where(inside, float("nan"), current)
    if exclude == "same_group":
        groups = gallery.groups[first : first + width]
        same_group = tile.groups.unsqueeze(1) == groups.unsqueeze(0)
        scores.masked_fill_(same_group, float("nan"))


def _dense_band(
    scores: Tensor,
    tile: _Queries,
    gallery: _Gallery,
    bound: Tensor,
    options: RankOptions,
    workspace: Workspace,
) -> _Band:
    """The band of a tile read through full relevance and ignore masks (wide label
    blocks): the junk is written as NaN too, so nothing above ``hi`` is a positive."""
    target = tile.labels.unsqueeze(1) == gallery.labels.unsqueeze(0)
    if options.exclude == "same_label_and_group":
        junk = target & (tile.groups.unsqueeze(1) == gallery.groups.unsqueeze(0))
        scores.masked_fill_(junk, math.nan)
    valid = target & ~torch.isnan(scores)
    best = torch.where(valid, scores, float("-inf")).amax(dim=1, keepdim=True)
    has_positive = valid.any(dim=1)
    lo, hi = _band_edges(best, bound, has_positive)
    greater = torch.zeros(scores.shape[0], dtype=count_dtype(scores.shape[1]), device=scores.device)
    found: Found = []
    keep = callable(options.similarity)
    near = _near_scan(options.near_duplicate, bound, scores, scores.shape[1])
    if near is not None:
        _near_block(scores, None, near, (tile.labels, gallery.labels), 0, keep)
    _scan(scores, lo, hi, 0, greater, found, keep, workspace, True)
    return _gather_band(greater, has_positive, found, near)


class _Decided(NamedTuple):
    """The counts of decided tiles: ``g_>``, ``g_> + e``, ``p`` per query, the pairs
    re-scored, and the near-duplicate counts (:data:`NEAR_COUNTS`)."""

    counts: TieCounts
    rescored: Tensor
    near: Tensor


def _decide(
    embeddings: Tensor,
    gallery: _Gallery,
    tiles: list[tuple[_Queries, _Band]],
    options: RankOptions,
    known: Tensor | None,
    workspace: Workspace,
) -> _Decided:
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
    tile = _Queries._make(torch.cat(fields) for fields in zip(*(t for t, _ in tiles), strict=True))
    offsets = [0]
    for part, _ in tiles[:-1]:
        offsets.append(offsets[-1] + part.rows.shape[0])
    bands = [band for _, band in tiles]
    rows, columns, values = _joined([band.pairs for band in bands], offsets)
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
        near_rows, near_columns, near_values = _joined(parts, offsets)
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
    return _Decided(counts, rescored, near)


def _joined(parts: list[_Pairs], offsets: list[int]) -> tuple[Tensor, Tensor, Tensor | None]:
    """The pairs of successive tiles, rows counted from the first tile's first row."""
    rows = torch.cat([pairs.rows + offset for pairs, offset in zip(parts, offsets, strict=True)])
    columns = torch.cat([pairs.columns for pairs in parts])
    kept = [pairs.values for pairs in parts if pairs.values is not None]
    return rows, columns, torch.cat(kept) if kept else None


# ------------------------------------------------------------------------- checks


def check_batch(
    embeddings: Tensor,
    labels: Tensor,
    groups: Tensor | None,
    ids: Tensor | None,
    names: tuple[str, str, str, str] = ("embeddings", "labels", "groups", "ids"),
) -> None:
    """Types, shapes, dtypes and devices of one batch of items (no value read)."""
    check_tensors(**dict(zip(names, (embeddings, labels, groups, ids), strict=True)))
    if embeddings.dim() != 2 or not embeddings.is_floating_point():
        raise ValueError(
            f"`{names[0]}` must be a floating point tensor of shape [B, D],"
            f" got {describe(embeddings)}"
        )
    batch = embeddings.shape[0]
    for name, value in zip(names[1:], (labels, groups, ids), strict=True):
        check_id_vector(name, value, batch, f"one entry per row of `{names[0]}`")
    check_same_device(**dict(zip(names, (embeddings, labels, groups, ids), strict=True)))


def check_finite(embeddings: Tensor, name: str = "embeddings") -> None:
    """Finite embeddings (reads values on the host; only with ``validate_args=True``)."""
    if embeddings.numel() and not bool(torch.isfinite(embeddings).all()):
        nan = int(torch.isnan(embeddings).sum())
        inf = int(torch.isinf(embeddings).sum())
        raise ValueError(f"`{name}` must be finite, found {nan} NaN and {inf} infinite value(s)")


def check_similarity(similarity: object) -> None:
    """A built-in similarity's name, or a callable."""
    if not callable(similarity):
        check_choice("similarity", similarity, SIMILARITIES)


def nan_scores_error(queries: int) -> ValueError:
    """The error for scores that came out NaN although the embeddings are finite."""
    return ValueError(
        f"`similarity` returned NaN scores for {queries} quer{'y' if queries == 1 else 'ies'};"
        " scores must not be NaN (a bug in a callable, or the overflow of huge embeddings"
        " under 'dot' / 'euclidean')"
    )


# ---------------------------------------------------------------------- processes


class ProcessGroup(NamedTuple):
    """The process group whose gathered states a ranking sees (``None``: the default)."""

    group: Any


class Shared(NamedTuple):
    """What :func:`rank_shared` returns, per direction (None where nothing is ranked)."""

    histograms: list[tuple[Tensor, Tensor] | None]  # (hist, queries) summed over processes
    near: list[Tensor | None]  # NEAR_COUNTS summed over processes
    ranked: list[int]  # the queries this process ranked
    rescored: list[int]  # the (query, item) pairs this process re-scored canonically


def rank_shared(
    embeddings: Tensor,
    labels: Tensor,
    groups: Tensor,
    directions: list[tuple[Side, Side] | None],
    options: RankOptions,
    route: Route,
    shared: ProcessGroup | None,
    known: Sequence[Tensor | None] | None = None,
) -> Shared:
    """Rank every direction's (queries, gallery), sharing the queries among processes.

    With ``shared`` (states gathered: every process holds every item) each process ranks
    its contiguous share of each direction's queries against the whole gallery and the
    counts are summed over the group, so every process returns the same counts. A
    direction that is ``None`` (nothing to rank) gives ``None``; a direction with the
    same sides as the one before (leave-one-out, both ways) is not ranked twice.
    ``known``: per direction, :func:`rank`'s ``known`` for all its queries.
    """
    world, me, group = 1, 0, None
    if shared is not None and dist.is_available() and dist.is_initialized():
        group = shared.group
        world, me = dist.get_world_size(group), dist.get_rank(group)
    results: list[RankCounts | None] = []
    ranked: list[int] = []
    rescored: list[int] = []
    failure: Exception | None = None
    for index, sides in enumerate(directions):
        if sides is None:
            results.append(None)
            ranked.append(0)
            rescored.append(0)
            continue
        before = directions[index - 1] if index else None
        if before is not None and same_sides(before, sides):
            results.append(results[-1])
            ranked.append(ranked[-1])
            rescored.append(rescored[-1])
            continue
        queries, gallery = sides
        num = queries.rows.shape[0]
        lo, hi = num * me // world, num * (me + 1) // world
        share = Side(queries.rows[lo:hi], queries.identity[lo:hi])
        flags = None if known is None or known[index] is None else known[index]
        flags = None if flags is None else flags[:, lo:hi]
        try:
            counts = rank(embeddings, labels, groups, share, gallery, options, route, flags)
        except Exception as err:
            if world == 1:
                raise
            # Take part in the all_reduce, so that no other process waits forever, then
            # raise here and there.
            failure = err
            nothing = Side(share.rows[:0], share.identity[:0])
            counts = rank(embeddings, labels, groups, nothing, gallery, options, route)
        results.append(counts)
        ranked.append(hi - lo)
        rescored.append(int(counts.rescored))
    histograms, near = sum_over_processes(results, world, group, failure)
    return Shared(histograms, near, ranked, rescored)


def sum_over_processes(
    results: list[RankCounts | None],
    world: int,
    group: Any,
    failure: Exception | None,
) -> tuple[list[tuple[Tensor, Tensor] | None], list[Tensor | None]]:
    """Sum each direction's counts over the processes (every process calls this, with
    its share's counts, or None for a direction that could not be ranked anywhere), then
    raise a failure of any process on every process.

    Returns:
        ``(hist, queries)`` and the near counts per direction, or None where
        ``results`` holds None.
    """
    present = [r for r in results if r is not None]
    if not present:
        return [None for _ in results], [None for _ in results]
    hists = torch.stack([r.hist for r in present])
    counts = torch.stack(
        [torch.cat([r.queries, r.nan_queries.reshape(1), r.near]) for r in present]
    )
    failed = torch.tensor([int(failure is not None)], device=counts.device)
    if world > 1:
        dist.all_reduce(hists, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(failed, op=dist.ReduceOp.SUM, group=group)
    if failure is not None:
        raise failure
    if int(failed):
        raise RuntimeError("EmbeddingRecallAtK.compute() failed on another process; see its error")
    nan_queries = int(counts[:, 2].sum())
    if nan_queries:
        raise nan_scores_error(nan_queries)
    reduced = iter(zip(hists, counts[:, :2], counts[:, 3:], strict=True))
    histograms: list[tuple[Tensor, Tensor] | None] = []
    near: list[Tensor | None] = []
    for result in results:
        if result is None:
            histograms.append(None)
            near.append(None)
        else:
            hist, queries, near_counts = next(reduced)
            histograms.append((hist, queries))
            near.append(near_counts)
    return histograms, near


def same_sides(previous: tuple[Side, Side], current: tuple[Side, Side]) -> bool:
    """Whether a direction ranks the same queries against the same gallery as before."""
    return all(
        a.rows.shape == b.rows.shape and torch.equal(a.rows, b.rows)
        for a, b in zip(previous, current, strict=True)
    )


def check_directions(directions: object) -> tuple[str, str]:
    if (
        isinstance(directions, str)
        or not isinstance(directions, Sequence)
        or len(directions) != 2
        or not all(isinstance(d, str) and d for d in directions)
        or directions[0] == directions[1]
    ):
        raise ValueError(
            "`directions` must be two distinct non-empty strings (the key prefixes of"
            f" query -> gallery and gallery -> query), got {directions!r}"
        )
    return (directions[0], directions[1])
