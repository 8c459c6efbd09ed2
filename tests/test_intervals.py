"""``confidence_interval()``: the Wilson score interval, checked against the formula
written out here, for the dense, flat and embedding forms; and the band of ``plot()``.

The two-process case (a gloo pair must give the one-process interval) is part of the
gathered-states spawn in ``test_protocol_audit.py``.
"""

from __future__ import annotations

import math
import warnings
from statistics import NormalDist

import pytest
import torch
from torch import Tensor

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

LEVELS = (0.5, 0.8, 0.9, 0.95, 0.99)


def wilson(p: float, n: int, level: float) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``p`` out of ``n``, as in the textbooks:

    (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), z the two-sided quantile.
    """
    if n == 0:
        return math.nan, math.nan
    z = NormalDist().inv_cdf(0.5 + level / 2)
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    denominator = 1 + z * z / n
    return (centre - spread) / denominator, (centre + spread) / denominator


def assert_wilson(interval: Tensor, p: float, n: int, level: float) -> None:
    assert interval.shape == (2,)
    low, high = wilson(p, n, level)
    assert interval.tolist() == pytest.approx([low, high], abs=1e-6, rel=1e-6), (p, n, level)


def ranks_to_scores(ranks: list[int], gallery: int = 20) -> tuple[Tensor, Tensor]:
    """Dense scores ``[Q, G]`` and an index target where query i's true item has rank
    ``ranks[i]`` (0 = no true item: target -1)."""
    num = len(ranks)
    scores = torch.arange(gallery, 0, -1, dtype=torch.float32).repeat(num, 1)
    target = torch.tensor([r - 1 for r in ranks])
    return scores, target


# The worked example: R@1 = 0.5, R@5 = 0.8 over ten queries.
RANKS = [1, 1, 2, 1, 8, 3, 1, 12, 1, 4]


@pytest.mark.parametrize("level", LEVELS)
def test_dense_worked_example(level: float) -> None:
    metric = RetrievalRecallAtK(k=(1, 5, 10))
    metric.update(*ranks_to_scores(RANKS))
    interval = metric.confidence_interval(level)
    assert isinstance(interval, dict)
    assert list(interval) == ["recall@1", "recall@5", "recall@10"]
    for key, p in (("recall@1", 0.5), ("recall@5", 0.8), ("recall@10", 0.9)):
        assert_wilson(interval[key], p, 10, level)
        assert interval[key].dtype == torch.get_default_dtype()
    # The point estimate lies inside, and a higher level gives a wider interval.
    values = metric.compute()
    assert isinstance(values, dict)
    wider = metric.confidence_interval(min(0.999, level + 0.04))
    assert isinstance(wider, dict)
    for key, (low, high) in interval.items():
        assert low <= values[key] <= high
        assert wider[key][0] <= low and high <= wider[key][1]


def test_extremes_zero_and_one() -> None:
    """p = 0 and p = 1: one bound is the boundary, the other is z^2 / (n + z^2) away."""
    metric = RetrievalRecallAtK(k=(1, 20))
    metric.update(*ranks_to_scores([5] * 7))
    interval = metric.confidence_interval(0.95)
    assert isinstance(interval, dict)
    z2 = NormalDist().inv_cdf(0.975) ** 2
    assert interval["recall@1"].tolist() == pytest.approx([0.0, z2 / (7 + z2)])
    assert interval["recall@20"].tolist() == pytest.approx([7 / (7 + z2), 1.0])
    assert_wilson(interval["recall@1"], 0.0, 7, 0.95)
    assert_wilson(interval["recall@20"], 1.0, 7, 0.95)


def test_int_k_gives_one_tensor_and_n_follows_empty_target_action() -> None:
    ranks = [1, 3, 0, 0, 2, 1]  # two queries without a true item
    scores, target = ranks_to_scores(ranks)
    for action, p, n in (("neg", 3 / 6, 6), ("pos", 5 / 6, 6), ("skip", 3 / 4, 4)):
        metric = RetrievalRecallAtK(k=2, empty_target_action=action)
        metric.update(scores, target)
        interval = metric.confidence_interval(0.9)
        assert isinstance(interval, Tensor)
        assert_wilson(interval, p, n, 0.9)


def test_nothing_counted_is_nan() -> None:
    metric = RetrievalRecallAtK(k=(1, 5), empty_target_action="skip")
    metric.update(*ranks_to_scores([0, 0, 0]))
    with pytest.warns(UserWarning, match="No query was counted"):
        interval = metric.confidence_interval()
    assert isinstance(interval, dict)
    for value in interval.values():
        assert value.shape == (2,) and torch.isnan(value).all()
    single = RetrievalRecallAtK(k=1, empty_target_action="skip")
    single.update(*ranks_to_scores([0]))
    with pytest.warns(UserWarning, match="No query was counted"):
        assert torch.isnan(single.confidence_interval()).all()


def test_ties_expected_uses_the_expected_hit_rate() -> None:
    """Every item tied: the expected hit rate at K of one positive among G items is K/G."""
    gallery = 8
    scores = torch.zeros(12, gallery)
    target = torch.arange(12) % gallery
    metric = RetrievalRecallAtK(k=(1, 2, 8), ties="expected")
    metric.update(scores, target)
    interval = metric.confidence_interval(0.95)
    assert isinstance(interval, dict)
    for k in (1, 2, 8):
        assert_wilson(interval[f"recall@{k}"], k / gallery, 12, 0.95)


@pytest.mark.parametrize("level", (0.68, 0.95, 0.999))
def test_flat_form(level: float) -> None:
    """The flat form, a query's items split over two updates: the interval of its values."""
    generator = torch.Generator().manual_seed(1)
    num_queries, per_query = 30, 12
    preds = torch.randn(num_queries * per_query, generator=generator)
    indexes = torch.arange(num_queries).repeat_interleave(per_query) * 7 - 50
    target = torch.zeros(num_queries * per_query, dtype=torch.long)
    target[
        torch.randint(0, per_query, (num_queries,), generator=generator)
        + torch.arange(num_queries) * per_query
    ] = 1
    target[:per_query] = 0  # the first query has no positive: a miss ("neg")
    metric = RetrievalRecallAtK(k=(1, 3))
    half = len(preds) // 2
    order = torch.randperm(len(preds), generator=generator)
    first, second = order[:half], order[half:]
    metric.update(preds[first], target[first], indexes=indexes[first])
    metric.update(preds[second], target[second], indexes=indexes[second])
    values = metric.compute()
    assert isinstance(values, dict)
    # The recall counted by hand.
    hits = {1: 0, 3: 0}
    for q in range(num_queries):
        rows = slice(q * per_query, (q + 1) * per_query)
        s, t = preds[rows], target[rows].bool()
        if not t.any():
            continue
        rank = int((s[~t] >= s[t].max()).sum()) + 1
        for k in hits:
            hits[k] += rank <= k
    interval = metric.confidence_interval(level)
    assert isinstance(interval, dict)
    for k, count in hits.items():
        assert float(values[f"recall@{k}"]) == pytest.approx(count / num_queries)
        assert_wilson(interval[f"recall@{k}"], count / num_queries, num_queries, level)


