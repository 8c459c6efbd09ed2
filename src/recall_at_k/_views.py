"""Per-K child metrics, so that Lightning logs every K of one metric automatically.

Lightning's ``self.log`` accepts a ``Metric`` only when its ``compute()`` returns a
tensor; it logs the metric's ``_forward_cache`` on steps and calls ``compute()`` at epoch
end (with its own sync), then ``reset()``. A Recall@K metric returns a dict of K values,
so each metric owns one :class:`RecallView` per output key: a state-less ``Metric``
registered as a submodule of the metric (Lightning finds it among the module's children)
whose ``compute()`` is the metric's cached ``compute()[key]``, whose ``_forward_cache``
the metric sets to the batch value of ``forward``, and whose ``reset()`` resets the
metric. The metric counts once per batch; its views only read it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor
from torchmetrics import Metric


class RecallMetric(Metric):
    """The class attributes every Recall@K ``Metric`` of this package shares."""

    is_differentiable: bool = False
    higher_is_better: bool = True
    full_state_update: bool = False
    plot_lower_bound: float = 0.0
    plot_upper_bound: float = 1.0


class RecallView(RecallMetric):
    """One output of a Recall@K metric, as a ``Metric`` of its own (see ``per_k()``).

    It has no state; ``update`` does nothing (the parent is updated and tells its views);
    ``compute`` reads the parent's result (computed, and synchronised across processes,
    once for all views); ``reset`` resets the parent.
    """

    __jit_unused_properties__: ClassVar[list[str]] = [
        *Metric.__jit_unused_properties__,
        "parent",
    ]

    def __init__(self, parent: Metric, key: str) -> None:
        # No cache of its own: the parent's compute() is cached until its next update.
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

    def expire(self) -> None:
        """Forget a computed value and the batch value (the parent was reset)."""
        super().reset()
        self._forward_cache = None

    def extra_repr(self) -> str:
        return f"key={self.key!r}"
