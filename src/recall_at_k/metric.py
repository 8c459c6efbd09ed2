"""``RetrievalRecallAtK``: its states, and the wiring of each input form to the kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, SupportsIndex, cast, overload

import torch
from torch import Tensor

from recall_at_k import _dense, _flat, _kernel
from recall_at_k._base import Histogram, RecallAtKMetric
from recall_at_k._checks import check_optional_int
from recall_at_k._outcomes import QueryOutcomes, from_records
from recall_at_k._sync import ListLayout
from recall_at_k._types import EmptyTargetAction, OutputT, Ties
from recall_at_k.ranking import budget

__all__ = ["RetrievalRecallAtK"]


class RetrievalRecallAtK(RecallAtKMetric[OutputT]):
    r"""Recall@K for several K at once, exact, in constant memory.

    The share of queries with a true match in their top K: torchmetrics'
    ``RetrievalHitRate(top_k=k)`` on data without tied scores, not ``RetrievalRecall``
    (the fraction of a query's positives retrieved). Ties follow ``ties``, never sort
    order; negative and zero scores rank like any other.

    ``update`` has torchmetrics' retrieval signature (positional or keyword, alone or in a
    ``MetricCollection``) and takes two input forms:

    - dense (``indexes=None``): ``[Q, G]`` scores of complete queries. The state, a histogram
      of first-hit ranks 1..max K and two int64 query counts, does not grow with Q or G
      (O(Q) with ``query_ids``).
    - flat (``indexes`` given): (query, item) pairs, a query's items over any calls and
      processes. Each query keeps its best valid positive and top max K valid negatives
      (and a count of negatives tied at the boundary): O(queries x max K), never O(items).

    Args:
        k: an int (``compute`` returns a scalar tensor, so ``self.log("val/r1", metric)``
            works in Lightning) or a sequence of distinct ints (a dict keyed by ``key``).
        ties: ``"pessimistic"`` (default: ties count against the query), ``"optimistic"``
            or ``"expected"`` (exact expectation over a random order).
        empty_target_action: a query without a valid positive counts as a miss (``"neg"``),
            a hit (``"pos"``), not at all (``"skip"``) or raises at ``compute`` (``"error"``).
        ignore_index: flat form: items whose target equals it are dropped.
        validate_args: check input values (NaN, target range), reading them on the host;
            with ``False`` the dense update never synchronises with the device.
        key: template of the result's keys, ``"recall@{k}"`` by default (for example
            ``"recall_at_{k}"`` for loggers that reject ``@``, or ``"R{k:02d}"``).
        complete_queries: flat form: every update holds all the items of each query id it
            contains, so a query id that comes again (DistributedSampler padding, on any
            process) is a repeat and counts once.
        metric_kwargs: torchmetrics' own (``sync_on_compute``, ``process_group``, ...).

    Example:
        >>> import torch
        >>> from recall_at_k import RetrievalRecallAtK
        >>> metric = RetrievalRecallAtK(k=(1, 5))
        >>> scores = torch.tensor([[0.1, 0.9, 0.3], [0.8, 0.7, -0.2]])
        >>> metric.update(scores, torch.tensor([1, 2]))
        >>> metric.compute()
        {'recall@1': tensor(0.5000), 'recall@5': tensor(1.)}

        The flat form, as torchmetrics' ``RetrievalHitRate`` takes it:

        >>> metric = RetrievalRecallAtK(k=1)
        >>> metric(torch.tensor([0.9, 0.4, 0.7, 0.8]), torch.tensor([0, 1, 1, 0]),
        ...        torch.tensor([0, 0, 1, 1]))
        tensor(0.)
    """

    __jit_unused_properties__: ClassVar[list[str]] = [
        *RecallAtKMetric.__jit_unused_properties__,
        "rank_histogram",
        "query_counts",
    ]

    # Private switches for tests; every value gives the same counts.
    _dense_block_bytes: int = budget.DENSE_BLOCK_BYTES
    _dense_small_batch: int = budget.DENSE_SMALL_BATCH
    _flat_path: _flat.SegmentPath = "auto"
    _flat_slack: int | None = None  # None: _flat.compact_slack(max_k)

    @overload
    def __init__(
        self: RetrievalRecallAtK[Tensor],
        k: SupportsIndex,
        *,
        ties: Ties = "pessimistic",
        empty_target_action: EmptyTargetAction = "neg",
        ignore_index: int | None = None,
        validate_args: bool = True,
        key: str = "recall@{k}",
        complete_queries: bool = False,
        **metric_kwargs: Any,
    ) -> None: ...

    @overload
    def __init__(
        self: RetrievalRecallAtK[dict[str, Tensor]],
        k: Sequence[SupportsIndex] = (1, 5, 10),
        *,
        ties: Ties = "pessimistic",
        empty_target_action: EmptyTargetAction = "neg",
        ignore_index: int | None = None,
        validate_args: bool = True,
        key: str = "recall@{k}",
        complete_queries: bool = False,
        **metric_kwargs: Any,
    ) -> None: ...

    def __init__(
        self,
        k: SupportsIndex | Sequence[SupportsIndex] = (1, 5, 10),
        *,
        ties: Ties = "pessimistic",
        empty_target_action: EmptyTargetAction = "neg",
        ignore_index: int | None = None,
        validate_args: bool = True,
        key: str = "recall@{k}",
        complete_queries: bool = False,
        **metric_kwargs: Any,
    ) -> None:
        super().__init__(
            k,
            ties=ties,
            empty_target_action=empty_target_action,
            key=key,
            validate_args=validate_args,
            **metric_kwargs,
        )
        self.ignore_index = check_optional_int("ignore_index", ignore_index)
        self.complete_queries = bool(complete_queries)
        # State names carry update()'s settings: no shared compute group across them.
        tag = f"{ties}_k{self.max_k}"
        if self.ignore_index is not None:
            tag += f"_ignore{self.ignore_index}".replace("-", "m")
        if self.complete_queries:
            tag += "_complete"
        self._needed_counts = _kernel.needed_counts(self.ties)
        expected = ties == "expected"
        self._hist_name, self._queries_name = f"rank_hist_{tag}", f"query_count_{tag}"
        hist = torch.zeros(self.max_k, dtype=torch.float64 if expected else torch.int64)
        self._add_count_state(self._hist_name, hist)
        self._add_count_state(self._queries_name, torch.zeros(2, dtype=torch.int64))
        # Flat form: blocks of per-query partial rows (recall_at_k._flat), merged by id.
        self._flat_name = f"flat_partials_{tag}"
        rows = ListLayout((_flat.ROW_PREFIX + self.max_k,), torch.int64)
        self._add_list_state(self._flat_name, rows)
        # Dense form with query_ids: one outcome record a query, de-duplicated by id.
        self._ids_name, self._outcomes_name = f"query_ids_{tag}", f"query_outcomes_{tag}"
        self._add_list_state(self._ids_name, ListLayout((), torch.int64))
        record = ((self.max_k + 1,), torch.float64) if expected else ((), torch.int64)
        self._add_list_state(self._outcomes_name, ListLayout(*record))

    @property
    def rank_histogram(self) -> Tensor:
        """``[max K]``: (expected) number of dense queries whose first hit is at rank r."""
        return cast(Tensor, getattr(self, self._hist_name))

    @property
    def query_counts(self) -> Tensor:
        """int64 ``[2]``: dense queries with a valid positive, queries without."""
        return cast(Tensor, getattr(self, self._queries_name))

    def update(
        self,
        preds: Tensor,
        target: Tensor,
        indexes: Tensor | None = None,
        *,
        ignore: Tensor | None = None,
        query_ids: Tensor | None = None,
    ) -> None:
        """Add a batch: complete queries (dense form) or (query, item) pairs (flat form).

        Args:
            preds: dense: float ``[Q, G]`` scores, one row per query (higher = more similar).
                Flat: float ``[N]`` score of each item.
            target: dense: bool / 0-1 integer or float ``[Q, G]`` mask, or integer ``[Q]``
                true column (``-1``: no true item in this gallery). Flat: bool / 0-1 integer or
                float ``[N]`` relevance; items whose target equals ``ignore_index`` are dropped.
            indexes: flat form: integer ``[N]`` query id of each item (any int64 value). Ids
                are global: the same id in another call or process is the same query, and
                independent of dense rows.
            ignore: dense only: optional bool ``[Q, G]``: items neither positive nor negative
                (the query's own column, same-instance items, ...).
            query_ids: dense only: optional integer ``[Q]`` id of each query row: an id seen
                again (DistributedSampler's padded repeats, on any process) counts once, with
                its first row's outcome (an id's rows must be the same query). O(Q) state.

        Example:
            Query 0's items arrive over two calls:

            >>> import torch
            >>> from recall_at_k import RetrievalRecallAtK
            >>> metric = RetrievalRecallAtK(k=(1, 2))
            >>> metric.update(torch.tensor([0.9, 0.4, 0.7]), torch.tensor([0, 1, 1]),
            ...               torch.tensor([0, 0, 1]))
            >>> metric.update(torch.tensor([0.8, 0.1]), torch.tensor([1, 0]),
            ...               torch.tensor([0, 1]))
            >>> metric.compute()
            {'recall@1': tensor(0.5000), 'recall@2': tensor(1.)}
        """
        self._touch_views()
        if indexes is not None:
            if query_ids is not None:
                raise ValueError(
                    "`query_ids` is for the dense form; in the flat form `indexes` already"
                    " are the query ids (for padded repeats pass complete_queries=True)"
                )
            rows = _flat.flat_partials(
                preds,
                target,
                indexes,
                ignore,
                max_k=self.max_k,
                ignore_index=self.ignore_index,
                validate_args=self.validate_args,
                path=self._flat_path,
            )
            if rows is not None:
                getattr(self, self._flat_name).append(rows)
                self._compact_flat()
            return
        if isinstance(preds, Tensor) and preds.dim() == 1:
            raise ValueError(
                f"`preds` of shape {list(preds.shape)} is the flat form: pass the query ids"
                " too, `update(preds, target, indexes)` (the dense form takes [Q, G] scores)"
            )
        counts = _dense.tie_counts(
            preds,
            target,
            ignore,
            self._needed_counts,
            self.validate_args,
            self._workspace,
            self._dense_block_bytes,
            self._dense_small_batch,
        )
        if query_ids is None:
            hist, queries = _kernel.rank_histogram(counts, self.ties, self.max_k)
            # Out of place (usable after inference_mode); plain attributes, as torchmetrics'.
            object.__setattr__(self, self._hist_name, self.rank_histogram + hist)
            object.__setattr__(self, self._queries_name, self.query_counts + queries)
            return
        outcomes = _kernel.query_outcomes(counts, self.ties, self.max_k)
        _dense.check_query_ids(query_ids, preds)
        getattr(self, self._ids_name).append(query_ids.to(torch.int64, copy=True))
        getattr(self, self._outcomes_name).append(outcomes)

    def _compact_flat(self) -> None:
        state = getattr(self, self._flat_name)
        if not isinstance(state, list) or not state:
            return
        # The row count, carried over (by ids) while the list only grew by one block
        # (torchmetrics replaces it on sync, forward, moves); a wrong one only moves a merge.
        known: Any = self.__dict__.get("_flat_rows")
        grown = known is not None and known[:2] == (id(state), len(state) - 1)
        grown = grown and known[3] == id(state[-2])
        rows = known[2] + state[-1].shape[0] if grown else sum(b.shape[0] for b in state)
        compacted = _flat.compact(
            state, self.max_k, self.complete_queries, self._flat_path, self._flat_slack, rows
        )
        if compacted is not state:
            # A plain attribute, as torchmetrics keeps list states (skips Module's checks).
            object.__setattr__(self, self._flat_name, compacted)
            rows = sum(block.shape[0] for block in compacted)
        if compacted:
            known = (id(compacted), len(compacted), rows, id(compacted[-1]))
            object.__setattr__(self, "_flat_rows", known)

    def _after_forward(self) -> None:
        # forward concatenates a fresh state onto the accumulated one: compact it here.
        self._compact_flat()

    def _flat_counts(self) -> tuple[Tensor, _kernel.TieCounts] | None:
        state = getattr(self, self._flat_name)
        return _flat.flat_tie_counts(state, self.max_k, self.complete_queries, path=self._flat_path)

    def _histograms(self) -> list[Histogram]:
        hist, queries = self.rank_histogram, self.query_counts
        flat, dense = self._flat_counts(), self._dense_records()
        for more in (
            None if flat is None else _kernel.rank_histogram(flat[1], self.ties, self.max_k),
            None if dense is None else _kernel.histogram_of(dense[1], self.max_k),
        ):
            if more is not None:
                hist, queries = hist + more[0], queries + more[1]
        return [(hist, queries)]

    def query_outcomes(self) -> QueryOutcomes:
        """Each counted query's hit@K and first-hit rank, synchronised as ``compute()``.

        The ids are the flat form's ``indexes`` or the dense form's ``query_ids`` (a repeated
        id counts once), ascending; ``hits.mean(0)`` is ``compute()``'s Recall@K. Dense rows
        added without ``query_ids`` keep no per-query record: this then raises a ``ValueError``.
        See :class:`recall_at_k.QueryOutcomes`.

        Example:
            >>> import torch
            >>> from recall_at_k import RetrievalRecallAtK
            >>> metric = RetrievalRecallAtK(k=(1, 2))
            >>> scores = torch.tensor([[0.1, 0.9, 0.3], [0.8, 0.7, -0.2]])
            >>> metric.update(scores, torch.tensor([1, 2]), query_ids=torch.tensor([7, 3]))
            >>> outcomes = metric.query_outcomes()
            >>> outcomes.ids, outcomes.first_hit_rank
            (tensor([3, 7]), tensor([3, 1]))
            >>> outcomes.hits
            tensor([[0., 0.],
                    [1., 1.]], dtype=torch.float64)
        """
        return cast(QueryOutcomes, self._synced(self._query_outcomes))

    def _query_outcomes(self) -> QueryOutcomes:
        without_ids = int(self.query_counts.sum())
        if without_ids:
            raise ValueError(
                f"`query_ids`: query_outcomes() needs the id of every dense query row, but"
                f" {without_ids} row(s) were added without `query_ids` (their state is a"
                " rank histogram, not one record per query); pass"
                " `update(scores, target, query_ids=ids)`"
            )
        flat, dense = self._flat_counts(), self._dense_records()
        if flat is not None and dense is not None:
            raise ValueError(
                "query_outcomes(): this metric holds dense rows (ids from `query_ids`) and"
                " flat items (ids from `indexes`), which are independent ids; give each"
                " input form a metric of its own"
            )
        if flat is not None:
            ids, records = flat[0], _kernel.query_outcomes(flat[1], self.ties, self.max_k)
        elif dense is not None:
            ids, records = dense
        else:
            ids = torch.zeros(0, dtype=torch.int64, device=self.query_counts.device)
            records = ids.clone()
            if self.ties == "expected":
                records = torch.zeros(0, self.max_k + 1, dtype=torch.float64, device=ids.device)
        keys = None if self.single_k else self.output_keys
        return from_records(ids, records, self.ks, self.max_k, self.empty_target_action, keys)

    def _dense_records(self) -> tuple[Tensor, Tensor] | None:
        """Dense updates' ``query_ids`` and outcomes, sorted by id, each id once (None: none)."""
        ids, outcomes = getattr(self, self._ids_name), getattr(self, self._outcomes_name)
        if isinstance(ids, list):  # not synchronised: still this process's list of blocks
            if not ids:
                return None
            ids, outcomes = torch.cat(ids), torch.cat(outcomes)
        if ids.numel() == 0:
            return None
        keep = _kernel.first_of_each_id(ids)
        return ids[keep], outcomes[keep]
