"""Every Lightning recipe the docs show, in a real ``Trainer`` with a ``CSVLogger``.

Each test asserts the logged keys and values in the CSV file against the brute-force
references on the very batches the module saw: per-step and per-epoch logging through
``forward`` + ``per_k``, an int ``k`` through ``self.log``, a ``MetricCollection`` beside
torchmetrics' ``RetrievalMRR``, a manual ``compute()``/``reset()``, a checkpoint callback
monitoring a per-K key, ``precision="16-true"``/``"bf16-true"`` (counts stay exact) and
two DDP processes (``ddp_spawn``'s launcher, workers forked: ``forked_ddp``) on an
odd-sized validation set (padding counts once).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from embedding_reference import Batch, reference_embedding_recall
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning_models import EndProcessGroup, forked_ddp
from reference import reference_recall
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.retrieval import RetrievalMRR

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

pytestmark = pytest.mark.usefixtures("quiet_warnings")

GALLERY = 6
KS = (1, 3)
EMBEDDING_KS = (1, 2)


def make_data(num: int, seed: int, features: int = 8, gallery: int = GALLERY) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(num, features, generator=gen),
        torch.randint(0, gallery, (num,), generator=gen),
        torch.arange(num),
    )


def trainer_for(tmp_path: Path, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        logger=CSVLogger(tmp_path, name="logs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def logged(tmp_path: Path) -> dict[str, list[float]]:
    """Every logged column of the CSV file: its non-empty values in order of steps."""
    (path,) = (tmp_path / "logs").glob("version_*/metrics.csv")
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    columns: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if key not in ("epoch", "step") and value != "":
                columns.setdefault(key, []).append(float(value))
    return columns


def dense_reference(
    scores: Tensor, target: Tensor, ks: tuple[int, ...], ties: str = "pessimistic"
) -> list[float]:
    mask = torch.arange(scores.shape[1]).unsqueeze(0) == target.unsqueeze(1)
    return reference_recall(scores.double().tolist(), mask.tolist(), None, ks, ties, "neg")


def embedding_reference(batches: list[tuple[Tensor, Tensor]], **options: Any) -> list[float]:
    values = reference_embedding_recall(
        [Batch(embeddings=e.double(), labels=y) for e, y in batches], EMBEDDING_KS, **options
    )
    return list(values.values())


def one_hot(target: Tensor, width: int) -> Tensor:
    return torch.nn.functional.one_hot(target, width).flatten()


class Recipes(pl.LightningModule):
    """Training: forward + per_k on step and epoch, int k via self.log, embeddings per step.

    Validation: per_k at epoch end (monitored by a checkpoint), forward + per_k on step
    and epoch, a MetricCollection with RetrievalMRR computed and reset at epoch end, the
    same collection logged member by member in the step, an EmbeddingRecallAtK computed
    by hand.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, GALLERY)
        self.train_recall = RetrievalRecallAtK(k=KS)
        self.train_top1 = RetrievalRecallAtK(k=1)
        self.train_embedding = EmbeddingRecallAtK(k=EMBEDDING_KS, similarity="dot")
        self.val_recall = RetrievalRecallAtK(k=KS)
        self.val_steps = RetrievalRecallAtK(k=KS)
        self.val_metrics = MetricCollection(
            {"recall": RetrievalRecallAtK(k=KS), "mrr": RetrievalMRR()}, prefix="val_c/"
        )
        self.val_members = MetricCollection(
            {"recall": RetrievalRecallAtK(k=KS), "mrr": RetrievalMRR()}
        )
        self.val_embedding = EmbeddingRecallAtK(k=EMBEDDING_KS, similarity="dot")
        self.train_seen: list[tuple[int, Tensor, Tensor]] = []
        self.val_seen: list[tuple[int, Tensor, Tensor, Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        features, target, _ = batch
        scores = self.layer(features)
        detached = scores.detach()
        self.train_recall(detached, target)
        self.log_dict(self.train_recall.per_k("train/"), on_step=True, on_epoch=True)
        self.train_top1(detached, target)
        self.log("train/top1", self.train_top1, on_step=False, on_epoch=True)
        self.train_embedding(detached, target)
        self.log_dict(self.train_embedding.per_k("train_emb/"), on_step=True, on_epoch=False)
        self.train_seen.append((self.current_epoch, detached.clone(), target.clone()))
        return torch.nn.functional.cross_entropy(scores, target)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        features, target, ids = batch
        scores = self.layer(features)
        self.val_recall.update(scores, target)
        self.log_dict(self.val_recall.per_k("val/"))
        self.val_steps(scores, target)
        self.log_dict(self.val_steps.per_k("val_s/"), on_step=True, on_epoch=True)
        self.val_metrics.update(
            scores.flatten(), one_hot(target, GALLERY), indexes=ids.repeat_interleave(GALLERY)
        )
        # The same collection logged member by member: one line, Lightning computes and resets.
        self.val_members.update(
            scores.flatten(), one_hot(target, GALLERY), indexes=ids.repeat_interleave(GALLERY)
        )
        self.log_dict(
            {**self.val_members["recall"].per_k("val_m/"), "val_m/mrr": self.val_members["mrr"]}
        )
        self.val_embedding.update(scores, target)
        self.val_seen.append((self.current_epoch, scores.clone(), target.clone(), ids.clone()))

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_metrics.compute())
        self.val_metrics.reset()
        result = self.val_embedding.compute()
        self.log_dict({f"val_emb/{key}": value for key, value in result.items()})
        self.val_embedding.reset()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_fit_logs_every_recipe_with_the_reference_values(tmp_path: Path) -> None:
    model = Recipes()
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "checkpoints",
        monitor="val/recall@1",
        mode="max",
        save_top_k=1,
        filename="best",
    )
    trainer = trainer_for(tmp_path, max_epochs=2, log_every_n_steps=1, callbacks=[checkpoint])
    trainer.fit(
        model,
        DataLoader(make_data(24, seed=1), batch_size=8),
        DataLoader(make_data(20, seed=2), batch_size=8),
    )
    columns = logged(tmp_path)
    keys = [f"recall@{k}" for k in KS]
    emb_keys = [f"recall@{k}" for k in EMBEDDING_KS]
    expected_columns = {
        *(f"train/{key}_step" for key in keys),
        *(f"train/{key}_epoch" for key in keys),
        "train/top1",
        *(f"train_emb/{key}" for key in emb_keys),
        *(f"val/{key}" for key in keys),
        *(f"val_s/{key}_step" for key in keys),
        *(f"val_s/{key}_epoch" for key in keys),
        *(f"val_c/{key}" for key in keys),
        "val_c/mrr",
        *(f"val_m/{key}" for key in keys),
        "val_m/mrr",
        *(f"val_emb/{key}" for key in emb_keys),
    }
    assert expected_columns <= set(columns), sorted(set(columns))

    # Per step: the batch values, through forward.
    steps = model.train_seen
    assert len(steps) == 6
    for i, key in enumerate(keys):
        want = [dense_reference(s, y, KS)[i] for _, s, y in steps]
        assert columns[f"train/{key}_step"] == pytest.approx(want, abs=1e-6), key
    for i, key in enumerate(emb_keys):
        want = [embedding_reference([(s, y)], similarity="dot")[i] for _, s, y in steps]
        assert columns[f"train_emb/{key}"] == pytest.approx(want, abs=1e-6), key

    val_batches = [(s, y) for _, s, y, _ in model.val_seen]
    assert len(val_batches) == 6
    for i, key in enumerate(keys):
        want = [dense_reference(s, y, KS)[i] for s, y in val_batches]
        assert columns[f"val_s/{key}_step"] == pytest.approx(want, abs=1e-6), key

    # Per epoch: everything the epoch saw, from a fresh state each epoch.
    for epoch in range(2):
        scores = torch.cat([s for e, s, _ in steps if e == epoch])
        target = torch.cat([y for e, _, y in steps if e == epoch])
        want = dense_reference(scores, target, KS)
        for i, key in enumerate(keys):
            assert columns[f"train/{key}_epoch"][epoch] == pytest.approx(want[i], abs=1e-6)
        top1 = dense_reference(scores, target, (1,))[0]
        assert columns["train/top1"][epoch] == pytest.approx(top1, abs=1e-6)

    val_recall1 = []
    for epoch in range(2):
        seen = [(s, y, ids) for e, s, y, ids in model.val_seen if e == epoch]
        scores = torch.cat([s for s, _, _ in seen])
        target = torch.cat([y for _, y, _ in seen])
        want = dense_reference(scores, target, KS)
        val_recall1.append(want[0])
        for i, key in enumerate(keys):
            assert columns[f"val/{key}"][epoch] == pytest.approx(want[i], abs=1e-6), key
            assert columns[f"val_c/{key}"][epoch] == pytest.approx(want[i], abs=1e-6), key
            assert columns[f"val_m/{key}"][epoch] == pytest.approx(want[i], abs=1e-6), key
            assert columns[f"val_s/{key}_epoch"][epoch] == pytest.approx(want[i], abs=1e-6), key
        mrr = RetrievalMRR()
        for s, y, ids in seen:
            mrr.update(s.flatten(), one_hot(y, GALLERY), indexes=ids.repeat_interleave(GALLERY))
        assert columns["val_c/mrr"][epoch] == pytest.approx(float(mrr.compute()), abs=1e-6)
        assert columns["val_m/mrr"][epoch] == pytest.approx(float(mrr.compute()), abs=1e-6)
        emb = embedding_reference([(scores, target)], similarity="dot")
        for i, key in enumerate(emb_keys):
            assert columns[f"val_emb/{key}"][epoch] == pytest.approx(emb[i], abs=1e-6), key

    assert columns["val/recall@1"] == pytest.approx(val_recall1, abs=1e-6)
    assert checkpoint.best_model_score is not None
    assert float(checkpoint.best_model_score) == pytest.approx(max(val_recall1), abs=1e-6)
    assert Path(checkpoint.best_model_path).is_file()


