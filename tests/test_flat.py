"""The flat ``(preds, target, indexes)`` form of RetrievalRecallAtK (issue 3).

Against the brute-force reference (queries split over batches in random order, every tie
policy and empty-target action, ignored items, heavy ties, +-inf; the padded and the
sorted per-query top K forced in turn), against torchmetrics ``RetrievalHitRate`` on
tie-free data, inside a ``MetricCollection``, mixed with the dense form, and the
O(queries x max K) state bound. (Processes: test_distributed.py; errors: test_errors.py.)
"""

from __future__ import annotations

import io
import itertools
import math
import pickle
import random
from collections.abc import Sequence

import pytest
import torch
from helpers import (
    ACTIONS,
    TIES,
    Item,
    assert_recall_close,
    compute_or_error,
    flat_tensors,
    recall_values,
)
from reference import reference_flat_recall
from torchmetrics import MetricCollection
from torchmetrics.retrieval import RetrievalHitRate, RetrievalMRR, RetrievalNormalizedDCG

from recall_at_k import RetrievalRecallAtK, _flat
from recall_at_k.ranking import budget

IGNORE = -1
INF = math.inf

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

# ------------------------------------------------------------------------ helpers


def _reference(
    items: Sequence[Item],
    ks: Sequence[int],
    ties: str,
    action: str,
    dense: Sequence[tuple[list[float], list[bool]]] = (),
) -> list[float] | str:
    return reference_flat_recall(items, ks, ties, action, dense, ignore_index=IGNORE)


def _split(items: list[Item], num_batches: int, rng: random.Random) -> list[list[Item]]:
    cuts = sorted(rng.randint(0, len(items)) for _ in range(num_batches - 1))
    bounds = [0, *cuts, len(items)]
    return [items[a:b] for a, b in itertools.pairwise(bounds)]


def _random_items(rng: random.Random, with_ignored: bool = True) -> list[Item]:
    """A few queries of 0..14 items; heavy ties (few distinct values, +-inf) or none."""
    pool = rng.choice(
        [None, None, [0.0, 1.0], [-INF, -1.0, 0.0, 0.5], [-INF, 0.0, INF], [2.5], [-3.0, -2.0]]
    )
    ids = rng.sample(range(1000), rng.randint(1, 10))
    weights = [6, 2, 1] if with_ignored else [6, 2, 0]
    items: list[Item] = []
    sizes = [rng.randint(0, 14) for _ in ids]
    if rng.random() < 0.2:  # every query the same size: the reshape fast path
        sizes = [max(sizes)] * len(ids)
    for qid, size in zip(ids, sizes, strict=True):
        for _ in range(size):
            score = rng.choice(pool) if pool else round(rng.gauss(0.0, 1.0), 3)
            target = rng.choices([0, 1, IGNORE], weights=weights)[0]
            items.append((qid, score, target))
    if rng.random() < 0.7:
        rng.shuffle(items)  # random order; otherwise grouped by query, as loaders give
    return items


KS_CHOICES = [(1,), (1, 2), (2, 3), (3, 1), (1, 3, 5), (4,), (1, 2, 3, 4, 5, 8), (10,)]


# ----------------------------------------------------------- agreement with reference


@pytest.mark.parametrize("num_batches", [1, 2, 5])
@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("ties", TIES)
def test_agrees_with_reference(ties: str, action: str, num_batches: int) -> None:
    rng = random.Random(f"{ties}/{action}/{num_batches}")
    for case in range(10):
        items = _random_items(rng)
        ks = rng.choice(KS_CHOICES)
        dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.float16])
        target_dtype = rng.choice([torch.int64, torch.int32, torch.bool])
        if target_dtype == torch.bool:
            items = [it for it in items if it[2] != IGNORE]
        metric = RetrievalRecallAtK(
            k=ks,
            ties=ties,
            empty_target_action=action,
            ignore_index=IGNORE,
            validate_args=rng.random() < 0.7,
        )
        for part in _split(items, num_batches, rng):
            index_dtype = rng.choice([torch.int64, torch.int32])
            preds, target, indexes = flat_tensors(part, dtype, target_dtype, index_dtype)
            metric.update(preds, target, indexes=indexes)
        # The reference reads the scores back from the tensor (float16 rounds them).
        rounded = [(q, float(torch.tensor(s, dtype=dtype)), t) for q, s, t in items]
        want = _reference(rounded, ks, ties, action)
        assert_recall_close(compute_or_error(metric), want, where=(case, ks, dtype, items))


