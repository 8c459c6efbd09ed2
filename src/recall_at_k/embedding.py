"""``EmbeddingRecallAtK``: cat states of embeddings, roles, the sharding protocol, wiring.

The metric keeps every item it is given (``dist_reduce_fx="cat"``); ``compute`` ranks
each direction's queries against its gallery with :func:`recall_at_k._rank.rank`.
Under DDP the states are gathered by torchmetrics' sync; each process then ranks only
its share of the queries and the histograms are summed with ``all_reduce``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Literal, NamedTuple, SupportsIndex, cast, overload

import torch
from torch import Tensor

from recall_at_k import _embedding_checks, _items, _sync
from recall_at_k import audit as _audit
from recall_at_k._base import Histogram, RecallAtKMetric
from recall_at_k._checks import check_choice, check_positive_int
from recall_at_k._outcomes import QueryOutcomes, embedding_outcomes
from recall_at_k._sync import ListLayout
from recall_at_k._types import (
    EXCLUDES,
    ROLES,
    EmptyTargetAction,
    Exclude,
    OutputT,
    Role,
    Similarity,
    Ties,
)
from recall_at_k.ranking import bands as _bands
from recall_at_k.ranking import budget as _budget
from recall_at_k.ranking import gallery as _gallery
from recall_at_k.ranking import ordered as _ordered
from recall_at_k.ranking import outcomes as _ranking_outcomes
from recall_at_k.ranking import progress as _progress
from recall_at_k.ranking import rank as _rank
from recall_at_k.ranking import score as _score
from recall_at_k.ranking import sharded as _sharded
from recall_at_k.ranking import workers as _workers
from recall_at_k.ranking.bands import AUTO_ROUTE, Route
from recall_at_k.ranking.gallery import Side

__all__ = ["EmbeddingRecallAtK"]


_VALUES = "embedding_values"
"""The list state of embeddings (a tensor once gathered): swapped by the lean sync."""

_META = "embedding_meta"
"""The list state of their metadata (:mod:`recall_at_k._items`): swapped with it."""


class _LeanSync(NamedTuple):
    """Within :meth:`EmbeddingRecallAtK.sync_context`, synced: this process's own
    states (the metric's are empty) and the group that every process reads them in."""

    values: list[Tensor]
    meta: list[Tensor]
    group: _rank.ProcessGroup


class EmbeddingRecallAtK(RecallAtKMetric[OutputT]):
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
    follow ``ties``, never sort order.

    ``compute`` never materialises the query x gallery matrix: queries are ranked in
    tiles whose scores fit in ``chunk_bytes`` (at least one query a tile), on the
    embeddings' device. Under DDP (states gathered by torchmetrics' sync) each process
    ranks only its share of the queries against the gathered gallery and the hit counts
    are summed with ``all_reduce``, so every process returns the single-process result.
    With ``sync_on_compute=False`` every process computes on its own data alone.

    Embeddings are stored in the wider of float32 and their own dtype: half-precision
    inputs are widened exactly, float64 inputs stay float64, and no module cast
    (``.to(torch.float16)``, ``.half()``, ``set_dtype``, Lightning's ``"16-true"`` /
    ``"bf16-true"``) changes them, before or after it. Once any stored batch (on any
    process) is float64, all are ranked in float64, as
    :func:`~recall_at_k.functional.embedding_recall_at_k` ranks the same inputs. The
    stored states grow with the data: O(items x D). Items are ranked by a canonical
    score, a fixed-order float64 sum over the stored rows (cosine rows normalised once
    each), so the result is identical for every ``chunk_bytes``, thread count, number of
    processes and device; the float32 matrix product is the fast path, and the items its
    rounding could misplace are re-scored (``last_compute_rescored``).

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
        near_duplicate: a threshold in the metric's own similarity (0.95 for cosine,
            say): :meth:`protocol_report` then also counts queries with a gallery item
            scored at or above it (for now a separate pass: about one more ranking).
        progress: show a tqdm progress bar on stderr over the queries ``compute``
            ranks (under DDP only on the process of rank 0); needs tqdm
            (``pip install tqdm``).
        sharded: under DDP, keep each process's items where they are: no process ever
            holds the whole gallery. The metadata is gathered; the gallery passes by
            every process in blocks of at most a tile (each process broadcasting its
            own rows in turn), twice, and each process ranks the queries it holds
            (:mod:`recall_at_k.ranking.sharded`); the result is bit for bit the
            one-process one. ``False`` by default: the gathered ranking does half the
            work (one pass), so shard only when one copy of all the embeddings does not
            fit on each device. Ignored by one process; refused with a callable
            ``similarity``. :meth:`query_outcomes` gathers each process's records.
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

    __jit_ignored_attributes__: ClassVar[list[str]] = [
        "last_compute_num_queries_ranked",
        "near_duplicate",
        "_report",
        "last_compute_rescored",
    ]

    last_compute_num_queries_ranked: dict[str, int]
    """Queries this process ranked in the last ``compute``, per direction (its share under
    DDP, every query otherwise)."""
    last_compute_rescored: dict[str, int]
    """(query, gallery item) pairs this process re-scored canonically in the last
    ``compute``, per direction: the items whose fast float32 score lay within the
    certified rounding band around their query's best positive."""

    _items_are_samples: ClassVar[bool] = True  # BootStrapper would copy gallery items
    _route: Route = AUTO_ROUTE
    """How tiles are counted (a private switch for tests; every route is exact)."""

    @overload
    def __init__(
        self: EmbeddingRecallAtK[Tensor],
        k: SupportsIndex,
        *,
        similarity: Similarity = "cosine",
        exclude: Exclude = "none",
        bidirectional: Literal[False] = False,
        directions: Sequence[str] = ("q2g", "g2q"),
        ties: Ties = "pessimistic",
        empty_target_action: EmptyTargetAction = "neg",
        chunk_bytes: int = 256 * 2**20,
        near_duplicate: float | None = None,
        progress: bool = False,
        sharded: bool = False,
        key: str = "recall@{k}",
        validate_args: bool = True,
        **metric_kwargs: Any,
    ) -> None: ...

    @overload
    def __init__(
        self: EmbeddingRecallAtK[dict[str, Tensor]],
        k: SupportsIndex | Sequence[SupportsIndex],
        *,
        similarity: Similarity = "cosine",
        exclude: Exclude = "none",
        bidirectional: Literal[True],
        directions: Sequence[str] = ("q2g", "g2q"),
        ties: Ties = "pessimistic",
        empty_target_action: EmptyTargetAction = "neg",
        chunk_bytes: int = 256 * 2**20,
        near_duplicate: float | None = None,
        progress: bool = False,
        sharded: bool = False,
        key: str = "recall@{k}",
        validate_args: bool = True,
        **metric_kwargs: Any,
    ) -> None: ...

    @overload
    def __init__(
        self: EmbeddingRecallAtK[dict[str, Tensor]],
        k: Sequence[SupportsIndex] = (1, 5, 10),
        *,
        similarity: Similarity = "cosine",
        exclude: Exclude = "none",
        bidirectional: bool = False,
        directions: Sequence[str] = ("q2g", "g2q"),
        ties: Ties = "pessimistic",
        empty_target_action: EmptyTargetAction = "neg",
        chunk_bytes: int = 256 * 2**20,
        near_duplicate: float | None = None,
        progress: bool = False,
        sharded: bool = False,
        key: str = "recall@{k}",
        validate_args: bool = True,
        **metric_kwargs: Any,
    ) -> None: ...

    def __init__(
        self,
        k: SupportsIndex | Sequence[SupportsIndex] = (1, 5, 10),
        *,
        similarity: Similarity = "cosine",
        exclude: Exclude = "none",
        bidirectional: bool = False,
        directions: Sequence[str] = ("q2g", "g2q"),
        ties: Ties = "pessimistic",
        empty_target_action: EmptyTargetAction = "neg",
        chunk_bytes: int = 256 * 2**20,
        near_duplicate: float | None = None,
        progress: bool = False,
        sharded: bool = False,
        key: str = "recall@{k}",
        validate_args: bool = True,
        **metric_kwargs: Any,
    ) -> None:
        checked_directions = _embedding_checks.check_directions(directions)
        prefixes = [f"{d}/" for d in checked_directions] if bidirectional else [""]
        super().__init__(
            k,
            ties=ties,
            empty_target_action=empty_target_action,
            key=key,
            validate_args=validate_args,
            prefixes=prefixes,
            **metric_kwargs,
        )
        _embedding_checks.check_similarity(similarity)
        check_choice("exclude", exclude, EXCLUDES)
        self.directions = checked_directions
        self.chunk_bytes = check_positive_int("chunk_bytes", chunk_bytes)
        self.similarity = similarity
        self.exclude = exclude
        self.bidirectional = bool(bidirectional)
        self.near_duplicate = _audit.check_near_duplicate(near_duplicate)
        self.progress = _progress.check_progress(progress)
        self.sharded = _sharded.check_sharded(sharded, similarity)
        self.last_compute_num_queries_ranked = {}
        # The protocol report of the last compute() (None once data changes); the
        # warning about identical positives is shown once per instance (never re-armed).
        self._report: list[dict[str, int]] | None = None
        self._report_gathered = False  # whether the report counted gathered states
        self._audit_warned = False
        self.last_compute_rescored = {}
        # The process group whose gathered states the running compute() sees; set by
        # sync() for the compute that follows it, None when states are local.
        self._gathered: _rank.ProcessGroup | None = None
        # Within sync_context: this process's own embeddings (not gathered whole).
        self._lean_sync = False
        self._lean: _LeanSync | None = None
        # Embeddings are stored flattened (1-D, float32 or wider: _items.stored_dtype)
        # so that a process without data sends an empty block of the same layout; the
        # width is in the metadata.
        self._add_list_state("embedding_values", ListLayout((), None))
        self._add_list_state("embedding_meta", ListLayout((_items.META_COLUMNS,), torch.int64))

    # ------------------------------------------------------------------ update

    def update(
        self,
        embeddings: Tensor,
        labels: Tensor,
        *,
        role: Role = "both",
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
        self._report = None
        _embedding_checks.check_batch(embeddings, labels, groups, ids)
        check_choice("role", role, ROLES)
        if self.exclude != "none" and groups is None:
            raise ValueError(
                f"`groups` are required with exclude={self.exclude!r}: pass the group"
                " (camera, source, ...) of every item to update()"
            )
        values = cast(list[Tensor], self.embedding_values)
        meta_blocks = cast(list[Tensor], self.embedding_meta)
        _items.check_width(meta_blocks, embeddings.shape[1], role)
        if self.validate_args:
            _embedding_checks.check_finite(embeddings)
        # A copy of our own: the caller may reuse its tensor.
        stored = embeddings.detach().to(_items.stored_dtype(embeddings), copy=True)
        values.append(stored.reshape(-1))
        meta_blocks.append(_items.metadata(labels, groups, ids, role, embeddings.shape[1]))

    # ------------------------------------------------------------------ sync hooks

    @contextmanager
    def sync_context(
        self,
        dist_sync_fn: Callable[..., Any] | None = None,
        process_group: Any | None = None,
        should_sync: bool = True,
        should_unsync: bool = True,
        distributed_available: Callable[..., Any] | None = None,
    ) -> Generator[None, None, None]:
        """torchmetrics' ``sync_context`` (what ``compute()`` syncs in), except that the
        embeddings and their metadata are not gathered into the states: inside it each
        process keeps its own, the ranking broadcasts every process's metadata into a
        tensor of its own (freed before the copy) and reads every process's rows a run
        at a time (:class:`recall_at_k._sync.BroadcastRows`), writing each to its place
        in its one copy. An explicit ``sync()`` gathers them as torchmetrics does, and so does
        a context that leaves the states synced (``should_unsync=False``: ``forward``
        with ``dist_sync_on_step=True`` keeps the gathered batch state)."""
        # A custom gather function gathers all.
        self._lean_sync = dist_sync_fn is None and should_unsync
        try:
            with super().sync_context(
                dist_sync_fn, process_group, should_sync, should_unsync, distributed_available
            ):
                yield
        finally:
            self._lean_sync = False

    def sync(
        self,
        dist_sync_fn: Any | None = None,
        process_group: Any | None = None,
        should_sync: bool = True,
        distributed_available: Any | None = None,
    ) -> None:
        """The base ``sync``, recording whether the states are now gathered: ``compute``
        shards the queries across processes only then. Within :meth:`sync_context` the
        embeddings stay where they are (each process's own)."""
        will_sync = self._will_sync(should_sync, distributed_available)
        self._gathered = None
        group = _rank.ProcessGroup(process_group or self.process_group)
        lean = will_sync and self._lean_sync and self._lean is None
        if lean:
            # Neither the rows nor their metadata are gathered into the state: the
            # ranking reads them from every process when it needs them (_stored), so
            # no gathered copy outlives its use, and torchmetrics' cache of the local
            # states clones neither.
            values = cast(list[Tensor], getattr(self, _VALUES))
            self._lean = _LeanSync(values, cast(list[Tensor], getattr(self, _META)), group)
            setattr(self, _VALUES, [])
            setattr(self, _META, [])
        try:
            super().sync(dist_sync_fn, process_group, should_sync, distributed_available)
        except BaseException:
            if lean:
                self._restore_local()
            raise
        if will_sync:
            self._gathered = group

    def unsync(self, should_unsync: bool = True) -> None:
        """The base ``unsync``; the states are local again afterwards."""
        super().unsync(should_unsync=should_unsync)
        if should_unsync:
            self._gathered = None
            self._restore_local()

    def _restore_local(self) -> None:
        """After a sync within :meth:`sync_context`: this process's own states again."""
        if self._lean is not None:
            setattr(self, _VALUES, self._lean.values)
            setattr(self, _META, self._lean.meta)
        self._lean = None

    # ------------------------------------------------------------------ compute

    def _histograms(self) -> list[Histogram]:
        # On CPU the ranking's heavy parts run on worker threads: the caller on one.
        threaded = self.device.type == "cpu" and not self.sharded and not callable(self.similarity)
        try:
            with _workers.caller_on_one_thread(threaded):
                return self._rank_directions()
        finally:
            self._gathered = None

    def _rank_directions(self, computing: bool = True) -> list[Histogram]:
        """Rank every direction and audit it. ``computing``: for ``compute()`` (which sets
        the ``last_compute_*`` attributes and may warn); else for ``protocol_report()`` on
        demand, which needs the near-duplicate counts of a ranking."""
        source, meta = self._stored()
        if meta.shape[0] == 0:
            # Nothing added (on any process): like RetrievalRecallAtK, NaN with a warning.
            empty = torch.zeros(self.max_k, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
            self._audit([None, None], [None, None], [0, 0], [None, None], computing)
            return [empty for _ in self._prefixes]
        if self.sharded and isinstance(source, _sync.BroadcastRows):
            return self._rank_sharded(source, meta, computing)
        # The one whole copy: the stored items in the ranking's order, bit for bit
        # (audited so), then prepared in place.
        num = meta.shape[0]
        block = self._block_bytes(source.shape[1], num)
        # The sides int32 where the items allow, an equal side held once.
        directions = _items.narrow_sides(self._directions(meta), num)
        # Of the metadata only the labels (and the groups, where ``exclude`` reads
        # them) live on, int32 where they fit, in the ranking's order (not the ids,
        # flags and widths, nor the order itself).
        columns = _items.label_columns(meta, self.exclude != "none")
        del meta
        ordered = _ordered.ordered_items(source, columns[0], directions, None, block)
        del directions
        embeddings, directions = ordered.embeddings, ordered.directions
        columns = _items.take_columns(columns, ordered.order)
        del ordered
        audits = self._audits((embeddings, columns.T), directions)
        _ordered.normalise(embeddings, self.similarity, block)
        check_nan = self.validate_args and _score.may_produce_nan(embeddings, self.similarity)
        options, known = self._rank_options(audits, check_nan, num)
        group = self._gathered  # shard across processes only when states are gathered
        shared = _rank.rank_shared(
            embeddings,
            columns[0],
            columns[1],
            directions,
            options,
            self._route,
            group,
            known,
        )
        return self._ranked(shared, audits, directions, computing, 0)

    def _scratch_bytes(self, items: int) -> int:
        """The scratch of a ranking of ``items`` items: what ``chunk_bytes`` leaves
        beside their bookkeeping (:mod:`recall_at_k.ranking.budget`)."""
        return _budget.scratch_bytes(self.chunk_bytes, items)

    def _block_bytes(self, width: int, items: int) -> int:
        """Rows of ``width`` are copied, prepared and audited this many bytes at a time
        in a ranking of ``items`` items (:func:`recall_at_k.ranking.budget.block_bytes`)."""
        return _budget.block_bytes(self._scratch_bytes(items), width)

    def _rank_sharded(
        self, source: _sync.BroadcastRows, meta: Tensor, computing: bool
    ) -> list[Histogram]:
        """:meth:`_rank_directions` with the gallery sharded (``sharded=True``, states in
        the lean sync): each process ranks the queries it holds against every process's
        rows as they pass by (:func:`recall_at_k.ranking.sharded.rank_sharded`); the
        audit's codes are made without any process holding every row."""
        directions = _items.narrow_sides(self._directions(meta), meta.shape[0])
        audits = self._audits(self._sharded_codes(source, meta), directions)
        options, known = self._rank_options(audits, self.validate_args, None)
        labels, groups = meta[:, _items.LABEL], meta[:, _items.GROUP]
        shared, _ = _sharded.rank_sharded(source, labels, groups, directions, options, known)
        return self._ranked(shared, audits, directions, computing, 1)

    def _rank_options(
        self,
        audits: Sequence[_audit.DirectionAudit | None] | None,
        check_nan: bool,
        items: int | None,
    ) -> tuple[_bands.RankOptions, list[Tensor | None] | None]:
        """The ranking's options, and per direction the queries known to have a near
        positive / negative (the audit's copies; only with ``near_duplicate`` and an
        audit). The ranking of ``items`` items in one copy takes the scratch that
        ``chunk_bytes`` leaves beside their bookkeeping; a sharded one (None) has its
        own shares of ``chunk_bytes``."""
        near = self.near_duplicate if audits is not None else None
        options = _bands.RankOptions(
            self.similarity,
            self.exclude,
            self.ties,
            self.max_k,
            self.chunk_bytes if items is None else self._scratch_bytes(items),
            check_nan,
            near,
            self.progress,
        )
        known = None
        if near is not None and audits is not None:
            known = [None if audit is None else audit.known() for audit in audits]
        return options, known

    def _ranked(
        self,
        shared: _rank.Shared,
        audits: Sequence[_audit.DirectionAudit | None] | None,
        directions: Sequence[Any],
        computing: bool,
        depth: int,
    ) -> list[Histogram]:
        """The histograms of a ranking; for ``compute()`` its ``last_compute_*``
        attributes; the protocol report made of ``audits`` and its near counts
        (``depth``: this call's frames below ``_rank_directions``, for the warning)."""
        if computing:
            ranked = zip(self.directions, shared.ranked, strict=False)
            self.last_compute_num_queries_ranked = dict(ranked)
            self.last_compute_rescored = dict(zip(self.directions, shared.rescored, strict=False))
        counted = _audit.counted_queries(shared.histograms, self.empty_target_action)
        self._audit(audits, shared.near, counted, directions, computing, 8 + depth)
        return shared.histograms

    @staticmethod
    def _sharded_codes(source: _sync.BroadcastRows, meta: Tensor) -> Callable[[], _audit.Codes]:
        """The audit's codes of every process's rows (a collective), made on demand."""

        def codes() -> _audit.Codes:
            labels, groups = meta[:, _items.LABEL], meta[:, _items.GROUP]
            sizes = _budget.sharded_audit_sizes()
            return _audit.sharded_codes(
                source.local, source.counts, labels, groups, source.group, sizes
            )

        return codes

    def _directions(self, meta: Tensor) -> list[tuple[Side, Side] | None]:
        """Each direction's (queries, gallery), None for one that cannot be ranked
        (an error outside ``forward``)."""
        _items.check_groups(meta, self.exclude)
        flags = meta[:, _items.FLAGS]
        identity = _gallery.identities(meta[:, _items.ID], (flags & _items.HAS_ID) != 0)
        roles = [(_items.IS_QUERY, _items.IS_GALLERY), (_items.IS_GALLERY, _items.IS_QUERY)]
        directions: list[tuple[Side, Side] | None] = []
        for index, (query_flag, gallery_flag) in enumerate(roles[: len(self._prefixes)]):
            queries = _gallery.select((flags & query_flag) != 0, identity)
            gallery = _gallery.select((flags & gallery_flag) != 0, identity)
            name = self.directions[index]
            missing = _items.missing_side(name, index, queries.rows, gallery.rows)
            if missing is not None and not self._in_forward:
                raise ValueError(missing)
            directions.append(None if missing is not None else (queries, gallery))
        return directions

    # ------------------------------------------------------------------ per query

    def query_outcomes(self) -> QueryOutcomes | dict[str, QueryOutcomes]:
        """Each counted query's hit@K and first-hit rank, synchronised as ``compute()``.

        Computed from the stored items: the queries are ranked again, as ``compute()``
        ranks them (under DDP each process ranks its share and the outcomes are
        gathered), with one record per query kept instead of a histogram. The ids are
        the queries' ``ids`` (of every query, or of none: then the position of each
        query among the items added with its role, ``"query"`` or ``"both"`` -- or
        ``"gallery"`` for the gallery -> query direction --, counted in the order of the
        (gathered) state), ascending; ``hits.mean(0)`` is ``compute()``'s Recall@K.
        With ``bidirectional=True``, a dict of one per direction, keyed by its name.
        See :class:`recall_at_k.QueryOutcomes`.

        Example:
            >>> import torch
            >>> from recall_at_k import EmbeddingRecallAtK
            >>> metric = EmbeddingRecallAtK(k=1)
            >>> embeddings = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [0.6, 0.8]])
            >>> metric.update(embeddings, torch.tensor([0, 0, 1, 1]),
            ...               ids=torch.tensor([10, 11, 12, 13]))
            >>> outcomes = metric.query_outcomes()
            >>> outcomes.ids, outcomes.first_hit_rank
            (tensor([10, 11, 12, 13]), tensor([1, 2, 1, 2]))
            >>> outcomes.hits.squeeze(1)
            tensor([1., 0., 1., 0.], dtype=torch.float64)
        """
        outcomes: list[QueryOutcomes] = self._synced(self._query_outcomes)
        if self.bidirectional:
            return dict(zip(self.directions, outcomes, strict=False))
        return outcomes[0]

    def _query_outcomes(self) -> list[QueryOutcomes]:
        try:
            source, meta = self._stored()
            directions = self._directions(meta) if meta.shape[0] else [None, None]
            directions = directions[: len(self._prefixes)]
            if meta.shape[0] and self.sharded and isinstance(source, _sync.BroadcastRows):
                records = self._sharded_records(source, meta, directions)
                return self._outcomes_of(meta, directions, records)
            # The one whole copy, prepared, in the ranking's order; each direction's
            # queries keep their order (the records'), renumbered to its rows.
            ordered = _ordered.ordered_items(
                source,
                meta[:, _items.LABEL],
                directions,
                self.similarity,
                self._block_bytes(source.shape[1], meta.shape[0]),
            )
            embeddings, order = ordered.embeddings, ordered.order
            check_nan = self.validate_args and _score.may_produce_nan(embeddings, self.similarity)
            options = self._rank_options(None, check_nan, meta.shape[0])[0]
            options = options._replace(progress=False)
            records = _ranking_outcomes.rank_outcomes(
                embeddings,
                meta[order, _items.LABEL],
                meta[order, _items.GROUP],
                ordered.directions,
                options,
                self._route,
                self._gathered,
            )
        finally:
            self._gathered = None
        return self._outcomes_of(meta, directions, records)

    def _sharded_records(
        self,
        source: _sync.BroadcastRows,
        meta: Tensor,
        directions: Sequence[tuple[Side, Side] | None],
    ) -> list[Tensor | None]:
        """Every query's outcome record with the gallery sharded (gathered on every
        process)."""
        options = self._rank_options(None, self.validate_args, None)[0]._replace(progress=False)
        labels, groups = meta[:, _items.LABEL], meta[:, _items.GROUP]
        _, records = _sharded.rank_sharded(
            source, labels, groups, directions, options, outcomes=True
        )
        assert records is not None
        return records

    def _outcomes_of(
        self,
        meta: Tensor,
        directions: Sequence[tuple[Side, Side] | None],
        records: Sequence[Tensor | None],
    ) -> list[QueryOutcomes]:
        single = self.single_k and not self.bidirectional
        return [
            embedding_outcomes(
                meta,
                index,
                None if sides is None else sides[0],
                rec,
                self.ks,
                self.max_k,
                self.empty_target_action,
                None if single else [prefix + key for key in self.keys],
            )
            for index, (prefix, sides, rec) in enumerate(
                zip(self._prefixes, directions, records, strict=True)
            )
        ]

    # ------------------------------------------------------------------ protocol audit

    def protocol_report(self) -> dict[str, int] | dict[str, dict[str, int]]:
        """Counts that reveal a leaky or repeated protocol: ``"queries"`` (counted);
        ``"identical_positive"`` / ``"identical_negative"``: queries with a non-ignored
        gallery item whose embedding is bitwise-equal, another sample, of their label (a
        guaranteed hit) / of another; ``"rounding_positive"`` / ``"rounding_negative"``:
        the same for an item equal to the query up to float rounding but not bitwise
        (every coordinate within ``2^-10`` of the larger of the two rows' largest
        absolute coordinate: a DistributedSampler repeat computed in another batch
        shape); with ``near_duplicate``, ``"near_positive"`` / ``"near_negative"`` (an
        item scored at or above it, or a copy of either kind) and ``"near_hits_at_1"``
        (the rank-1 hit scores at or above it); ``"duplicate_gallery_items"``
        (bitwise-equal to an earlier gallery item) and
        ``"rounding_duplicate_gallery_items"`` (the others equal up to rounding to an
        earlier gallery item). From the last ``compute()``, else computed now
        (collective under DDP). Bidirectional: one dict per direction, keyed by its
        name.
        """
        if _audit.stale_anywhere(self, self._report is None):
            self._synced(self._audit_on_demand)
        reports = [dict(r) for r in self._report or []]
        return (
            dict(zip(self.directions, reports, strict=False)) if self.bidirectional else reports[0]
        )

    def _audit_on_demand(self) -> None:
        try:
            if self.near_duplicate is not None:
                self._rank_directions(computing=False)  # the near counts need a ranking
                return
            source, meta = self._stored()
            sides = self._directions(meta) if meta.shape[0] else [None, None]
            stored: tuple[Tensor, Tensor] | Callable[[], _audit.Codes]
            stored = torch.zeros(0, 0), meta
            if meta.shape[0] and self.sharded and isinstance(source, _sync.BroadcastRows):
                stored = self._sharded_codes(source, meta)  # no whole copy of the rows
            elif meta.shape[0]:
                labels = meta[:, _items.LABEL]
                block = self._block_bytes(source.shape[1], meta.shape[0])
                ordered = _ordered.ordered_items(source, labels, sides, None, block)
                sides = ordered.directions
                stored = ordered.embeddings, meta.index_select(0, ordered.order)
            audits = self._audits(stored, sides)
            self._audit(audits, [None, None], [None, None], sides, warn=False)
        finally:
            self._gathered = None

    def _audits(
        self,
        stored: tuple[Tensor, Tensor] | Callable[[], _audit.Codes],
        sides: Sequence[Any],
    ) -> list[_audit.DirectionAudit | None] | None:
        """The identical-item audit of each direction, or None when the report is kept
        (not in ``forward``, whose report would be the batch's; kept while the local data
        are those it counted -- a ``confidence_interval()`` after ``compute()`` ranks
        again -- but not after a gathered compute: another process's data may differ)."""
        if self._in_forward:
            return None
        gathered = self._gathered is not None
        if self._report is not None and not gathered and not self._report_gathered:
            return None
        options = _audit.options_of(self)
        if not callable(stored):
            embeddings, meta = stored
            # Blocks of a share of the scratch, whatever the rows' width.
            scratch = self._scratch_bytes(meta.shape[0])
            share = max(1, scratch // _budget.BLOCK_SHARE)
            block = _budget.block_bytes(scratch, embeddings.shape[1])
            options = options._replace(sizes=_budget.audit_sizes(min(block, share)))
        return _audit.audit_directions(stored, sides[: len(self._prefixes)], options)

    def _audit(
        self,
        audits: Sequence[_audit.DirectionAudit | None] | None,
        near: Sequence[Tensor | None],
        counted: Sequence[int | None],
        sides: Sequence[Any],
        warn: bool = True,
        stacklevel: int = 7,
    ) -> None:
        """Store the report made of ``audits`` (None: keep the one there is) and warn
        once per instance (never re-armed) of identical positives or duplicate gallery
        items, bitwise or up to rounding (``stacklevel``: the frames up to the caller of
        ``compute()``)."""
        if self._in_forward:
            return
        count = len(self._prefixes)
        options = _audit.options_of(self)
        if audits is not None or self._report is None:
            audits = [None] * count if audits is None else audits
            self._report = _audit.protocol_reports(
                audits[:count], near[:count], counted[:count], options
            )
            self._report_gathered = self._gathered is not None
        message = _audit.warning_message(options.names, self._report, sides[:count])
        if warn and message is not None and not self._audit_warned:
            self._audit_warned = True
            warnings.warn(message, UserWarning, stacklevel=stacklevel)

    def reset(self) -> None:
        """Reset the state (and the views); forget the protocol report."""
        super().reset()
        self._report = None

    def merge_state(self, incoming_state: Any) -> None:
        """torchmetrics' ``merge_state``; forget the protocol report."""
        super().merge_state(incoming_state)
        self._report = None

    def _stored(self) -> tuple[_ordered.RowSource | _sync.BroadcastRows, Tensor]:
        """The stored (or gathered) embeddings, read in blocks (nothing is copied whole;
        ranked in the widest dtype stored, on any process), and their metadata."""
        lean = self._lean
        if lean is None:
            blocks, width, meta = _items.stored_blocks(self.embedding_values, self.embedding_meta)
            return _ordered.RowSource(blocks, meta.shape[0], width, _sync.FLOAT_FLOOR), meta
        # Synced within sync_context: the metadata of every process broadcast into one
        # tensor that lives as long as its reader (not in the state), the rows read from
        # every process a run at a time, in the widest dtype any process stores.
        group = lean.group.group
        local = _items.blocks(lean.values)
        local_meta = [m.reshape(-1, _items.META_COLUMNS) for m in _items.blocks(lean.meta)]
        device = local_meta[0].device if local_meta else self.device
        rows = sum(block.shape[0] for block in local_meta)
        held = sum(block.numel() for block in local)
        mine = _sync.widest_float([block.dtype for block in local])
        counts, helds, dtype = _sync.process_rows(rows, held, mine, group, device)
        gathered = _sync.broadcast_rows(local_meta, counts, _items.META_COLUMNS, device, group)
        _, width, meta = _items.stored_blocks([], [gathered], False)
        del gathered
        if any(h != c * width for h, c in zip(helds, counts, strict=True)):
            raise ValueError(
                f"`embeddings`: the processes hold {helds} values for {counts} items of"
                f" width {width}; the state was corrupted"
            )
        source = _sync.BroadcastRows(local, counts, width, dtype, device, group)
        return source, meta
