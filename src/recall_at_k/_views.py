"""Per-K child metrics, so that Lightning logs every K of one metric: ``self.log`` takes a
``Metric`` only if its ``compute()`` returns a tensor, so each metric owns one state-less
:class:`RecallView` per output key, reading its key's result and resetting the metric."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, cast

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
        """``Module.__setattr__``, without its costly checks for a plain value (None, bool, number,
        str) given to an attribute already in ``__dict__`` (never a parameter or submodule)."""
        if type(value) in _PLAIN_TYPES and name in self.__dict__:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


_PLAIN_TYPES = frozenset({type(None), bool, int, float, str})


class RecallView(RecallMetric):
    """One output of a Recall@K metric as a state-less ``Metric`` (``per_k()``): ``compute``
    returns ``read(key)``, ``reset`` resets the parent, ``forward(value)`` is the batch value."""

    __jit_unused_properties__: ClassVar[list[str]] = [*Metric.__jit_unused_properties__, "parent"]

    def __init__(self, parent: Metric, key: str, read: Callable[[str], Tensor]) -> None:
        # No cache of its own: the parent keeps its result until its state changes.
        super().__init__(compute_with_cache=False)
        self.key = key
        # Plain attributes, not submodules: the view is the parent's child, not its owner.
        object.__setattr__(self, "_parent", parent)
        object.__setattr__(self, "_read", read)
        self._batch: Tensor | None = None  # the batch value during its own forward, else None

    @property
    def parent(self) -> Metric:
        return cast(Metric, self.__dict__["_parent"])

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the parent counts (and calls this so that torchmetrics does not warn)."""

    def compute(self) -> Tensor:
        if self._batch is not None:
            return self._batch
        read: Callable[[str], Tensor] = self.__dict__["_read"]
        return read(self.key)

    @torch.jit.unused
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``forward(value)``: torchmetrics' ``forward`` with ``value`` as the batch value."""
        (self._batch,) = args
        try:
            return super().forward()
        finally:
            self._batch = None

    def reset(self) -> None:
        """Reset the parent (which expires every view); in the view's own ``forward``, the view."""
        if self._batch is not None:
            super().reset()
        else:
            self.parent.reset()

    def expire(self) -> None:
        """Forget the batch value (the parent was reset): torchmetrics' reset of the view."""
        super().reset()

    def extra_repr(self) -> str:
        return f"key={self.key!r}"