@pytest.mark.parametrize("path", ["padded", "sorted"])
@pytest.mark.parametrize("ties", TIES)
def test_both_segment_top_paths_agree_with_reference(ties: str, path: _flat.SegmentPath) -> None:
    """Force the padded-matrix top-K, or the (id, -score) sort, for every batch and merge."""
    rng = random.Random(f"{ties}/{path}")
    for case in range(20):
        items = _random_items(rng)
        ks = rng.choice(KS_CHOICES)
        metric = RetrievalRecallAtK(k=ks, ties=ties, ignore_index=IGNORE)
        metric._flat_path = path
        metric._flat_slack = 0  # merge early and often
        for part in _split(items, rng.choice([1, 2, 5, 9]), rng):
            preds, target, indexes = flat_tensors(part)
            metric.update(preds, target, indexes=indexes)
        assert_recall_close(
            compute_or_error(metric), _reference(items, ks, ties, "neg"), where=(case, ks, items)
        )


@pytest.mark.parametrize("num_queries", [3, 64, 65, 150])
def test_every_layout_of_a_batch_gives_the_same_partials(num_queries: int) -> None:
    """Grouped ascending (equal or unequal sizes), grouped descending and shuffled items
    of few and of many (> 64: the grouping is then read through tensor operations)
    queries: the same partials, and Recall@K as the reference says."""
    rng = random.Random(num_queries)
    pool = [-INF, -1.0, 0.0, 0.0, 0.5, INF]
    for equal in (True, False):
        size = rng.randint(1, 12)
        items: list[Item] = []
        for qid in sorted(rng.sample(range(-500, 500), num_queries)):
            for _ in range(size if equal else rng.randint(1, 12)):
                items.append((qid, rng.choice(pool), int(rng.random() < 0.3)))
        descending = sorted(items, key=lambda item: -item[0])
        shuffled = rng.sample(items, len(items))
        partials = []
        for layout in (items, descending, shuffled):
            preds, target, indexes = flat_tensors(layout)
            partials.append(_flat.summarise(preds, target.bool(), indexes, 5))
            for ties in TIES:
                metric = RetrievalRecallAtK(k=(1, 2, 5), ties=ties)
                metric.update(preds, target, indexes=indexes)
                want = _reference(items, (1, 2, 5), ties, "neg")
                assert_recall_close(compute_or_error(metric), want, where=(ties, equal))
        for other in partials[1:]:
            for a, b in zip(partials[0], other, strict=True):
                assert torch.equal(a, b)


def test_one_huge_query_among_small_ones_uses_the_sort() -> None:
    rng = random.Random(3)
    items: list[Item] = [
        (0, float(rng.randint(0, 30)), int(rng.random() < 0.01)) for _ in range(3000)
    ]
    items += [(q, float(rng.randint(0, 3)), int(rng.random() < 0.3)) for q in range(1, 200)]
    rng.shuffle(items)
    chosen: list[str] = []
    for ties in TIES:
        metric = RetrievalRecallAtK(k=(1, 5, 50), ties=ties)
        for part in _split(items, 3, rng):
            preds, target, indexes = flat_tensors(part)
            metric.update(preds, target, indexes=indexes)
            _, counts = torch.unique(indexes, return_counts=True)
            if counts.numel():
                chosen.append(_flat.choose_path(counts, len(part)))
        assert_recall_close(
            compute_or_error(metric), _reference(items, (1, 5, 50), ties, "neg"), where=ties
        )
    assert "sorted" in chosen  # the padded matrix would have been 67 times the items
    # ... and the sort gives the very partials the padded matrix gives.
    preds, target, indexes = flat_tensors(items)
    by_path = [
        _flat.summarise(preds, target.bool(), indexes, 50, path=path)
        for path in ("auto", "padded", "sorted")
    ]
    for other in by_path[1:]:
        for a, b in zip(by_path[0], other, strict=True):
            assert torch.equal(a, b)


