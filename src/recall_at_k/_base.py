"""The base of both metrics: options, output keys, per-K views, cast-proof states, the sync
rule for list states, the kept result, scratch memory, results, intervals and plots,
through torchmetrics' documented ``Metric`` interface (and torch's ``_apply`` hook).

A subclass declares its states (``_add_count_state``, ``_add_list_state``), implements
``update`` (calling ``_touch_views`` first) and ``_histograms`` (the synchronised rank
histogram of each output prefix); the base makes ``compute()``, ``confidence_interval()``
and ``plot()`` of them."""

from __future__ import annotations

import math
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
from recall_at_k._result import format_output, recall_values, wilson_interval
from recall_at_k._sync import (
    ListLayout,
    agree_float_dtypes,
    empty_filled_list_states,
    fill_empty_list_states,
)
from recall_at_k._types import EMPTY_TARGET_ACTIONS, TIES, OutputT
from recall_at_k._views import RecallMetric, RecallView

# (hist [max K], queries [2]) of one output prefix; None: nothing ranked (NaN, no warning)
Histogram = tuple[Tensor, Tensor] | None
ResultKey = tuple[int, ...]  # the update counts a kept result was computed from


class RecallAtKMetric(RecallMetric, Generic[OutputT]):
    """Recall@K for several K at once (base class; use a subclass)."""

    __jit_unused_properties__: ClassVar[list[str]] = [
        *Metric.__jit_unused_properties__,
        "output_keys",
        "_view_list",
    ]

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
        keep_result = metric_kwargs.pop("compute_with_cache", True)
        if not isinstance(keep_result, bool):
            raise ValueError(
                f"`compute_with_cache` must be a bool (keep compute()'s result until the"
                f" state changes), got {keep_result!r}"
            )
        # torchmetrics' cache outlives sync, unsync, merge_state, casts: keep our own.
        super().__init__(compute_with_cache=False, **metric_kwargs)
        self._keep_result = keep_result
        self._result: Any = None
        self._result_key: ResultKey | None = None
        self._gathered_states = False  # between a sync() that gathered and its unsync()
        self._gathered_key: ResultKey = ()  # every process's update count at that sync
        self._widened: dict[str, Any] = {}  # float list states replaced for a gather
        self.ks, self.single_k = check_k(k)
        self.max_k = max(self.ks)
        check_choice("ties", ties, TIES)
        check_choice("empty_target_action", empty_target_action, EMPTY_TARGET_ACTIONS)
        self.keys = check_key(key, self.ks)
        self.ties, self.empty_target_action = ties, empty_target_action
        self.key, self.validate_args = key, validate_args
        self._prefixes = tuple(prefixes)
        self._exact_states: list[str] = []
        self._list_layouts: dict[str, ListLayout] = {}
        self._filled_for_sync: list[str] = []
        self._workspace = Workspace()
        self._in_forward = False
        views = [RecallView(self, name, self._value_for_view) for name in self.output_keys]
        # Submodules, so that Lightning and module casts find them.
        self.views = torch.nn.ModuleList(views)
        self.__dict__["_view_list"] = views
        object.__setattr__(self, "_views_need_touch", True)

    @property
    def output_keys(self) -> list[str]:
        """The keys of ``compute()``'s dict, in order (one per K and direction)."""
        return [prefix + key for prefix in self._prefixes for key in self.keys]

    def _add_count_state(self, name: str, default: Tensor) -> None:
        """A ``"sum"`` state of counts: its dtype never changes (see :meth:`_apply`)."""
        self.add_state(name, default, dist_reduce_fx="sum")
        self._exact_states.append(name)

    def _add_list_state(self, name: str, layout: ListLayout) -> None:
        """A ``"cat"`` list state of blocks of ``layout``, whose dtypes casts never change."""
        self.add_state(name, [], dist_reduce_fx="cat")
        self._list_layouts[name] = layout
        self._exact_states.append(name)

    def _apply(self, fn: Callable[[Tensor], Tensor], exclude_state: Sequence[str] = ()) -> Any:
        """torchmetrics' ``_apply``, except that exact states only change device: a cast
        (``.half()``, ``precision="16-true"``) would round counts, bit patterns and embeddings.
        Their defaults stay where they are (``reset()`` moves a tensor default to its state)."""
        exact: list[str] = self.__dict__.get("_exact_states", [])
        this: Any = super()._apply(fn, exclude_state=(*exclude_state, *exact))
        for name in exact:
            setattr(this, name, _to_device_of(getattr(this, name), fn))
        # A result kept from before a cast is computed again from the exact states.
        this._result = None
        return this

    def sync(
        self,
        dist_sync_fn: Callable[..., Any] | None = None,
        process_group: Any | None = None,
        should_sync: bool = True,
        distributed_available: Callable[..., Any] | None = None,
    ) -> None:
        """torchmetrics' ``sync``, after the rule of :mod:`recall_at_k._sync` (typed empty blocks,
        one float dtype); :meth:`unsync` puts this process's own lists back."""
        gather = self._will_sync(should_sync, distributed_available) and not self._gathered_states
        group = process_group or self.process_group
        if gather:  # (torchmetrics raises for a second gather)
            self._filled_for_sync = fill_empty_list_states(self, self._list_layouts)
            floats = [name for name, layout in self._list_layouts.items() if layout.dtype is None]
            before = {name: getattr(self, name) for name in floats}
            # Collectives that let go of their tensors before they return.
            if dist_sync_fn is None or dist_sync_fn is gather_all_tensors:
                dist_sync_fn = _collectives.gather_all_tensors
            agree_float_dtypes(self, self._list_layouts, dist_sync_fn, group)
            self._widened = {n: v for n, v in before.items() if getattr(self, n) is not v}
        super().sync(dist_sync_fn, process_group, should_sync, distributed_available)
        if gather:
            self._gathered_states = True
            # compute()'s key: every process's update count, gathered as the states were.
            mine = torch.tensor([self.update_count], dtype=torch.int64, device=self.device)
            assert dist_sync_fn is not None
            self._gathered_key = tuple(int(count) for count in dist_sync_fn(mine, group))

    def _will_sync(
        self, should_sync: bool, distributed_available: Callable[..., Any] | None
    ) -> bool:
        """Whether ``sync(should_sync=..., distributed_available=...)`` gathers states."""
        available = distributed_available or self.distributed_available_fn
        return bool(should_sync and callable(available) and available())

    def merge_state(self, incoming_state: Any) -> None:
        """torchmetrics' ``merge_state``; the next ``compute()`` counts the merged state."""
        super().merge_state(incoming_state)
        self._result = None

    def unsync(self, should_unsync: bool = True) -> None:
        """torchmetrics' ``unsync``: this process's own states again."""
        super().unsync(should_unsync)
        if should_unsync:
            for name, value in self._widened.items():
                setattr(self, name, value)
            self._widened = {}
            empty_filled_list_states(self, self._filled_for_sync)
            self._filled_for_sync = []
            self._gathered_states = False

    @property
    def _view_list(self) -> list[RecallView]:
        return cast(list[RecallView], self.__dict__["_view_list"])

    def _touch_views(self) -> None:
        """Called first in every ``update``: the first after construction or ``reset``
        updates the views (else torchmetrics warns that they compute before an update)."""
        if self.__dict__["_views_need_touch"]:
            for view in self._view_list:
                view.update()
            object.__setattr__(self, "_views_need_touch", False)

    @torch.jit.unused
    def forward(self, *args: Any, **kwargs: Any) -> OutputT:
        """Add the batch and return its own value (torchmetrics' ``forward``); each view of
        :meth:`per_k` receives its key's batch value (what Lightning logs on steps)."""
        self._in_forward = True
        try:
            value = super().forward(*args, **kwargs)
        finally:
            self._in_forward = False
            # dist_sync_on_step=True: torchmetrics put the accumulated states back itself.
            self._gathered_states = False
            self._widened, self._filled_for_sync = {}, []
        self._after_forward()
        for view in self._view_list:
            view(value[view.key] if isinstance(value, dict) else value)
        return cast(OutputT, value)

    def _after_forward(self) -> None:
        """Hook for subclasses (the flat state is compacted here)."""

    def reset(self) -> None:
        """Reset the state (and the views), and release scratch memory."""
        super().reset()
        self._result = None
        for view in self._view_list:
            view.expire()
        object.__setattr__(self, "_views_need_touch", True)
        self._release_scratch()

    def _release_scratch(self) -> None:
        """Free scratch buffers, except inside ``forward`` (which resets once per batch)."""
        if not self._in_forward:
            self._workspace.clear()

    def _histograms(self) -> list[Histogram]:
        """The (synchronised) rank histogram of each output prefix."""
        raise NotImplementedError

    def _recall_values(self) -> list[tuple[Tensor, int]]:
        """(Recall@K values float64 ``[len(ks)]``, counted queries) per prefix."""
        self._release_scratch()
        results = []
        for prefix, histogram in zip(self._prefixes, self._histograms(), strict=True):
            if histogram is None:
                results.append((torch.full((len(self.ks),), math.nan, dtype=torch.float64), 0))
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
        """Recall@K over everything seen (synchronised across processes), kept (unless
        ``compute_with_cache=False``) until an ``update``, ``reset``, ``merge_state``, module
        cast, or ``sync()`` / ``unsync()`` changes the held state."""
        key = self._result_key_now()
        if self._result is not None and self._result_key == key:
            return cast(OutputT, self._result)
        result = self._output([values for values, _ in self._recall_values()])
        if self._keep_result and not self._in_forward:
            self._result, self._result_key = result, key
        self._after_compute()
        return result

    def _after_compute(self) -> None:
        """Called by ``compute()`` once it has computed (a subclass warns here)."""

    def _result_key_now(self) -> ResultKey:
        """What ``compute()`` would compute from now, inside its sync: this process's
        update count, or with gathered states every process's (gathered by ``sync``)."""
        return self._gathered_key if self._gathered_states else (self.update_count,)

    def _value_for_view(self, key: str) -> Tensor:
        """``compute()[key]``, for a view of :meth:`per_k`."""
        result = self.compute()
        return result[key] if isinstance(result, dict) else result

    def confidence_interval(self, level: float = 0.95) -> OutputT:
        """The Wilson score interval of each Recall@K, from the synchronised state.

        With n the counted queries, p the Recall@K and z the two-sided normal quantile of
        ``level``: centre (p + z^2 / 2n) / (1 + z^2 / n), half-width z / (1 + z^2 / n) *
        sqrt(p (1 - p) / n + z^2 / 4n^2). For ``ties="expected"`` p is the expected hit rate and
        the interval conservative. NaN where nothing is counted.

        Returns:
            ``tensor([low, high])`` per key, in ``compute()``'s structure (a dict of them, or
            one tensor for an int ``k``)."""
        level = check_level(level)
        values = self._synced(self._recall_values)
        intervals = [wilson_interval(v, counted, level) for v, counted in values]
        return self._output(intervals)

    def _synced(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the synchronised state, as ``compute()`` sees it."""
        with self.sync_context(dist_sync_fn=self.dist_sync_fn, should_sync=self.sync_on_compute):
            return fn()

    def per_k(self, prefix: str = "") -> Mapping[str, Metric]:
        """One ``Metric`` per output key, for ``self.log_dict`` in Lightning.

        Example:
            In a ``LightningModule`` (``self.recall = RetrievalRecallAtK()``), one line in
            ``validation_step`` logs ``val/recall@1``, ``val/recall@5`` and ``val/recall@10``
            at epoch end, synchronised, and resets the metric for the next epoch::

                self.recall.update(scores, target)
                self.log_dict(self.recall.per_k("val/"))

            In ``training_step``, call the metric (``forward``) and log on steps::

                self.recall(scores, target)
                self.log_dict(self.recall.per_k("train/"), on_step=True, on_epoch=True)

        Args:
            prefix: prepended to every key."""
        if not isinstance(prefix, str):
            raise ValueError(
                f"`prefix` of per_k() must be a str put before every key (for example"
                f" 'val/'), got {type(prefix).__name__}: per_k('val/') gives one Metric"
                f" per key, for self.log_dict"
            )
        return {prefix + view.key: view for view in self._view_list}

    def plot(
        self,
        val: OutputT | Sequence[OutputT] | None = None,
        ax: Any | None = None,
        *,
        interval: OutputT | None = None,
        labels: Sequence[str] | None = None,
    ) -> tuple[Any, Any]:
        """Draw Recall@K against K (a CMC curve; one per direction when bidirectional), the
        y-axis fitted to the curves and band within [0, 1].

        Args:
            val: a result of :meth:`compute` (default: compute now), or a list of them (one
                curve each); values logged by Lightning (``trainer.callback_metrics``, keys
                with a prefix) work too.
            ax: a matplotlib axis to draw on; a new figure when ``None``.
            interval: a result of :meth:`confidence_interval`, drawn as a band around the curve
                of one result.
            labels: one legend label per result of ``val``; by default "step 0", ... .

        Returns:
            ``(fig, ax)``."""
        results: list[Any] = [self.compute() if val is None else val]
        if val is not None and not isinstance(val, (Tensor, Mapping)):
            if not isinstance(val, Sequence):
                self._check_plotted(val)
            results = list(val)
        for result in results:
            self._check_plotted(result)
        keys = {
            prefix.rstrip("/"): [prefix + key for key in self.keys] for prefix in self._prefixes
        }
        curves = [
            {name: (self.ks, _plot.values_of(result, of)) for name, of in keys.items()}
            for result in results
        ]
        bands = None
        if interval is not None:
            if len(results) != 1:
                raise ValueError(
                    "`interval` is the band of one result: pass one `val` (a list of results"
                    " draws one curve each, and one interval cannot belong to all of them)"
                )
            _check_interval(interval)
            bands = {name: _plot.bounds_of(interval, of) for name, of in keys.items()}
        title = type(self).__name__
        one = len(curves) == 1 and labels is None
        return _plot.plot_curves(curves[0] if one else curves, ax, title, bands, labels)

    def _check_plotted(self, result: object) -> None:
        """Raise unless ``result`` can be one result of :meth:`compute` for :meth:`plot`."""
        name = type(self).__name__
        if isinstance(result, Mapping):
            return
        if isinstance(result, Tensor) and result.numel() == 1:
            if len(self.output_keys) == 1:
                return
            raise ValueError(
                f"`val` of plot() is one value, and this {name} has"
                f" {len(self.output_keys)} ({', '.join(self.output_keys)}): pass its"
                f" compute() dict, or a list of them"
            )
        got = type(result).__name__
        if isinstance(result, Tensor):
            got = f"a tensor of shape {list(result.shape)}"
        raise ValueError(
            f"`val` of plot() must be a result of {name}.compute() (a scalar tensor or a"
            f" dict of them) or a list of such results, got {got}; a torchmetrics"
            f" wrapper's output is not one: plot the wrapped metric's compute()"
        )


def _check_interval(interval: object) -> None:
    """Raise unless ``interval`` is a result of ``confidence_interval()``."""
    entries = list(interval.values()) if isinstance(interval, Mapping) else [interval]
    if all(isinstance(e, Tensor) and e.shape == (2,) for e in entries):
        return
    raise ValueError(
        f"`interval` of plot() must be a result of confidence_interval() (tensor([low,"
        f" high]) per key), got {type(interval).__name__} with entries of shape"
        f" {[list(e.shape) if isinstance(e, Tensor) else type(e).__name__ for e in entries]}"
    )


def _to_device_of(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``value`` (a tensor or a list of them) on the device ``fn`` moves to, in its dtype."""
    if isinstance(value, Tensor):
        device = fn(torch.zeros((), device=value.device)).device
        return value.to(device)
    return [_to_device_of(v, fn) for v in value]