def embedding_data(seed: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(40) % 8
    centres = torch.randn(8, 6, generator=generator)
    embeddings = centres[labels] + 1.2 * torch.randn(40, 6, generator=generator)
    return embeddings, labels


def brute_force_hits(embeddings: Tensor, labels: Tensor, k: int) -> int:
    """Leave-one-out cosine hits at k, pessimistic ties, counted by hand."""
    normed = torch.nn.functional.normalize(embeddings.double(), dim=1)
    scores = normed @ normed.T
    hits = 0
    for q in range(len(labels)):
        others = torch.arange(len(labels)) != q
        positive = others & (labels == labels[q])
        best = scores[q][positive].max()
        rank = int((scores[q][others & ~positive] >= best).sum()) + 1
        hits += rank <= k
    return hits


@pytest.mark.parametrize("level", (0.8, 0.95))
def test_embedding_form_and_bidirectional_keys(level: float) -> None:
    embeddings, labels = embedding_data()
    metric = EmbeddingRecallAtK(k=(1, 5))
    metric.update(embeddings, labels)
    interval = metric.confidence_interval(level)
    assert isinstance(interval, dict)
    for k in (1, 5):
        hits = brute_force_hits(embeddings, labels, k)
        assert_wilson(interval[f"recall@{k}"], hits / 40, 40, level)

    both = EmbeddingRecallAtK(k=1, bidirectional=True, directions=("i2t", "t2i"))
    both.update(embeddings[:10], labels[:10], role="query")
    both.update(embeddings[10:], labels[10:], role="gallery")
    values = both.compute()
    interval = both.confidence_interval(level)
    assert list(interval) == ["i2t/recall@1", "t2i/recall@1"]
    for key, n in (("i2t/recall@1", 10), ("t2i/recall@1", 30)):
        assert_wilson(interval[key], float(values[key]), n, level)


def test_level_is_checked() -> None:
    metric = RetrievalRecallAtK(k=1)
    metric.update(*ranks_to_scores([1, 2]))
    for bad in (0, 1, 1.5, -0.1, True, "0.95", math.nan):
        with pytest.raises(ValueError, match="`level`"):
            metric.confidence_interval(bad)  # type: ignore[arg-type]


def test_interval_leaves_the_metric_as_it_was() -> None:
    """Asking for the interval changes neither the state nor later results."""
    metric = RetrievalRecallAtK(k=(1, 5))
    metric.update(*ranks_to_scores(RANKS))
    before = metric.compute()
    metric.confidence_interval()
    metric.update(*ranks_to_scores([1, 1]))
    after = metric.compute()
    assert isinstance(before, dict) and isinstance(after, dict)
    assert float(before["recall@1"]) == 0.5
    assert float(after["recall@1"]) == pytest.approx(7 / 12)


def test_plot_draws_the_band() -> None:
    from matplotlib.collections import PolyCollection

    metric = RetrievalRecallAtK(k=(1, 5, 10))
    metric.update(*ranks_to_scores(RANKS))
    interval = metric.confidence_interval(0.9)
    assert isinstance(interval, dict)
    fig, ax = metric.plot(interval=interval)
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1
    vertices = bands[0].get_paths()[0].vertices
    for k, key in ((1, "recall@1"), (5, "recall@5"), (10, "recall@10")):
        at_k = vertices[vertices[:, 0] == k][:, 1]
        low, high = interval[key].tolist()
        assert min(at_k) == pytest.approx(low) and max(at_k) == pytest.approx(high)
    # One band belongs to one result, not to a list of them.
    with pytest.raises(ValueError, match="`interval`"):
        metric.plot([metric.compute(), metric.compute()], interval=interval)
    # Without `interval` no band.
    _, plain = metric.plot()
    assert not [c for c in plain.collections if isinstance(c, PolyCollection)]
    import matplotlib.pyplot as plt

    plt.close("all")
    del fig


def test_plot_band_per_direction() -> None:
    from matplotlib.collections import PolyCollection

    embeddings, labels = embedding_data()
    metric = EmbeddingRecallAtK(k=(1, 5), bidirectional=True)
    metric.update(embeddings[:10], labels[:10], role="query")
    metric.update(embeddings[10:], labels[10:], role="gallery")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        interval = metric.confidence_interval()
    _, ax = metric.plot(interval=interval)
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 2
    import matplotlib.pyplot as plt

    plt.close("all")


def test_plot_fits_the_y_axis_to_the_curve_and_its_band() -> None:
    """R@1..R@10 of 0.972-0.989 on 1,000 queries: the y-axis spans the curve and its
    band with a small margin (not 0-1, where the curve would be a flat line), and the
    band's vertices are the interval's bounds."""
    from matplotlib.collections import PolyCollection

    ranks = [1] * 972 + [3] * 13 + [7] * 4 + [15] * 11  # R@1 .972, R@5 .985, R@10 .989
    metric = RetrievalRecallAtK(k=(1, 5, 10))
    metric.update(*ranks_to_scores(ranks))
    result = metric.compute()
    interval = metric.confidence_interval()
    assert isinstance(result, dict) and isinstance(interval, dict)
    assert [round(float(v), 3) for v in result.values()] == [0.972, 0.985, 0.989]
    _, ax = metric.plot(result, interval=interval)
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    vertices = band.get_paths()[0].vertices
    for k, key in ((1, "recall@1"), (5, "recall@5"), (10, "recall@10")):
        at_k = vertices[vertices[:, 0] == k][:, 1]
        low, high = interval[key].tolist()
        assert min(at_k) == pytest.approx(low) and max(at_k) == pytest.approx(high)
    lowest = min(float(v[0]) for v in interval.values())
    highest = max(float(v[1]) for v in interval.values())
    bottom, top = ax.get_ylim()
    assert lowest - 0.02 < bottom < lowest and highest < top <= min(1.0, highest + 0.02)
    assert top - bottom < 0.1  # on 0-1 the whole curve would fit in a tenth of the axis
    # Without the band the axis fits the curve alone.
    _, plain = metric.plot(result)
    bottom, top = plain.get_ylim()
    assert 0.96 < bottom < 0.972 and 0.989 < top < 1.0
    # A list of results: one axis for all of them.
    other = {"recall@1": 0.5, "recall@5": 0.6, "recall@10": 0.7}
    _, both = metric.plot([result, other])  # type: ignore[list-item]
    bottom, top = both.get_ylim()
    assert len(both.get_lines()) == 2 and 0.45 < bottom < 0.5 and top == 1.0  # clipped
    import matplotlib.pyplot as plt

    plt.close("all")


def test_plot_limits_stay_within_zero_and_one_and_keep_what_the_axis_held() -> None:
    import matplotlib.pyplot as plt

    metric = RetrievalRecallAtK(k=(1, 5))
    _, ax = metric.plot({"recall@1": 0.0, "recall@5": 1.0})
    assert ax.get_ylim() == (0.0, 1.0)
    assert all(not line.get_clip_on() for line in ax.get_lines())  # markers at 0, 1 whole
    _, nan = metric.plot({"recall@1": math.nan, "recall@5": math.nan})
    assert nan.get_ylim() == (0.0, 1.0)  # nothing counted: NaN, drawn on 0-1
    _, one = metric.plot({"recall@1": 0.5, "recall@5": 0.5})
    assert one.get_ylim() == pytest.approx((0.49, 0.51))  # equal values: the least margin
    # Drawn on an axis that already holds a curve: the limits keep it in view.
    _, held = metric.plot({"recall@1": 0.3, "recall@5": 0.4})
    _, held = metric.plot({"recall@1": 0.8, "recall@5": 0.9}, ax=held)
    bottom, top = held.get_ylim()
    assert bottom < 0.3 and top > 0.9
    plt.close("all")
