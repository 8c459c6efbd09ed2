"""Per-K child metrics, so that Lightning can log every K of one metric automatically.

Lightning's ``self.log`` accepts a ``Metric`` only when its ``compute()`` returns a
tensor, then calls ``compute()`` at epoch end (with its own sync) and ``reset()``
afterwards. A Recall@K metric returns a dict of K values, so each parent owns one
:class:`RecallView` per output key: a state-less ``Metric`` registered as a submodule
of the parent (Lightning finds it among the ``LightningModule``'s modules) whose
``compute()`` is the parent's cached ``compute()[key]`` and whose ``reset()`` resets the
parent. The parent does the counting once per batch; the views only read it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric


class RecallView(Metric):
    """One output of a parent Recall@K metric, as a ``Metric`` of its own.

    Not created by users: see the parent's ``per_k()``. It has no state; ``update`` does
    nothing (the parent is updated, and tells its views); ``compute`` reads the parent's
    result (computed, and synchronised across processes, once for all views); ``reset``
    resets the parent.
    """

    is_differentiable: bool = False
    higher_is_better: bool = True
    full_state_update: bool = False
    plot_lower_bound: float = 0.0
    plot_upper_bound: float = 1.0

    def __init__(self, parent: Metric, key: str) -> None:
        # No cache of its own: the parent's compute() is cached (until its next update).
        super().__init__(compute_with_cache=False)
        self.key = key
        # A plain attribute, not a submodule: the view is the parent's child, not its owner.
        object.__setattr__(self, "_parent", parent)

    @property
    def parent(self) -> Metric:
        parent: Metric = self.__dict__["_parent"]
        return parent

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: the parent counts; it calls this so the view's cache expires."""

    def compute(self) -> Tensor:
        result = self.parent.compute()
        value: Tensor = result[self.key] if isinstance(result, dict) else result
        return value

    def reset(self) -> None:
        """Reset the parent (which expires every view's cache)."""
        self.parent.reset()

    def _expire(self) -> None:
        super().reset()

    def extra_repr(self) -> str:
        return f"key={self.key!r}"


def _forget_computed(metric: object) -> None:
    # torchmetrics' compute cache attribute; setting it is harmless if it is ever renamed.
    if hasattr(metric, "_computed"):
        object.__setattr__(metric, "_computed", None)


class PerKViews:
    """Mixin for a Recall@K ``Metric``: owns one :class:`RecallView` per output key.

    The metric calls :meth:`_init_views` in ``__init__`` with its output keys and
    :meth:`_touch_views` in every ``update``; the mixin's ``reset`` also resets the views.
    A view's ``update`` count is what torchmetrics checks before warning about a
    ``compute`` without ``update``, so the parent's first update after construction or
    reset updates the views once (later updates cost one attribute check).
    """

    def _init_views(self, keys: list[str]) -> None:
        assert isinstance(self, Metric)
        views = {key: RecallView(self, key) for key in keys}
        # Module names may not contain "."; the keys may.
        self.views = torch.nn.ModuleDict(
            {f"view{i}": view for i, view in enumerate(views.values())}
        )
        object.__setattr__(self, "_view_by_key", views)
        object.__setattr__(self, "_views_need_touch", True)

    def _touch_views(self) -> None:
        if self.__dict__["_views_need_touch"]:
            for view in self.__dict__["_view_by_key"].values():
                view.update()
            object.__setattr__(self, "_views_need_touch", False)

    def sync(self, *args: Any, **kwargs: Any) -> None:
        """torchmetrics' ``sync``, then forget a result computed before it.

        torchmetrics keeps ``compute()``'s result until the next ``update``/``reset``, but
        not across ``sync``/``unsync``: with ``sync_on_compute=False``, ``compute()``,
        ``sync()``, ``compute()`` would return the local value twice.
        """
        super().sync(*args, **kwargs)  # type: ignore[misc]
        _forget_computed(self)

    def unsync(self, *args: Any, **kwargs: Any) -> None:
        """torchmetrics' ``unsync``, then forget the synchronised result."""
        super().unsync(*args, **kwargs)  # type: ignore[misc]
        _forget_computed(self)

    def reset(self) -> None:
        super().reset()  # type: ignore[misc]
        for view in self.__dict__["_view_by_key"].values():
            view._expire()
        object.__setattr__(self, "_views_need_touch", True)

    def per_k(self, prefix: str = "") -> dict[str, RecallView]:
        """One ``Metric`` per output key, for ``self.log_dict`` in Lightning.

        Example:
            In a ``LightningModule`` (``self.recall = RetrievalRecallAtK()`` in
            ``__init__``), one line in ``validation_step`` logs ``val/recall@1``,
            ``val/recall@5`` and ``val/recall@10`` at epoch end, synchronised across
            processes, and resets the metric for the next epoch::

                self.recall.update(scores, target)
                self.log_dict(self.recall.per_k("val/"))

        Args:
            prefix: prepended to every key.
        """
        views: dict[str, RecallView] = self.__dict__["_view_by_key"]
        return {prefix + key: view for key, view in views.items()}
