"""A ranking's items: the sides (who is a query, who is in the gallery), the gallery and
the queries in label order, each query's rounding bound, and the fast scores of a tile.

The gallery's columns are its items sorted by label (stable), so that each label's items
are one run of adjacent columns: a query's positives are read as a contiguous block of
its score row. Queries are ranked in label order too, so that a tile's label blocks are
adjacent. The fast score is one matrix product per tile (:mod:`recall_at_k.ranking.score` says
how far it may be from the canonical score).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from recall_at_k._kernel import Workspace
from recall_at_k._types import Similarity
from recall_at_k.ranking.score import bound_absolute, bound_coefficient, norm_upper


class Side(NamedTuple):
    """The items that play one role, each sample once: rows into the item tensors and
    the sample identity of each."""

    rows: Tensor
    identity: Tensor


class Gallery(NamedTuple):
    """A direction's gallery, prepared for scoring.

    Its columns are the gallery's items sorted by label (stable), so that each label's
    items are one run of adjacent columns: a query's positives are read as a contiguous
    block of its score row. Its labels and groups are views of the items' where its
    rows are one run of them (:mod:`recall_at_k.ranking.ordered`); the rows have the
    side's dtype, the runs' starts and counts :func:`index_dtype`.
    """

    rows: Tensor  # [G] rows of the prepared embeddings, in column order
    embeddings: Tensor  # [G, D] in column order (not centred: see ``centre``)
    centre: Tensor | None  # [D] the mean subtracted, for "euclidean"
    neg_sq_norms: Tensor | None  # [1, G] negated squared norms, for "euclidean"
    bound: float  # B's relative part per |q| max |g| (or (|q| + max |g|)^2, "euclidean")
    absolute: float  # B's absolute part (products rounded below the smallest normal)
    max_norm: float  # max_g |g| (of the centred vectors for "euclidean")
    labels: Tensor  # [G], ascending
    groups: Tensor  # [G]
    block_labels: Tensor  # [C] distinct labels, ascending
    block_starts: Tensor  # [C] the first column of each label's run
    block_counts: Tensor  # [C] the run's length
    identity_sorted: Tensor  # [G] identities, ascending
    identity_column: Tensor  # [G] column of each entry of ``identity_sorted``
    chunk_rows: int = 0  # rows read at a time (gallery_bounds); 0: GALLERY_CHUNK_BYTES


class Queries(NamedTuple):
    """Queries in gallery terms, in label order. Rows, columns and positions are
    :func:`index_dtype` (int32 where the items allow); the rows, labels and groups are
    the gallery's (leave-one-out) or views of the items' where the queries are one run
    of them, else copies."""

    rows: Tensor  # [Q] rows of the prepared embeddings
    labels: Tensor
    groups: Tensor
    block_start: Tensor  # [Q] first column of the query's label run
    block_count: Tensor  # [Q] its length (0: no item of that label in the gallery)
    self_column: Tensor  # [Q] column of the query itself in the gallery, -1 if absent
    position: Tensor  # [Q] the query's index in the side it came from


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


def index_dtype(num: int) -> torch.dtype:
    """The dtype of rows, columns and positions among ``num`` items: int32 where they
    fit (half the bytes of every item's bookkeeping), else int64."""
    return torch.int32 if num < 2**31 else torch.int64


def select(plays_role: Tensor, identity: Tensor) -> Side:
    """Items playing a role, keeping the first item of each identity (dedupe by id)."""
    num = identity.shape[0]
    rows = plays_role.nonzero().squeeze(1)
    ident = identity[rows]
    first = torch.full((num,), num, dtype=torch.int64, device=identity.device)
    first.scatter_reduce_(0, ident, rows, reduce="amin")
    keep = first[ident] == rows
    return Side(rows[keep], ident[keep])


GALLERY_CHUNK_BYTES = 2**20
"""The gallery's norms (and its centre, for ``"euclidean"``) are computed this many bytes
of rows at a time."""


def gallery_of(
    embeddings: Tensor,
    labels: Tensor,
    groups: Tensor,
    side: Side,
    similarity: Similarity,
    chunk_bytes: int = GALLERY_CHUNK_BYTES,
) -> Gallery:
    """The gallery of ``side``; its norms (and centre) computed ``chunk_bytes`` of rows
    at a time (a centred copy of them for ``"euclidean"``)."""
    side_labels = labels[side.rows]
    labels_sorted, label_order = torch.sort(side_labels, stable=True)
    if torch.equal(labels_sorted, side_labels):
        rows, identity = side.rows, side.identity  # already in label order (stable)
    else:
        rows, identity = side.rows[label_order], side.identity[label_order]
    del label_order, side_labels
    run = _run_of(rows)
    if run is not None:
        # Stored in the ranking's order (:mod:`recall_at_k.ranking.ordered`): the
        # gallery's labels and groups are views, no copies of every item's.
        labels_sorted, gallery_groups = labels[run], groups[run]
    else:
        gallery_groups = labels_sorted if _same(groups, labels) else groups[rows]
    gallery_embeddings = _rows_of(embeddings, rows)
    num, width = gallery_embeddings.shape
    step = max(1, chunk_bytes // max(1, width * gallery_embeddings.element_size()))
    centre = neg_sq_norms = None
    if similarity == "euclidean":
        # Centred on the gallery's mean: a common offset of every vector cancels in the
        # product (:func:`product` centres each panel of columns; callers centre the
        # queries). Any centre is exact (the bound covers its rounding).
        total = torch.zeros(width, dtype=gallery_embeddings.dtype, device=embeddings.device)
        for start in range(0, num, step):
            total += gallery_embeddings[start : start + step].sum(dim=0)
        centre = total.div_(max(1, num))
        neg_sq_norms = torch.empty((1, num), dtype=gallery_embeddings.dtype, device=total.device)
        for start in range(0, num, step):
            part = gallery_embeddings[start : start + step] - centre
            neg_sq_norms[0, start : start + step] = part.square_().sum(dim=1).neg_()
    max_norm = 0.0
    dim, dtype = embeddings.shape[1], embeddings.dtype
    if gallery_embeddings.numel():
        # In the embeddings' own dtype, then raised past its rounding (relative error
        # at most gamma_{D+2}, and squares below the smallest normal): an upper bound
        # of the exact largest norm; a chunk of rows at a time.
        largest = 0.0
        for start in range(0, num, step):
            part = gallery_embeddings[start : start + step]
            if centre is not None:
                part = part - centre
            largest = max(largest, float(torch.linalg.vector_norm(part, dim=1).max()))
        upper = torch.tensor([largest], dtype=torch.float64)
        max_norm = float(norm_upper(upper, dim, dtype))
    bound = bound_coefficient(similarity, dim, dtype, embeddings.device)
    absolute = bound_absolute(similarity, dim, dtype)
    block_labels, block_counts = torch.unique_consecutive(labels_sorted, return_counts=True)
    # Copies of their own size (the storages keep the capacity of every column's).
    block_labels = block_labels.clone()
    block_counts = block_counts.to(index_dtype(num), copy=True)
    block_starts = torch.cumsum(block_counts, dim=0, dtype=block_counts.dtype) - block_counts
    identity_sorted, identity_column = torch.sort(identity)
    identity_column = identity_column.to(index_dtype(num))
    return Gallery(
        rows,
        gallery_embeddings,
        centre,
        neg_sq_norms,
        bound,
        absolute,
        max_norm,
        labels_sorted,
        gallery_groups,
        block_labels,
        block_starts,
        block_counts,
        identity_sorted,
        identity_column,
        step,
    )


def _run_of(rows: Tensor) -> slice | None:
    """The slice ``rows`` are, where they are one ascending run of rows, else None."""
    if rows.numel() == 0:
        return None
    first = int(rows[0])
    if int(rows[-1]) != first + rows.shape[0] - 1:
        return None
    run = torch.arange(first, first + rows.shape[0], dtype=rows.dtype, device=rows.device)
    return slice(first, first + rows.shape[0]) if torch.equal(rows, run) else None


def _same(groups: Tensor, labels: Tensor) -> bool:
    """Whether ``groups`` is a view of ``labels`` (nothing reads the groups)."""
    return (
        groups.data_ptr() == labels.data_ptr()
        and groups.shape == labels.shape
        and groups.stride() == labels.stride()
        and groups.dtype == labels.dtype
    )


def _rows_of(embeddings: Tensor, rows: Tensor) -> Tensor:
    """``embeddings[rows]``: a view where ``rows`` are one ascending run (the items
    are stored in the ranking's order, :mod:`recall_at_k.ranking.ordered`), else a copy."""
    if rows.numel() == 0:
        return embeddings[:0]
    run = _run_of(rows)
    return embeddings[rows] if run is None else embeddings[run]


def centred_rows(gallery: Gallery, first: int, stop: int) -> Tensor:
    """The gallery's rows ``first:stop`` as the product reads them: centred for
    ``"euclidean"`` (a copy), else a view."""
    rows = gallery.embeddings[first:stop]
    return rows if gallery.centre is None else rows - gallery.centre


def gallery_bounds(gallery: Gallery, similarity: Similarity) -> Tensor:
    """:func:`bounds` of the gallery's own rows as queries (leave-one-out), computed a
    chunk of rows at a time."""
    num, width = gallery.embeddings.shape
    step = gallery.chunk_rows
    if step <= 0:
        step = max(1, GALLERY_CHUNK_BYTES // max(1, width * gallery.embeddings.element_size()))
    parts = [
        bounds(centred_rows(gallery, start, min(num, start + step)), gallery, similarity)
        for start in range(0, num, step)
    ]
    if not parts:
        return torch.zeros((0, 1), dtype=torch.float64, device=gallery.embeddings.device)
    return torch.cat(parts)


def bounds(queries: Tensor, gallery: Gallery, similarity: Similarity) -> Tensor:
    """``[T, 1]`` float64: each query's bound ``B`` on ``|fast - canonical|``."""
    # In the queries' dtype, raised past its rounding: an upper bound of each norm.
    norms: Tensor = torch.linalg.vector_norm(queries, dim=1, keepdim=True).to(torch.float64)
    norms = norm_upper(norms, queries.shape[1], queries.dtype)
    if similarity == "euclidean":
        norms = norms.add_(gallery.max_norm).square_().mul_(gallery.bound)
    else:
        norms.mul_(gallery.max_norm * gallery.bound)
    return norms.add_(gallery.absolute)


def queries_of(labels: Tensor, groups: Tensor, side: Side, gallery: Gallery) -> Queries:
    """The queries in label order: a tile's label blocks are then adjacent and together
    one run of columns (what :func:`_panel_counts` computes first)."""
    narrow = index_dtype(max(side.rows.shape[0], gallery.rows.shape[0]))
    query_labels, order = torch.sort(labels[side.rows], stable=True)
    rows = side.rows[order]
    if rows.shape == gallery.rows.shape and torch.equal(rows, gallery.rows):
        # The gallery's own items in its order (leave-one-out): its rows, labels and
        # groups (views where they are), not copies.
        rows, query_labels, query_groups = gallery.rows, gallery.labels, gallery.groups
    elif (run := _run_of(rows)) is not None:  # stored in label order: views
        query_labels, query_groups = labels[run], groups[run]
    else:
        query_groups = query_labels if _same(groups, labels) else groups[rows]
    identity = side.identity[order]
    order = order.to(narrow)
    out_int32 = narrow == torch.int32
    block = torch.searchsorted(gallery.block_labels, query_labels, out_int32=out_int32)
    block = block.clamp_(max=gallery.block_labels.shape[0] - 1)
    found = gallery.block_labels[block] == query_labels
    block_start = gallery.block_starts[block].to(narrow)
    block_count = torch.where(found, gallery.block_counts[block], 0).to(narrow)
    del block, found
    position = torch.searchsorted(gallery.identity_sorted, identity, out_int32=out_int32)
    position = position.clamp_(max=gallery.identity_sorted.shape[0] - 1)
    is_self = gallery.identity_sorted[position] == identity
    self_column = torch.where(is_self, gallery.identity_column[position], -1).to(narrow)
    return Queries(rows, query_labels, query_groups, block_start, block_count, self_column, order)


def tile_scores(
    queries: Tensor, gallery: Gallery, similarity: Similarity, workspace: Workspace
) -> Tensor:
    """Scores ``[T, G]`` of a tile, ours to write into."""
    num_rows, num_gallery = queries.shape[0], gallery.embeddings.shape[0]
    if not callable(similarity):
        return product(queries, gallery, 0, num_gallery, similarity, workspace)
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


def product(
    queries: Tensor,
    gallery: Gallery,
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
        assert gallery.neg_sq_norms is not None and gallery.centre is not None
        # -(|q'|^2 - 2 q'.g' + |g'|^2); the stored rows are not centred: centre the
        # columns a part at a time, each part no larger than the tile.
        dim = gallery.embeddings.shape[1]
        step = max(1, num_rows * width // max(1, dim))
        for part in range(first, stop, step):
            end = min(stop, part + step)
            centred = workspace.get("centred", (end - part, dim), queries.dtype, queries.device)
            torch.sub(gallery.embeddings[part:end], gallery.centre, out=centred)
            target = out[:, part - first : end - first]
            norms = gallery.neg_sq_norms[:, part:end]
            if step >= width:
                torch.addmm(norms, queries, centred.T, alpha=2, out=target)
            else:
                # In a buffer of the workspace: fresh ones, often just below the C heap's
                # mmap threshold, fragmented it.
                buffer = workspace.get("centred_scores", tuple(target.shape), out.dtype, out.device)
                target.copy_(torch.addmm(norms, queries, centred.T, alpha=2, out=buffer))
        out.sub_(queries.square().sum(dim=1, keepdim=True))
    else:
        torch.matmul(queries, gallery_t, out=out)
    return out
