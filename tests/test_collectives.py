"""recall_at_k._collectives on two gloo processes: each collective gives torch.distributed's
result, returns only once no thread of the process group holds its tensors any more
(their use counts are back), and gather_all_tensors gives what torchmetrics' does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import run_distributed
from torchmetrics.utilities.distributed import gather_all_tensors as torchmetrics_gather

from recall_at_k import _collectives

ROUNDS = 200  # a gloo thread still held a tensor after wait() in 25-43% of all_reduces


def _use_count(tensor: torch.Tensor) -> int:
    count: int = tensor._use_count()  # type: ignore[attr-defined]
    return count


def _worker(rank: int, world: int, payload: Any) -> dict[str, Any]:
    held = 0  # collectives after which a tensor of theirs was still held elsewhere
    for step in range(ROUNDS):
        value = torch.full((3,), float(rank + step))
        _collectives.all_reduce(value)
        held += _use_count(value) > 1
        assert value.tolist() == [float(1 + 2 * step)] * 3
        mine = torch.tensor([rank, step])
        parts = [torch.zeros_like(mine) for _ in range(world)]
        _collectives.all_gather(parts, mine)
        held += any(_use_count(t) > 1 for t in [*parts, mine])
        assert [p.tolist() for p in parts] == [[r, step] for r in range(world)]
        rows = torch.arange(4.0) if rank == 1 else torch.zeros(4)
        part = rows[1:3]  # a view, as the ranking broadcasts parts of a buffer
        _collectives.broadcast(part, src=1)
        held += _use_count(part) > 1
        assert part.tolist() == [1.0, 2.0]
    gathered = {}
    for name, tensor in {
        "scalar": torch.tensor(float(rank) + 0.5),
        "equal": torch.arange(6).reshape(2, 3) + 10 * rank,
        "uneven": torch.arange(4 * (rank + 1) * (3 - rank), dtype=torch.float64).reshape(
            2 * (rank + 1), 2 * (3 - rank)
        ),
        "none here": torch.ones(0 if rank == 0 else 3, 2),
    }.items():
        ours = _collectives.gather_all_tensors(tensor)
        theirs = torchmetrics_gather(tensor)
        gathered[name] = (ours, theirs, ours[rank] is tensor)
    return {"held": held, "gathered": gathered}


@pytest.mark.ddp
def test_collectives_return_once_gloo_let_go_and_gather_as_torchmetrics() -> None:
    for result in run_distributed(_worker, world_size=2):
        assert result["held"] == 0
        for name, (ours, theirs, own) in result["gathered"].items():
            assert own, name  # this process's own tensor, as torchmetrics returns it
            assert len(ours) == len(theirs) == 2, name
            for a, b in zip(ours, theirs, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
