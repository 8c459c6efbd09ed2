"""Lightning: every K logged from one metric instance, in one process and under DDP."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning_models import KS, EndProcessGroup, Ranker, make_data
from torch.utils.data import DataLoader, TensorDataset

from recall_at_k import RetrievalRecallAtK


def trainer_for(**kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def direct_recall(model: Ranker, data: TensorDataset) -> dict[str, float]:
    features, target, _ = data.tensors
    metric = RetrievalRecallAtK(k=KS)
    with torch.no_grad():
        metric.update(model.layer(features), target)
    result = metric.compute()
    assert isinstance(result, dict)
    return {f"val/{key}": float(value) for key, value in result.items()}


def logged_recall(results: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in results.items() if key.startswith("val/")}


pytestmark = pytest.mark.usefixtures("quiet_warnings")


def test_every_k_is_logged_without_an_epoch_end_hook_and_reset_between_runs() -> None:
    model = Ranker()
    first, second = make_data(40, seed=1), make_data(24, seed=2)
    trainer = trainer_for()
    logged_first = trainer.validate(model, DataLoader(first, batch_size=7), verbose=False)[0]
    assert logged_recall(logged_first) == pytest.approx(direct_recall(model, first))
    assert sorted(logged_recall(logged_first)) == ["val/recall@1", "val/recall@3", "val/recall@5"]
    # A second run sees only its own data: Lightning reset the metric after the first.
    logged_second = trainer.validate(model, DataLoader(second, batch_size=5), verbose=False)[0]
    assert logged_recall(logged_second) == pytest.approx(direct_recall(model, second))
    assert int(model.recall.query_counts.sum()) == 0  # reset after the epoch


class _EpochRecorder(pl.Callback):
    def __init__(self, data: TensorDataset) -> None:
        self.data = data
        self.logged: list[dict[str, float]] = []
        self.direct: list[dict[str, float]] = []

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert isinstance(pl_module, Ranker)
        self.direct.append(direct_recall(pl_module, self.data))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.logged.append(logged_recall(trainer.callback_metrics))


def test_fit_logs_each_epoch_from_a_fresh_state() -> None:
    model = Ranker()
    train, val = make_data(64, seed=3), make_data(30, seed=4)
    recorder = _EpochRecorder(val)
    trainer = trainer_for(max_epochs=2, callbacks=[recorder], num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(train, batch_size=16), DataLoader(val, batch_size=8))
    assert len(recorder.logged) == 2
    for logged, direct in zip(recorder.logged, recorder.direct, strict=True):
        assert logged == pytest.approx(direct)
    assert recorder.direct[0] != recorder.direct[1]  # the model changed between epochs


@pytest.mark.ddp
def test_ddp_fit_logs_the_single_process_values_and_padding_counts_once() -> None:
    # 31 validation queries on 2 processes: DistributedSampler pads one repeated query.
    train, val = make_data(64, seed=3), make_data(31, seed=4)
    model = Ranker(use_query_ids=True)
    trainer = trainer_for(
        max_epochs=2,
        devices=2,
        strategy="ddp_spawn",
        num_sanity_val_steps=0,
        callbacks=[EndProcessGroup()],
    )
    trainer.fit(model, DataLoader(train, batch_size=16), DataLoader(val, batch_size=8))
    logged = logged_recall(dict(trainer.callback_metrics))
    # ddp_spawn hands the trained weights back: evaluate them here, on one process.
    single = direct_recall(model, val)
    assert logged == pytest.approx(single)  # with query_ids: each query once
    plain = {
        key.replace("plain/", "val/"): float(value)
        for key, value in trainer.callback_metrics.items()
        if key.startswith("plain/")
    }
    assert sorted(plain) == sorted(single)
    assert plain != pytest.approx(single)  # without them the padded repeat counts twice
