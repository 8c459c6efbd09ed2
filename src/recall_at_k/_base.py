"""The base of both metrics: options, output keys, per-K views, states that casts never
round, the sync rule for list states, scratch memory, results, intervals and plots.

A subclass declares its states with :meth:`RecallAtKMetric._add_count_state` and
:meth:`RecallAtKMetric._add_list_state`, implements ``update`` (calling
:meth:`RecallAtKMetric._touch_views` first) and :meth:`RecallAtKMetric._histograms`
(the synchronised rank histogram of each output prefix); the base turns those into
``compute()``, ``confidence_interval()`` and ``plot()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, cast

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from recall_at_k import _collectives, _plot
from recall_at_k._checks import (
    check_choice,
    check_k,
    check_key,
    check_level,
    check_torchmetrics_names,
)
from recall_at_k._kernel import Workspace
from recall_at_k._misuse import HigherIsBetter, check_lightning_log, check_wrapper_caller
from recall_at_k._result import format_output, recall_values, wilson_interval
from recall_at_k._sync import (
    ListLayout,
    agree_float_dtypes,
    empty_filled_list_states,
    fill_empty_list_states,
)
from recall_at_k._types import EMPTY_TARGET_ACTIONS, TIES, OutputT
from recall_at_k._views import RecallMetric, RecallView

Histogram = tuple[Tensor, Tensor] | None
"""``(hist [max K], queries [2])`` of one output prefix, or None where nothing could be
ranked (a batch value of ``forward`` without queries or gallery): NaN, no warning."""


_WRITTEN_EVERY_UPDATE = frozenset({"_computed", "_update_count"})
"""Plain attributes (never parameters, buffers or modules) of torchmetrics' ``Metric``
that its ``update`` wrapper writes at every call."""


def _forget_computed(metric: Metric) -> None:
    # torchmetrics' compute cache; setting it is harmless if it is ever renamed.
    if hasattr(metric, "_computed"):
        object.__setattr__(metric, "_computed", None)


class RecallAtKMetric(RecallMetric, Generic[OutputT]):
    """Recall@K for several K at once (base class; use a subclass)."""

    __jit_unused_properties__: ClassVar[list[str]] = [
        *Metric.__jit_unused_properties__,
        "output_keys",
        "_view_list",
        "_returns_dict",
        "_forward_cache",
    ]

    # True, as a class attribute; read on an instance by ``MetricTracker`` when it is
    # built, it raises where the tracker cannot take this metric's output.
    higher_is_better = HigherIsBetter()
    # Whether the rows of an update are samples that also make up the gallery.
    _items_are_samples: ClassVar[bool] = False

    def __init__(
        self,
        k: Any,
        *,
        ties: str,
        empty_target_action: str,
        key: str,
        validate_args: bool,
        prefixes: Sequence[str] = ("",),
        **metric_kwargs: Any,
    ) -> None:
        check_torchmetrics_names(metric_kwargs)
        super().__init__(**metric_kwargs)
        self.ks, self.single_k = check_k(k)
        self.max_k = max(self.ks)
        check_choice("ties", ties, TIES)
        check_choice("empty_target_action", empty_target_action, EMPTY_TARGET_ACTIONS)
        self.keys = check_key(key, self.ks)
        self.ties = ties
        self.empty_target_action = empty_target_action
        self.key = key
        self.validate_args = validate_args
        self._prefixes = tuple(prefixes)
        self._exact_states: list[str] = []
        self._list_layouts: dict[str, ListLayout] = {}
        self._filled_for_sync: list[str] = []
        self._workspace = Workspace()
        self._in_forward = False
        views = [RecallView(self, name) for name in self.output_keys]
        # Submodules, so that Lightning and module casts find them.
        self.views = torch.nn.ModuleList(views)
        self.__dict__["_view_list"] = views
        object.__setattr__(self, "_views_need_touch", True)

    def __setattr__(self, name: str, value: Any) -> None:
        """``Module.__setattr__``, except for the plain attributes that torchmetrics'
        ``update`` wrapper writes at every call (``_computed``, ``_update_count``):
        through ``Module.__setattr__`` those two writes cost about half of
        torchmetrics' own small update."""
        if name in _WRITTEN_EVERY_UPDATE:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def output_keys(self) -> list[str]:
        """The keys of ``compute()``'s dict, in order (one per K and direction)."""
        return [prefix + key for prefix in self._prefixes for key in self.keys]

    @property
    def _returns_dict(self) -> bool:
        """Whether ``compute()`` returns a dict (several K or directions), not one tensor."""
        return not (self.__dict__.get("single_k", True) and self.__dict__.get("_prefixes") == ("",))

    @property
    def _forward_cache(self) -> Any:
        """torchmetrics' batch value of ``forward``; Lightning's ``self.log`` reads it
        when called, which raises for a metric whose ``compute()`` is a dict (see
        :mod:`recall_at_k._misuse`)."""
        if self._returns_dict:
            check_lightning_log(type(self).__name__, self.output_keys)
        return self.__dict__.get("_forward_cache")

    @_forward_cache.setter
    def _forward_cache(self, value: Any) -> None:
        self.__dict__["_forward_cache"] = value

    # ------------------------------------------------------------------ states

    def _add_count_state(self, name: str, default: Tensor) -> None:
        """A ``"sum"`` state of counts: its dtype never changes (see :meth:`_apply`)."""
        self.add_state(name, default, dist_reduce_fx="sum")
        self._exact_states.append(name)

    def _add_list_state(self, name: str, layout: ListLayout) -> None:
        """A ``"cat"`` list state of blocks of ``layout``: its blocks keep their dtypes
        under casts (see :meth:`_apply`; float embeddings are never rounded to half)."""
        self.add_state(name, [], dist_reduce_fx="cat")
        self._list_layouts[name] = layout
        self._exact_states.append(name)

    def _apply(self, fn: Callable[[Tensor], Tensor], exclude_state: Sequence[str] = ()) -> Any:
        """torchmetrics' ``_apply``, except that exact states only change device.

        A module cast (``.to(torch.float16)``, ``.half()``, ``set_dtype``, Lightning's
        ``precision="16-true"``) would otherwise round counts kept in float64, cast
        int64 counts and float64 bit patterns to half precision, and round stored
        embeddings (those stored before the cast too) to half precision.
        """
        exact: list[str] = self.__dict__.get("_exact_states", [])
        this: Any = super()._apply(fn, exclude_state=(*exclude_state, *exact))
        for name in exact:
            this._defaults[name] = _to_device_of(this._defaults[name], fn)
            setattr(this, name, _to_device_of(getattr(this, name), fn))
        # A result computed before a cast is computed again from the exact states.
        _forget_computed(this)
        return this

    def sync(
        self,
        dist_sync_fn: Callable[..., Any] | None = None,
        process_group: Any | None = None,
        should_sync: bool = True,
        distributed_available: Callable[..., Any] | None = None,
    ) -> None:
        """torchmetrics' ``sync``, with one rule for list states, then forget a result
        computed before it.

        Before a gather, every empty list state gets one empty block of its layout
        (:mod:`recall_at_k._sync`). torchmetrics keeps ``compute()``'s result until the
        next ``update``/``reset``, but not across ``sync``/``unsync``: with
        ``sync_on_compute=False``, ``compute()``, ``sync()``, ``compute()`` would
        otherwise return the local value twice.
        """
        if self._will_sync(should_sync, distributed_available):
            self._filled_for_sync = fill_empty_list_states(self, self._list_layouts)
        super().sync(dist_sync_fn, process_group, should_sync, distributed_available)
        _forget_computed(self)

    def _sync_dist(
        self, dist_sync_fn: Callable[..., Any] = gather_all_tensors, process_group: Any = None
    ) -> None:
        """torchmetrics' gather of the states, after the processes agree on the dtype of
        float list states (:func:`recall_at_k._sync.agree_float_dtypes`). Its default
        gather function is replaced by the same gather that holds each collective's
        tensors until the process group lets go of them
        (:func:`recall_at_k._collectives.gather_all_tensors`)."""
        if dist_sync_fn is gather_all_tensors:
            dist_sync_fn = _collectives.gather_all_tensors
        group = process_group or self.process_group
        agree_float_dtypes(self, self._list_layouts, dist_sync_fn, group)
        super()._sync_dist(dist_sync_fn, process_group=process_group)

    def _will_sync(
        self, should_sync: bool, distributed_available: Callable[..., Any] | None
    ) -> bool:
        """Whether ``sync(should_sync=..., distributed_available=...)`` gathers states."""
        available = distributed_available or self.distributed_available_fn
        return bool(should_sync and callable(available) and available())

    def merge_state(self, incoming_state: Any) -> None:
        """torchmetrics' ``merge_state``, then forget a result computed before it (the
        next ``compute()`` counts the merged state)."""
        super().merge_state(incoming_state)
        _forget_computed(self)
        for view in self._view_list:
            _forget_computed(view)

    def unsync(self, should_unsync: bool = True) -> None:
        """torchmetrics' ``unsync``, then forget the synchronised result."""
        super().unsync(should_unsync)
        if should_unsync:
            empty_filled_list_states(self, self._filled_for_sync)
            self._filled_for_sync = []
        _forget_computed(self)

    # ------------------------------------------------------------------ life cycle

    @property
    def _view_list(self) -> list[RecallView]:
        views: list[RecallView] = self.__dict__["_view_list"]
        return views

    def _touch_views(self) -> None:
        """Called first in every ``update``: the first update after construction or
        ``reset`` updates the views once (torchmetrics warns about a ``compute`` of a
        metric never updated); later ones cost one attribute check."""
        if self.__dict__["_views_need_touch"]:
            for view in self._view_list:
                view.update()
            object.__setattr__(self, "_views_need_touch", False)

    @torch.jit.unused
    def forward(self, *args: Any, **kwargs: Any) -> OutputT:
        """Add the batch and return its own value (torchmetrics' ``forward``).

        Each view of :meth:`per_k` receives its key's batch value, which is what
        Lightning logs for a metric on ``on_step=True``.
        """
        self._in_forward = True
        try:
            value = super().forward(*args, **kwargs)
        finally:
            self._in_forward = False
        self._after_forward()
        for view in self._view_list:
            view._forward_cache = value[view.key] if isinstance(value, dict) else value
        return cast(OutputT, value)

    def _after_forward(self) -> None:
        """Hook for subclasses (the flat state is compacted here)."""

    def reset(self) -> None:
        """Reset the state (and the views), and release scratch memory."""
        super().reset()
        for view in self._view_list:
            view.expire()
        object.__setattr__(self, "_views_need_touch", True)
        self._release_scratch()

    def _release_scratch(self) -> None:
        """Free scratch buffers, except inside ``forward`` (which resets and computes
        internally, once per batch)."""
        if not self._in_forward:
            self._workspace.clear()

    # ------------------------------------------------------------------ results

    def _histograms(self) -> list[Histogram]:
        """The (synchronised) rank histogram of each output prefix."""
        raise NotImplementedError

    def _recall_values(self) -> list[tuple[Tensor, int]]:
        """(Recall@K values float64 ``[len(ks)]``, counted queries) per prefix."""
        self._release_scratch()
        results = []
        for prefix, histogram in zip(self._prefixes, self._histograms(), strict=True):
            if histogram is None:
                nan = torch.full((len(self.ks),), float("nan"), dtype=torch.float64)
                results.append((nan, 0))
                continue
            try:
                results.append(recall_values(*histogram, self.ks, self.empty_target_action))
            except ValueError as err:
                if not prefix:
                    raise
                raise ValueError(f"direction {prefix.rstrip('/')!r}: {err}") from err
        return results

    def _output(self, per_prefix: list[Tensor]) -> OutputT:
        single = self.single_k and self._prefixes == ("",)
        return cast(OutputT, format_output(torch.cat(per_prefix), self.output_keys, single))

    def compute(self) -> OutputT:
        """Recall@K over everything seen (synchronised across processes)."""
        check_wrapper_caller(self)
        return self._output([values for values, _ in self._recall_values()])

    def confidence_interval(self, level: float = 0.95) -> OutputT:
        """The Wilson score interval of each Recall@K, from the synchronised state.

        With n the number of counted queries, p the Recall@K value and z the two-sided
        normal quantile of ``level``, the interval is centred on
        (p + z^2 / 2n) / (1 + z^2 / n) with half-width
        z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2). For ``ties="expected"``
        p is the expected hit rate, and the interval is conservative (a random tie order
        only adds variance that the tie policy removes). NaN where nothing is counted.

        Returns:
            ``tensor([low, high])`` per key, in ``compute()``'s structure (a dict of
            them, or one tensor for an int ``k``).
        """
        level = check_level(level)
        values = self._synced(self._recall_values)
        intervals = [wilson_interval(v, counted, level) for v, counted in values]
        return self._output(intervals)

    def _synced(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the synchronised state, as ``compute()`` sees it."""
        with self.sync_context(
            dist_sync_fn=self.dist_sync_fn,
            should_sync=self._to_sync,
            should_unsync=self._should_unsync,
        ):
            return fn()

    # ------------------------------------------------------------------ logging, plots

    def per_k(self, prefix: str = "") -> Mapping[str, Metric]:
        """One ``Metric`` per output key, for ``self.log_dict`` in Lightning.

        Example:
            In a ``LightningModule`` (``self.recall = RetrievalRecallAtK()`` in
            ``__init__``), one line in ``validation_step`` logs ``val/recall@1``,
            ``val/recall@5`` and ``val/recall@10`` at epoch end, synchronised across
            processes, and resets the metric for the next epoch::

                self.recall.update(scores, target)
                self.log_dict(self.recall.per_k("val/"))

            In ``training_step``, call the metric (``forward``) and log on steps::

                self.recall(scores, target)
                self.log_dict(self.recall.per_k("train/"), on_step=True, on_epoch=True)

        Args:
            prefix: prepended to every key.
        """
        return {prefix + view.key: view for view in self._view_list}

    def plot(
        self,
        val: OutputT | Sequence[OutputT] | None = None,
        ax: Any | None = None,
        *,
        interval: OutputT | None = None,
        labels: Sequence[str] | None = None,
    ) -> tuple[Any, Any]:
        """Draw Recall@K against K (a CMC curve; one per direction when bidirectional).

        Args:
            val: a result of :meth:`compute` (default: compute now), or a list of them
                (for instance one per epoch; one curve each). Values logged by Lightning
                (``trainer.callback_metrics``, keys with a prefix) work too.
            ax: a matplotlib axis to draw on; a new figure when ``None``.
            interval: a result of :meth:`confidence_interval`, drawn as a band around
                the curve of one result.
            labels: one legend label per result of ``val`` (say, per model or epoch);
                without it, a list of results is labelled by position ("step 0", ...).

        Returns:
            ``(fig, ax)``.
        """
        results: list[Any] = [self.compute() if val is None else val]
        if val is not None and not isinstance(val, (Tensor, dict)):
            results = list(val)
        curves = []
        for result in results:
            curve = {}
            for prefix in self._prefixes:
                keys = [prefix + key for key in self.keys]
                curve[prefix.rstrip("/")] = (self.ks, _plot.values_of(result, keys))
            curves.append(curve)
        bands = None
        if interval is not None and len(results) != 1:
            raise ValueError(
                "`interval` is the band of one result: pass one `val` (a list of results"
                " draws one curve each, and one interval cannot belong to all of them)"
            )
        if interval is not None:
            bands = {
                prefix.rstrip("/"): _plot.bounds_of(interval, [prefix + k for k in self.keys])
                for prefix in self._prefixes
            }
        title = type(self).__name__
        one = len(curves) == 1 and labels is None
        return _plot.plot_curves(curves[0] if one else curves, ax, title, bands, labels)


def _to_device_of(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``value`` (a tensor or a list of them) on the device ``fn`` moves tensors to, in
    its own dtype."""
    if isinstance(value, Tensor):
        device = fn(torch.zeros((), device=value.device)).device
        return value.to(device)
    return [_to_device_of(v, fn) for v in value]
