"""Lightning: every K logged from one metric instance, in one process and under DDP."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from recall_at_k import RetrievalRecallAtK

KS = (1, 3, 5)
GALLERY = 16


def _data(num: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(num, 8, generator=gen)
    target = torch.randint(0, GALLERY, (num,), generator=gen)
    ids = torch.arange(num)
    return TensorDataset(features, target, ids)


class Ranker(pl.LightningModule):
    """Scores a fixed gallery of 16 items from 8 features; trains to put the target first."""

    def __init__(self, use_query_ids: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, GALLERY)
        self.recall = RetrievalRecallAtK(k=KS)
        self.use_query_ids = use_query_ids

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        features, target, _ = batch
        return torch.nn.functional.cross_entropy(self.layer(features), target)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        features, target, ids = batch
        scores = self.layer(features)
        if self.use_query_ids:
            self.recall.update(scores, target, query_ids=ids)
        else:
            self.recall.update(scores, target)
        self.log_dict(self.recall.per_k("val/"))  # the one line: all K, at epoch end

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _trainer(**kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _direct(model: Ranker, data: TensorDataset) -> dict[str, float]:
    features, target, _ = data.tensors
    metric = RetrievalRecallAtK(k=KS)
    with torch.no_grad():
        metric.update(model.layer(features), target)
    result = metric.compute()
    assert isinstance(result, dict)
    return {f"val/{key}": float(value) for key, value in result.items()}


def _logged(results: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in results.items() if key.startswith("val/")}


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_every_k_is_logged_without_an_epoch_end_hook_and_reset_between_runs() -> None:
    model = Ranker()
    first, second = _data(40, seed=1), _data(24, seed=2)
    trainer = _trainer()
    logged_first = trainer.validate(model, DataLoader(first, batch_size=7), verbose=False)[0]
    assert _logged(logged_first) == pytest.approx(_direct(model, first))
    assert sorted(_logged(logged_first)) == ["val/recall@1", "val/recall@3", "val/recall@5"]
    # A second run sees only its own data: Lightning reset the metric after the first.
    logged_second = trainer.validate(model, DataLoader(second, batch_size=5), verbose=False)[0]
    assert _logged(logged_second) == pytest.approx(_direct(model, second))
    assert int(model.recall.query_counts.sum()) == 0  # reset after the epoch


class _EpochRecorder(pl.Callback):
    def __init__(self, data: TensorDataset) -> None:
        self.data = data
        self.logged: list[dict[str, float]] = []
        self.direct: list[dict[str, float]] = []

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert isinstance(pl_module, Ranker)
        self.direct.append(_direct(pl_module, self.data))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.logged.append(_logged(trainer.callback_metrics))


def test_fit_logs_each_epoch_from_a_fresh_state() -> None:
    model = Ranker()
    train, val = _data(64, seed=3), _data(30, seed=4)
    recorder = _EpochRecorder(val)
    trainer = _trainer(max_epochs=2, callbacks=[recorder], num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(train, batch_size=16), DataLoader(val, batch_size=8))
    assert len(recorder.logged) == 2
    for logged, direct in zip(recorder.logged, recorder.direct, strict=True):
        assert logged == pytest.approx(direct)
    assert recorder.direct[0] != recorder.direct[1]  # the model changed between epochs
