"""What the code blocks of README.md and docs/*.md need to run (see ``tests/test_docs.py``).

A block is run as written. A marker on the line just before its opening fence,
``<!-- docs-test: NAME [NAME ...] -->`` (an HTML comment: neither GitHub nor the site
shows it), names what the block needs; every name is one of:

- ``continue``: run in the namespace of the previous block of the same file (a block
  that builds on the one before it);
- ``class-body``: the block is a fragment of a class body (indented ``def``s); it is
  dedented and run as the body of ``class Model(Model)``, a subclass of the ``Model`` in
  its namespace (from the previous block with ``continue``, or from a fixture);
- ``step-body``: the block is the body of a ``validation_step`` of the flat form; it is
  run as ``def validation_step(self, batch, batch_idx)`` after
  ``preds, target, indexes = self(batch)``, in a ``class Model(Model)`` as above;
- a fixture of :data:`FIXTURES`: names the block uses without defining them (a
  ``val_loader``, a ``model``, embeddings, ...), put in its namespace before it runs;
- ``trainer`` / ``trainer-flat``: after the block has run, the ``Model`` it defines (a
  ``LightningModule``) is fitted for one short epoch in a real ``Trainer`` on small
  random data, dense (``self(batch)`` returns ``scores, target``) or flat (it returns
  ``preds, target, indexes``), and whatever it logged is checked: some key holds a
  Recall@K value in [0, 1]. The harness gives the model its ``forward``, a ``loss``, and
  a ``training_step`` / ``configure_optimizers`` where the block has none.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 8
GALLERY = 12


def _embedding_data() -> dict[str, Any]:
    """``val_loader`` (batches of ``(images, labels)``) and ``model`` (embeds them)."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(40, FEATURES, generator=gen)
    labels = torch.randint(0, 5, (40,), generator=gen)
    model = torch.nn.Linear(FEATURES, 4)
    return {"val_loader": DataLoader(TensorDataset(images, labels), batch_size=16), "model": model}


def _captions() -> dict[str, Any]:
    """Images (with ids) and five captions per image (with the id of their image)."""
    gen = torch.Generator().manual_seed(0)
    image_ids = torch.arange(6)
    images = torch.randn(6, FEATURES, generator=gen)
    caption_image_ids = image_ids.repeat_interleave(5)
    captions = images[caption_image_ids] + 0.5 * torch.randn(30, FEATURES, generator=gen)
    return {
        "image_embeddings": images,
        "image_ids": image_ids,
        "caption_embeddings": captions,
        "caption_image_ids": caption_image_ids,
    }


def _reid() -> dict[str, Any]:
    """A query and a gallery set of person ids seen by cameras, as in Market-1501."""
    gen = torch.Generator().manual_seed(0)
    people = torch.randn(5, FEATURES, generator=gen)

    def side(num: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 5, (num,), generator=gen)
        return (
            people[ids] + 0.3 * torch.randn(num, FEATURES, generator=gen),
            ids,
            torch.randint(0, 3, (num,), generator=gen),
        )

    qf, qp, qc = side(10)
    gf, gp, gc = side(30)
    return {
        "query_features": qf,
        "query_person_ids": qp,
        "query_cameras": qc,
        "gallery_features": gf,
        "gallery_person_ids": gp,
        "gallery_cameras": gc,
    }


def _dense_batch() -> dict[str, Any]:
    """A ``metric`` (several K), dense ``scores`` / ``target`` and a ``batch`` with ``"index"``."""
    from recall_at_k import RetrievalRecallAtK

    gen = torch.Generator().manual_seed(0)
    return {
        "metric": RetrievalRecallAtK(k=(1, 5)),
        "scores": torch.randn(6, GALLERY, generator=gen),
        "target": torch.randint(0, GALLERY, (6,), generator=gen),
        "batch": {"index": torch.arange(6)},
    }


def _flat_batch() -> dict[str, Any]:
    """Flat ``preds`` / ``target`` / ``indexes`` (4 whole queries of 5 items each) and
    ``RetrievalRecallAtK``."""
    from recall_at_k import RetrievalRecallAtK

    gen = torch.Generator().manual_seed(0)
    return {
        "RetrievalRecallAtK": RetrievalRecallAtK,
        "preds": torch.randn(20, generator=gen),
        "target": torch.rand(20, generator=gen) < 0.3,
        "indexes": torch.arange(4).repeat_interleave(5),
    }


