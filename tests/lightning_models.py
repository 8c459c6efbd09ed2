"""LightningModules shared by the Lightning tests (importable by spawned DDP workers)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import TensorDataset

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

KS = (1, 3, 5)
GALLERY = 16


def make_data(num: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(num, 8, generator=gen)
    target = torch.randint(0, GALLERY, (num,), generator=gen)
    ids = torch.arange(num)
    return TensorDataset(features, target, ids)


def forked_ddp() -> DDPStrategy:
    """``ddp_spawn``'s launcher with its workers forked from the tests' fork server
    (``start_method="forkserver"``; tests/distributed_pool.py), not spawned: the same
    pickled trainer and model, gloo group and DistributedSampler padding, without each
    worker importing torch, torchmetrics, Lightning and the package again (CHANGELOG.md).
    tests/test_lightning.py keeps one ``"ddp_spawn"`` run."""
    return DDPStrategy(start_method="forkserver")


class EndProcessGroup(pl.Callback):
    """Ends each DDP worker's gloo process group once its run is over.

    Lightning leaves a gloo group alive when a spawned worker exits (it destroys only NCCL
    groups at exit). Its threads are then destroyed among the C++ static destructors, and
    in 3 of 44 runs here a worker aborted there ("terminate called without an active
    exception", no Python frame), after every value had been logged. The barrier
    lets both ranks finish their last collective before either group goes.
    """

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


class Ranker(pl.LightningModule):
    """Scores a fixed gallery of 16 items from 8 features; trains to put the target first."""

    def __init__(self, use_query_ids: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, GALLERY)
        self.recall = RetrievalRecallAtK(k=KS)
        self.plain = RetrievalRecallAtK(k=KS)  # the same, fed without query_ids
        self.use_query_ids = use_query_ids

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        features, target, _ = batch
        return torch.nn.functional.cross_entropy(self.layer(features), target)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        features, target, ids = batch
        scores = self.layer(features)
        if self.use_query_ids:
            self.recall.update(scores, target, query_ids=ids)
            self.plain.update(scores, target)
            self.log_dict(self.plain.per_k("plain/"))
        else:
            self.recall.update(scores, target)
        self.log_dict(self.recall.per_k("val/"))  # the one line: all K, at epoch end

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def embedding_data(num: int, seed: int) -> TensorDataset:
    """``num`` items of 8 features, 6 labels, ids."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(num, 8, generator=gen)
    labels = torch.randint(0, 6, (num,), generator=gen)
    return TensorDataset(features, labels, torch.arange(num))


class ShardedEmbedder(pl.LightningModule):
    """Embeds 8 features into 4; validation logs leave-one-out Recall@K, sharded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 4)
        self.recall = EmbeddingRecallAtK(KS, sharded=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        features, labels, ids = batch
        self.recall.update(self.layer(features), labels, ids=ids)
        self.log_dict(self.recall.per_k("val/"))
