"""``EmbeddingRecallAtK``: cat states of embeddings, tiled ranking, sharded across processes.

The gallery of a validation loop is often the validation set itself, complete only at the
end of the epoch. This metric keeps the embeddings (``dist_reduce_fx="cat"``), and at
``compute`` ranks every query against the whole gallery in tiles of queries whose scores
fit in ``chunk_bytes``, summing the per-tile rank histograms of the shared kernel. Under
DDP the states are gathered by torchmetrics; each process then ranks only its share of the
queries and the histograms are summed with ``all_reduce``.

Per tile, a query's positives are read from a small block: the gallery's columns are its
items sorted by label, which puts the items of each label in one run of adjacent
columns, so a query's positives are the ``block_count`` columns from ``block_start`` on
(a gather of adjacent values). Ignored items (the
query itself, same-group items) are written as NaN into the tile, and NaN compares false
with everything, so the full-width work per tile is one matrix product and one
comparison with the best positive's score. When a tile's label blocks are wide (few,
large classes) the tile goes through :func:`recall_at_k._kernel.dense_tie_counts` with
full relevance and ignore masks instead; both routes give the same counts.

On CPU the block route never holds a tile's full score rows: queries are ranked in label
order, so a tile's label blocks form one run of columns, scored first; the remaining
columns follow in panels of ``_CPU_PANEL_BYTES`` that are compared with each query's
best positive while they are still in the core's cache. Every score is computed exactly
once, so the value that sets a query's s* is the one its counts compare. (Ties are ties of
the computed scores: a BLAS product may round one dot product differently at different
columns, see the README.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from recall_at_k import _kernel
from recall_at_k._plot import plot_curves, values_of
from recall_at_k._result import RecallOutput, format_recall, recall_result
from recall_at_k._validation import (
    _choice_validation,
    _describe,
    _empty_target_action_validation,
    _k_validation,
    _key_validation,
    _same_device_validation,
    _ties_validation,
)
from recall_at_k._views import PerKViews

__all__ = ["EmbeddingRecallAtK"]

SIMILARITIES = ("cosine", "dot", "euclidean")
EXCLUDES = ("none", "same_group", "same_label_and_group")
ROLES = ("query", "gallery", "both")

Similarity = Callable[[Tensor, Tensor], Tensor]

# Per-row metadata, one int64 row per item: label, group, id, flags, embedding width.
_LABEL, _GROUP, _ID, _FLAGS, _WIDTH = range(5)
_META_COLUMNS = 5
_IS_QUERY, _IS_GALLERY, _HAS_GROUP, _HAS_ID = 1, 2, 4, 8
_ROLE_FLAGS = {"query": _IS_QUERY, "gallery": _IS_GALLERY, "both": _IS_QUERY | _IS_GALLERY}

# A tile takes the block route while its widest label block is at most this share of the
# gallery; above it the dense masks are cheaper than gathering the blocks.
_SPARSE_MAX_BLOCK_FRACTION = 0.25

# On CPU, tiles hold at most this many bytes of scores, whatever chunk_bytes allows.
_CPU_TILE_BYTES = 32 * 2**20
# Rows of a tile counted at a time on CPU: a block that stays in the core's cache.
_CPU_COUNT_BLOCK_BYTES = 2 * 2**20
# On CPU a tile's scores are computed in panels of columns of about this many bytes,
# each compared with the best positive's score while it is still in the core's cache.
_CPU_PANEL_BYTES = 2 * 2**20
# Whether CPU tiles go by panels (tests turn it off to run the whole-tile route on CPU).
_CPU_PANELS = True

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _embedding_structure_validation(
    embeddings: Tensor,
    labels: Tensor,
    role: str,
    groups: Tensor | None,
    ids: Tensor | None,
) -> None:
    """Types, shapes, dtypes and devices of one ``update`` (no host synchronisation)."""
    named = (("embeddings", embeddings), ("labels", labels), ("groups", groups), ("ids", ids))
    for name, value in named:
        if value is not None and not isinstance(value, Tensor):
            raise ValueError(f"`{name}` must be a torch.Tensor, got {type(value).__name__}")
    if embeddings.dim() != 2 or not embeddings.is_floating_point():
        raise ValueError(
            "`embeddings` must be a floating point tensor of shape [B, D],"
            f" got {_describe(embeddings)}"
        )
    batch = embeddings.shape[0]
    for name, value in named[1:]:
        if value is None:
            continue
        if value.dim() != 1 or value.shape[0] != batch or value.dtype not in _INTEGER_DTYPES:
            raise ValueError(
                f"`{name}` must be an integer (int64) tensor of shape [B] = [{batch}], one"
                f" entry per embedding, got {_describe(value)}"
            )
    _choice_validation("role", role, ROLES)
    _same_device_validation(embeddings=embeddings, labels=labels, groups=groups, ids=ids)


def _embedding_values_validation(embeddings: Tensor) -> None:
    """Finite embeddings (reads values on the host; only with ``validate_args=True``)."""
    if embeddings.numel() and not bool(torch.isfinite(embeddings).all()):
        nan = int(torch.isnan(embeddings).sum())
        inf = int(torch.isinf(embeddings).sum())
        raise ValueError(
            f"`embeddings` must be finite, found {nan} NaN and {inf} infinite value(s)"
        )


def _directions_validation(directions: object) -> tuple[str, str]:
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


def _chunk_bytes_validation(chunk_bytes: object) -> int:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"`chunk_bytes` must be a positive int, got {chunk_bytes!r}")
    return chunk_bytes


class _Side(NamedTuple):
    """The rows (into the gathered data) that play one role, each sample once."""

    rows: Tensor
    identity: Tensor


class _Gallery(NamedTuple):
    """A direction's gallery, prepared for scoring.

    Its columns are the gallery's items sorted by label (stable), so that each label's
    items are one run of adjacent columns: a query's positives are read as a contiguous
    block of its score row.
    """

    embeddings: Tensor  # [G, D] in column order; L2-normalised for "cosine"
    neg_sq_norms: Tensor | None  # [1, G] negated squared norms, for "euclidean"
    labels: Tensor  # [G], ascending
    groups: Tensor  # [G]
    block_labels: Tensor  # [C] distinct labels, ascending
    block_starts: Tensor  # [C] the first column of each label's run
    block_counts: Tensor  # [C] the run's length
    identity_sorted: Tensor  # [G] identities, ascending
    identity_column: Tensor  # [G] column of each entry of ``identity_sorted``


class _Queries(NamedTuple):
    """One process's share of a direction's queries, in gallery terms."""

    rows: Tensor  # [Q] rows of the prepared embeddings
    labels: Tensor
    groups: Tensor
    block_start: Tensor  # [Q] first column of the query's label run
    block_count: Tensor  # [Q] its length (0: no item of that label in the gallery)
    self_column: Tensor  # [Q] column of the query itself in the gallery, -1 if absent


class EmbeddingRecallAtK(PerKViews, Metric):
    r"""Recall@K of embeddings ranked against a gallery that is complete only at the end.

    ``update`` stores embeddings with their labels (relevance = same label) and roles;
    ``compute`` ranks every query against the whole gallery. Leave-one-out (metric
    learning: CUB, SOP, In-shop) adds items with ``role="both"``: every item is a query
    against all the others. Query/gallery protocols (re-ID) add the two sets separately;
    cross-modal retrieval (image <-> text) adds the two modalities as query and gallery
    and sets ``bidirectional=True``.

    A query never retrieves itself: with ``ids`` a gallery item with the query's id is
    that same sample and is ignored; without ``ids`` an item added with ``role="both"``
    is excluded from its own gallery by its position in the data (never by dropping
    the first neighbour, which may be a tied duplicate). Items repeated with the same
    ``ids`` within a role (DistributedSampler padding, a dataset yielding each image once
    per caption) count once. Ignored items are neither positives nor negatives; ties
    follow ``ties`` (DESIGN section 1), never sort order.

    ``compute`` never materialises the query x gallery matrix: queries are ranked in
    tiles whose scores fit in ``chunk_bytes`` (at least one query a tile), on the
    embeddings' device, and the result does not depend on ``chunk_bytes``. Under DDP
    (states gathered by torchmetrics' sync) each process ranks only its share of the
    queries against the gathered gallery and the hit counts are summed with
    ``all_reduce``, so every process returns the single-process result. With
    ``sync_on_compute=False`` every process computes on its own data alone.

    Embeddings are stored in the metric's dtype (``float32`` unless changed with
    ``set_dtype``), which every process agrees on when states are gathered.
    The stored states grow with the data: O(items x D).

    Args:
        k: an int or a sequence of distinct ints, as for
            :class:`~recall_at_k.RetrievalRecallAtK`.
        similarity: ``"cosine"`` (L2-normalise, then dot), ``"dot"``, ``"euclidean"``
            (negative squared L2 distance), or a callable ``(queries [T, D], gallery
            [G, D]) -> scores [T, G]`` (higher = more similar; called once per tile).
        exclude: ``"none"``; ``"same_group"``: gallery items in the query's group are
            ignored; ``"same_label_and_group"``: items with the query's label and group
            are ignored (the Market-1501 "junk" rule). Both need ``groups`` in every
            ``update``.
        bidirectional: also rank the gallery against the queries; the result's keys
            become ``"{direction}/recall@{k}"`` (always a dict, even for an int ``k``).
        directions: the two key prefixes: query -> gallery, then gallery -> query.
        ties: ``"pessimistic"`` (default), ``"optimistic"`` or ``"expected"``.
        empty_target_action: a query without a valid positive counts as a miss
            (``"neg"``), a hit (``"pos"``), not at all (``"skip"``), or raises
            (``"error"``).
        chunk_bytes: upper bound of the bytes of one tile's scores (on CPU tiles stay
            within 32 MiB even when it allows more). Peak memory of ``compute`` is about
            one tile (twice it for ``ties="expected"``) plus copies of the embeddings.
        key: template of the result's keys, ``"recall@{k}"`` by default.
        validate_args: check that embeddings are finite, and a callable similarity's
            scores free of NaN (these checks read values on the host).
        metric_kwargs: torchmetrics' own (``sync_on_compute``, ``process_group``, ...).

    Example:
        Leave-one-out over four items of two classes:

        >>> import torch
        >>> from recall_at_k import EmbeddingRecallAtK
        >>> metric = EmbeddingRecallAtK(k=(1, 2))
        >>> embeddings = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [0.6, 0.8]])
        >>> metric.update(embeddings, torch.tensor([0, 0, 1, 1]))
        >>> metric.compute()
        {'recall@1': tensor(0.5000), 'recall@2': tensor(1.)}

        Image -> text and text -> image, two captions per image; the image ids make the
        image, repeated once per caption, count once:

        >>> metric = EmbeddingRecallAtK(k=1, bidirectional=True, directions=("i2t", "t2i"))
        >>> images = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).repeat_interleave(2, dim=0)
        >>> image_ids = torch.tensor([0, 0, 1, 1])
        >>> captions = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.1, 0.9], [0.3, 0.7]])
        >>> metric.update(images, image_ids, role="query", ids=image_ids)
        >>> metric.update(captions, image_ids, role="gallery")
        >>> metric.compute()
        {'i2t/recall@1': tensor(1.), 't2i/recall@1': tensor(0.7500)}
    """

    is_differentiable: bool = False
    higher_is_better: bool = True
    full_state_update: bool = False
    plot_lower_bound: float = 0.0
    plot_upper_bound: float = 1.0

    last_compute_num_queries_ranked: dict[str, int]
    """Queries this process ranked in the last ``compute``, per direction (its share under
    DDP, every query otherwise)."""

    def __init__(
        self,
        k: int | Sequence[int] = (1, 5, 10),
        *,
        similarity: str | Similarity = "cosine",
        exclude: str = "none",
        bidirectional: bool = False,
        directions: Sequence[str] = ("q2g", "g2q"),
        ties: str = "pessimistic",
        empty_target_action: str = "neg",
        chunk_bytes: int = 256 * 2**20,
        key: str = "recall@{k}",
        validate_args: bool = True,
        **metric_kwargs: Any,
    ) -> None:
        super().__init__(**metric_kwargs)
        self.ks = _k_validation(k)
        if not callable(similarity):
            _choice_validation("similarity", similarity, SIMILARITIES)
        _choice_validation("exclude", exclude, EXCLUDES)
        _ties_validation(ties)
        _empty_target_action_validation(empty_target_action)
        _key_validation(key)
        self.directions = _directions_validation(directions)
        self.chunk_bytes = _chunk_bytes_validation(chunk_bytes)
        self.single_k = isinstance(k, int)
        self.max_k = max(self.ks)
        self.similarity = similarity
        self.exclude = exclude
        self.bidirectional = bool(bidirectional)
        self.ties = ties
        self.empty_target_action = empty_target_action
        self.key = key
        self.validate_args = validate_args
        self.last_compute_num_queries_ranked = {}
        # The process group whose gathered states the running compute() sees; set by
        # sync() for the compute that follows it, None when states are local.
        self._gathered: tuple[Any] | None = None
        self._in_forward = False
        # (width, role) of the first embeddings since the state was last empty.
        self._first_width: tuple[int, str] | None = None
        # Embeddings are stored flattened (1-D) so that a process without data, which
        # torchmetrics represents by an empty 1-D tensor of the metric's dtype, gathers
        # with the others; the width is kept in the metadata.
        self.add_state("embedding_values", [], dist_reduce_fx="cat")
        self.add_state("embedding_meta", [], dist_reduce_fx="cat")
        keys = [self.key.format(k=k) for k in self.ks]
        if self.bidirectional:
            keys = [f"{direction}/{key}" for direction in self.directions for key in keys]
        self._init_views(keys)

    # ------------------------------------------------------------------ update

    def update(
        self,
        embeddings: Tensor,
        labels: Tensor,
        *,
        role: str = "both",
        groups: Tensor | None = None,
        ids: Tensor | None = None,
    ) -> None:
        """Add a batch of items.

        Args:
            embeddings: float ``[B, D]``.
            labels: integer ``[B]``; a gallery item is relevant to a query with the same
                label (a class, an identity, an image id).
            role: ``"query"``, ``"gallery"`` or ``"both"`` (leave-one-out).
            groups: integer ``[B]`` (camera, source photo, video, ...); needed by
                ``exclude``.
            ids: integer ``[B]`` sample ids, shared by the roles: a gallery item with a
                query's id is that query and is ignored; an id repeated within a role
                counts once.
        """
        self._touch_views()
        _embedding_structure_validation(embeddings, labels, role, groups, ids)
        if self.exclude != "none" and groups is None:
            raise ValueError(
                f"`groups` are required with exclude={self.exclude!r}: pass the group"
                " (camera, source, ...) of every item to update()"
            )
        width = embeddings.shape[1]
        values = self._state("embedding_values")
        meta_state = self._state("embedding_meta")
        assert isinstance(values, list) and isinstance(meta_state, list)
        if not values:
            self._first_width = (width, role)
        elif self._first_width is not None and self._first_width[0] != width:
            first, first_role = self._first_width
            raise ValueError(
                f"`embeddings` of role {role!r} have width {width}, but earlier embeddings"
                f" (role {first_role!r}) have width {first}; queries and gallery must"
                " come from one embedding space"
            )
        if self.validate_args:
            _embedding_values_validation(embeddings)
        batch = embeddings.shape[0]
        device = embeddings.device
        flags = _ROLE_FLAGS[role]
        flags |= _HAS_GROUP if groups is not None else 0
        flags |= _HAS_ID if ids is not None else 0
        zeros = torch.zeros(batch, dtype=torch.int64, device=device)
        meta = torch.stack(
            [
                labels.to(torch.int64),
                groups.to(torch.int64) if groups is not None else zeros,
                ids.to(torch.int64) if ids is not None else zeros,
                torch.full_like(zeros, flags),
                torch.full_like(zeros, width),
            ],
            dim=1,
        )
        values.append(embeddings.detach().to(self.dtype).reshape(-1))
        meta_state.append(meta)

    def _state(self, name: str) -> list[Tensor] | Tensor:
        """A cat state: a list of tensors, or one tensor once gathered by ``sync``."""
        value: list[Tensor] | Tensor = getattr(self, name)
        return value

    # ------------------------------------------------------------------ sync hooks

    def sync(
        self,
        dist_sync_fn: Callable[..., Any] | None = None,
        process_group: Any | None = None,
        should_sync: bool = True,
        distributed_available: Callable[..., Any] | None = None,
    ) -> None:
        """torchmetrics' ``sync``, recording whether the states are now gathered.

        ``compute`` shards the queries across processes only when this call gathered the
        states. A process without data gets an empty metadata tensor of the right shape
        and dtype, so that every process gathers tensors of one dtype and rank.
        """
        available = distributed_available or self.distributed_available_fn
        will_sync = bool(should_sync and callable(available) and available())
        meta = self._state("embedding_meta")
        if will_sync and isinstance(meta, list) and not meta:
            meta.append(torch.zeros(0, _META_COLUMNS, dtype=torch.int64, device=self.device))
        self._gathered = None
        super().sync(
            dist_sync_fn=dist_sync_fn,
            process_group=process_group,
            should_sync=should_sync,
            distributed_available=distributed_available,
        )
        if will_sync:
            self._gathered = (process_group or self.process_group,)

    def unsync(self, should_unsync: bool = True) -> None:
        """torchmetrics' ``unsync``; the states are local again afterwards."""
        super().unsync(should_unsync=should_unsync)
        if should_unsync:
            self._gathered = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The batch value (the batch ranked against itself), accumulating the batch.

        A direction that the batch alone cannot rank (no query or no gallery in it) is
        NaN in the batch value rather than an error.
        """
        self._in_forward = True
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._in_forward = False

    # ------------------------------------------------------------------ compute

    def compute(self) -> RecallOutput:
        """Recall@K over everything seen (gathered across processes when synced)."""
        try:
            return self._compute()
        finally:
            self._gathered = None

    def _compute(self) -> RecallOutput:
        embeddings, meta = self._stored()
        world, rank, group = 1, 0, None
        if self._gathered is not None and dist.is_available() and dist.is_initialized():
            group = self._gathered[0]
            world = dist.get_world_size(group)
            rank = dist.get_rank(group)
        identity = _identities(meta)
        specs = [(self.directions[0], _IS_QUERY, _IS_GALLERY)]
        if self.bidirectional:
            specs.append((self.directions[1], _IS_GALLERY, _IS_QUERY))
        in_forward = self._in_forward
        prepared = self._prepare(embeddings)
        ranked: dict[str, int] = {}
        hists: list[Tensor] = []
        counts: list[Tensor] = []
        valid: list[bool] = []
        previous: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
        failure: Exception | None = None
        for index, (name, query_flag, gallery_flag) in enumerate(specs):
            queries = _select(meta, identity, query_flag)
            gallery = _select(meta, identity, gallery_flag)
            missing = self._missing(index, name, queries, gallery)
            if missing is not None:
                if not in_forward:
                    raise ValueError(missing)
                valid.append(False)
                hists.append(self._zero_hist(embeddings.device))
                counts.append(torch.zeros(4, dtype=torch.int64, device=embeddings.device))
                ranked[name] = 0
                continue
            valid.append(True)
            if previous is not None and _same_sets(previous, queries, gallery):
                # Leave-one-out: gallery -> query is query -> gallery again.
                hists.append(hists[-1])
                counts.append(counts[-1])
                ranked[name] = ranked[specs[index - 1][0]]
                continue
            previous = (queries.rows, gallery.rows, queries.identity, gallery.identity)
            num = queries.rows.shape[0]
            lo, hi = num * rank // world, num * (rank + 1) // world
            share = _Side(queries.rows[lo:hi], queries.identity[lo:hi])
            try:
                hist, count = self._rank(prepared, meta, share, gallery)
            except Exception as err:
                if world == 1:
                    raise
                # Take part in the all_reduce below, so that no other process waits
                # forever, then raise here and there.
                failure = err
                hist = self._zero_hist(embeddings.device)
                count = torch.tensor([0, 0, 0, 1], device=embeddings.device)
            hists.append(hist)
            counts.append(count)
            ranked[name] = hi - lo
        self.last_compute_num_queries_ranked = ranked
        hist_all = torch.stack(hists)
        count_all = torch.stack(counts)
        if world > 1:
            dist.all_reduce(hist_all, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(count_all, op=dist.ReduceOp.SUM, group=group)
        if failure is not None:
            raise failure
        if int(count_all[:, 3].sum()):
            raise RuntimeError(
                "EmbeddingRecallAtK.compute() failed on another process; see its error"
            )
        if int(count_all[:, 2].sum()):
            raise ValueError(
                f"`similarity` returned NaN scores for {int(count_all[:, 2].sum())} quer(ies);"
                " scores must not be NaN (a bug in a callable, or the overflow of huge"
                " embeddings under 'dot' / 'euclidean')"
            )
        return self._results(specs, valid, hist_all, count_all[:, :2])

    def _results(
        self,
        specs: list[tuple[str, int, int]],
        valid: list[bool],
        hists: Tensor,
        counts: Tensor,
    ) -> RecallOutput:
        if not self.bidirectional:
            if not valid[0]:
                return format_recall(self._nan(hists.device), self.ks, self.single_k, self.key)
            return recall_result(
                hists[0], counts[0], self.ks, self.single_k, self.key, self.empty_target_action
            )
        output: dict[str, Tensor] = {}
        for index, (name, _, _) in enumerate(specs):
            key = f"{name}/{self.key}"
            if not valid[index]:
                part = format_recall(self._nan(hists.device), self.ks, False, key)
            else:
                try:
                    part = recall_result(
                        hists[index], counts[index], self.ks, False, key, self.empty_target_action
                    )
                except ValueError as err:
                    raise ValueError(f"direction {name!r}: {err}") from err
            assert isinstance(part, dict)
            output.update(part)
        return output

    def _nan(self, device: torch.device) -> Tensor:
        return torch.full((len(self.ks),), float("nan"), dtype=torch.float64, device=device)

    def _zero_hist(self, device: torch.device) -> Tensor:
        dtype = torch.float64 if self.ties == "expected" else torch.int64
        return torch.zeros(self.max_k, dtype=dtype, device=device)

    def _missing(self, index: int, name: str, queries: _Side, gallery: _Side) -> str | None:
        """The error message when a direction has no queries or no gallery."""
        query_role, gallery_role = ("query", "gallery") if index == 0 else ("gallery", "query")
        arrow = "query -> gallery" if index == 0 else "gallery -> query"
        sides = ((queries, "queries", query_role), (gallery, "gallery", gallery_role))
        for side, what, role in sides:
            if side.rows.numel() == 0:
                return (
                    f"`role`: direction {name!r} ({arrow}) has no {what} at compute(): add"
                    f" embeddings with role={role!r} or role='both' first"
                )
        return None

    def _stored(self) -> tuple[Tensor, Tensor]:
        """The (possibly gathered) embeddings ``[N, D]`` and metadata ``[N, 5]``."""
        values = self._state("embedding_values")
        meta_state = self._state("embedding_meta")
        has_meta = isinstance(meta_state, Tensor) or len(meta_state) > 0
        meta = dim_zero_cat(meta_state) if has_meta else torch.zeros(0, _META_COLUMNS)
        meta = meta.to(torch.int64).reshape(-1, _META_COLUMNS)
        # A copy of our own in every case (torch.cat copies), which _prepare may change.
        if isinstance(values, Tensor):
            flat = values.clone()
        elif values:
            flat = torch.cat(values)
        else:
            flat = torch.zeros(0, dtype=self.dtype)
        meta = meta.to(flat.device)
        num = meta.shape[0]
        if num == 0:
            return flat.reshape(0, 0), meta
        widths = meta[:, _WIDTH]
        width_min, width_max = (int(v) for v in torch.aminmax(widths))
        if width_min != width_max:
            raise ValueError(
                "`embeddings` must all have one width: got widths"
                f" {sorted(set(widths.tolist()))} across query and gallery"
                " embeddings (on this or another process)"
            )
        if flat.numel() != num * width_min:
            raise ValueError(
                f"`embeddings`: the state holds {flat.numel()} values for {num} items of"
                f" width {width_min}; it was corrupted"
            )
        return flat.reshape(num, width_min), meta

    def _prepare(self, embeddings: Tensor) -> Tensor:
        """Embeddings in a float dtype of at least 32 bits; L2-normalised for "cosine"
        (``embeddings`` is compute's own copy, so this may work in place)."""
        embeddings = embeddings.to(torch.promote_types(embeddings.dtype, torch.float32))
        if self.similarity == "cosine":
            # What F.normalize computes, without another copy of the embeddings.
            norms = torch.linalg.vector_norm(embeddings, dim=1, keepdim=True)
            embeddings.div_(norms.clamp_min_(1e-12))
        return embeddings

    # ------------------------------------------------------------------ ranking

    def _rank(
        self, embeddings: Tensor, meta: Tensor, queries: _Side, gallery_side: _Side
    ) -> tuple[Tensor, Tensor]:
        """Histogram ``[max K]`` and counts ``[4]``: queries with / without a valid
        positive, queries with NaN scores, and 0 (the slot of a failure elsewhere)."""
        device = embeddings.device
        hist_total = self._zero_hist(device)
        counts = torch.zeros(4, dtype=torch.int64, device=device)
        if queries.rows.numel() == 0:
            return hist_total, counts
        gallery = self._gallery(embeddings, meta, gallery_side)
        num_gallery = gallery.embeddings.shape[0]
        share = self._queries(meta, queries, gallery)
        itemsize = gallery.embeddings.element_size()
        tile_bytes = self.chunk_bytes
        if device.type == "cpu":
            # Larger CPU tiles buy nothing (the product is as fast in 32 MiB tiles) and
            # cost memory: the bound of chunk_bytes still holds, the tile is only smaller.
            tile_bytes = min(tile_bytes, _CPU_TILE_BYTES)
        rows_per_tile = max(1, tile_bytes // max(1, num_gallery * itemsize))
        need = _kernel.needs_for(self.ties)
        check_nan = self.validate_args and self._may_produce_nan(embeddings)
        by_panels = (
            _CPU_PANELS and device.type == "cpu" and not callable(self.similarity) and not check_nan
        )
        buffer: Tensor | None = None
        for start in range(0, share.rows.shape[0], rows_per_tile):
            tile = _Queries._make(t[start : start + rows_per_tile] for t in share)
            tile_embeddings = embeddings.index_select(0, tile.rows)
            widest = int(tile.block_count.max()) if tile.block_count.numel() else 0
            if by_panels and widest <= _SPARSE_MAX_BLOCK_FRACTION * num_gallery:
                tie_counts, buffer = self._panel_counts(
                    tile_embeddings, tile, gallery, need, widest, buffer
                )
            else:
                scores, buffer = self._scores(tile_embeddings, gallery, buffer)
                if check_nan:
                    nan_rows = torch.isnan(scores).any(dim=1)
                    counts[2] += nan_rows.sum()
                tie_counts = self._tile_counts(scores, tile, gallery, need, widest)
            hist, query_counts = _kernel.rank_histogram(tie_counts, self.ties, self.max_k)
            hist_total += hist
            counts[:2] += query_counts
        return hist_total, counts

    def _may_produce_nan(self, embeddings: Tensor) -> bool:
        """Whether scores could be NaN although the embeddings are finite."""
        if callable(self.similarity):
            return True
        if self.similarity == "cosine" or embeddings.numel() == 0:
            return False
        # dot / euclidean overflow to inf (and inf - inf = NaN) only for huge values.
        largest = float(embeddings.abs().amax())
        bound = 4.0 * embeddings.shape[1] * largest * largest
        return bound >= torch.finfo(embeddings.dtype).max / 4

    def _gallery(self, embeddings: Tensor, meta: Tensor, side: _Side) -> _Gallery:
        labels_sorted, label_order = torch.sort(meta[side.rows, _LABEL], stable=True)
        rows = side.rows[label_order]
        gallery_embeddings = embeddings[rows]
        neg_sq_norms = None
        if self.similarity == "euclidean":
            neg_sq_norms = gallery_embeddings.square().sum(dim=1).neg_().unsqueeze(0)
        block_labels, block_counts = torch.unique_consecutive(labels_sorted, return_counts=True)
        block_starts = torch.cumsum(block_counts, dim=0) - block_counts
        identity_sorted, identity_column = torch.sort(side.identity[label_order])
        return _Gallery(
            gallery_embeddings,
            neg_sq_norms,
            labels_sorted,
            meta[rows, _GROUP],
            block_labels,
            block_starts,
            block_counts,
            identity_sorted,
            identity_column,
        )

    def _queries(self, meta: Tensor, side: _Side, gallery: _Gallery) -> _Queries:
        """The share's queries in label order: a tile's label blocks are then adjacent
        and together one run of columns (what :meth:`_panel_counts` computes first)."""
        labels, order = torch.sort(meta[side.rows, _LABEL], stable=True)
        side = _Side(side.rows[order], side.identity[order])
        block = torch.searchsorted(gallery.block_labels, labels)
        block = block.clamp(max=gallery.block_labels.shape[0] - 1)
        found = gallery.block_labels[block] == labels
        block_start = gallery.block_starts[block]
        block_count = torch.where(found, gallery.block_counts[block], 0)
        position = torch.searchsorted(gallery.identity_sorted, side.identity)
        position = position.clamp(max=gallery.identity_sorted.shape[0] - 1)
        is_self = gallery.identity_sorted[position] == side.identity
        self_column = torch.where(is_self, gallery.identity_column[position], -1)
        return _Queries(
            side.rows,
            labels,
            meta[side.rows, _GROUP],
            block_start,
            block_count,
            self_column,
        )

    def _scores(
        self, queries: Tensor, gallery: _Gallery, buffer: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """Scores ``[T, G]`` of a tile, written into ``buffer`` when there is one."""
        num_rows, num_gallery = queries.shape[0], gallery.embeddings.shape[0]
        if callable(self.similarity):
            scores = self.similarity(queries, gallery.embeddings)
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
            return scores.detach().clone(memory_format=torch.contiguous_format), buffer
        return self._product(queries, gallery, 0, num_gallery, buffer)

    def _product(
        self, queries: Tensor, gallery: _Gallery, first: int, stop: int, buffer: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Scores ``[T, stop - first]`` of a tile against the gallery columns
        ``first:stop``, written into ``buffer`` (grown when too small)."""
        num_rows, width = queries.shape[0], stop - first
        if buffer is None or buffer.numel() < num_rows * width:
            buffer = torch.empty(num_rows * width, dtype=queries.dtype, device=queries.device)
        out = buffer[: num_rows * width].view(num_rows, width)
        gallery_t = gallery.embeddings[first:stop].T
        if self.similarity == "euclidean":
            assert gallery.neg_sq_norms is not None
            # -(|q|^2 - 2 q.g + |g|^2)
            torch.addmm(gallery.neg_sq_norms[:, first:stop], queries, gallery_t, alpha=2, out=out)
            out.sub_(queries.square().sum(dim=1, keepdim=True))
        else:
            torch.matmul(queries, gallery_t, out=out)
        return out, buffer

    def _panel_counts(
        self,
        queries: Tensor,
        tile: _Queries,
        gallery: _Gallery,
        need: tuple[bool, bool, bool],
        widest: int,
        buffer: Tensor | None,
    ) -> tuple[_kernel.TieCounts, Tensor | None]:
        """:func:`_block_counts` of a tile whose scores never exist all at once (CPU).

        The tile's queries are in label order, so their label blocks together are one
        run of columns ``[lo, hi)``: those scores come first, give each query's s*, p
        and its block's share of the counts; the other columns follow in panels of
        about ``_CPU_PANEL_BYTES``, each counted against s* while still in cache. Every
        score is computed once, so the positive that sets s* is counted with that same
        value.
        """
        num_rows, num_gallery = queries.shape[0], gallery.embeddings.shape[0]
        if widest == 0:  # no query of the tile has an item of its label in the gallery
            return _no_positive_counts(num_rows, queries.device), buffer
        present = tile.block_count > 0
        lo = int(torch.where(present, tile.block_start, num_gallery).min())
        hi = int(torch.where(present, tile.block_start + tile.block_count, 0).max())
        scores, buffer = self._product(queries, gallery, lo, hi, buffer)
        self._ignore_in_place(scores, tile, gallery, lo)
        block_tile = tile._replace(block_start=tile.block_start - lo)
        counts, best = _block_counts(
            scores, block_tile, gallery.groups[lo:hi], need, widest, self.exclude
        )
        greater, at_or_above = counts.greater, counts.equal
        width = max(1, _CPU_PANEL_BYTES // (num_rows * queries.element_size()))
        panels = [(a, min(a + width, lo)) for a in range(0, lo, width)]
        panels += [(a, min(a + width, num_gallery)) for a in range(hi, num_gallery, width)]
        # Each query lies in its own label block, so only same-group exclusion, or an id
        # shared by items of different labels, ignores anything outside [lo, hi).
        self_outside = (tile.self_column >= 0) & (
            (tile.self_column < lo) | (tile.self_column >= hi)
        )
        ignore_outside = self.exclude == "same_group" or bool(self_outside.any())
        for first, stop in panels:
            scores, buffer = self._product(queries, gallery, first, stop, buffer)
            if ignore_outside:
                self._ignore_in_place(scores, tile, gallery, first)
            panel_gt, panel_ge = _row_counts(scores, best, need[0], need[1])
            if greater is not None and panel_gt is not None:
                greater += panel_gt
            if at_or_above is not None and panel_ge is not None:
                at_or_above += panel_ge
        return counts, buffer

    def _ignore_in_place(
        self, scores: Tensor, tile: _Queries, gallery: _Gallery, first: int = 0
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
        if self.exclude == "same_group":
            groups = gallery.groups[first : first + width]
            same_group = tile.groups.unsqueeze(1) == groups.unsqueeze(0)
            scores.masked_fill_(same_group, float("nan"))

    def _tile_counts(
        self,
        scores: Tensor,
        tile: _Queries,
        gallery: _Gallery,
        need: tuple[bool, bool, bool],
        widest: int,
    ) -> _kernel.TieCounts:
        """Counts of a whole ``[T, G]`` tile (GPU, callable similarity, NaN checks)."""
        self._ignore_in_place(scores, tile, gallery)
        if widest > _SPARSE_MAX_BLOCK_FRACTION * scores.shape[1]:
            return self._dense_counts(scores, tile, gallery, need)
        return _block_counts(scores, tile, gallery.groups, need, widest, self.exclude)[0]

    def _dense_counts(
        self,
        scores: Tensor,
        tile: _Queries,
        gallery: _Gallery,
        need: tuple[bool, bool, bool],
    ) -> _kernel.TieCounts:
        """The kernel on full relevance and ignore masks (wide label blocks)."""
        target = tile.labels.unsqueeze(1) == gallery.labels.unsqueeze(0)
        ignore = torch.isnan(scores)
        scores.masked_fill_(ignore, 0.0)
        if self.exclude == "same_label_and_group":
            ignore |= target & (tile.groups.unsqueeze(1) == gallery.groups.unsqueeze(0))
        return _kernel.dense_tie_counts(scores, target, ignore, need)

    # ------------------------------------------------------------------ plot

    def plot(
        self, val: RecallOutput | Sequence[RecallOutput] | None = None, ax: Any | None = None
    ) -> tuple[Any, Any]:
        """Draw Recall@K against K (a CMC curve; one per direction when bidirectional).

        Args:
            val: a result of :meth:`compute` (default: compute now), or a list of them.
            ax: a matplotlib axis to draw on; a new figure when ``None``.

        Returns:
            ``(fig, ax)``.

        Example:
            >>> import torch
            >>> from recall_at_k import EmbeddingRecallAtK
            >>> metric = EmbeddingRecallAtK(k=(1, 2, 3))
            >>> metric.update(torch.eye(4), torch.tensor([0, 0, 1, 1]))
            >>> fig, ax = metric.plot()
        """
        val = val if val is not None else self.compute()
        results = [val] if isinstance(val, (Tensor, dict)) else list(val)
        prefixes = [f"{d}/" for d in self.directions] if self.bidirectional else [""]
        curves = []
        for result in results:
            curve = {}
            for prefix in prefixes:
                keys = [prefix + self.key.format(k=k) for k in self.ks]
                curve[prefix.rstrip("/")] = (self.ks, values_of(result, keys))
            curves.append(curve)
        return plot_curves(curves[0] if len(curves) == 1 else curves, ax, type(self).__name__)


def _identities(meta: Tensor) -> Tensor:
    """A sample identity per row: rows sharing an id share it, a row without id is alone."""
    num = meta.shape[0]
    has_id = (meta[:, _FLAGS] & _HAS_ID) != 0
    identity = torch.empty(num, dtype=torch.int64, device=meta.device)
    ids, order = torch.sort(meta[has_id, _ID])
    distinct, inverse_sorted = torch.unique_consecutive(ids, return_inverse=True)
    inverse = torch.empty_like(inverse_sorted)
    inverse[order] = inverse_sorted
    identity[has_id] = inverse
    without = (~has_id).nonzero().squeeze(1)
    identity[without] = distinct.shape[0] + torch.arange(without.shape[0], device=meta.device)
    return identity


def _select(meta: Tensor, identity: Tensor, flag: int) -> _Side:
    """Rows playing a role, keeping the first row of each identity (dedupe by id)."""
    rows = ((meta[:, _FLAGS] & flag) != 0).nonzero().squeeze(1)
    ident = identity[rows]
    first = torch.full((meta.shape[0],), meta.shape[0], dtype=torch.int64, device=meta.device)
    first.scatter_reduce_(0, ident, rows, reduce="amin")
    keep = first[ident] == rows
    return _Side(rows[keep], ident[keep])


def _same_sets(previous: tuple[Tensor, Tensor, Tensor, Tensor], q: _Side, g: _Side) -> bool:
    """Whether a direction ranks the same queries against the same gallery as before."""
    prev_queries, prev_gallery = previous[0], previous[1]
    return bool(
        prev_queries.shape == q.rows.shape
        and prev_gallery.shape == g.rows.shape
        and torch.equal(prev_queries, q.rows)
        and torch.equal(prev_gallery, g.rows)
    )


def _row_counts(
    scores: Tensor, threshold: Tensor, want_gt: bool, want_ge: bool
) -> tuple[Tensor | None, Tensor | None]:
    """Row-wise counts of ``scores > threshold`` and ``scores >= threshold``.

    Overwrites ``scores``: each comparison writes 0/1 into the float tile itself (NaN
    compares false), which needs no second tile of memory and, on CPU, is faster than a
    ``bool`` result. Sums of 0/1 floats are exact below 2**24 items (float64 rows
    beyond; 16-bit tiles sum in float32). On CPU the rows go in blocks of about
    ``_CPU_COUNT_BLOCK_BYTES``, so that each block's sum reads what its comparison has
    just written from the core's cache.
    """
    num_rows, num_gallery = scores.shape
    exact_dtype = scores.dtype if scores.dtype in (torch.float32, torch.float64) else torch.float32
    if num_gallery >= 2**24:
        exact_dtype = torch.float64
    step = num_rows
    if scores.device.type == "cpu":
        step = max(1, _CPU_COUNT_BLOCK_BYTES // max(1, num_gallery * scores.element_size()))
    greater = torch.empty(num_rows, dtype=torch.int64, device=scores.device) if want_gt else None
    at_or_above = (
        torch.empty(num_rows, dtype=torch.int64, device=scores.device) if want_ge else None
    )
    spare = torch.empty_like(scores[:step]) if want_gt and want_ge else None
    for start in range(0, num_rows, step):
        block = scores[start : start + step]
        bound = threshold[start : start + step]
        if greater is not None:
            above = block if spare is None else spare[: block.shape[0]]
            torch.gt(block, bound, out=above)
            greater[start : start + step] = above.sum(dim=1, dtype=exact_dtype)
        if at_or_above is not None:
            block.ge_(bound)
            at_or_above[start : start + step] = block.sum(dim=1, dtype=exact_dtype)
    return greater, at_or_above


def _no_positive_counts(num_rows: int, device: torch.device) -> _kernel.TieCounts:
    """The counts of a tile none of whose queries has an item of its label."""
    zeros = torch.zeros(num_rows, dtype=torch.int64, device=device)
    return _kernel.TieCounts(zeros, zeros, zeros, zeros.bool())


def _block_counts(
    scores: Tensor,
    tile: _Queries,
    groups: Tensor,
    need: tuple[bool, bool, bool],
    widest: int,
    exclude: str,
) -> tuple[_kernel.TieCounts, Tensor]:
    """g_>, g_> + e and p of a tile whose positives are read from their label blocks.

    ``scores`` already holds NaN where an item is ignored (the query itself, same-group
    items). Every item sharing the query's label lies in its block, so the valid
    negatives at or above s* are all items at or above s* minus the block's items at or
    above s* (ignored junk of the label-and-group rule included: it is in the block).
    ``groups`` are the groups of the columns of ``scores``; ``tile.block_start`` counts
    in those columns. Returns the counts and s* (``[T, 1]``).
    """
    want_gt, want_ge, _ = need
    device = scores.device
    if widest == 0:  # no query of the tile has an item of its label in the gallery
        best = torch.full((scores.shape[0], 1), float("-inf"), device=device)
        return _no_positive_counts(scores.shape[0], device), best
    steps = torch.arange(widest, device=device)
    in_block = steps.unsqueeze(0) < tile.block_count.unsqueeze(1)
    # Rows without a block (block_count 0) may start anywhere: keep them in range.
    columns = (tile.block_start.unsqueeze(1) + steps.unsqueeze(0)).clamp_(
        min=0, max=max(scores.shape[1] - 1, 0)
    )
    block = scores.gather(1, columns)
    valid = in_block & ~torch.isnan(block)
    if exclude == "same_label_and_group":
        valid &= groups[columns] != tile.groups.unsqueeze(1)
    best = torch.where(valid, block, float("-inf")).amax(dim=1, keepdim=True)
    has_positive = valid.any(dim=1)
    block_at_or_above = block >= best  # NaN compares false
    tied = (block_at_or_above & valid).sum(dim=1)
    greater, at_or_above = _row_counts(scores, best, want_gt, want_ge)
    if greater is not None:
        greater -= ((block > best) & in_block).sum(dim=1)
    if at_or_above is not None:
        at_or_above -= (block_at_or_above & in_block).sum(dim=1)
    return _kernel.TieCounts(greater, at_or_above, tied, has_positive), best
