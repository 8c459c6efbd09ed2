"""Distributed cost: time of ``compute()`` with 1 and 2 gloo processes (127.0.0.1).

- ``RetrievalRecallAtK``, dense form: the state is a histogram of max K ranks plus two
  counts, so the sync is one small reduction whatever the number of queries;
- ``EmbeddingRecallAtK``, leave-one-out, cosine, D = 128: the sync gathers every
  process's embeddings, then each process ranks only its share of the queries against the
  whole gallery and the hit counts are summed.

The same data, split evenly over the processes (:func:`measure.call`), one torch thread
each. After a barrier each process times its ``compute()`` (sync included) of a fresh
metric; a run's time is the slowest process's, the table shows the median run.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

import measure
import torch
import torch.distributed as dist
from dense import random_block
from embedding import DIM, make_data

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

KS = (1, 5, 10)
BATCH = 256
HEAD = ("metric", "data (all processes)", "processes", "compute() time", "time / 1 process")
HEAD += ("queries ranked per process", "same result on every process", "recall@1")


def worker(dense: list[int], embedding: int, repeats: int) -> dict[str, Any]:
    """Each case on this process's share of its data: a warm-up, then ``repeats`` timed
    ``compute()`` calls, each of a fresh metric after a barrier."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for case in ("dense", "embedding"):
        if case == "dense":
            inputs, targets, _ = random_block(*dense, torch.Generator().manual_seed(0))
            new: Callable[[], Any] = functools.partial(RetrievalRecallAtK, KS, validate_args=False)
        else:
            inputs, targets = make_data(embedding)
            new = functools.partial(EmbeddingRecallAtK, KS)
        total = inputs.shape[0]
        mine = range(total * rank // world, total * (rank + 1) // world)
        probes = [measure.Probe("cpu") for _ in range(repeats + 1)]
        for probe in probes:
            metric = new()
            for start in range(mine.start, mine.stop, BATCH):
                stop = min(start + BATCH, mine.stop)
                metric.update(inputs[start:stop], targets[start:stop])
            dist.barrier()
            with probe.timed():
                result = metric.compute()
        ranked = getattr(metric, "last_compute_num_queries_ranked", None)
        out[case] = {
            "times": [probe.seconds for probe in probes[1:]],
            "values": {key: float(value) for key, value in result.items()},
            "ranked": sum(ranked.values()) if ranked is not None else None,
        }
    return out


def run(*, dense_size: list[int], embedding_num: int, repeats: int, **_: object) -> measure.Section:
    """Both metrics with 1 and 2 processes: dense ``(Q, G)``, ``embedding_num`` embeddings."""
    kwargs = {"dense": dense_size, "embedding": embedding_num, "repeats": repeats}
    outs = {world: measure.call(worker, kwargs, world=world) or [] for world in (1, 2)}
    cases = [
        ("dense", "RetrievalRecallAtK, dense", "Q = {:,} x G = {:,}".format(*dense_size)),
        ("embedding", "EmbeddingRecallAtK, leave-one-out", f"N = {embedding_num:,}, D = {DIM}"),
    ]
    body = []
    for case, name, data in cases:
        single = statistics.median(outs[1][0][case]["times"])
        for world, parts in ((world, [out[case] for out in outs[world]]) for world in (1, 2)):
            seconds = statistics.median(map(max, zip(*(p["times"] for p in parts), strict=True)))
            values, ranked = parts[0]["values"], [p["ranked"] for p in parts]
            same = all(p["values"] == values for p in parts)
            body.append(
                [name, data, world, measure.fmt_seconds(seconds), f"{seconds / single:.2f}x"]
            )
            body[-1] += ["—" if None in ranked else ", ".join(f"{r:,}" for r in ranked)]
            body[-1] += ["yes" if same else "NO", f"{values['recall@1']:.4f}"]
    same = all(outs[1][0][case]["values"] == outs[2][0][case]["values"] for case, _, _ in cases)
    text = (
        "Time of `compute()` (sync included), gloo on 127.0.0.1, one torch thread a"
        f" process, median of {repeats} run(s) of the slowest process. The 1-process rows"
        " run on a process group of one process, holding all the data. 2-process results"
        f" equal the 1-process ones: {'yes' if same else 'NO'}."
    )
    return f"{text}\n\n{measure.table(HEAD, body)}", {}