def test_expected_stays_exact_when_the_tied_block_outgrows_max_k() -> None:
    """Ten negatives tie with the positive at 0.5; max K is 2; they arrive in three parts."""
    parts = [
        [(7, 0.5, 0), (7, 0.5, 0), (7, 0.9, 0)],
        [(7, 0.5, 1), (7, 0.5, 0), (7, 0.5, 0), (7, 0.1, 0)],
        [(7, 0.5, 0)] * 6,
    ]
    for ties in TIES:
        metric = RetrievalRecallAtK(k=(1, 2, 3), ties=ties)
        for part in parts:
            preds, target, indexes = flat_tensors(part)
            metric.update(preds, target, indexes=indexes)
        want = _reference([it for part in parts for it in part], (1, 2, 3), ties, "neg")
        assert_recall_close(compute_or_error(metric), want, where=ties)
    # g_> = 1, e = 10, p = 1: P(hit@2) = 1 - C(10, 1) / C(11, 1) = 1 / 11.
    assert want == pytest.approx([0.0, 1 / 11, 2 / 11])


@pytest.mark.parametrize("ties", TIES)
def test_infinite_scores_are_ordinary_values(ties: str) -> None:
    items: list[Item] = [
        (0, -INF, 1),
        (0, -INF, 0),
        (0, -INF, 0),  # positive at -inf, tied negatives
        (1, INF, 1),
        (1, INF, 0),
        (1, 3.0, 0),  # positive at +inf, one tied negative
        (2, INF, 0),
        (2, INF, 0),
        (2, -INF, 1),  # positive below two +inf negatives
        (3, -INF, 0),
        (3, 0.0, 0),  # negatives only
        (4, -INF, 1),  # a positive only
    ]
    for num_batches in (1, 3):
        metric = RetrievalRecallAtK(k=(1, 2, 3), ties=ties)
        for part in _split(list(items), num_batches, random.Random(num_batches)):
            if part:
                preds, target, indexes = flat_tensors(part)
                metric.update(preds, target, indexes=indexes)
        assert_recall_close(
            compute_or_error(metric), _reference(items, (1, 2, 3), ties, "neg"), where=num_batches
        )


def test_dtypes_of_scores_targets_and_ids() -> None:
    rng = random.Random(11)
    items = [
        (q, float(rng.randint(-4, 4)) / 4, int(rng.random() < 0.3))
        for q in range(20)
        for _ in range(9)
    ]
    want = _reference(items, (1, 3), "expected", "neg")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for target_dtype in (torch.bool, torch.uint8, torch.int32, torch.int64):
            for index_dtype in (torch.int16, torch.int32, torch.int64):
                metric = RetrievalRecallAtK(k=(1, 3), ties="expected")
                preds, target, indexes = flat_tensors(items, dtype, target_dtype, index_dtype)
                metric.update(preds, target, indexes=indexes)
                assert_recall_close(
                    compute_or_error(metric), want, where=(dtype, target_dtype, index_dtype)
                )


def test_same_shape_multidimensional_inputs_are_flattened_like_torchmetrics() -> None:
    preds = torch.tensor([[0.9, 0.2], [0.4, 0.8]])
    target = torch.tensor([[1, 0], [0, 1]])
    indexes = torch.tensor([[0, 0], [1, 1]])
    metric = RetrievalRecallAtK(k=1)
    metric.update(preds, target, indexes=indexes)
    assert float(metric.compute()) == 1.0  # type: ignore[arg-type]


