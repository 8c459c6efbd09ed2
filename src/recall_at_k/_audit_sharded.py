"""The protocol audit's codes over every process's rows, for a sharded gallery.

PLACEHOLDER: this version gathers every process's rows (a whole copy on each process)
and calls :func:`recall_at_k._audit.codes`; the version that never holds all rows
replaces it. The signature and the result are the contract.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k import _audit

PLACEHOLDER = True
"""This version gathers every row (tests of the sharded gallery's memory know it)."""


def sharded_codes(
    local: Tensor, counts: list[int], labels: Tensor, groups: Tensor, group: Any
) -> _audit.Codes:
    """:func:`recall_at_k._audit.codes` of the concatenation of every process's stored
    rows in rank order (``local``: this process's ``[n, D]``, bits as stored, float32 or
    wider, every process the same dtype; ``counts``: rows per process; ``labels``,
    ``groups``: gathered, in stored order). Collective over ``group``."""
    world = dist.get_world_size(group)
    largest = max(counts) if counts else 0
    padded = torch.zeros((largest, local.shape[1]), dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    every = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(every, padded, group=group)
    rows = torch.cat([block[:count] for block, count in zip(every, counts, strict=True)])
    return _audit.codes(rows, labels, groups)