def _lightning() -> dict[str, Any]:
    """What the Lightning blocks import in the text around them."""
    from lightning.pytorch import LightningModule
    from torchmetrics import MetricCollection
    from torchmetrics.retrieval import RetrievalMRR

    from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

    return {
        "LightningModule": LightningModule,
        "RetrievalRecallAtK": RetrievalRecallAtK,
        "EmbeddingRecallAtK": EmbeddingRecallAtK,
        "MetricCollection": MetricCollection,
        "RetrievalMRR": RetrievalMRR,
    }


def _collection_model() -> dict[str, Any]:
    """A ``Model`` holding ``self.val_metrics``: Recall@1/5/10 beside ``RetrievalMRR``
    (flat form, prefix ``val/``), updated in ``validation_step``."""
    namespace = _lightning()
    code = textwrap.dedent(
        """
        class Model(LightningModule):
            def __init__(self):
                super().__init__()
                self.val_metrics = MetricCollection(
                    {"recall": RetrievalRecallAtK(k=(1, 5, 10)), "mrr": RetrievalMRR()},
                    prefix="val/",
                )

            def validation_step(self, batch, batch_idx):
                preds, target, indexes = self(batch)
                self.val_metrics.update(preds, target, indexes=indexes)
        """
    )
    exec(compile(code, "<docs fixture collection_model>", "exec"), namespace)
    return namespace


def _recall_model() -> dict[str, Any]:
    """A ``Model`` holding ``self.val_recall`` (Recall@1/5/10), updated in
    ``validation_step`` with dense scores."""
    namespace = _lightning()
    code = textwrap.dedent(
        """
        class Model(LightningModule):
            def __init__(self):
                super().__init__()
                self.val_recall = RetrievalRecallAtK(k=(1, 5, 10))

            def validation_step(self, batch, batch_idx):
                scores, target = self(batch)
                self.val_recall.update(scores, target)
        """
    )
    exec(compile(code, "<docs fixture recall_model>", "exec"), namespace)
    return namespace


def _val_batches() -> dict[str, Any]:
    """``val_batches``: three batches of dense ``(scores, target)``."""
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(8, GALLERY, generator=gen), torch.randint(0, GALLERY, (8,), generator=gen))
        for _ in range(3)
    ]
    return {"val_batches": batches}


FIXTURES: dict[str, Callable[[], dict[str, Any]]] = {
    "val_loader": _embedding_data,
    "captions": _captions,
    "reid": _reid,
    "dense_batch": _dense_batch,
    "flat_batch": _flat_batch,
    "lightning": _lightning,
    "collection_model": _collection_model,
    "recall_model": _recall_model,
    "val_batches": _val_batches,
}

# --------------------------------------------------------------------------- wrappers


def class_body(code: str) -> str:
    """A class-body fragment as the body of a subclass of the namespace's ``Model``."""
    return "class Model(Model):\n" + textwrap.indent(textwrap.dedent(code), "    ")


def step_body(code: str) -> str:
    """The body of a flat-form ``validation_step``, as a method of a ``Model`` subclass."""
    body = "preds, target, indexes = self(batch)\n" + textwrap.dedent(code)
    method = "def validation_step(self, batch, batch_idx):\n" + textwrap.indent(body, "    ")
    return class_body(method)


# --------------------------------------------------------------------------- trainer


def fit_and_check(namespace: dict[str, Any], tmp_path: Path, *, flat: bool) -> dict[str, float]:
    """Fit the block's ``Model`` for one short epoch; return what it logged (checked)."""
    import lightning.pytorch as pl
    from lightning.pytorch import LightningModule

    base = namespace["Model"]
    has_training_step = base.training_step is not LightningModule.training_step

    class Checked(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(FEATURES, GALLERY)

        def forward(self, batch: Any) -> Any:
            features, target = batch[0], batch[1]
            scores = self.layer(features)
            if not flat:
                return scores, target
            relevant = torch.nn.functional.one_hot(target, GALLERY).bool()
            indexes = batch[2].unsqueeze(1).expand(-1, GALLERY)
            return scores.reshape(-1), relevant.reshape(-1), indexes.reshape(-1)

        def loss(self, scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(scores, target)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if not has_training_step:

        def training_step(self: Any, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1])

        Checked.training_step = training_step  # type: ignore[method-assign]

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(48, FEATURES, generator=gen),
        torch.randint(0, GALLERY, (48,), generator=gen),
        torch.arange(48),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    loader = DataLoader(data, batch_size=16)
    trainer.fit(Checked(), loader, loader)
    logged = {key: float(value) for key, value in trainer.logged_metrics.items()}
    recalls = {key: value for key, value in logged.items() if "recall" in key.lower()}
    assert recalls, f"the model logged no Recall@K value: {sorted(logged)}"
    for key, value in recalls.items():
        assert 0.0 <= value <= 1.0 and not math.isnan(value), (key, value)
    return logged
