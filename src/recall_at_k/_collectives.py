"""Blocking collectives that return only once the process group has let go of their tensors.

With gloo (CPU tensors) a blocking collective returns while the thread that ran it still
holds its tensors; a tensor whose last Python reference goes then is freed by that
thread, which must take the GIL. Up to torch 2.7 ``destroy_process_group()`` waits for
gloo's threads while holding the GIL: a deadlock. So every collective of this package
keeps its tensors referenced until the group's threads hold them no longer (their use
counts back to before). CUDA tensors don't wait: NCCL does not need the GIL to free them.

:func:`gather_all_tensors` is torchmetrics' function of that name (the gather of
``sync()``), following this rule."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

RELEASE_TIMEOUT_S = 10.0
"""The longest a collective waits for the process group's threads to let go of its
tensors. They do within milliseconds; if something else held one of them for longer,
the collective returns after this (the result is complete either way)."""


def all_reduce(tensor: Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> None:
    """``dist.all_reduce(tensor, op, group)``, in place."""
    with _held([tensor]):
        dist.all_reduce(tensor, op=op, group=group)


def all_gather(parts: list[Tensor], tensor: Tensor, group: Any = None) -> None:
    """``dist.all_gather(parts, tensor, group)``: ``parts[r]`` = process r's ``tensor``."""
    with _held([*parts, tensor]):
        dist.all_gather(parts, tensor, group=group)


def broadcast(tensor: Tensor, src: int, group: Any = None) -> None:
    """``dist.broadcast`` from process ``src`` of ``group`` (a rank in the group)."""
    source = src if group is None else dist.get_global_rank(group, src)
    with _held([tensor]):
        dist.broadcast(tensor, src=source, group=group)


def gather_all_tensors(result: Tensor, group: Any = None) -> list[Tensor]:
    """Every process's ``result`` (sizes may differ, not dimensions) in process order, this
    process's own itself: torchmetrics' ``gather_all_tensors``, through this module."""
    result = result.contiguous()
    world = dist.get_world_size(group)
    dist.barrier(group=group)
    with torch.no_grad():
        gather = _gather_padded if result.ndim else _gather
        parts = gather(result, world, group)
    parts[dist.get_rank(group)] = result
    return parts


def _gather(tensor: Tensor, world: int, group: Any) -> list[Tensor]:
    """Every process's ``tensor``, all of one shape, in new tensors."""
    parts = [torch.zeros_like(tensor) for _ in range(world)]
    all_gather(parts, tensor, group)
    return parts


def _gather_padded(result: Tensor, world: int, group: Any) -> list[Tensor]:
    """Every process's ``result`` of at least one dimension: each padded to the largest
    size in every dimension where sizes differ, gathered, and cut back."""
    shapes = _gather(torch.tensor(result.shape, device=result.device), world, group)
    largest = torch.stack(shapes).amax(dim=0)
    if all(bool((size == largest).all()) for size in shapes):
        return _gather(result, world, group)
    padded = result.new_zeros(tuple(largest.tolist()))
    padded[tuple(slice(size) for size in result.shape)] = result
    parts = _gather(padded, world, group)
    return [
        part[tuple(slice(int(size)) for size in sizes)]
        for part, sizes in zip(parts, shapes, strict=True)
    ]


@contextlib.contextmanager
def _held(tensors: Sequence[Tensor]) -> Iterator[None]:
    """Around one blocking collective on ``tensors``: after it, wait (releasing the GIL)
    until no thread of the process group holds any of the CPU ones any more."""
    cpu = [tensor for tensor in tensors if tensor.device.type == "cpu"]
    before = [_use_count(tensor) for tensor in cpu]
    yield
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    for tensor, count in zip(cpu, before, strict=True):
        while _use_count(tensor) > count and time.monotonic() < deadline:
            time.sleep(1e-4)


def _use_count(tensor: Tensor) -> int:
    """The C++ references to ``tensor`` (its Python object holds one): torch's undocumented
    ``Tensor._use_count()``; 0 where a torch lacks it (no collective waits)."""
    count = getattr(tensor, "_use_count", None)
    return int(count()) if callable(count) else 0
