"""Typed users need no casts: ``compute()`` and the functions are typed by ``k``.

One ``mypy --strict`` run over a small user file: an int ``k`` types ``compute()`` and
``retrieval_recall_at_k`` / ``embedding_recall_at_k`` / ``recall_at_k_from_ranks`` as
``Tensor``; a sequence ``k`` (or the default) as ``dict[str, Tensor]``, so
``compute()["recall@1"]`` type-checks; ``bidirectional=True`` always gives a dict.
``per_k()`` is a ``Mapping[str, Metric]`` that Lightning's ``self.log_dict`` accepts.
``paired_comparison`` of two metrics is typed the same way (one ``PairedComparison`` or
a dict of them). ``QueryOutcomes.grouped`` returns ``dict[int, dict[str, Tensor]]`` for
any outcomes and takes ``outcomes.labels`` (``Tensor | None``) as it is typed. Each
``reveal_type`` line names the type it must reveal in its trailing comment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# mypy over a typed example, half a minute: `-m slow` runs it, as CI does.
pytestmark = pytest.mark.slow

USER_CODE = """\
from collections.abc import Mapping

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics import Metric

from recall_at_k import (
    EmbeddingRecallAtK,
    PairedComparison,
    QueryOutcomes,
    RetrievalRecallAtK,
    paired_comparison,
)
from recall_at_k.functional import (
    embedding_recall_at_k,
    recall_at_k_from_ranks,
    retrieval_recall_at_k,
)


def log_value(name: str, value: float) -> None:
    print(name, value)


single = RetrievalRecallAtK(k=5)
several = RetrievalRecallAtK(k=(1, 5))
default = RetrievalRecallAtK()
as_list = RetrievalRecallAtK(k=[1, 10], ties="expected")
log_value("r5", single.compute().item())
log_value("r1", several.compute()["recall@1"].item())
for key, value in default.compute().items():
    log_value(key, value.item())
by_key: dict[str, Tensor] = as_list.compute()
scalar: Tensor = single.compute()
reveal_type(single.compute())  # Tensor
reveal_type(several.compute())  # dict
reveal_type(default.compute())  # dict
reveal_type(as_list.compute())  # dict

e_single = EmbeddingRecallAtK(k=1, similarity="dot")
e_several = EmbeddingRecallAtK(k=(1, 5), exclude="same_group")
e_default = EmbeddingRecallAtK()
e_both = EmbeddingRecallAtK(k=1, bidirectional=True)
log_value("e1", e_single.compute().item())
log_value("e@5", e_several.compute()["recall@5"].item())
log_value("both", e_both.compute()["q2g/recall@1"].item())
reveal_type(e_single.compute())  # Tensor
reveal_type(e_several.compute())  # dict
reveal_type(e_default.compute())  # dict
reveal_type(e_both.compute())  # dict

scores = torch.rand(3, 4)
target = torch.tensor([0, 1, 2])
emb = torch.randn(6, 2)
labels = torch.tensor([0, 0, 1, 1, 2, 2])
reveal_type(retrieval_recall_at_k(scores, target, 1))  # Tensor
reveal_type(retrieval_recall_at_k(scores, target, k=np.int64(5)))  # Tensor
reveal_type(retrieval_recall_at_k(scores, target, (1, 5)))  # dict
reveal_type(retrieval_recall_at_k(scores, target, ties="expected"))  # dict
reveal_type(recall_at_k_from_ranks([1, 2], k=1))  # Tensor
reveal_type(recall_at_k_from_ranks(torch.tensor([1, 2]), [1, 2]))  # dict
reveal_type(embedding_recall_at_k(emb, labels, k=1))  # Tensor
reveal_type(embedding_recall_at_k(emb, labels, emb, labels, 1))  # Tensor
reveal_type(embedding_recall_at_k(emb, labels, None, None, k=5, similarity="dot"))  # Tensor
reveal_type(embedding_recall_at_k(emb, labels))  # dict
reveal_type(embedding_recall_at_k(emb, labels, emb, labels, k=[1, 5]))  # dict
log_value("f1", retrieval_recall_at_k(scores, target, k=1).item())
log_value("f5", embedding_recall_at_k(emb, labels, k=(1, 5))["recall@5"].item())
log_value("r1", recall_at_k_from_ranks([1, 3], k=(1, 5))["recall@1"].item())
views: Mapping[str, Metric] = several.per_k("val/")
reveal_type(e_both.per_k())  # Mapping

one: PairedComparison = paired_comparison(single, single)
log_value("p", paired_comparison(several, several)["recall@1"].p_value)
outcomes: QueryOutcomes = single.query_outcomes()
reveal_type(paired_comparison(single, single))  # PairedComparison
reveal_type(paired_comparison(e_several, e_several))  # dict of PairedComparison
reveal_type(paired_comparison(outcomes, outcomes))  # either
per_group = outcomes.grouped(torch.tensor([0]))
log_value("g", per_group[0]["recall@5"].item())
reveal_type(outcomes.grouped(outcomes.ids))  # grouped
e_outcomes = e_several.query_outcomes()
if isinstance(e_outcomes, QueryOutcomes):
    for label, recall in e_outcomes.grouped(e_outcomes.labels).items():
        log_value(f"class {label}", recall["recall@1"].item())


class Model(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.recall = RetrievalRecallAtK(k=(1, 5))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.recall.update(*batch)
        self.log_dict(self.recall.per_k("val/"))
        self.log_dict(self.recall.per_k("train/"), on_step=True, on_epoch=True)
"""

PAIRED = (  # how mypy writes a NamedTuple
    "tuple[float, float, float, float, int, int, int,"
    " fallback=recall_at_k._paired.PairedComparison]"
)
REVEALED = {
    "Tensor": "torch._tensor.Tensor",
    "dict": "dict[str, torch._tensor.Tensor]",
    "Mapping": "typing.Mapping[str, torchmetrics.metric.Metric]",
    "PairedComparison": PAIRED,
    "dict of PairedComparison": f"dict[str, {PAIRED}]",
    "either": f"{PAIRED} | dict[str, {PAIRED}]",
    "grouped": "dict[int, dict[str, torch._tensor.Tensor]]",
}
EXPECTED_REVEALS = {
    number: REVEALED[line.rsplit("# ", 1)[1]]
    for number, line in enumerate(USER_CODE.splitlines(), start=1)
    if line.startswith("reveal_type(")
}


def test_compute_is_typed_by_k_under_mypy_strict(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    user = tmp_path / "user_code.py"
    user.write_text(USER_CODE, encoding="utf-8")
    assert (SRC / "recall_at_k" / "py.typed").is_file(), "the package must ship py.typed"
    env = {**os.environ, "MYPYPATH": str(SRC)}
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-error-summary",
            "--hide-error-context",
            "--cache-dir",
            str(tmp_path / "mypy_cache"),
            str(user),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in completed.stdout.splitlines() if user.name + ":" in line]
    errors = [line for line in lines if ": error:" in line]
    assert not errors, "user code needs casts under mypy --strict:\n" + "\n".join(errors)
    reveals = {}
    for line in lines:
        match = re.match(r".*:(\d+): note: Revealed type is \"(.*)\"$", line)
        if match:
            reveals[int(match.group(1))] = match.group(2).replace("builtins.", "")
    assert reveals == EXPECTED_REVEALS, completed.stdout + completed.stderr
