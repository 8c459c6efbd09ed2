"""What Lightning refuses, as the docs say, and the manual epoch-end recipe under DDP.

- ``self.log(name, metric)`` / ``self.log_dict(collection)`` of a metric whose
  ``compute()`` is a dict: Lightning stops at epoch end ("must be a tensor"); the metric
  does not look at who reads it. ``per_k(prefix)`` (``test_lightning_patterns.py``) and an
  int ``k`` are what works.
- Calling the metric (``forward``) sets each view's batch value through the view's own
  ``forward``; casts, copies and pickling of a metric called so keep its results.
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
from lightning_models import EndProcessGroup, forked_ddp
from test_lightning_patterns import GALLERY, dense_reference, logged, make_data, trainer_for
from torch import Tensor
from torch.utils.data import DataLoader
from torchmetrics import MetricCollection
from torchmetrics.retrieval import RetrievalMRR

from recall_at_k import RetrievalRecallAtK

KS = (1, 3)


class LoggedWhole(pl.LightningModule):
    """Logs a metric of several K itself (``how="log"``), or a collection holding one."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.layer = torch.nn.Linear(8, GALLERY)
        self.recall = RetrievalRecallAtK(k=KS)
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
        else:
            flat_target = torch.nn.functional.one_hot(target, GALLERY).flatten()
            self.collection.update(
                scores.flatten(), flat_target, indexes=ids.repeat_interleave(GALLERY)
            )
            self.log_dict(self.collection)


@pytest.mark.parametrize(("how", "name"), [("log", "val/recall"), ("collection", "val/recall")])
def test_lightning_stops_at_epoch_end_when_a_logged_metric_returns_a_dict(
    tmp_path: Path, how: str, name: str
) -> None:
    model = LoggedWhole(how)
    trainer = trainer_for(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=rf"logged as '{name}' must be a tensor"):
            trainer.validate(model, DataLoader(make_data(24, seed=1), batch_size=8), verbose=False)
    assert model.steps == 3  # every step ran: Lightning's own check, at epoch end


def test_forward_then_cast_copy_and_pickle_keep_the_results() -> None:
    """``forward`` hands each view its batch value; a metric called so casts, copies
    and pickles with its views bound to the copy."""
    gen = torch.Generator().manual_seed(2)
    first = (torch.rand(5, GALLERY, generator=gen), torch.randint(0, GALLERY, (5,), generator=gen))
    second = (torch.rand(7, GALLERY, generator=gen), torch.randint(0, GALLERY, (7,), generator=gen))
    metric = RetrievalRecallAtK(k=KS)
    batch_value = metric(*first)
    assert [float(v) for v in batch_value.values()] == pytest.approx(dense_reference(*first, KS))
    metric(*second)
    both = dense_reference(torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]), KS)
    metric.to(torch.float64)
    for clone in (metric, copy.deepcopy(metric), pickle.loads(pickle.dumps(metric))):
        assert [float(v) for v in clone.compute().values()] == pytest.approx(both)
        views = clone.per_k("val/")
        assert [float(view.compute()) for view in views.values()] == pytest.approx(both)
    one = RetrievalRecallAtK(k=3)
    value = one(*first)
    assert float(value) == pytest.approx(dense_reference(*first, (3,))[0])


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
        strategy=forked_ddp(),
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
