"""Recall@K in a plain PyTorch evaluation loop under torchrun (no Lightning, no Trainer).

Each process evaluates its share of scikit-learn's digits (1,797 images, no download)
through a ``DataLoader`` with a ``DistributedSampler``, feeds the embeddings of its
batches to :class:`recall_at_k.EmbeddingRecallAtK` (leave-one-out: every image is a
query against all the others), and every process calls ``compute()``, which gathers
the embeddings of all processes and returns the Recall@K of the whole dataset; the
first process prints it.

``DistributedSampler`` pads the data so that every process gets as many samples: 1,797
images on two processes make two shards of 899, so one image is evaluated twice. The
``ids`` (each image's index in the dataset) make that repeat count once. The script then
ranks the whole dataset in one process (``embedding_recall_at_k``) and checks that the
values are the same, bit for bit.

The model under evaluation is a fixed random projection of the 64 pixels to 32
dimensions with entries +-1 (the same seed on every process). The pixels are integers
from 0 to 16, so its outputs are small integers, exact in float32: each image gets the
same embedding bit for bit in whatever batch it is computed. Recall@K is a function of
the embeddings alone; with a real network, an embedding that changes in its last bits
with the batch it was computed in (matrix products blocked differently for another batch
shape) is the model's doing, not the metric's.

On GPUs, use the ``"nccl"`` backend and put the model, the batches and the metric on
``cuda:LOCAL_RANK``; nothing else changes.

Run (``torchrun`` is ``python -m torch.distributed.run``; either works)::

    torchrun --standalone --nproc_per_node 2 examples/torchrun_evaluation.py
    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/torchrun_evaluation.py
    python examples/torchrun_evaluation.py    # one process, no torchrun
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from recall_at_k import EmbeddingRecallAtK
from recall_at_k.functional import embedding_recall_at_k

KS = (1, 5, 10)


def make_model(seed: int = 0) -> torch.nn.Module:
    """A random projection 64 -> 32 with entries +-1, the same on every process."""
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.randint(0, 2, (32, 64), generator=generator) * 2.0 - 1.0)
    return model.eval()


def main() -> dict[str, float]:
    distributed = "RANK" in os.environ  # set by torchrun for every process it starts
    if distributed:
        dist.init_process_group("gloo")  # "nccl" on GPUs
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    try:
        digits = load_digits()
        images = torch.tensor(digits.data, dtype=torch.float32)  # pixels: integers 0..16
        labels = torch.tensor(digits.target, dtype=torch.int64)
        ids = torch.arange(len(labels))  # each image's index in the dataset
        dataset = TensorDataset(images, labels, ids)
        model = make_model()

        # --8<-- [start:loop]
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        loader = DataLoader(dataset, batch_size=128, sampler=sampler)
        metric = EmbeddingRecallAtK(k=KS)  # cosine similarity, leave-one-out
        with torch.no_grad():
            for batch_images, batch_labels, batch_ids in loader:
                # ids=: a sample DistributedSampler repeats to even out the shards counts once
                metric.update(model(batch_images), batch_labels, ids=batch_ids)
        # --8<-- [end:loop]

        if rank == 0:
            repeated = len(sampler) * world_size - len(dataset)
            print(
                f"Recall@K of a +-1 random projection of the digits ({len(dataset):,} images,"
                " leave-one-out)"
            )
            print(
                f"{world_size} process{'es' if world_size > 1 else ''} x {len(sampler):,}"
                f" samples (DistributedSampler repeats {repeated} to even out the shards;"
                " ids= counts repeats once)"
            )
        # --8<-- [start:compute]
        # compute() gathers the embeddings of every process: every process must call it.
        result = metric.compute()
        if rank == 0:
            print("   ".join(f"{key} = {float(value):.4f}" for key, value in result.items()))
        # --8<-- [end:compute]

        if rank == 0:
            with torch.no_grad():
                one_process = embedding_recall_at_k(model(images), labels, k=KS)
            same = all(torch.equal(result[key], one_process[key]) for key in result)
            print(f"one process on the whole dataset gives the same values, bit for bit: {same}")
            assert same, (result, one_process)
        return {key: float(value) for key, value in result.items()}
    finally:
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
