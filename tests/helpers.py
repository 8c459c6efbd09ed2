"""Shared test helpers; first of all real processes joined by a gloo process group on 127.0.0.1.

Usage::

    def _worker(rank: int, world_size: int, payload) -> object:
        ...  # torch.distributed is initialised here; return something picklable

    results = run_distributed(_worker, world_size=2, payload=...)

The worker must be a module-level function (it is pickled by reference). Each process
returns a value; ``run_distributed`` returns them ordered by rank and re-raises a
worker's exception in the parent.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _entry(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    fn: Callable[..., Any],
    payload: Any,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            result = {"ok": fn(rank, world_size, payload)}
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything to the parent
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_distributed(
    fn: Callable[[int, int, Any], Any], world_size: int = 2, payload: Any = None
) -> list[Any]:
    """Spawn ``world_size`` gloo processes running ``fn(rank, world_size, payload)``."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _entry,
            args=(world_size, _free_port(), out_dir, fn, payload),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        results = []
        for rank in range(world_size):
            result = torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False)
            if "error" in result:
                raise AssertionError(f"rank {rank} failed:\n{result['error']}")
            results.append(result["ok"])
        return results