def test_ignored_items_and_queries_with_only_ignored_items() -> None:
    preds = torch.tensor([0.9, 0.5, 0.7, 0.3, 0.2])
    target = torch.tensor([-100, 1, 0, -100, -100])
    indexes = torch.tensor([0, 0, 0, 1, 1])  # query 1 has only ignored items: not counted
    metric = RetrievalRecallAtK(k=(1, 2), ignore_index=-100)
    metric.update(preds, target, indexes=indexes)
    assert recall_values(metric.compute()) == [0.0, 1.0]
    empty = RetrievalRecallAtK(k=1, ignore_index=-100)
    empty.update(preds[3:], target[3:], indexes=indexes[3:])
    with pytest.warns(UserWarning, match="No query was counted"):
        assert math.isnan(float(empty.compute()))  # type: ignore[arg-type]


def test_empty_batches_change_nothing() -> None:
    metric = RetrievalRecallAtK(k=1)
    metric.update(
        torch.empty(0), torch.empty(0, dtype=torch.int64), indexes=torch.empty(0, dtype=torch.int64)
    )
    preds, target, indexes = flat_tensors([(0, 0.4, 1), (0, 0.9, 0), (1, 0.2, 1)])
    metric.update(preds, target, indexes=indexes)
    metric.update(
        torch.empty(0), torch.empty(0, dtype=torch.int64), indexes=torch.empty(0, dtype=torch.int64)
    )
    assert float(metric.compute()) == 0.5  # type: ignore[arg-type]


# ------------------------------------------------------------- mixed dense and flat


@pytest.mark.parametrize("ties", TIES)
def test_dense_and_flat_in_one_instance_count_into_one_result(ties: str) -> None:
    rng = random.Random(ties)
    gen = torch.Generator().manual_seed(5)
    metric = RetrievalRecallAtK(k=(1, 2, 5), ties=ties, ignore_index=IGNORE)
    dense_rows: list[tuple[list[float], list[bool]]] = []
    items: list[Item] = []
    for step in range(4):
        scores = torch.randint(0, 3, (6, 7), generator=gen).float()
        mask = torch.rand(6, 7, generator=gen) < 0.25
        metric.update(scores, mask)
        dense_rows += [
            (s, [bool(v) for v in m]) for s, m in zip(scores.tolist(), mask.tolist(), strict=True)
        ]
        # flat ids deliberately overlap the dense row numbers: they are independent
        part = [
            (rng.randint(0, 5), float(rng.randint(0, 3)), rng.choice([0, 0, 1, IGNORE]))
            for _ in range(12)
        ]
        items += part
        preds, target, indexes = flat_tensors(part)
        metric.update(preds, target, indexes=indexes)
        if step == 1:  # a compute in between changes nothing
            compute_or_error(metric)
    assert_recall_close(
        compute_or_error(metric), _reference(items, (1, 2, 5), ties, "neg", dense_rows), where=ties
    )
    assert int(metric.query_counts.sum()) == 24  # the dense state holds the dense rows only


# --------------------------------------------------------------- against torchmetrics


def _tie_free_batches(seed: int, num_batches: int = 4) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_batches):
        n = int(torch.randint(40, 120, (1,), generator=gen))
        indexes = torch.randint(0, 25, (n,), generator=gen)
        preds = torch.randperm(100_000, generator=gen)[:n].float() / 1000 - 50  # distinct
        target = (torch.rand(n, generator=gen) < 0.15).long()
        target[torch.rand(n, generator=gen) < 0.1] = -100
        batches.append((preds, target, indexes))
    return batches


@pytest.mark.parametrize("action", ["neg", "pos", "skip"])
def test_each_k_equals_torchmetrics_hit_rate_on_tie_free_data(action: str) -> None:
    ks = (1, 3, 10)
    ours = RetrievalRecallAtK(k=ks, empty_target_action=action, ignore_index=-100)
    theirs = [RetrievalHitRate(top_k=k, empty_target_action=action, ignore_index=-100) for k in ks]
    for batch in _tie_free_batches(1):
        preds, target, indexes = batch
        ours.update(preds, target, indexes=indexes)
        for metric in theirs:
            metric.update(preds, target, indexes=indexes)
    result = ours.compute()
    assert isinstance(result, dict)
    for k, metric in zip(ks, theirs, strict=True):
        assert float(result[f"recall@{k}"]) == pytest.approx(float(metric.compute()), abs=1e-6)


