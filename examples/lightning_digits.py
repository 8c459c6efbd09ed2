"""Train an embedding network with Lightning and log validation Recall@1/5/10 every epoch.

The main example: a small embedding network (an MLP, 64 -> 128 -> 32, L2-normalised)
learns scikit-learn's handwritten digits (1,797 8x8 images, 10 classes, no download) on
CPU, with a proxy loss (normalised softmax: one learnable proxy per class, cross-entropy
on the cosine similarities to the proxies). What matters for retrieval is the embedding,
so validation ranks every validation image against all the others (leave-one-out) with
:class:`recall_at_k.EmbeddingRecallAtK` and logs Recall@1, @5 and @10.

Logging every K takes one ``log_dict`` line in ``validation_step``, and no
``on_validation_epoch_end``::

    self.recall.update(embeddings, labels, ids=ids)
    self.log_dict(self.recall.per_k("val/"))

``per_k`` gives one ``Metric`` per K (``val/recall@1``, ``val/recall@5``,
``val/recall@10``); Lightning computes them at the end of the epoch (the ranking is done
once for all K, gathered across processes under DDP) and resets the metric for the next
epoch. The ``ids`` (each validation image's index in the data) make an image that
DistributedSampler repeats to even out the shards count once.

With ``--devices 2`` each process trains on half of every epoch with the same batch size
(so twice the effective batch, half the steps): the table differs a little from the
one-process run, but each epoch's validation values are exactly what one process would
compute for that model.

The script prints a per-epoch table (epoch, train loss, val R@1, R@5, R@10) and saves
the final Recall@K curve as a PNG with the metric's ``plot()``.

Run (about 10 s on two CPU cores, more with ``--devices 2``)::

    python examples/lightning_digits.py                # one process
    python examples/lightning_digits.py --devices 2    # DDP on CPU, two processes (gloo)
    python examples/lightning_digits.py --epochs 10 --plot curve.png
"""

from __future__ import annotations

import argparse
import logging
import math
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from recall_at_k import EmbeddingRecallAtK

KS = (1, 5, 10)
VAL_SIZE = 360


class DigitEmbedder(pl.LightningModule):
    """An MLP embedding (L2-normalised) trained with one learnable proxy per class."""

    def __init__(
        self, embedding_dim: int = 32, num_classes: int = 10, temperature: float = 0.2
    ) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, embedding_dim)
        )
        self.proxies = torch.nn.Parameter(torch.randn(num_classes, embedding_dim))
        self.temperature = temperature
        # Leave-one-out: every validation image is a query against all the others.
        self.recall = EmbeddingRecallAtK(k=KS)

    def forward(self, images: Tensor) -> Tensor:
        return F.normalize(self.net(images), dim=1)

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels, _ = batch
        cosine = self(images) @ F.normalize(self.proxies, dim=1).T
        loss = F.cross_entropy(cosine / self.temperature, labels)
        self.log("train/loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        images, labels, ids = batch
        self.recall.update(self(images), labels, ids=ids)
        self.log_dict(self.recall.per_k("val/"))  # every K, computed and reset at epoch end

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


class EpochTable(pl.Callback):
    """Prints one row per epoch from what was logged (on the first process only)."""

    columns = ("epoch", "train loss", *(f"val R@{k}" for k in KS))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            print("  ".join(f"{c:>10s}" for c in self.columns))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation ran at the end of this training epoch; both are logged by now.
        metrics = trainer.callback_metrics
        values = [metrics.get("train/loss"), *(metrics.get(f"val/recall@{k}") for k in KS)]
        if trainer.is_global_zero:
            cells = [f"{trainer.current_epoch + 1:>10d}"]
            cells += [f"{_number(v):>10.4f}" for v in values]
            print("  ".join(cells), flush=True)


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def digits_loaders(seed: int, batch_size: int) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """A fixed, stratified train / validation split (1,437 / 360 images)."""
    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_rows, val_rows = train_test_split(
        range(len(labels)), test_size=VAL_SIZE, stratify=digits.target, random_state=seed
    )
    train_idx, val_idx = torch.tensor(train_rows), torch.tensor(val_rows)
    train = TensorDataset(images[train_idx], labels[train_idx], train_idx)
    val = TensorDataset(images[val_idx], labels[val_idx], val_idx)  # ids: index in the data
    generator = torch.Generator().manual_seed(seed)
    return (
        DataLoader(train, batch_size=batch_size, shuffle=True, generator=generator),
        DataLoader(val, batch_size=128),
    )


def quiet_lightning() -> None:
    """No banners, tips or warnings about a tiny CPU run."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*is smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=".*treespec.*")  # Lightning vs newer torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5, help="training epochs (default 5)")
    parser.add_argument(
        "--devices", type=int, default=1, help="CPU processes; 2 or more runs DDP (gloo)"
    )
    parser.add_argument(
        "--plot",
        default="recall_at_k_digits.png",
        help="where to save the final Recall@K curve (default recall_at_k_digits.png)",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.devices < 1:
        parser.error("--epochs and --devices must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    quiet_lightning()
    # A model this small trains fastest on one thread per process: more threads only
    # contend (Lightning's DDP gives each CPU process cores // processes threads anyway).
    torch.set_num_threads(1)
    pl.seed_everything(args.seed, verbose=False)
    train_loader, val_loader = digits_loaders(args.seed, args.batch_size)
    model = DigitEmbedder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        callbacks=[EpochTable()],
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(model, train_loader, val_loader)

    # The last epoch's values, as logged (and synchronised across processes).
    final = {f"recall@{k}": trainer.callback_metrics[f"val/recall@{k}"] for k in KS}
    if trainer.is_global_zero:  # under DDP every process runs this script to the end
        fig, ax = model.recall.plot(final)
        ax.set_title(f"Leave-one-out Recall@K, digits validation set, epoch {args.epochs}")
        fig.savefig(args.plot, dpi=100)
        print("final: " + "  ".join(f"val/{key} = {float(v):.4f}" for key, v in final.items()))
        print(f"saved the Recall@K curve to {args.plot}")
    if torch.distributed.is_initialized():
        # Lightning leaves a gloo group alive at exit; ending it here keeps its threads
        # out of the C++ static destructors (a process aborted there now and then). The
        # barrier first lets gloo's threads let go of Lightning's last collective (rank 1
        # reaches this line as soon as fit() returns): up to torch 2.7,
        # destroy_process_group() could otherwise wait for such a thread for good.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return {key: float(value) for key, value in final.items()}


if __name__ == "__main__":
    main()
