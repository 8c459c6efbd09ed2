"""``QueryOutcomes.labels`` and ``QueryOutcomes.grouped``: per-class and per-group Recall@K.

"Equal to computing each group on its own" is tested literally: each group's queries are
evaluated as a metric (or a functional call) of their own, against the same gallery and
with the same options, and the value ``grouped`` gives that group must be the value
that separate evaluation gives -- for the embedding form (query/gallery and
leave-one-out, every tie policy, ``exclude`` rules, queries without a positive,
bidirectional), the dense form with ``query_ids`` (ties, ``ignore``, padded repeats) and
the flat form, over random tied inputs. Then: the return structure and its keys, labels
in the order of the ids, and every error of ``groups``.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
from embedding_reference import gen, small_ints
from torch import Tensor

from recall_at_k import EmbeddingRecallAtK, QueryOutcomes, RetrievalRecallAtK
from recall_at_k.functional import embedding_recall_at_k

KS = (1, 2, 5)
KEYS = tuple(f"recall@{k}" for k in KS)


def values_of(result: Tensor | dict[str, Tensor], keys: tuple[str, ...] = KEYS) -> Tensor:
    """A result of ``compute()`` (or a functional call) as one tensor in ``keys`` order."""
    if isinstance(result, Tensor):
        return result.reshape(1)
    return torch.stack([result[key] for key in keys])


def quietly(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(...)`` with the "no query was counted" warning silenced (a group of skipped
    queries evaluated on its own is NaN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn(*args, **kwargs)


def assert_groups_equal(
    got: dict[int, dict[str, Tensor]],
    expected: dict[int, Tensor],
    ties: str,
    keys: tuple[str, ...] = KEYS,
) -> None:
    """``grouped()`` holds exactly the non-NaN groups of ``expected``, in ascending order,
    with the same values: bit for bit for 0/1 hits, to float rounding under
    ``"expected"`` (a sum of probabilities in another order)."""
    counted = {g: v for g, v in expected.items() if not bool(v.isnan().all())}
    assert list(got) == sorted(counted)
    for group, want in counted.items():
        assert tuple(got[group]) == keys
        value = values_of(got[group], keys)
        assert value.dtype == torch.get_default_dtype()
        if ties == "expected":
            torch.testing.assert_close(value, want, rtol=0, atol=1e-6)
        else:
            assert torch.equal(value, want), (group, value, want)


# ------------------------------------------------------------------- embeddings


def embedding_problem(seed: int) -> dict[str, Tensor]:
    """Tied small-integer embeddings: 30 queries and 40 gallery items, labels 0..5, a
    camera per item, and label 7 seen by queries only (those have no positive)."""
    g = gen(seed)
    problem = {
        "queries": small_ints(30, 3, g),
        "query_labels": torch.randint(0, 6, (30,), generator=g),
        "query_groups": torch.randint(0, 3, (30,), generator=g),
        "gallery": small_ints(40, 3, g),
        "gallery_labels": torch.randint(0, 6, (40,), generator=g),
        "gallery_groups": torch.randint(0, 3, (40,), generator=g),
    }
    problem["query_labels"][:3] = 7
    return problem


@pytest.mark.parametrize("ties", ["pessimistic", "optimistic", "expected"])
@pytest.mark.parametrize("action", ["neg", "pos", "skip"])
@pytest.mark.parametrize("exclude", ["none", "same_label_and_group"])
@pytest.mark.parametrize("seed", [0, 1])
def test_query_gallery_per_class_and_per_camera_equal_each_group_on_its_own(
    ties: Any, action: Any, exclude: Any, seed: int
) -> None:
    """Per class (``outcomes.labels``) and per camera (the queries' groups looked up by
    id), each against the same gallery, with the re-ID junk rule or without it."""
    p = embedding_problem(seed)
    options: dict[str, Any] = {
        "similarity": "dot",
        "ties": ties,
        "empty_target_action": action,
        "exclude": exclude,
    }
    metric = EmbeddingRecallAtK(KS, **options)
    for rows in torch.arange(30).split(11):  # queries over several updates
        metric.update(
            p["queries"][rows],
            p["query_labels"][rows],
            role="query",
            groups=p["query_groups"][rows],
        )
    metric.update(p["gallery"], p["gallery_labels"], role="gallery", groups=p["gallery_groups"])
    outcomes = metric.query_outcomes()
    assert isinstance(outcomes, QueryOutcomes) and outcomes.labels is not None
    # No ids: each query's id is its position among the queries; labels follow the ids.
    assert torch.equal(outcomes.labels, p["query_labels"][outcomes.ids])

    def on_its_own(selected: Tensor) -> Tensor:
        return values_of(
            quietly(
                embedding_recall_at_k,
                p["queries"][selected],
                p["query_labels"][selected],
                p["gallery"],
                p["gallery_labels"],
                KS,
                query_groups=p["query_groups"][selected],
                gallery_groups=p["gallery_groups"],
                **options,
            )
        )

    for groups, per_query in (
        (outcomes.labels, p["query_labels"]),
        (p["query_groups"][outcomes.ids], p["query_groups"]),
    ):
        expected = {int(g): on_its_own(per_query == g) for g in per_query.unique()}
        assert_groups_equal(outcomes.grouped(groups), expected, ties)
    per_class = outcomes.grouped(outcomes.labels)
    # Label 7 has no positive in the gallery: a miss, a hit, or left out.
    assert (7 in per_class) is (action != "skip")
    if action != "skip":
        assert float(per_class[7]["recall@5"]) == (1.0 if action == "pos" else 0.0)


@pytest.mark.parametrize("ties", ["pessimistic", "expected"])
@pytest.mark.parametrize("action", ["neg", "skip"])
def test_leave_one_out_per_class_equals_each_class_against_the_whole_set(
    ties: Any, action: Any
) -> None:
    """Leave-one-out: a class's queries on their own are ranked against the whole set
    (every item, themselves excluded by id), not against their class alone; ids given
    in a shuffled order, and some items repeated with their id (padding) count once."""
    g = gen(4)
    embeddings = small_ints(36, 3, g)
    labels = torch.randint(0, 5, (36,), generator=g)
    labels[-1] = 9  # a class of one: no positive
    ids = torch.randperm(36, generator=g) * 7 - 100
    options: dict[str, Any] = {"similarity": "cosine", "ties": ties, "empty_target_action": action}
    metric = EmbeddingRecallAtK(KS, **options)
    metric.update(embeddings[:20], labels[:20], ids=ids[:20])
    metric.update(embeddings[20:], labels[20:], ids=ids[20:])
    metric.update(embeddings[:4], labels[:4], ids=ids[:4])  # repeated: counts once
    outcomes = metric.query_outcomes()
    assert isinstance(outcomes, QueryOutcomes) and outcomes.labels is not None
    label_of_id = dict(zip(ids.tolist(), labels.tolist(), strict=True))
    assert outcomes.labels.tolist() == [label_of_id[i] for i in outcomes.ids.tolist()]
    expected = {}
    for label in labels.unique().tolist():
        selected = labels == label
        result = quietly(
            embedding_recall_at_k,
            embeddings[selected],
            labels[selected],
            embeddings,
            labels,
            KS,
            query_ids=ids[selected],
            gallery_ids=ids,
            **options,
        )
        expected[label] = values_of(result)
    assert_groups_equal(outcomes.grouped(outcomes.labels), expected, ties)
    # The groups together are the whole: hits weighted by group size give compute().
    total = quietly(metric.compute)
    sizes = torch.bincount(outcomes.labels)
    per_class = outcomes.grouped(outcomes.labels)
    weighted = sum(float(sizes[c]) * values_of(v).double() for c, v in per_class.items())
    assert isinstance(weighted, Tensor)
    torch.testing.assert_close(
        (weighted / outcomes.ids.numel()).float(), values_of(total), rtol=0, atol=1e-6
    )


def test_bidirectional_groups_each_direction_with_its_own_queries_labels() -> None:
    """Image -> text and text -> image: each direction's outcomes carry the labels of its
    own queries, and each direction groups on its own."""
    g = gen(8)
    images, image_ids = small_ints(12, 3, g), torch.arange(12)
    caption_image = torch.randint(0, 12, (30,), generator=g)
    captions = images[caption_image] + small_ints(30, 3, g)
    metric = EmbeddingRecallAtK(KS, similarity="dot", bidirectional=True, directions=("i2t", "t2i"))
    metric.update(images, image_ids, role="query")
    metric.update(captions, caption_image, role="gallery")
    per_direction = metric.query_outcomes()
    assert isinstance(per_direction, dict) and list(per_direction) == ["i2t", "t2i"]
    i2t, t2i = per_direction["i2t"], per_direction["t2i"]
    assert i2t.labels is not None and t2i.labels is not None
    assert torch.equal(i2t.labels, image_ids[i2t.ids])
    assert torch.equal(t2i.labels, caption_image[t2i.ids])
    # Per image parity (any partition) in each direction, against its own evaluation.
    for direction, outcomes, queries, query_labels, gallery, gallery_labels in (
        ("i2t", i2t, images, image_ids, captions, caption_image),
        ("t2i", t2i, captions, caption_image, images, image_ids),
    ):
        parity = query_labels % 2
        keys = tuple(f"{direction}/{key}" for key in KEYS)
        expected = {
            side: values_of(
                embedding_recall_at_k(
                    queries[parity == side],
                    query_labels[parity == side],
                    gallery,
                    gallery_labels,
                    KS,
                    similarity="dot",
                )
            )
            for side in (0, 1)
        }
        assert_groups_equal(outcomes.grouped(parity[outcomes.ids]), expected, "pessimistic", keys)


# ------------------------------------------------------------------- score forms


@pytest.mark.parametrize("ties", ["pessimistic", "optimistic", "expected"])
@pytest.mark.parametrize("action", ["neg", "pos", "skip"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_groups_equal_a_metric_per_group(ties: Any, action: Any, seed: int) -> None:
    """Dense rows with ``query_ids`` (sparse, negative too), tied scores, a mask target
    with rows that have no positive, an ``ignore`` mask, and padded repeats."""
    g = torch.Generator().manual_seed(seed)
    num, width = 60, 9
    scores = torch.randint(0, 3, (num, width), generator=g).float()
    target = torch.rand(num, width, generator=g) < 0.2
    ignore = torch.rand(num, width, generator=g) < 0.15
    ids = torch.randperm(num, generator=g) * 5 - 77
    group_of_row = torch.randint(-2, 3, (num,), generator=g)
    options: dict[str, Any] = {"ties": ties, "empty_target_action": action}
    metric = RetrievalRecallAtK(KS, **options)
    for rows in torch.arange(num).split(16):
        metric.update(scores[rows], target[rows], ignore=ignore[rows], query_ids=ids[rows])
    repeat = torch.arange(5)
    metric.update(scores[repeat], target[repeat], ignore=ignore[repeat], query_ids=ids[repeat])
    outcomes = metric.query_outcomes()
    assert outcomes.labels is None
    group_of_id = dict(zip(ids.tolist(), group_of_row.tolist(), strict=True))
    groups = torch.tensor([group_of_id[i] for i in outcomes.ids.tolist()])
    expected = {}
    for group in group_of_row.unique().tolist():
        rows = group_of_row == group
        alone = RetrievalRecallAtK(KS, **options)
        alone.update(scores[rows], target[rows], ignore=ignore[rows])
        expected[group] = values_of(quietly(alone.compute))
    assert_groups_equal(outcomes.grouped(groups), expected, ties)


def test_flat_groups_equal_a_metric_per_group() -> None:
    """The flat form (torchmetrics' ``indexes``): items of a query over several updates."""
    g = torch.Generator().manual_seed(3)
    num_items = 200
    indexes = torch.randint(0, 40, (num_items,), generator=g) * 3
    preds = torch.randint(0, 4, (num_items,), generator=g).float()
    target = (torch.rand(num_items, generator=g) < 0.3).long()
    group_of = {int(q): int(q) % 4 for q in indexes.unique()}
    metric = RetrievalRecallAtK(KS, ties="expected")
    for part in torch.arange(num_items).split(64):
        metric.update(preds[part], target[part], indexes[part])
    outcomes = metric.query_outcomes()
    groups = torch.tensor([group_of[i] for i in outcomes.ids.tolist()])
    expected = {}
    for group in sorted(set(group_of.values())):
        items = torch.tensor([group_of[int(q)] == group for q in indexes])
        alone = RetrievalRecallAtK(KS, ties="expected")
        alone.update(preds[items], target[items], indexes[items])
        expected[group] = values_of(alone.compute())
    assert_groups_equal(outcomes.grouped(groups), expected, "expected")


# ------------------------------------------------------------------- structure


def test_int_k_keys_one_value_per_group_and_empty_outcomes_give_no_group() -> None:
    metric = RetrievalRecallAtK(k=2)
    scores = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.8, 0.3], [0.1, 0.2, 0.9]])
    # First-hit ranks 1, 3 and 1.
    metric.update(scores, torch.tensor([0, 0, 2]), query_ids=torch.tensor([5, 6, 7]))
    outcomes = metric.query_outcomes()
    assert outcomes.keys is None  # compute() is one tensor for an int k
    per_group = outcomes.grouped(torch.tensor([1, 1, 0]))
    assert list(per_group) == [0, 1] and all(type(g) is int for g in per_group)
    assert per_group == {0: {"recall@2": torch.tensor(1.0)}, 1: {"recall@2": torch.tensor(0.5)}}
    empty = RetrievalRecallAtK(k=(1, 5)).query_outcomes()
    assert empty.grouped(torch.zeros(0, dtype=torch.int64)) == {}
    no_items = EmbeddingRecallAtK(k=(1, 5)).query_outcomes()
    assert isinstance(no_items, QueryOutcomes) and no_items.labels is not None
    assert no_items.labels.shape == (0,) and no_items.grouped(no_items.labels) == {}


