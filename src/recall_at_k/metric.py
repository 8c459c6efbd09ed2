"""``RetrievalRecallAtK``: states and update/compute wiring around the kernel."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from recall_at_k import _flat, _kernel
from recall_at_k._plot import plot_curves, values_of
from recall_at_k._result import RecallOutput, recall_result
from recall_at_k._validation import (
    _checked_dense_tie_counts,
    _dense_structure_validation,
    _dense_values_validation,
    _empty_target_action_validation,
    _k_validation,
    _key_validation,
    _query_ids_validation,
    _ties_validation,
)
from recall_at_k._views import PerKViews

__all__ = ["RetrievalRecallAtK"]


def state_tag(ties: str, max_k: int, ignore_index: int | None = None) -> str:
    """A suffix that makes state names unique per update-affecting configuration.

    torchmetrics' ``MetricCollection`` merges metrics into one compute group when their
    state names and values coincide after the first update; two instances whose updates
    differ (another tie policy, another largest K, another ``ignore_index``) must never
    share state, so those settings are part of every state name. Settings that only
    change ``compute`` (the K set below the largest K, ``empty_target_action``, ``key``)
    may share: each instance then computes its own result from the same state.
    """
    tag = f"{ties}_k{max_k}"
    if ignore_index is not None:
        tag += f"_ignore{ignore_index}".replace("-", "m")
    return tag


class RetrievalRecallAtK(PerKViews, Metric):
    r"""Recall@K for several K at once, exact, in constant memory.

    Recall@K is the share of queries whose best valid positive is ranked within the top
    K of that query's valid items; ties follow ``ties`` (DESIGN section 1), never sort
    order. Scores are ordinary numbers: negative and zero scores rank like any other.

    Dense form: ``update(scores, target, ignore=None)`` with ``scores`` float ``[Q, G]``
    (one row per complete query), ``target`` either a bool / 0-1 integer ``[Q, G]`` mask
    or an int64 ``[Q]`` column of the single true item (-1: none), and an optional bool
    ``[Q, G]`` ``ignore`` mask. The state is a histogram of first-hit ranks 1..max K plus
    two query counts (int64, exact far past 2**31 queries), summed across processes:
    its size does not depend on Q or G.

    Flat form (torchmetrics' retrieval convention, so the metric joins a
    ``MetricCollection`` of torchmetrics retrieval metrics unchanged):
    ``update(preds, target, indexes=indexes)`` with 1-D ``preds`` (float), ``target``
    (bool / 0-1 integer) and ``indexes`` (int64 query ids) of equal length. A query's
    items may arrive over several calls and several processes; ids are global (the same
    id on another process is the same query). Each query keeps only its best valid
    positive and its top max K valid negatives (plus a count of negatives tied at the
    boundary), so this state is O(queries x max K), never O(items). Both forms may feed
    one instance and count into one result.

    Args:
        k: an int (``compute`` returns a scalar tensor, so ``self.log("val/r1", metric)``
            works in Lightning) or a sequence of distinct ints (a dict keyed by ``key``).
        ties: ``"pessimistic"`` (default: ties count against the query),
            ``"optimistic"`` or ``"expected"`` (exact expectation over a random order).
        empty_target_action: a query without a valid positive counts as a miss
            (``"neg"``), a hit (``"pos"``), not at all (``"skip"``) or raises at
            ``compute`` (``"error"``).
        ignore_index: flat form only: items whose target equals it are dropped.
        validate_args: check input values (NaN, target range). Those checks read values on
            the host; with ``False`` the dense update never synchronises with the device.
        key: template of the result's keys, ``"recall@{k}"`` by default (for example
            ``"recall_at_{k}"`` for loggers that reject ``@``).
        metric_kwargs: torchmetrics' own (``sync_on_compute``, ``process_group``, ...).

    Example:
        >>> import torch
        >>> from recall_at_k import RetrievalRecallAtK
        >>> metric = RetrievalRecallAtK(k=(1, 5))
        >>> scores = torch.tensor([[0.1, 0.9, 0.3], [0.8, 0.7, -0.2]])
        >>> metric.update(scores, torch.tensor([1, 2]))
        >>> metric.compute()
        {'recall@1': tensor(0.5000), 'recall@5': tensor(1.)}
    """

    is_differentiable: bool = False
    higher_is_better: bool = True
    full_state_update: bool = False
    plot_lower_bound: float = 0.0
    plot_upper_bound: float = 1.0

    def __init__(
        self,
        k: int | Sequence[int] = (1, 5, 10),
        *,
        ties: str = "pessimistic",
        empty_target_action: str = "neg",
        ignore_index: int | None = None,
        validate_args: bool = True,
        key: str = "recall@{k}",
        **metric_kwargs: Any,
    ) -> None:
        # Flat form: a process without flat data must still join the gather of the flat
        # state (torchmetrics' own stand-in for an empty list state aborts it).
        metric_kwargs.setdefault("dist_sync_fn", _flat.gather_tolerating_empty)
        super().__init__(**metric_kwargs)
        self.ks = _k_validation(k)
        _ties_validation(ties)
        _empty_target_action_validation(empty_target_action)
        _key_validation(key)
        if ignore_index is not None and (
            isinstance(ignore_index, bool) or not isinstance(ignore_index, int)
        ):
            raise ValueError(f"`ignore_index` must be an int or None, got {ignore_index!r}")
        self.single_k = isinstance(k, int)
        self.ties = ties
        self.empty_target_action = empty_target_action
        self.ignore_index = ignore_index
        self.validate_args = validate_args
        self.key = key
        self.max_k = max(self.ks)
        tag = state_tag(ties, self.max_k, ignore_index)
        self._hist_name = f"rank_hist_{tag}"
        self._queries_name = f"query_count_{tag}"
        hist_dtype = torch.float64 if ties == "expected" else torch.int64
        self.add_state(
            self._hist_name, torch.zeros(self.max_k, dtype=hist_dtype), dist_reduce_fx="sum"
        )
        self.add_state(self._queries_name, torch.zeros(2, dtype=torch.int64), dist_reduce_fx="sum")
        # Flat form: blocks of per-query partial rows (int64 [rows, 5 + max K], see
        # recall_at_k._flat), concatenated across processes and merged by query id.
        self._flat_name = f"flat_partials_{tag}"
        self.add_state(self._flat_name, [], dist_reduce_fx="cat")
        # Dense form with query_ids: one outcome record a query (O(Q)), de-duplicated by
        # id at compute, so DistributedSampler's padded repeats count once.
        self._ids_name = f"query_ids_{tag}"
        self._outcomes_name = f"query_outcomes_{tag}"
        self.add_state(self._ids_name, [], dist_reduce_fx="cat")
        self.add_state(self._outcomes_name, [], dist_reduce_fx="cat")
        self._workspace = _kernel.Workspace()
        self._init_views([key.format(k=k) for k in self.ks])

    def __getstate__(self) -> dict[str, Any]:
        # Scratch buffers are not state: never pickle or deep-copy them.
        state: dict[str, Any] = super().__getstate__()
        state["_workspace"] = _kernel.Workspace()
        return state

    @property
    def rank_histogram(self) -> Tensor:
        """``[max K]``: (expected) number of queries whose first hit is at rank r."""
        hist: Tensor = getattr(self, self._hist_name)
        return hist

    @property
    def query_counts(self) -> Tensor:
        """int64 ``[2]``: queries with a valid positive, queries without."""
        queries: Tensor = getattr(self, self._queries_name)
        return queries

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """torchmetrics' ``forward`` (the batch value), then compact the flat state.

        ``forward`` updates a fresh state and concatenates it onto the accumulated one,
        so the compaction in ``update`` never sees the whole flat state; do it here.
        """
        value = super().forward(*args, **kwargs)
        state = getattr(self, self._flat_name)
        if isinstance(state, list):
            setattr(self, self._flat_name, _flat.compact(state, self.max_k))
        return value

    def update(
        self,
        preds: Tensor,
        target: Tensor,
        ignore: Tensor | None = None,
        *,
        indexes: Tensor | None = None,
        query_ids: Tensor | None = None,
    ) -> None:
        """Add a batch: complete queries (dense form) or (query, item) pairs (flat form).

        Args:
            preds: dense: float ``[Q, G]`` scores, one row per query (higher = more
                similar). Flat: float ``[N]`` score of each item.
            target: dense: bool / 0-1 integer ``[Q, G]`` mask, or int64 ``[Q]`` true column
                (``-1``: no true item in this gallery). Flat: bool / 0-1 integer ``[N]``
                relevance of each item; items whose target equals ``ignore_index`` are
                dropped first (a query all of whose items are dropped does not count).
            ignore: dense only: optional bool ``[Q, G]``: items neither positive nor
                negative.
            indexes: flat form: int64 ``[N]`` query id of each item (torchmetrics'
                retrieval convention). A query's items may arrive over several calls and
                several processes: ids are global, the same id in another call or on
                another process is the same query. Flat ids are independent of dense
                rows, which are always complete queries of their own.
            query_ids: dense form, optional int64 ``[Q]`` id of each query row: a query id
                seen again (DistributedSampler pads the last batch with repeats, on this
                or another process) counts once, with the outcome of its first row.
                Costs O(Q) state (one small record a query) instead of O(max K); the
                rows of one id must be the same query.

        Example:
            Query 0's items arrive over two calls:

            >>> import torch
            >>> from recall_at_k import RetrievalRecallAtK
            >>> metric = RetrievalRecallAtK(k=(1, 2))
            >>> metric.update(torch.tensor([0.9, 0.4, 0.7]), torch.tensor([0, 1, 1]),
            ...               indexes=torch.tensor([0, 0, 1]))
            >>> metric.update(torch.tensor([0.8, 0.1]), torch.tensor([1, 0]),
            ...               indexes=torch.tensor([0, 1]))
            >>> metric.compute()
            {'recall@1': tensor(0.5000), 'recall@2': tensor(1.)}
        """
        self._touch_views()
        if indexes is not None:
            if query_ids is not None:
                raise ValueError(
                    "`query_ids` is for the dense form; in the flat form `indexes` already"
                    " are the query ids"
                )
            rows = _flat.flat_partials(
                preds,
                target,
                indexes,
                ignore,
                max_k=self.max_k,
                ignore_index=self.ignore_index,
                validate_args=self.validate_args,
            )
            if rows is not None:
                state: list[Tensor] = getattr(self, self._flat_name)
                state.append(rows)
                setattr(self, self._flat_name, _flat.compact(state, self.max_k))
            return
        if isinstance(preds, Tensor) and preds.dim() == 1:
            raise ValueError(
                f"`preds` of shape {list(preds.shape)} is the flat form: pass the query ids"
                " as a keyword, `update(preds, target, indexes=indexes)` (the dense form"
                " takes [Q, G] scores)"
            )
        _dense_structure_validation(preds, target, ignore)
        if preds.shape[0] == 0:
            if self.validate_args:
                _dense_values_validation(preds, target)
            return
        if query_ids is not None:
            _query_ids_validation(query_ids, preds)
        counts = _checked_dense_tie_counts(
            preds,
            target,
            ignore,
            _kernel.needs_for(self.ties),
            self.validate_args,
            self._workspace,
        )
        outcomes = _kernel.query_outcomes(counts, self.ties, self.max_k)
        if query_ids is None:
            hist, queries = _kernel.histogram_of(outcomes, self.max_k)
            self.rank_histogram.add_(hist)
            self.query_counts.add_(queries)
        else:
            getattr(self, self._ids_name).append(query_ids.to(torch.int64))
            getattr(self, self._outcomes_name).append(outcomes)

    def _deduplicated_histogram(self) -> tuple[Tensor, Tensor] | None:
        """Histogram of the outcomes recorded with query_ids, each id counted once."""
        ids, outcomes = getattr(self, self._ids_name), getattr(self, self._outcomes_name)
        if isinstance(ids, list):  # not synchronised: still this process's list of blocks
            if not ids:
                return None
            ids, outcomes = torch.cat(ids), torch.cat(outcomes)
        if ids.numel() == 0:
            return None
        keep = _kernel.first_of_each_id(ids)
        return _kernel.histogram_of(outcomes[keep], self.max_k)

    def compute(self) -> RecallOutput:
        """Recall@K over everything seen (synchronised across processes)."""
        hist, queries = self.rank_histogram, self.query_counts
        flat = _flat.flat_rank_histogram(getattr(self, self._flat_name), self.ties, self.max_k)
        if flat is not None:
            hist, queries = hist + flat[0], queries + flat[1]
        deduplicated = self._deduplicated_histogram()
        if deduplicated is not None:
            hist, queries = hist + deduplicated[0], queries + deduplicated[1]
        return recall_result(
            hist,
            queries,
            self.ks,
            self.single_k,
            self.key,
            self.empty_target_action,
        )

    def plot(
        self, val: RecallOutput | Sequence[RecallOutput] | None = None, ax: Any | None = None
    ) -> tuple[Any, Any]:
        """Draw Recall@K against K (a CMC curve).

        Args:
            val: a result of :meth:`compute` (default: compute now), or a list of them
                (for instance one per epoch; one curve each).
            ax: a matplotlib axis to draw on; a new figure when ``None``.

        Returns:
            ``(fig, ax)``.

        Example:
            >>> import torch
            >>> from recall_at_k import RetrievalRecallAtK
            >>> metric = RetrievalRecallAtK(k=(1, 2, 3))
            >>> metric.update(torch.tensor([[0.2, 0.9, 0.1]]), torch.tensor([0]))
            >>> fig, ax = metric.plot()
        """
        val = val if val is not None else self.compute()
        keys = [self.key.format(k=k) for k in self.ks]
        results = [val] if isinstance(val, (Tensor, dict)) else list(val)
        curves = [{"": (self.ks, values_of(result, keys))} for result in results]
        return plot_curves(curves[0] if len(curves) == 1 else curves, ax, type(self).__name__)
