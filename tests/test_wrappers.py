"""torchmetrics' wrappers around both metrics, as the docs list them: each combination
the docs say works gives the brute-force reference's values; ``BootStrapper`` of
embeddings is inflated as the docs say, and ``confidence_interval()`` is the way
instead; this package's own entry points, given a wrapper or its output, raise a
``ValueError`` that names the argument and the remedy.

The metrics do not look for the wrapper around them. ``MetricTracker`` and
``BootStrapper`` with an int ``k`` (against a reference metric under the same
resampling) are checked in ``test_conformance.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from embedding_reference import Batch, reference_embedding_recall
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

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK, paired_comparison

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


def test_higher_is_better_is_a_plain_class_attribute() -> None:
    """``MetricTracker`` reads it to choose ``maximize``: True, for any ``k``."""
    for cls in (RetrievalRecallAtK, EmbeddingRecallAtK):
        assert cls.higher_is_better is True
        assert cls(k=KS).higher_is_better is True
    assert MetricTracker(RetrievalRecallAtK(k=3)).maximize is True


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


def test_tracker_of_an_int_k_tracks_it() -> None:
    tracker = MetricTracker(RetrievalRecallAtK(k=3))
    wants = []
    for scores, target in batches():
        tracker.increment()
        tracker.update(scores, target)
        wants.append(reference(scores, target, (3,))[0])
    best, step = tracker.best_metric(return_step=True)
    assert tracker.compute_all().tolist() == pytest.approx(wants)
    assert best == pytest.approx(max(wants))
    assert step == wants.index(max(wants))


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


def test_min_max_metric_one_wrapper_per_k_in_a_collection() -> None:
    """Several K: one wrapper per K, each with an int ``k``."""
    collection = MetricCollection(
        {f"recall@{k}": MinMaxMetric(RetrievalRecallAtK(k=k)) for k in KS}
    )
    seen = list(batches())
    for scores, target in seen:
        collection.update(scores, target)
    result = collection.compute()
    whole = reference(torch.cat([s for s, _ in seen]), torch.cat([t for _, t in seen]))
    for k, want in zip(KS, whole, strict=True):
        assert float(result[f"recall@{k}_raw"]) == pytest.approx(want)


def test_multioutput_wrapper_with_an_int_k() -> None:
    (a, a_target), (b, b_target) = list(batches(2))
    wrapper = MultioutputWrapper(RetrievalRecallAtK(k=3), num_outputs=2)
    wrapper.update(torch.stack([a, b], dim=-1), torch.stack([a_target, b_target], dim=-1))
    assert wrapper.compute().tolist() == pytest.approx(
        [reference(a, a_target, (3,))[0], reference(b, b_target, (3,))[0]]
    )


@pytest.mark.parametrize("wrap", [BootStrapper, MinMaxMetric], ids=["BootStrapper", "MinMax"])
def test_wrappers_of_one_tensor_do_not_take_the_dict_of_several_k(wrap: type) -> None:
    """What the docs say: such a wrapper fails with its own error on several K."""
    scores, target = next(batches())
    wrapper = wrap(RetrievalRecallAtK(k=KS))
    wrapper.update(scores, target)
    with pytest.raises((TypeError, RuntimeError, ValueError)):
        wrapper.compute()


def test_classwise_wrapper_does_not_give_recall_per_key() -> None:
    """The docs: it names the entries of a per-class tensor; given the dict of several K
    it returns the key names in place of the values."""
    scores, target = next(batches())
    wrapper = ClasswiseWrapper(RetrievalRecallAtK(k=KS))
    wrapper.update(scores, target)
    values = list(wrapper.compute().values())
    assert not any(isinstance(value, Tensor) for value in values), values


# ------------------------------------------------------------------ BootStrapper of embeddings


def _embeddings(num: int = 120, seed: int = 3) -> tuple[Tensor, Tensor]:
    """Random embeddings of 60 labels (pairs): Recall@1 is near chance."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num, 16, generator=gen), torch.arange(num) // 2


