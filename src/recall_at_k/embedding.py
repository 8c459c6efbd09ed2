"""``EmbeddingRecallAtK``: the stored items, their sync, and one path (plan, audit, rank)
for ``compute()``, ``query_outcomes()`` and ``protocol_report()``."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Literal, SupportsIndex, cast, overload

import torch
from torch import Tensor

from recall_at_k import _embedding_checks, _items
from recall_at_k import _embedding_lifecycle as lifecycle
from recall_at_k import audit as _audit
from recall_at_k._base import Histogram, RecallAtKMetric
from recall_at_k._checks import check_positive_int
from recall_at_k._outcomes import QueryOutcomes, embedding_outcomes
from recall_at_k._sync import ListLayout
from recall_at_k._types import EmptyTargetAction, Exclude, OutputT, Role, Similarity, Ties
from recall_at_k.ranking import engine, plan
from recall_at_k.ranking.blocks import Processes
from recall_at_k.ranking.progress import check_progress
from recall_at_k.ranking.stored import BroadcastRows

__all__ = ["EmbeddingRecallAtK"]

Purpose = Literal["compute", "query_outcomes", "protocol_report"]


class EmbeddingRecallAtK(RecallAtKMetric[OutputT]):
    r"""Recall@K of embeddings ranked against a gallery that is complete only at the end.

    ``update`` stores embeddings with labels (relevance = same label) and roles; ``compute``
    ranks every query against the whole gallery. Leave-one-out adds ``role="both"`` items;
    re-ID adds queries and gallery apart; image <-> text adds ``bidirectional=True``.

    A query never retrieves itself: a gallery item with the query's ``ids`` is that sample;
    without ``ids`` a ``role="both"`` item is excluded from its own gallery by position.
    Items repeated with the same ``ids`` within a role count once. Ignored items are neither
    positives nor negatives; ties follow ``ties``.

    ``compute`` ranks in tiles within ``chunk_bytes`` beside one copy of the embeddings,
    never the query x gallery matrix, by a canonical float64 score: the result is the same
    for every ``chunk_bytes``, thread count, process count and device (the pairs the float32
    fast path could misplace are re-scored, ``last_compute_rescored``).

    Args:
        k: an int or a sequence of distinct ints.
        similarity: ``"cosine"``, ``"dot"``, ``"euclidean"`` (negative squared L2), or a
            callable ``(queries [T, D], gallery [G, D]) -> scores [T, G]``.
        exclude: ``"none"``, ``"same_group"`` (items of the query's group are ignored) or
            ``"same_label_and_group"`` (the Market-1501 "junk" rule); both need ``groups``
            in every ``update``.
        bidirectional: also rank the gallery against the queries; keys become
            ``"{direction}/recall@{k}"``.
        directions: the two key prefixes, query -> gallery then gallery -> query.
        ties: ``"pessimistic"`` (default), ``"optimistic"`` or ``"expected"``.
        empty_target_action: a query without a valid positive is a miss (``"neg"``), a hit
            (``"pos"``), not counted (``"skip"``) or an error (``"error"``).
        chunk_bytes: what ``compute`` may add beside one copy of the embeddings.
        near_duplicate: a threshold in the metric's similarity: :meth:`protocol_report`
            also counts queries with a gallery item scored at or above it.
        progress: a tqdm bar on stderr over the ranking (rank 0 only); needs tqdm.
        sharded: under DDP, keep each process's items where they are (the gallery passes
            by in runs): the one-process result at twice the work, for when one copy of
            every embedding does not fit a device. Refused with a callable.
        key: template of the keys, ``"recall@{k}"`` by default.
        validate_args: check that embeddings are finite and scores free of NaN.
        metric_kwargs: torchmetrics' own (``sync_on_compute``, ``process_group``, ...).

    Example:
        >>> import torch
        >>> from recall_at_k import EmbeddingRecallAtK
        >>> metric = EmbeddingRecallAtK(k=(1, 2))
        >>> embeddings = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [0.6, 0.8]])
        >>> metric.update(embeddings, torch.tensor([0, 0, 1, 1]))
        >>> metric.compute()
        {'recall@1': tensor(0.5000), 'recall@2': tensor(1.)}

        Image -> text and text -> image, two captions per image (the image ids make the
        image, repeated once per caption, count once):

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
        "last_compute_rescored",
        "near_duplicate",
        "_life",
    ]
    last_compute_num_queries_ranked: dict[str, int]
    """Queries this process ranked in the last ``compute``, per direction."""
    last_compute_rescored: dict[str, int]
    """(query, item) pairs this process re-scored canonically in the last ``compute``."""

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
        names = _embedding_checks.check_directions(directions)
        prefixes = [f"{d}/" for d in names] if bidirectional else [""]
        super().__init__(
            k,
            ties=ties,
            empty_target_action=empty_target_action,
            key=key,
            validate_args=validate_args,
            prefixes=prefixes,
            **metric_kwargs,
        )
        _embedding_checks.check_similarity(similarity, exclude)
        self.directions = names
        self.chunk_bytes = check_positive_int("chunk_bytes", chunk_bytes)
        self.similarity, self.exclude = similarity, exclude
        self.bidirectional = bool(bidirectional)
        self.near_duplicate = _audit.check_near_duplicate(near_duplicate)
        self.progress = check_progress(progress)
        self.sharded = _embedding_checks.check_sharded(sharded, similarity)
        self.last_compute_num_queries_ranked = {}
        self.last_compute_rescored = {}
        self._life = lifecycle.Lifecycle()
        self._add_list_state("embedding_values", ListLayout((), None))
        self._add_list_state("embedding_meta", ListLayout((_items.META_COLUMNS,), torch.int64))

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
            labels: integer ``[B]``: a gallery item is relevant to a query of its label.
            role: ``"query"``, ``"gallery"`` or ``"both"`` (leave-one-out).
            groups: integer ``[B]`` (camera, source, ...), needed by ``exclude``.
            ids: integer ``[B]`` sample ids, shared by the roles: a gallery item with a
                query's id is that query; an id repeated within a role counts once.
        """
        self._touch_views()
        self._life.report = None
        _embedding_checks.check_update(embeddings, labels, groups, ids, role, self.exclude)
        values = cast(list[Tensor], self.embedding_values)
        meta = cast(list[Tensor], self.embedding_meta)
        _items.check_width(meta, embeddings.shape[1], role)
        if self.validate_args:
            _embedding_checks.check_finite(embeddings)
        stored = embeddings.detach().to(_items.stored_dtype(embeddings), copy=True)
        values.append(stored.reshape(-1))
        meta.append(_items.metadata(labels, groups, ids, role, embeddings.shape[1]))

    @contextmanager
    def sync_context(
        self,
        dist_sync_fn: Callable[..., Any] | None = None,
        process_group: Any | None = None,
        should_sync: bool = True,
        should_unsync: bool = True,
        distributed_available: Callable[..., Any] | None = None,
    ) -> Generator[None, None, None]:
        """torchmetrics' ``sync_context``, but each process keeps its rows, read a run at a time
        (``sync()``, a custom gather or ``should_unsync=False`` gather as torchmetrics does)."""
        self._life.keep_rows = dist_sync_fn is None and should_unsync
        try:
            with super().sync_context(
                dist_sync_fn, process_group, should_sync, should_unsync, distributed_available
            ):
                yield
        finally:
            self._life.keep_rows = False

    def sync(
        self,
        dist_sync_fn: Any | None = None,
        process_group: Any | None = None,
        should_sync: bool = True,
        distributed_available: Any | None = None,
    ) -> None:
        """The base ``sync``; the next ranking then shares its queries among the
        processes (and within :meth:`sync_context` reads rows where they are)."""
        life = self._life
        if not self._will_sync(should_sync, distributed_available):  # what is synced stays
            super().sync(dist_sync_fn, process_group, should_sync, distributed_available)
            return
        group = process_group or self.process_group
        local = None
        if life.keep_rows and (life.synced is None or life.synced.local is None):
            values, meta = self.embedding_values, self.embedding_meta
            local = (list(cast(list[Tensor], values)), list(cast(list[Tensor], meta)))
            self._set_states([], [])
        life.synced = None
        try:
            super().sync(dist_sync_fn, process_group, should_sync, distributed_available)
        except BaseException:
            if local is not None:
                self._set_states(*local)
            raise
        life.synced = lifecycle.Synced(group, local)

    def unsync(self, should_unsync: bool = True) -> None:
        """The base ``unsync``; the states are this process's own again."""
        super().unsync(should_unsync=should_unsync)
        synced = self._life.synced
        if should_unsync:
            if synced is not None and synced.local is not None:
                self._set_states(*synced.local)
            self._life.synced = None

    def _after_compute(self) -> None:
        """Warn (once per instance) of identical positives or repeated gallery items."""
        if self._life.warning:
            warnings.warn(self._life.warning, UserWarning, stacklevel=4)
            self._life.warning = ""

    def _histograms(self) -> list[Histogram]:
        ranked = cast(list[engine.Ranked | None], self._run("compute"))
        return [None if r is None else (r.hist, r.queries) for r in ranked]

    def query_outcomes(self) -> QueryOutcomes | dict[str, QueryOutcomes]:
        """Each counted query's hit@K and first-hit rank, synchronised as ``compute()`` (the
        queries ranked again). ``ids`` are the queries' ids, or each query's position among the
        items of its role in the (gathered) state; ``hits.mean(0)`` is ``compute()``'s
        Recall@K. With ``bidirectional=True``, a dict of one per direction.

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
        """
        outcomes = cast(list[QueryOutcomes], self._synced(lambda: self._run("query_outcomes")))
        if self.bidirectional:
            return dict(zip(self.directions, outcomes, strict=False))
        return outcomes[0]

    def protocol_report(self) -> dict[str, int] | dict[str, dict[str, int]]:
        """Counts that reveal a leaky or repeated protocol, per direction: ``"queries"``
        (counted); ``"identical_positive"`` / ``"identical_negative"``: queries with a
        non-ignored gallery item bitwise equal to them, another sample, of their label (a
        guaranteed hit) / of another; ``"rounding_positive"`` / ``"rounding_negative"``: the
        same up to float rounding (every coordinate within ``2^-10`` of the larger row's largest
        absolute coordinate); with ``near_duplicate``, ``"near_positive"`` / ``"near_negative"``
        (an item scored at or above it, or a copy) and ``"near_hits_at_1"``;
        ``"duplicate_gallery_items"`` / ``"rounding_duplicate_gallery_items"`` (gallery items
        equal to an earlier one, bitwise / up to rounding). From the last ``compute()``, else
        computed now (collective under DDP)."""
        if _audit.stale_anywhere(self, self._life.report is None):
            self._synced(lambda: self._run("protocol_report"))
        reports = [dict(r) for r in (self._life.report or ([], False))[0]]
        return (
            dict(zip(self.directions, reports, strict=False)) if self.bidirectional else reports[0]
        )

    def reset(self) -> None:
        """Reset the state (and the views); forget the protocol report."""
        super().reset()
        self._life.report = None

    def merge_state(self, incoming_state: Any) -> None:
        """torchmetrics' ``merge_state``; forget the protocol report."""
        super().merge_state(incoming_state)
        self._life.report = None

    def _run(self, purpose: Purpose) -> list[Any]:
        """Plan, audit and rank the stored items for ``purpose``: ``compute()`` (histograms, report,
        warning), ``query_outcomes()`` (one per direction) or ``protocol_report()`` (kept)."""
        synced = self._life.synced
        count = len(self._prefixes)
        group = None if synced is None else Processes(synced.group)
        rows, meta = _items.stored_rows(
            self.embedding_values, self.embedding_meta, synced and synced.local, group, self.device
        )
        items = _items.items_of(meta)
        sides = [self._side(entry) for entry in plan.directions(items, count)]
        _items.check_groups(meta, self.exclude)
        sharded = self.sharded and isinstance(rows, BroadcastRows)
        planned = plan.make_plan(rows, items, sides, self.exclude, self.chunk_bytes, sharded)
        del items
        if purpose != "query_outcomes":  # nothing else reads every item's metadata: not kept
            del meta, sides
        options, audits = _audit.options_of(self), None
        if purpose != "query_outcomes" and not self._in_forward:
            audits = lifecycle.audits_for(self._life, options, planned, sharded, group)
        plan.prepare(planned, self.similarity)
        ranked: list[engine.Ranked | None] = [None] * count
        if purpose != "protocol_report" or self.near_duplicate is not None:
            near = self.near_duplicate if audits is not None else None
            basics = self.similarity, self.exclude, self.ties, self.max_k, self.validate_args
            progress = self.progress and purpose == "compute"
            caller = f"EmbeddingRecallAtK.{purpose}()"
            rank_options = engine.RankOptions(*basics, near, progress, caller=caller)
            known = None if audits is None or near is None else [a and a.known() for a in audits]
            outcomes = purpose == "query_outcomes"
            ranked = engine.rank(planned, rank_options, group, sharded, known, outcomes)
        if purpose == "query_outcomes":
            single = self.single_k and not self.bidirectional
            return [
                embedding_outcomes(
                    meta,
                    index,
                    None if sides[index] is None else sides[index][0],  # type: ignore[index]
                    None if r is None else r.records,
                    self.ks,
                    self.max_k,
                    self.empty_target_action,
                    None if single else [self._prefixes[index] + key for key in self.keys],
                )
                for index, r in enumerate(ranked)
            ]
        if purpose == "compute":
            if planned.rows.shape[0] == 0:  # nothing added on any process: NaN, a warning
                zeros = torch.zeros(max(self.max_k, 4), dtype=torch.int64)
                empty = engine.Ranked(zeros[: self.max_k], zeros[:2], zeros[:4], 0, 0, None)
                ranked = [empty] * count
            names = self.directions[:count]
            pairs = list(zip(names, ranked, strict=True))
            self.last_compute_num_queries_ranked = {n: r.ranked if r else 0 for n, r in pairs}
            self.last_compute_rescored = {n: r.rescored if r else 0 for n, r in pairs}
        if not self._in_forward:
            lifecycle.keep_report(
                self._life, options, audits, ranked, planned.directions, group is not None
            )
        return ranked

    def _side(self, entry: plan.Direction | tuple[int, str] | None) -> plan.Direction | None:
        """A direction's sides; a side without items raises (None in ``forward``)."""
        if isinstance(entry, tuple) and isinstance(entry[1], str):
            if not self._in_forward:
                raise ValueError(_items.missing_side(self.directions[entry[0]], *entry))
            return None
        return entry

    def _set_states(self, values: list[Tensor], meta: list[Tensor]) -> None:
        setattr(self, "embedding_values", values)  # noqa: B010 - a registered state
        setattr(self, "embedding_meta", meta)  # noqa: B010
