"""One rule for list states across processes: a process without data sends a typed empty.

torchmetrics gathers a ``"cat"`` list state by concatenating each process's list and
gathering the result; a process whose list is empty sends a 1-D tensor of the metric's
float dtype instead, which cannot be gathered beside other processes' int64
``[rows, width]`` blocks (the collective fails or hangs). Every list state therefore
declares its layout, the trailing shape and dtype of its blocks, and an empty list is
replaced by an empty block of that layout before the gather. Tensor (``"sum"``) states
need nothing: every process always holds one of the same shape.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torchmetrics import Metric


class ListLayout(NamedTuple):
    """The blocks of a list state: ``[rows, *trailing]`` of ``dtype``.

    ``dtype=None`` stands for the metric's own dtype (``Metric.dtype``), for float data
    that follows the module's dtype casts.
    """

    trailing: tuple[int, ...]
    dtype: torch.dtype | None


def fill_empty_list_states(metric: Metric, layouts: dict[str, ListLayout]) -> list[str]:
    """Give every empty list state one empty block of its layout, before a gather.

    Returns:
        The names of the states filled, for :func:`empty_filled_list_states`.
    """
    filled = []
    for name, layout in layouts.items():
        value = getattr(metric, name)
        if isinstance(value, list) and not value:
            dtype = metric.dtype if layout.dtype is None else layout.dtype
            value.append(torch.empty((0, *layout.trailing), dtype=dtype, device=metric.device))
            filled.append(name)
    return filled


def empty_filled_list_states(metric: Metric, filled: list[str]) -> None:
    """After ``unsync``: the local states filled before the gather are empty lists again."""
    for name in filled:
        value = getattr(metric, name)
        if isinstance(value, list) and all(block.numel() == 0 for block in value):
            value.clear()