def test_metric_collection_with_torchmetrics_retrieval_metrics() -> None:
    collection = MetricCollection(
        [RetrievalRecallAtK(k=(1, 5)), RetrievalMRR(), RetrievalNormalizedDCG()]
    )
    alone = [RetrievalRecallAtK(k=(1, 5)), RetrievalMRR(), RetrievalNormalizedDCG()]
    for preds, target, indexes in _tie_free_batches(2):
        target = target.clamp(min=0)
        batch_values = collection(preds, target, indexes=indexes)
        assert set(batch_values) == {
            "recall@1",
            "recall@5",
            "RetrievalMRR",
            "RetrievalNormalizedDCG",
        }
        single = RetrievalRecallAtK(k=(1, 5))
        single.update(preds, target, indexes=indexes)
        assert batch_values["recall@1"] == single.compute()["recall@1"]  # type: ignore[index]
        for metric in alone:
            metric.update(preds, target, indexes=indexes)
    result = collection.compute()
    recall = alone[0].compute()
    assert isinstance(recall, dict)
    assert result["recall@1"] == recall["recall@1"] and result["recall@5"] == recall["recall@5"]
    assert result["RetrievalMRR"] == pytest.approx(float(alone[1].compute()))
    assert result["RetrievalNormalizedDCG"] == pytest.approx(float(alone[2].compute()))


def test_collection_never_groups_instances_that_differ() -> None:
    """Instances with another tie policy or ``ignore_index`` keep their own flat state."""
    collection = MetricCollection(
        {
            "pess": RetrievalRecallAtK(k=1),
            "opt": RetrievalRecallAtK(k=1, ties="optimistic"),
            "drop_negatives": RetrievalRecallAtK(k=1, ignore_index=0),
            "drop_nothing": RetrievalRecallAtK(k=1, ignore_index=5),
        },
        compute_groups=True,
    )
    for _ in range(2):  # groups are formed after the first update
        collection.update(
            torch.tensor([0.5, 0.5, 0.5, 0.9]),
            torch.tensor([1, 0, 1, 0]),
            indexes=torch.tensor([0, 0, 1, 1]),
        )
    result = {name: float(value) for name, value in collection.compute().items()}
    assert result == {"pess": 0.0, "opt": 0.5, "drop_negatives": 1.0, "drop_nothing": 0.0}


# ---------------------------------------------------------- torchmetrics Metric rules


def test_forward_returns_the_batch_value_and_accumulates() -> None:
    first = flat_tensors([(0, 0.9, 1), (0, 0.1, 0), (1, 0.2, 1), (1, 0.8, 0)])
    second = flat_tensors([(1, 0.1, 1), (2, 0.3, 0), (2, 0.4, 1)])
    metric = RetrievalRecallAtK(k=1)
    assert float(metric(first[0], first[1], indexes=first[2])) == 0.5
    assert float(metric(second[0], second[1], indexes=second[2])) == 1.0
    # query 1 spans both batches: 0.2 is its best positive, 0.8 beats it
    assert float(metric.compute()) == pytest.approx(2 / 3)  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:The ``compute`` method")
