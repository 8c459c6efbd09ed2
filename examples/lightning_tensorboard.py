"""Log every Recall@K and the Recall@K curve to TensorBoard, beside a CSV file (Lightning).

The main example's model and data (``examples/lightning_digits.py``: an embedding MLP
trained on scikit-learn's digits, leave-one-out Recall@1/5/10 on 360 validation images,
no download), trained with two loggers at once: Lightning's ``CSVLogger`` and its
``TensorBoardLogger`` (``pip install tensorboard``). The model logs every K with one line
in ``validation_step``, as in the main example::

    self.log_dict(self.recall.per_k("val/"))

so both loggers get the scalars ``val/recall@1``, ``val/recall@5`` and ``val/recall@10``
after every validation. A small callback then draws the epoch's Recall@K curve with the
metric's ``plot()`` (from the values just logged: nothing is ranked twice) and adds it
to TensorBoard as the figure ``val/recall@K_curve`` (TensorBoard's "Images" tab, one per
epoch, at ``trainer.global_step``).

Run (about 10 s on two CPU cores)::

    python examples/lightning_tensorboard.py
    tensorboard --logdir lightning_logs/tensorboard
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import matplotlib.pyplot as plt
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

# The main example, beside this file (Python puts a script's folder on sys.path).
from lightning_digits import KS, DigitEmbedder, digits_loaders, quiet_lightning

CURVE_TAG = "val/recall@K_curve"


# --8<-- [start:callback]
class RecallCurveToTensorBoard(pl.Callback):
    """After each validation, adds the Recall@K curve of the values just logged to
    TensorBoard (on the first process, which holds the logger's writer)."""

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        assert isinstance(pl_module, DigitEmbedder)
        # The epoch's values, computed (and synchronised) once by Lightning.
        values = {f"recall@{k}": trainer.callback_metrics[f"val/recall@{k}"] for k in KS}
        fig, ax = pl_module.recall.plot(values)
        ax.set_title(f"Leave-one-out Recall@K, epoch {trainer.current_epoch + 1}")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_figure(CURVE_TAG, fig, global_step=trainer.global_step)
        plt.close(fig)


# --8<-- [end:callback]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="training epochs (default 3)")
    parser.add_argument("--logdir", default="lightning_logs", help="(default lightning_logs)")
    args = parser.parse_args(argv)
    quiet_lightning()
    torch.set_num_threads(1)  # a model this small trains fastest on one thread a process
    pl.seed_everything(0, verbose=False)
    train_loader, val_loader = digits_loaders(seed=0, batch_size=32)
    # --8<-- [start:trainer]
    csv_logger = CSVLogger(args.logdir, name="csv")
    tb_logger = TensorBoardLogger(args.logdir, name="tensorboard", default_hp_metric=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        logger=[csv_logger, tb_logger],  # both get every logged value
        callbacks=[RecallCurveToTensorBoard()],
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(DigitEmbedder(), train_loader, val_loader)
    # --8<-- [end:trainer]

    final = {f"val/recall@{k}": float(trainer.callback_metrics[f"val/recall@{k}"]) for k in KS}
    if trainer.is_global_zero:
        print(f"epoch {args.epochs}: " + "  ".join(f"{key} = {v:.4f}" for key, v in final.items()))
        print(f"CSV: every K, every epoch, in {Path(csv_logger.log_dir) / 'metrics.csv'}")
        print(f"TensorBoard: the same scalars and the figure {CURVE_TAG!r} in {tb_logger.log_dir}")
        print(f"view them with: tensorboard --logdir {Path(args.logdir) / 'tensorboard'}")
    return final


if __name__ == "__main__":
    main()
