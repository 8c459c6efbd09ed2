"""Per-K views: one Metric per output key, bound to their parent through copies."""

from __future__ import annotations

import copy
import pickle
import warnings

import torch

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK


def _filled() -> RetrievalRecallAtK:
    metric = RetrievalRecallAtK(k=(1, 2), key="R{k}")
    metric.update(torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.8, 0.3]]), torch.tensor([0, 2]))
    return metric


def test_views_read_the_parent_and_reset_it() -> None:
    metric = _filled()
    views = metric.per_k("val/")
    assert list(views) == ["val/R1", "val/R2"]
    result = metric.compute()
    assert isinstance(result, dict)
    assert {k: float(v.compute()) for k, v in views.items()} == {
        "val/R1": float(result["R1"]),
        "val/R2": float(result["R2"]),
    }
    # the parent's next update is seen by the views (no stale cache)
    metric.update(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([0]))
    assert float(views["val/R1"].compute()) == float(metric.compute()["R1"])  # type: ignore[index]
    views["val/R2"].reset()
    assert int(metric.query_counts.sum()) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.isnan(views["val/R1"].compute())


def test_views_follow_their_parent_through_copies() -> None:
    metric = _filled()
    for clone in (copy.deepcopy(metric), pickle.loads(pickle.dumps(metric))):
        clone.update(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([0]))
        view = clone.per_k()["R1"]
        assert view.parent is clone
        assert float(view.compute()) == float(clone.compute()["R1"])  # type: ignore[index]
    assert int(metric.query_counts.sum()) == 2  # the original is untouched


def test_embedding_views_have_the_bidirectional_keys() -> None:
    metric = EmbeddingRecallAtK(k=(1, 3), bidirectional=True, directions=("i2t", "t2i"))
    metric.update(torch.randn(6, 4), torch.arange(6), role="query")
    metric.update(torch.randn(12, 4), torch.arange(12) % 6, role="gallery")
    views = metric.per_k("val/")
    assert list(views) == [
        "val/i2t/recall@1",
        "val/i2t/recall@3",
        "val/t2i/recall@1",
        "val/t2i/recall@3",
    ]
    result = metric.compute()
    assert isinstance(result, dict)
    for key, view in views.items():
        assert torch.equal(view.compute(), result[key.removeprefix("val/")])