def test_resampled_embeddings_find_their_own_copies() -> None:
    """Why the docs advise against BootStrapper for EmbeddingRecallAtK: in rows drawn with
    replacement, every row whose sample was drawn twice is a hit at rank 1."""
    embeddings, labels = _embeddings()
    gen = torch.Generator().manual_seed(5)
    rows = torch.multinomial(torch.ones(len(labels)), len(labels), replacement=True, generator=gen)
    metric = EmbeddingRecallAtK(k=1)
    metric.update(embeddings[rows], labels[rows])
    repeated = (torch.bincount(rows, minlength=len(labels)) > 1)[rows].double().mean()
    want = reference_embedding_recall(
        [Batch(embeddings=embeddings[rows].double(), labels=labels[rows])], (1,)
    )
    assert float(metric.compute()) == pytest.approx(want["recall@1"], abs=1e-6)
    assert float(metric.compute()) >= float(repeated) > 0.5


def test_bootstrapper_of_embeddings_is_inflated_and_confidence_interval_is_not() -> None:
    embeddings, labels = _embeddings()
    metric = EmbeddingRecallAtK(k=1)
    metric.update(embeddings, labels)
    torch.manual_seed(0)
    wrapper = BootStrapper(EmbeddingRecallAtK(k=1), num_bootstraps=5)
    wrapper.update(embeddings, labels)
    value = float(metric.compute())
    low, high = metric.confidence_interval().tolist()
    assert low <= value <= high < 0.3
    with pytest.warns(UserWarning, match=r"identical item of their own label.*identical_positive"):
        inflated = float(wrapper.compute()["mean"])
    assert inflated > high + 0.3


# ------------------------------------------------------------------ our entry points


@pytest.mark.parametrize("prefix", [5, None, ("val/",)])
def test_per_k_names_its_prefix_argument(prefix: object) -> None:
    with pytest.raises(ValueError, match=r"`prefix` of per_k\(\) must be a str .* per_k\('val/'\)"):
        RetrievalRecallAtK(k=KS).per_k(prefix)  # type: ignore[arg-type]


def _wrapped_values() -> dict[str, object]:
    scores, target = next(batches())
    boot = BootStrapper(RetrievalRecallAtK(k=3), num_bootstraps=3)
    outputs = MultioutputWrapper(RetrievalRecallAtK(k=3), num_outputs=2)
    boot.update(scores, target)
    outputs.update(torch.stack([scores, scores], -1), torch.stack([target, target], -1))
    return {"number": 0.5, "multioutput": outputs.compute(), "boot-list": [boot.compute()["mean"]]}


@pytest.mark.parametrize(
    ("name", "match"),
    [
        (
            "number",
            r"`val` of plot\(\) must be a result of RetrievalRecallAtK.compute\(\).*got float",
        ),
        ("multioutput", r"got a tensor of shape \[2\]; .*plot the wrapped metric's compute\(\)"),
        ("boot-list", r"`val` of plot\(\) is one value, and this RetrievalRecallAtK has 2"),
    ],
)
def test_plot_names_val_when_given_a_wrapper_output(name: str, match: str) -> None:
    pytest.importorskip("matplotlib")
    metric = RetrievalRecallAtK(k=3) if name != "boot-list" else RetrievalRecallAtK(k=KS)
    with pytest.raises(ValueError, match=match):
        metric.plot(_wrapped_values()[name])  # type: ignore[arg-type]


def test_plot_names_interval_when_given_something_else() -> None:
    pytest.importorskip("matplotlib")
    metric = RetrievalRecallAtK(k=KS)
    metric.update(*next(batches()))
    with pytest.raises(
        ValueError,
        match=r"`interval` of plot\(\) must be a result of confidence_interval\(\).*\[\[\], \[\]\]",
    ):
        metric.plot(metric.compute(), interval=metric.compute())


def test_paired_comparison_names_the_argument_that_is_a_wrapper() -> None:
    scores, target = next(batches())
    metric = RetrievalRecallAtK(k=3)
    metric.update(scores, target, query_ids=torch.arange(30))
    wrapper = BootStrapper(RetrievalRecallAtK(k=3), num_bootstraps=2)
    with pytest.raises(ValueError, match=r"`b` must be a RetrievalRecallAtK or .*got BootStrapper"):
        paired_comparison(metric, wrapper)  # type: ignore[arg-type]
