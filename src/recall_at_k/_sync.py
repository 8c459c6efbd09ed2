"""One rule for list states across processes: a process without data sends a typed empty.

torchmetrics gathers a ``"cat"`` list state by concatenating each process's list; an
empty list sends a 1-D tensor of the metric's float dtype, which cannot be gathered
beside other processes' int64 ``[rows, width]`` blocks (the collective fails or hangs).
So every list state declares its layout (trailing shape and dtype), and an empty list is
replaced by an empty block of that layout before the gather. ``"sum"`` states need
nothing. A float list state (embeddings) keeps each block's stored dtype; processes
agree on the widest before a gather and widen their blocks to it (exactly)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torchmetrics import Metric

from recall_at_k.ranking.stored import FLOAT_BITS, FLOAT_FLOOR, FLOAT_OF_BITS, widest_float


class ListLayout(NamedTuple):
    """The blocks of a list state: ``[rows, *trailing]`` of ``dtype``; ``None``: float blocks of
    at least ``FLOAT_FLOOR``, each in its stored dtype. No module cast changes it."""

    trailing: tuple[int, ...]
    dtype: torch.dtype | None


def fill_empty_list_states(metric: Metric, layouts: dict[str, ListLayout]) -> list[str]:
    """Give every empty list state one empty block of its layout, before a gather; return
    the names of the states filled, for :func:`empty_filled_list_states`."""
    filled = []
    for name, layout in layouts.items():
        value = getattr(metric, name)
        if isinstance(value, list) and not value:
            dtype = FLOAT_FLOOR if layout.dtype is None else layout.dtype
            value.append(torch.empty((0, *layout.trailing), dtype=dtype, device=metric.device))
            filled.append(name)
    return filled


def empty_filled_list_states(metric: Metric, filled: list[str]) -> None:
    """After ``unsync``: the local states filled before the gather are empty lists again."""
    for name in filled:
        value = getattr(metric, name)
        if isinstance(value, list) and all(block.numel() == 0 for block in value):
            value.clear()


def agree_float_dtypes(
    metric: Metric,
    layouts: dict[str, ListLayout],
    dist_sync_fn: Callable[..., Any],
    process_group: Any | None,
) -> None:
    """Before a gather, widen float list states' blocks to the widest dtype on any process (a
    small gather, ``dist_sync_fn``) into new lists: torchmetrics' local copy stays as it was."""
    names = [name for name, layout in layouts.items() if layout.dtype is None]
    if not names:
        return
    states = [_blocks(getattr(metric, name)) for name in names]
    widest = [widest_float([block.dtype for block in blocks]) for blocks in states]
    local = torch.tensor([FLOAT_BITS[dtype] for dtype in widest], device=metric.device)
    gathered = torch.stack([g.reshape(-1) for g in dist_sync_fn(local, group=process_group)])
    for name, blocks, bits in zip(names, states, gathered.amax(dim=0).tolist(), strict=True):
        dtype = FLOAT_OF_BITS[int(bits)]
        if any(block.dtype != dtype for block in blocks):
            setattr(metric, name, [block.to(dtype) for block in blocks])


def _blocks(value: Any) -> list[Tensor]:
    return [value] if isinstance(value, Tensor) else list(value)
