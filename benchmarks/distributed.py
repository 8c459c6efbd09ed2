"""Distributed cost: time of ``compute()`` with 1 and 2 gloo processes (127.0.0.1).

- ``RetrievalRecallAtK``, dense form: the state is a histogram of max K ranks plus two
  counts, so the sync is one small reduction whatever the number of queries;
- ``EmbeddingRecallAtK``, leave-one-out, cosine, D = 128: the sync gathers every
  process's embeddings, then each process ranks only its share of the queries against the
  whole gallery and the hit counts are summed.

The processes are spawned by the tests' gloo helper (``tests/helpers.py``). The same
data in both cases, split evenly over the processes; each process runs one torch thread,
so two processes use two cores. ``update`` is not timed: after a barrier each process
times its ``compute()`` (sync included) on a fresh metric; a run's time is the slowest
process's, the table shows the median over the runs.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from embedding import DIM, make_data
from measure import Section, fmt_seconds, markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import run_distributed

KS = (1, 5, 10)
BATCH = 256


def _shard(num: int, rank: int, world_size: int) -> range:
    return range(num * rank // world_size, num * (rank + 1) // world_size)


def _timed_computes(
    make: Callable[[range, Any], Any], rows: range, group: Any, repeats: int
) -> dict[str, Any]:
    """Warm-up, then ``repeats`` timed ``compute()`` calls, each on a fresh metric."""
    make(rows, group).compute()
    times = []
    result: Any = None
    metric: Any = None
    for _ in range(repeats):
        metric = make(rows, group)
        dist.barrier(group=metric.process_group)
        begin = time.perf_counter()
        result = metric.compute()
        times.append(time.perf_counter() - begin)
    ranked = getattr(metric, "last_compute_num_queries_ranked", None)
    return {
        "times": times,
        "values": {key: float(value) for key, value in result.items()},
        "ranked": sum(ranked.values()) if ranked is not None else None,
    }


def _maker(case: str, size: Any) -> Callable[[range, Any], Any]:
    """Fresh metrics of ``case`` updated with the given rows of its data, in batches."""
    from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

    if case == "dense":
        num_queries, gallery = size
        gen = torch.Generator().manual_seed(0)
        inputs = torch.randn(num_queries, gallery, generator=gen)
        targets = torch.randint(0, gallery, (num_queries,), generator=gen)
        inputs[torch.arange(num_queries), targets] += 2.0
        new: Callable[..., Any] = functools.partial(RetrievalRecallAtK, KS, validate_args=False)
    else:
        inputs, targets = make_data(size)
        new = functools.partial(EmbeddingRecallAtK, KS)

    def make(rows: range, group: Any) -> Any:
        metric = new(process_group=group)
        for start in range(rows.start, rows.stop, BATCH):
            stop = min(start + BATCH, rows.stop)
            metric.update(inputs[start:stop], targets[start:stop])
        return metric

    return make


def worker(rank: int, world_size: int, payload: dict[str, Any]) -> dict[str, Any]:
    """Every case, first on a group of process 0 alone (all the data), then on all."""
    alone = dist.new_group([0])
    repeats = payload["repeats"]
    out = {}
    for case in ("dense", "embedding"):
        size = payload[case]
        make = _maker(case, size)
        total = size[0] if isinstance(size, tuple) else size
        single = None
        if rank == 0:
            single = _timed_computes(make, range(total), alone, repeats)
        dist.barrier()
        mine = _shard(total, rank, world_size)
        shared = _timed_computes(make, mine, None, repeats)
        dist.barrier()
        out[case] = {1: single, world_size: shared}
    return out


# ------------------------------------------------------------------------ report

HEAD: tuple[str, ...] = ("metric", "data (all processes)", "processes", "compute() time")
HEAD += ("time / 1 process", "queries ranked per process", "same result on every process")
HEAD += ("recall@1",)


def _table_row(name: str, data: str, parts: list[dict[str, Any]], single: float) -> list[str]:
    """The row of one case on ``len(parts)`` processes (``parts``: each one's timings)."""
    seconds = statistics.median(
        max(runs) for runs in zip(*(p["times"] for p in parts), strict=True)
    )
    values = parts[0]["values"]
    ranked = [p["ranked"] for p in parts]
    return [
        name,
        data,
        str(len(parts)),
        fmt_seconds(seconds),
        f"{seconds / single:.2f}x",
        "—" if None in ranked else ", ".join(f"{r:,}" for r in ranked),
        "yes" if all(p["values"] == values for p in parts) else "NO",
        f"{values['recall@1']:.4f}",
    ]


def run(dense_size: tuple[int, int], embedding_num: int, *, repeats: int) -> Section:
    """Both metrics with 1 and 2 processes: dense ``(Q, G)``, ``embedding_num`` embeddings."""
    payload = {"dense": dense_size, "embedding": embedding_num, "repeats": repeats}
    # New processes, no time limit: a measurement of their first computes, at any size.
    outs = run_distributed(worker, 2, payload, fresh=True, timeout=None)
    cases = [
        ("dense", "RetrievalRecallAtK, dense", "Q = {:,} x G = {:,}".format(*dense_size)),
        ("embedding", "EmbeddingRecallAtK, leave-one-out", f"N = {embedding_num:,}, D = {DIM}"),
    ]
    body = []
    for case, name, data in cases:
        single = statistics.median(outs[0][case][1]["times"])
        body.append(_table_row(name, data, [outs[0][case][1]], single))
        body.append(_table_row(name, data, [out[case][2] for out in outs], single))
    same_single = all(
        outs[0][case][1]["values"] == outs[0][case][2]["values"] for case, _, _ in cases
    )
    table = markdown_table(HEAD, body)
    return Section(
        "Time of `compute()` (sync included), gloo on 127.0.0.1, one torch thread a"
        f" process, median of {repeats} run(s) of the slowest process. The"
        " 1-process rows run on a process group of process 0 alone, holding all the data."
        f" 2-process results equal the 1-process ones: {'yes' if same_single else 'NO'}.\n\n"
        f"{table}"
    )