def test_any_integer_dtype_and_the_same_groups_in_any_order() -> None:
    """int32 or uint8 group values work like int64; grouping is by value, not position."""
    metric = RetrievalRecallAtK(k=(1, 2))
    g = torch.Generator().manual_seed(0)
    metric.update(torch.rand(20, 4, generator=g), torch.arange(20) % 4, query_ids=torch.arange(20))
    outcomes = metric.query_outcomes()
    groups = torch.arange(20) % 3
    reference = outcomes.grouped(groups)
    assert outcomes.grouped(groups.to(torch.int32)) == reference
    assert outcomes.grouped(groups.to(torch.uint8)) == reference
    assert list(reference) == [0, 1, 2]
    for group, values in reference.items():
        hits = outcomes.hits[groups == group].mean(0).float()
        assert torch.equal(values_of(values, ("recall@1", "recall@2")), hits)


# ------------------------------------------------------------------- errors


def _outcomes() -> QueryOutcomes:
    metric = RetrievalRecallAtK(k=(1, 2))
    metric.update(torch.rand(4, 3), torch.tensor([0, 1, 2, 0]), query_ids=torch.arange(4))
    return metric.query_outcomes()


def test_error_groups_none_for_the_score_forms() -> None:
    outcomes = _outcomes()
    assert outcomes.labels is None
    with pytest.raises(ValueError, match=r"`groups` is None: these outcomes carry no `labels`"):
        outcomes.grouped(outcomes.labels)


def test_error_groups_not_a_tensor() -> None:
    with pytest.raises(
        ValueError, match=r"`groups` must be a torch.Tensor.*got list; pass torch.as_tensor"
    ):
        _outcomes().grouped([0, 1, 0, 1])  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_error_groups_not_integer(dtype: torch.dtype) -> None:
    with pytest.raises(
        ValueError,
        match=rf"`groups` must be an integer \(int64\) tensor.*shape \[4\] and dtype {dtype}"
        r"; pass `groups.long\(\)`",
    ):
        _outcomes().grouped(torch.zeros(4, dtype=dtype))


@pytest.mark.parametrize("shape", [(3,), (4, 1), ()])
def test_error_groups_not_aligned_with_ids(shape: tuple[int, ...]) -> None:
    with pytest.raises(
        ValueError,
        match=r"`groups` must have shape \[4\], one group value per query in the order of"
        rf" `ids`, got shape {re.escape(str(list(shape)))}.*group_of_id\[outcomes.ids\]",
    ):
        _outcomes().grouped(torch.zeros(shape, dtype=torch.int64))
