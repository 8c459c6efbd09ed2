"""torchmetrics' wrappers around both metrics: each combination of wrapper and ``k`` the
docs list either gives the brute-force reference's values or raises a ValueError that
says what to use instead (never an obscure error or a silently wrong value).

``MetricTracker`` and ``BootStrapper`` with an int ``k`` are checked in
``test_conformance.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torchmetrics
from reference import reference_recall
from torch import Tensor
from torchmetrics import MetricCollection
from torchmetrics.wrappers import (
    BootStrapper,
    ClasswiseWrapper,
    MetricTracker,
    MinMaxMetric,
    MultioutputWrapper,
    MultitaskWrapper,
    Running,
)

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

KS = (1, 3)


def reference(scores: Tensor, target: Tensor, ks: tuple[int, ...] = KS) -> list[float]:
    mask = torch.arange(scores.shape[1]).unsqueeze(0) == target.unsqueeze(1)
    return reference_recall(scores.double().tolist(), mask.tolist(), None, ks, "pessimistic", "neg")


def batches(count: int = 3, seed: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    for step in range(count):
        scores = torch.rand(30, 8, generator=gen)
        target = torch.randint(0, 8, (30,), generator=gen)
        scores[torch.arange(8 * step), target[: 8 * step]] = 2.0  # better every step
        yield scores, target


# ------------------------------------------------------------------ what works


def test_tracker_of_a_collection_with_maximize_true_tracks_every_k() -> None:
    tracker = MetricTracker(MetricCollection({"recall": RetrievalRecallAtK(k=KS)}), maximize=True)
    wants = []
    for scores, target in batches():
        tracker.increment()
        tracker.update(scores, target)
        wants.append(reference(scores, target))
    all_steps = tracker.compute_all()
    best, step = tracker.best_metric(return_step=True)
    for i, key in enumerate(["recall@1", "recall@3"]):
        column = [w[i] for w in wants]
        assert all_steps[key].tolist() == pytest.approx(column)
        assert best[key] == pytest.approx(max(column))
        assert step[key] == column.index(max(column))


def test_running_with_several_k_is_the_recall_of_the_window() -> None:
    running = Running(RetrievalRecallAtK(k=KS), window=2)
    seen = list(batches())
    for scores, target in seen:
        running(scores, target)
    last_two = (torch.cat([s for s, _ in seen[1:]]), torch.cat([t for _, t in seen[1:]]))
    assert [float(v) for v in running.compute().values()] == pytest.approx(reference(*last_two))


def test_multitask_wrapper_with_several_k() -> None:
    (scores, target), (other, other_target) = list(batches(2))
    wrapper = MultitaskWrapper({"image": RetrievalRecallAtK(k=KS), "text": RetrievalRecallAtK(k=5)})
    wrapper.update({"image": scores, "text": other}, {"image": target, "text": other_target})
    result = wrapper.compute()
    assert [float(v) for v in result["image"].values()] == pytest.approx(reference(scores, target))
    assert float(result["text"]) == pytest.approx(reference(other, other_target, (5,))[0])


def test_min_max_metric_with_an_int_k() -> None:
    wrapper = MinMaxMetric(RetrievalRecallAtK(k=3))
    values = []
    seen_scores, seen_target = [], []
    for scores, target in batches():
        wrapper.update(scores, target)
        seen_scores.append(scores)
        seen_target.append(target)
        values.append(reference(torch.cat(seen_scores), torch.cat(seen_target), (3,))[0])
        result = wrapper.compute()
    assert float(result["raw"]) == pytest.approx(values[-1])
    assert float(result["max"]) == pytest.approx(max(values))
    assert float(result["min"]) == pytest.approx(min(values))


def test_multioutput_wrapper_with_an_int_k() -> None:
    (a, a_target), (b, b_target) = list(batches(2))
    wrapper = MultioutputWrapper(RetrievalRecallAtK(k=3), num_outputs=2)
    wrapper.update(torch.stack([a, b], dim=-1), torch.stack([a_target, b_target], dim=-1))
    assert wrapper.compute().tolist() == pytest.approx(
        [reference(a, a_target, (3,))[0], reference(b, b_target, (3,))[0]]
    )


# ------------------------------------------------------------------ clear errors


@pytest.mark.parametrize("k", [5, KS])
def test_classwise_wrapper_is_refused(k: int | tuple[int, ...]) -> None:
    scores, target = next(batches())
    wrapper = ClasswiseWrapper(RetrievalRecallAtK(k=k))
    with pytest.raises(ValueError, match=r"ClasswiseWrapper names the entries of a per-class"):
        wrapper(scores, target)
    wrapper.update(scores, target)
    with pytest.raises(ValueError, match=r"no\s+classes: its values are one per K.*per_k"):
        wrapper.compute()


@pytest.mark.parametrize(
    "make",
    [
        lambda m: BootStrapper(m, num_bootstraps=3),
        MinMaxMetric,
        lambda m: MultioutputWrapper(m, num_outputs=1),
    ],
    ids=["BootStrapper", "MinMaxMetric", "MultioutputWrapper"],
)
def test_wrappers_of_one_tensor_refuse_several_k(make: object) -> None:
    scores, target = next(batches())
    wrapper = make(RetrievalRecallAtK(k=KS))  # type: ignore[operator]
    if isinstance(wrapper, MultioutputWrapper):
        scores, target = scores.unsqueeze(-1), target.unsqueeze(-1)
    name = type(wrapper).__name__
    wrapper.update(scores, target)
    with pytest.raises(
        ValueError,
        match=rf"{name} needs a metric whose compute\(\) is one tensor, and this"
        r" RetrievalRecallAtK returns 2 values \(recall@1, recall@3\): give the wrapper one"
        r" metric per K, with an int `k`",
    ):
        wrapper.compute()


def test_bootstrapper_of_several_k_points_to_confidence_interval() -> None:
    scores, target = next(batches())
    wrapper = BootStrapper(RetrievalRecallAtK(k=KS), num_bootstraps=3)
    with pytest.raises(ValueError, match=r"or use confidence_interval\(\)"):
        wrapper(scores, target)


@pytest.mark.parametrize("k", [1, KS])
def test_bootstrapper_of_embeddings_is_refused(k: int | tuple[int, ...]) -> None:
    """Resampled embeddings find their own copies: R@1 0.015 became 0.64 in a trial."""
    wrapper = BootStrapper(EmbeddingRecallAtK(k=k), num_bootstraps=3)
    wrapper.update(torch.randn(20, 4), torch.randint(0, 5, (20,)))
    with pytest.raises(ValueError, match=r"a sample drawn twice finds its own copy"):
        wrapper.compute()


# torchmetrics >= 1.7 reads the metric's `higher_is_better` when a MetricTracker is built
# without `maximize`; 1.6 defaults to maximize=True there and reads nothing, so the refusal
# comes at best_metric() (the next test).
TRACKER_READS_THE_METRIC = tuple(int(p) for p in torchmetrics.__version__.split(".")[:2]) >= (1, 7)


@pytest.mark.skipif(
    not TRACKER_READS_THE_METRIC, reason="torchmetrics < 1.7 builds a tracker without reading it"
)
def test_tracker_of_several_k_is_refused_when_built() -> None:
    with pytest.raises(
        ValueError, match=r"MetricTracker.best_metric\(\) needs one tensor per step.*maximize=True"
    ):
        MetricTracker(RetrievalRecallAtK(k=KS))
    with pytest.raises(ValueError, match=r"one `maximize` entry per member.*pass maximize=True"):
        MetricTracker(MetricCollection({"recall": RetrievalRecallAtK(k=KS)}))


def test_best_metric_of_a_bare_tracker_of_several_k_says_what_to_use() -> None:
    tracker = MetricTracker(RetrievalRecallAtK(k=KS), maximize=True)  # not read when given
    for scores, target in batches(2):
        tracker.increment()
        tracker.update(scores, target)
    with pytest.raises(ValueError, match=r"track it in a MetricCollection with maximize=True"):
        tracker.best_metric()


def test_wrappers_that_take_one_tensor_accept_an_int_k_without_the_check_firing() -> None:
    """The caller check is silent for an int k, and for several K outside such wrappers."""
    scores, target = next(batches())
    metric = RetrievalRecallAtK(k=KS)
    metric.update(scores, target)
    assert metric.higher_is_better is True and RetrievalRecallAtK.higher_is_better is True
    assert [float(v) for v in metric.compute().values()] == pytest.approx(reference(scores, target))
    tracker = MetricTracker(RetrievalRecallAtK(k=3))  # reads higher_is_better: no error
    assert tracker.maximize is True
