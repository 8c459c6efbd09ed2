"""One process of tests/test_process_exit.py, run as a script: a user's script under DDP.

``python exit_worker.py RANK WORLD ROUNDS DIR`` joins a gloo process group through the
file ``DIR/round<i>`` and, ROUNDS times over: computes EmbeddingRecallAtK (leave-one-out,
ranked on two worker threads) and RetrievalRecallAtK (dense rows) on this process's
share of the data of :func:`shares`, one of the two last in turn (so that either
metric's collectives come right before the teardown), then
``dist.destroy_process_group()`` at once, as a script ends. It prints one line per
round, ``RESULT <json>``, and exits 0.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys

import torch
import torch.distributed as dist
from torch import Tensor

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

KS = (1, 5)


def shares(rank: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Process ``rank``'s embeddings, labels, dense scores and true columns (of
    different sizes on each process)."""
    g = torch.Generator().manual_seed(rank)
    items, queries = 150 + 30 * rank, 40 + 10 * rank
    embeddings = torch.randn(items, 16, generator=g)
    labels = torch.randint(0, 12, (items,), generator=g)
    scores = torch.randn(queries, 50, generator=g)
    columns = torch.randint(-1, 50, (queries,), generator=g)
    return embeddings, labels, scores, columns


def values(result: dict[str, Tensor]) -> dict[str, float]:
    return {key: float(value) for key, value in result.items()}


def main(rank: int, world: int, rounds: int, where: str) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks, if the test times out
    torch.set_num_threads(2)  # the embedding ranking runs on two worker threads
    embeddings, labels, scores, columns = shares(rank)
    for round_ in range(rounds):
        dist.init_process_group(
            "gloo", init_method=f"file://{where}/round{round_}", rank=rank, world_size=world
        )
        embedding = EmbeddingRecallAtK(k=KS)
        embedding.update(embeddings, labels)
        dense = RetrievalRecallAtK(k=KS)
        dense.update(scores, columns)
        if round_ % 2:
            out = {"dense": values(dense.compute()), "embedding": values(embedding.compute())}
        else:
            out = {"embedding": values(embedding.compute()), "dense": values(dense.compute())}
        dist.destroy_process_group()
        print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