def test_reset_merge_state_pickle_state_dict_and_dtype_casts() -> None:
    rng = random.Random(8)
    items = [*_random_items(rng, with_ignored=False), (2000, 1.0, 1), (2000, 1.0 + 2**-40, 0)]
    half = len(items) // 2
    want = _reference(items, (1, 2), "expected", "neg")
    a, b = (
        RetrievalRecallAtK(k=(1, 2), ties="expected"),
        RetrievalRecallAtK(k=(1, 2), ties="expected"),
    )
    a.update(*flat_tensors(items[:half], torch.float64)[:2], indexes=flat_tensors(items[:half])[2])
    b.update(*flat_tensors(items[half:], torch.float64)[:2], indexes=flat_tensors(items[half:])[2])
    a.merge_state(b)
    assert_recall_close(compute_or_error(a), want, where="merge_state")
    assert_recall_close(compute_or_error(pickle.loads(pickle.dumps(a))), want, where="pickle")

    a.persistent(True)
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    fresh = RetrievalRecallAtK(k=(1, 2), ties="expected")
    fresh.load_state_dict(torch.load(buffer))
    assert_recall_close(compute_or_error(fresh), want, where="state_dict")

    # A module-wide cast (Lightning's half precision) must not round the kept scores:
    # they are stored as int64 bit patterns. (Cast before any compute: torchmetrics
    # casts its cached result too.)
    cast = RetrievalRecallAtK(k=(1, 2), ties="expected")
    preds, target, indexes = flat_tensors(items, torch.float64)
    cast.update(preds, target, indexes=indexes)
    cast.to(torch.float16)
    assert all(block.dtype == torch.int64 for block in getattr(cast, cast._flat_name))
    assert_recall_close(compute_or_error(cast), want, where="after .to(float16)")

    a.reset()
    assert getattr(a, a._flat_name) == []
    with pytest.warns(UserWarning, match="No query was counted"):
        a.compute()


def test_compute_does_not_change_the_state() -> None:
    metric = RetrievalRecallAtK(k=(1, 2))
    for part in _split(_random_items(random.Random(4)), 3, random.Random(4)):
        preds, target, indexes = flat_tensors([it for it in part if it[2] != IGNORE])
        metric.update(preds, target, indexes=indexes)
    before = [block.clone() for block in getattr(metric, metric._flat_name)]
    first, second = compute_or_error(metric), compute_or_error(metric)
    assert first == second
    after = getattr(metric, metric._flat_name)
    assert len(before) == len(after) and all(
        torch.equal(x, y) for x, y in zip(before, after, strict=True)
    )


# ------------------------------------------------------------------------ state size


def _state_elements(metric: RetrievalRecallAtK) -> int:
    total = 0
    for name in metric._defaults:
        value = getattr(metric, name)
        blocks = value if isinstance(value, list) else [value]
        total += sum(block.numel() for block in blocks)
    return total


def _grouped_queries(num_queries: int, gallery: int, first_id: int = 0) -> Batch:
    preds = torch.rand(num_queries * gallery)
    target = torch.rand(num_queries * gallery) < 0.05
    indexes = torch.arange(first_id, first_id + num_queries).repeat_interleave(gallery)
    return preds, target, indexes


def test_state_is_bounded_by_queries_times_max_k_independent_of_items() -> None:
    num_queries, max_k = 300, 10
    sizes = {}
    for gallery in (20, 2000):
        metric = RetrievalRecallAtK(k=(1, 5, max_k))
        for start in range(0, num_queries, 100):
            preds, target, indexes = _grouped_queries(100, gallery, start)
            metric.update(preds, target, indexes=indexes)
        sizes[gallery] = _state_elements(metric)
    assert sizes[20] == sizes[2000] <= 2 * num_queries * max_k


def test_compaction_keeps_the_state_bounded_when_queries_arrive_in_many_pieces() -> None:
    """Every query gets one item per update, over 100 updates."""
    num_queries, max_k, rounds = 400, 10, 100
    metric = RetrievalRecallAtK(k=(1, 5, max_k), ties="expected")
    items: list[Item] = []
    gen = torch.Generator().manual_seed(0)
    largest = 0
    for _ in range(rounds):
        preds = torch.randint(0, 50, (num_queries,), generator=gen).float()
        target = (torch.rand(num_queries, generator=gen) < 0.02).long()
        indexes = torch.randperm(num_queries, generator=gen)
        metric.update(preds, target, indexes=indexes)
        items += list(zip(indexes.tolist(), preds.tolist(), target.tolist(), strict=True))
        largest = max(largest, _state_elements(metric))
    # Merged: one row a query, up to twice that plus the slack before the next merge, plus
    # one update's rows (without compaction: 100 rows a query).
    bound = (3 * num_queries + _flat.compact_slack(max_k)) * (_flat.ROW_PREFIX + max_k)
    assert largest <= bound < rounds * num_queries * (_flat.ROW_PREFIX + max_k) // 10
    assert_recall_close(
        compute_or_error(metric), _reference(items, (1, 5, max_k), "expected", "neg"), where=""
    )