class AllTied(pl.LightningModule):
    """Every query's 3 items tie: with ties="expected", R@1 = 1/3 and R@2 = 2/3 exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 3)
        self.recall = RetrievalRecallAtK(k=(1, 2), ties="expected")
        self.top1 = RetrievalRecallAtK(k=1, ties="expected")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        features, target, _ = batch
        scores = self.layer(features) * 0  # in the module's precision
        self.recall.update(scores, target)
        self.log_dict(self.recall.per_k("val/"))
        self.top1.update(scores, target)
        self.log("val/top1", self.top1)


@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_true_half_precision_keeps_counts_exact(tmp_path: Path, precision: str) -> None:
    model = AllTied()
    trainer = trainer_for(tmp_path, precision=precision)
    trainer.validate(
        model, DataLoader(make_data(20_000, seed=3, gallery=3), batch_size=1000), verbose=False
    )
    columns = logged(tmp_path)
    assert columns["val/recall@1"] == pytest.approx([1 / 3], rel=1e-6, abs=0)
    assert columns["val/recall@2"] == pytest.approx([2 / 3], rel=1e-6, abs=0)
    assert columns["val/top1"] == pytest.approx([1 / 3], rel=1e-6, abs=0)


class Padded(pl.LightningModule):
    """Flat form with complete queries, and embeddings with ids, under DDP padding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, GALLERY)
        self.flat = RetrievalRecallAtK(k=KS, complete_queries=True)
        self.plain = RetrievalRecallAtK(k=KS)  # the padded repeat counts twice here
        self.embedding = EmbeddingRecallAtK(k=EMBEDDING_KS, similarity="dot")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        features, target, ids = batch
        scores = self.layer(features)
        self.flat.update(scores.flatten(), one_hot(target, GALLERY), ids.repeat_interleave(GALLERY))
        self.log_dict(self.flat.per_k("flat/"))
        self.plain.update(
            scores.flatten(), one_hot(target, GALLERY), indexes=ids.repeat_interleave(GALLERY)
        )
        self.log_dict(self.plain.per_k("plain/"))
        self.embedding.update(scores, target, ids=ids)
        self.log_dict(self.embedding.per_k("emb/"))


