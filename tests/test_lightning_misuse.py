"""Lightning misuse is reported where it happens, in a real ``Trainer``; the manual
epoch-end recipe of the docs logs under DDP without Lightning's ``sync_dist`` warning.

- ``self.log(name, metric)`` / ``self.log_dict(collection)`` of a metric whose
  ``compute()`` is a dict fail in Lightning only at epoch end ("must be a tensor"); the
  metric raises at the first ``self.log`` call instead, naming ``per_k``.
- ``self.log_dict(metric.compute())`` in ``on_validation_epoch_end`` under DDP makes
  Lightning warn once per key that ``sync_dist=True`` is recommended, although the values
  are already synchronised; ``sync_dist=True, reduce_fx="max"`` logs them unchanged and
  without the warning.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning_models import EndProcessGroup
from test_lightning_patterns import GALLERY, dense_reference, logged, make_data, trainer_for
from torch import Tensor
from torch.utils.data import DataLoader
from torchmetrics import MetricCollection
from torchmetrics.retrieval import RetrievalMRR

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

KS = (1, 3)


class Misuse(pl.LightningModule):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.layer = torch.nn.Linear(8, GALLERY)
        self.recall = RetrievalRecallAtK(k=KS)
        self.embedding = EmbeddingRecallAtK(k=KS, bidirectional=False)
        self.collection = MetricCollection(
            {"recall": RetrievalRecallAtK(k=KS), "mrr": RetrievalMRR()}, prefix="val/"
        )
        self.steps = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        features, target, ids = batch
        scores = self.layer(features)
        self.steps += 1
        if self.how == "log":
            self.recall.update(scores, target)
            self.log("val/recall", self.recall)
        elif self.how == "forward":
            self.recall(scores, target)
            self.log("val/recall", self.recall, on_step=True, on_epoch=False)
        elif self.how == "embedding":
            self.embedding.update(scores, target)
            self.log("val/emb", self.embedding)
        else:
            flat_target = torch.nn.functional.one_hot(target, GALLERY).flatten()
            self.collection.update(
                scores.flatten(), flat_target, indexes=ids.repeat_interleave(GALLERY)
            )
            self.log_dict(self.collection)


@pytest.mark.parametrize(
    ("how", "name", "class_name", "prefix"),
    [
        ("log", "val/recall", "RetrievalRecallAtK", "val/"),
        ("forward", "val/recall", "RetrievalRecallAtK", "val/"),
        ("embedding", "val/emb", "EmbeddingRecallAtK", "val/"),
        ("collection", "val/recall", "RetrievalRecallAtK", "val/"),
    ],
)
def test_logging_a_metric_of_several_k_raises_at_the_first_log_naming_per_k(
    tmp_path: Path, how: str, name: str, class_name: str, prefix: str
) -> None:
    model = Misuse(how)
    trainer = trainer_for(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            ValueError,
            match=rf"self.log\('{name}', metric\): this {class_name}'s compute\(\) is a dict"
            rf" of 2 values \(recall@1, recall@3\).*self.log_dict\(metric.per_k\('{prefix}'\)\)",
        ):
            trainer.validate(model, DataLoader(make_data(24, seed=1), batch_size=8), verbose=False)
    assert model.steps == 1  # at the first step, not at epoch end


def test_reading_the_forward_cache_outside_lightning_still_works() -> None:
    """Only Lightning's logging is refused: casts, copies and pickling read it freely."""
    metric = RetrievalRecallAtK(k=KS)
    value = metric(torch.rand(5, GALLERY), torch.randint(0, GALLERY, (5,)))
    assert metric._forward_cache == value
    metric.to(torch.float64)  # torchmetrics' _apply reads the forward cache
    assert copy.deepcopy(metric)._forward_cache.keys() == value.keys()
    assert pickle.loads(pickle.dumps(metric))._forward_cache.keys() == value.keys()
    one = RetrievalRecallAtK(k=3)
    assert torch.equal(
        one(torch.rand(5, GALLERY), torch.zeros(5, dtype=torch.long)), one._forward_cache
    )


# ------------------------------------------------------------------ the manual recipe, DDP


class RecordWarnings(pl.Callback):
    """Writes the warnings each process saw during validation to ``warnings-RANK.txt``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self._records = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._catcher.__exit__(None, None, None)
        text = "\n".join(str(record.message) for record in self._records)
        (self.folder / f"warnings-{trainer.global_rank}.txt").write_text(text)


class Manual(pl.LightningModule):
    """The docs' manual recipe ("new/") beside the one Lightning warns about ("old/")."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, GALLERY)
        self.old = RetrievalRecallAtK(k=KS, key="old/recall@{k}")
        self.new = RetrievalRecallAtK(k=KS, key="new/recall@{k}")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        features, target, ids = batch
        scores = self.layer(features)
        self.old.update(scores, target, query_ids=ids)
        self.new.update(scores, target, query_ids=ids)

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.old.compute())  # Lightning warns: sync_dist=True recommended
        self.old.reset()
        self.log_dict(self.new.compute(), sync_dist=True, reduce_fx="max")
        self.new.reset()


@pytest.mark.ddp
def test_manual_recipe_logs_the_synced_values_without_the_sync_dist_warning(
    tmp_path: Path,
) -> None:
    model = Manual()
    data = make_data(31, seed=5)  # two processes: DistributedSampler pads one query
    trainer = trainer_for(
        tmp_path,
        devices=2,
        strategy="ddp_spawn",
        callbacks=[EndProcessGroup(), RecordWarnings(tmp_path)],
    )
    trainer.validate(model, DataLoader(data, batch_size=4), verbose=False)
    features, target, _ = data.tensors
    with torch.no_grad():
        scores: Tensor = model.layer(features)
    want = dense_reference(scores, target, KS)
    columns = logged(tmp_path)
    for i, k in enumerate(KS):
        assert columns[f"new/recall@{k}"] == [pytest.approx(want[i], abs=1e-6)]
        assert columns[f"old/recall@{k}"] == [pytest.approx(want[i], abs=1e-6)]
    seen = (tmp_path / "warnings-0.txt").read_text()
    assert "self.log('old/recall@1', ..., sync_dist=True)" in seen  # the check can see it
    assert "'new/" not in seen, seen
