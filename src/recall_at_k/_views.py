"""Per-K child metrics, so that Lightning logs every K of one metric automatically.

Lightning's ``self.log`` accepts a ``Metric`` only when its ``compute()`` returns a
tensor; on steps it logs the batch value of the metric's last ``forward``, and at epoch
end it calls ``compute()`` (with its own sync), then ``reset()``. A Recall@K metric
returns a dict of K values, so each metric owns one :class:`RecallView` per output key:
a state-less ``Metric`` registered as a submodule of the metric (Lightning finds it
among the module's children) whose ``compute()`` reads the metric's result for its key,
whose ``forward`` the metric calls with the key's batch value after its own ``forward``,
and whose ``reset()`` resets the metric. The metric counts once per batch; its views
only read it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor
from torchmetrics import Metric


class RecallMetric(Metric):
    """The class attributes every Recall@K ``Metric`` of this package shares."""

    is_differentiable: bool = False
    higher_is_better: bool = True
    full_state_update: bool = False
    plot_lower_bound: float = 0.0
    plot_upper_bound: float = 1.0

    def __setattr__(self, name: str, value: Any) -> None:
        """``Module.__setattr__``, with a shortcut for a plain value (None, a bool, a
        number or a str) given to an attribute already in the instance's ``__dict__``.

        ``Module.__setattr__`` stores such a value exactly so, after checks for
        parameters, buffers and submodules that cost several times a small update's
        arithmetic (torchmetrics' ``update`` and ``forward`` set a few plain flags and
        counters at every call). The shortcut changes nothing: a registered parameter,
        buffer or submodule is never in ``__dict__`` (``Module.__getattr__`` finds it
        only because of that), and a plain value can become none of them.
        """
        if type(value) in _PLAIN_TYPES and name in self.__dict__:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


_PLAIN_TYPES = frozenset({type(None), bool, int, float, str})


class RecallView(RecallMetric):
    """One output of a Recall@K metric, as a ``Metric`` of its own (see ``per_k()``).

    It has no state; ``update`` does nothing (the parent is updated and tells its views);
    ``compute`` returns ``read(key)``, the parent's result for this key (computed, and
    synchronised across processes, once for all views); ``reset`` resets the parent.
    ``forward(value)`` makes ``value`` (the parent's batch value for this key) the
    view's own batch value, through torchmetrics' ``forward``.
    """

    __jit_unused_properties__: ClassVar[list[str]] = [
        *Metric.__jit_unused_properties__,
        "parent",
    ]

    def __init__(self, parent: Metric, key: str, read: Callable[[str], Tensor]) -> None:
        # No cache of its own: the parent keeps its result until its state changes.
        super().__init__(compute_with_cache=False)
        self.key = key
        # Plain attributes, not submodules: the view is the parent's child, not its owner.
        object.__setattr__(self, "_parent", parent)
        object.__setattr__(self, "_read", read)
        # The batch value during this view's own forward, else None.
        self._batch: Tensor | None = None

    @property
    def parent(self) -> Metric:
        parent: Metric = self.__dict__["_parent"]
        return parent

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: the parent counts; it calls this once after it starts counting,
        so that torchmetrics does not warn that the view computes before an update."""

    def compute(self) -> Tensor:
        if self._batch is not None:
            return self._batch
        read: Callable[[str], Tensor] = self.__dict__["_read"]
        return read(self.key)

    @torch.jit.unused
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``forward(value)``: torchmetrics' ``forward``, whose batch value is ``value``
        (the parent's batch value for this key); the parent is not touched."""
        (self._batch,) = args
        try:
            return super().forward()
        finally:
            self._batch = None

    def reset(self) -> None:
        """Reset the parent (which expires every view); within the view's own
        ``forward``, torchmetrics' reset of the view alone."""
        if self._batch is not None:
            super().reset()
        else:
            self.parent.reset()

    def expire(self) -> None:
        """Forget the batch value (the parent was reset): torchmetrics' reset of the view."""
        super().reset()

    def extra_repr(self) -> str:
        return f"key={self.key!r}"