@pytest.mark.ddp
def test_ddp_on_an_odd_validation_set_counts_padding_once(tmp_path: Path) -> None:
    model = Padded()
    data = make_data(31, seed=4)  # two processes: DistributedSampler pads one query
    features, target, _ = data.tensors
    with torch.no_grad():  # the padded query (the first) ranks its positive third
        target[0] = model.layer(features[0]).argsort(descending=True)[2]
    trainer = trainer_for(tmp_path, devices=2, strategy=forked_ddp(), callbacks=[EndProcessGroup()])
    trainer.validate(model, DataLoader(data, batch_size=4), verbose=False)
    columns = logged(tmp_path)
    with torch.no_grad():
        scores = model.layer(features)
    want = dense_reference(scores, target, KS)
    # The run did pad: counted twice, the first query's positive falls to rank 5.
    assert columns["plain/recall@3"] != pytest.approx([want[1]], abs=1e-6)
    for i, k in enumerate(KS):
        assert columns[f"flat/recall@{k}"] == pytest.approx([want[i]], abs=1e-6)
    emb = embedding_reference([(scores, target)], similarity="dot")
    for i, k in enumerate(EMBEDDING_KS):
        assert columns[f"emb/recall@{k}"] == pytest.approx([emb[i]], abs=1e-6)