@pytest.mark.parametrize("max_k", [1, 10, 100, 1000])
def test_the_rows_waiting_for_a_merge_hold_a_bounded_number_of_bytes(max_k: int) -> None:
    slack = _flat.compact_slack(max_k)
    row_bytes = 8 * (_flat.ROW_PREFIX + max_k)
    assert budget.FLAT_SLACK_BYTES == 1024 * (_flat.ROW_PREFIX + 10) * 8  # 1,024 rows at K = 10
    assert slack >= 1 and slack * row_bytes <= budget.FLAT_SLACK_BYTES
    assert (slack + 1) * row_bytes > budget.FLAT_SLACK_BYTES
    assert _flat.compact_slack(10) == 1024


@pytest.mark.parametrize("seed", range(4))
def test_the_carried_row_count_matches_the_state_through_forward_reset_and_copies(
    seed: int,
) -> None:
    """The compaction's row count, carried from one update to the next, is the state's
    row count after updates, forward, reset (which empties the list in place), a deep
    copy and a pickle round trip."""
    import copy

    gen = torch.Generator().manual_seed(seed)

    def feed(metric: RetrievalRecallAtK[dict[str, torch.Tensor]], forward: bool) -> None:
        indexes = torch.randint(0, 50, (40,), generator=gen)
        args = (torch.rand(40, generator=gen), torch.rand(40, generator=gen) < 0.3, indexes)
        if forward:
            metric(*args)
        else:
            metric.update(*args)
        state = getattr(metric, metric._flat_name)
        known = metric.__dict__.get("_flat_rows")
        if known is not None and known[0] == id(state):
            assert known[2] == sum(block.shape[0] for block in state)

    metric = RetrievalRecallAtK(k=(1, 5))
    metric._flat_slack = 16
    for step in range(60):
        feed(metric, forward=step % 7 == 3)
        if step in (20, 21, 45):
            metric.reset()
        if step == 30:
            metric = copy.deepcopy(metric)
        if step == 40:
            metric = pickle.loads(pickle.dumps(metric))
    rows = sum(block.shape[0] for block in getattr(metric, metric._flat_name))
    assert rows <= 2 * 50 + 16 + 40


# ---------------------------------------------------------------------------- errors


def test_targets_equal_to_ignore_index_are_dropped() -> None:
    preds, indexes = torch.tensor([0.3, 0.7, 0.1]), torch.tensor([0, 0, 1])
    metric = RetrievalRecallAtK(k=1, ignore_index=-100)
    metric.update(preds, torch.tensor([0, 1, -100]), indexes=indexes)  # dropped: fine
    assert float(metric.compute()) == 1.0  # type: ignore[arg-type]


def test_validate_args_false_skips_the_value_checks() -> None:
    metric = RetrievalRecallAtK(k=1, validate_args=False)
    metric.update(
        torch.tensor([0.3, 0.7, 0.1]), torch.tensor([0, 1, 1]), indexes=torch.tensor([-5, -5, 3])
    )
    assert float(metric.compute()) == 1.0  # type: ignore[arg-type]


def test_forward_keeps_the_flat_state_compact() -> None:
    """MetricCollection and Lightning call forward: its concatenation is compacted too."""
    gen = torch.Generator().manual_seed(3)
    metric = RetrievalRecallAtK(k=(1, 5))
    for _ in range(100):
        indexes = torch.randint(0, 400, (400,), generator=gen)
        metric(
            torch.rand(400, generator=gen), torch.rand(400, generator=gen) < 0.3, indexes=indexes
        )
    rows = sum(block.shape[0] for block in getattr(metric, metric._flat_name))
    assert rows <= 6 * 400
