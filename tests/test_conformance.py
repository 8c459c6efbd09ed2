"""Conformance: both metrics behave as torchmetrics metrics in every pattern users write.

The first part runs every input form of ``tests/conformance.py``'s case table through
each torchmetrics pattern (and two gloo processes, spawned once for all forms), against
the brute-force references. The rest reproduces, one test each, the drop-in problems
found so far: torchmetrics' positional signature, ``inference_mode``, scratch memory
after ``compute()``/``reset()``, dtype casts of count states, small inputs, aliasing,
``torch.jit.script`` of a module holding a metric, and torchmetrics' wrappers.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conformance import (
    CASES,
    Case,
    as_values,
    assert_close,
    check_batching_and_order,
    check_beside_torchmetrics,
    check_call_styles,
    check_compute_on_cpu,
    check_dtype_casts,
    check_inference_mode,
    check_merge_state,
    check_persistence,
    check_update_and_forward,
    distributed_expectations,
    distributed_worker,
)
from helpers import run_distributed
from reference import reference_recall
from torch import Tensor
from torchmetrics import Metric, MetricCollection
from torchmetrics.retrieval import RetrievalHitRate, RetrievalMRR
from torchmetrics.wrappers import BootStrapper, MetricTracker

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK
from recall_at_k.functional import retrieval_recall_at_k

CASE_IDS = [case.name for case in CASES]
CHECKS: dict[str, Callable[[Case], None]] = {
    "update_and_forward": check_update_and_forward,
    "batching_and_order": check_batching_and_order,
    "persistence": check_persistence,
    "merge_state": check_merge_state,
    "dtype_casts": check_dtype_casts,
    "inference_mode": check_inference_mode,
    "compute_on_cpu": check_compute_on_cpu,
    "call_styles": check_call_styles,
}


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_case(case: Case, check: str) -> None:
    CHECKS[check](case)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.name.startswith("flat")], ids=lambda c: c.name
)
def test_flat_case_beside_torchmetrics_retrieval_metrics(case: Case) -> None:
    check_beside_torchmetrics(case)


# ---------------------------------------------------------------- two processes, one spawn


@pytest.fixture(scope="module")
def distributed_results() -> list[list[Any]]:
    return run_distributed(distributed_worker, world_size=2, payload=CASE_IDS)


@pytest.mark.ddp
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_two_gloo_processes_equal_one(case: Case, distributed_results: list[list[Any]]) -> None:
    """dist_sync_on_step off and on; uneven shards, an idle process, forward in lockstep."""
    for rank, results in enumerate(distributed_results):
        expected = distributed_expectations(case.name, world_size=2, rank=rank)
        rows = [row for row in results if row[0] == case.name]
        errors = [row[2] for row in rows if row[1] == "error"]
        assert not errors, f"rank {rank} raised:\n{errors[0]}"
        got = {(label, step): values for _, label, step, values in rows}
        assert sorted(got) == sorted(expected)
        for where, values in expected.items():
            assert_close(got[where], values, f"rank {rank}, {where}")


# ---------------------------------------------------------------- shared data


def _flat_tie_free(seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = 60
    preds = torch.randperm(n, generator=gen).float() / n  # distinct scores: no ties
    target = (torch.rand(n, generator=gen) < 0.3).long()
    indexes = torch.randint(0, 8, (n,), generator=gen)
    return preds, target, indexes


def _flat_reference(
    preds: Tensor, target: Tensor, indexes: Tensor, ks: tuple[int, ...], ties: str = "pessimistic"
) -> list[float]:
    scores, relevant = [], []
    for q in indexes.unique().tolist():
        rows = indexes == q
        scores.append(preds[rows].double().tolist())
        relevant.append([bool(t) for t in target[rows].tolist()])
    return reference_recall(scores, relevant, None, ks, ties, "neg")


def _dense_reference(
    scores: Tensor,
    target: Tensor,
    ks: tuple[int, ...],
    ties: str = "pessimistic",
    ignore: Tensor | None = None,
) -> list[float]:
    if target.dim() == 1:
        columns = target.long()
        target = torch.arange(scores.shape[1]).unsqueeze(0) == columns.unsqueeze(1)
    return reference_recall(
        scores.double().tolist(),
        target.bool().tolist(),
        None if ignore is None else ignore.tolist(),
        ks,
        ties,
        "neg",
    )


@pytest.mark.parametrize("cls", [RetrievalRecallAtK, EmbeddingRecallAtK])
def test_class_attributes_are_torchmetrics(cls: type[Metric]) -> None:
    assert cls.full_state_update is False
    assert cls.higher_is_better is True
    assert cls.is_differentiable is False
    assert cls.plot_lower_bound == 0.0
    assert cls.plot_upper_bound == 1.0


# ---------------------------------------------------------------- 1: torchmetrics' signature


def test_update_has_torchmetrics_retrieval_signature() -> None:
    params = inspect.signature(RetrievalRecallAtK.update).parameters
    assert list(params)[:4] == ["self", "preds", "target", "indexes"]
    assert params["indexes"].default is None
    assert params["indexes"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert params["ignore"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["query_ids"].kind is inspect.Parameter.KEYWORD_ONLY


def test_positional_indexes_alone_and_in_a_collection_equal_hit_rate() -> None:
    preds, target, indexes = _flat_tie_free()
    want = _flat_reference(preds, target, indexes, (5,))[0]
    metric = RetrievalRecallAtK(k=5)
    metric(preds, target, indexes)
    metric.update(preds[:0], target[:0], indexes[:0])
    assert float(metric.compute()) == pytest.approx(want, abs=1e-6)
    collection = MetricCollection(
        [RetrievalRecallAtK(k=5), RetrievalMRR(), RetrievalHitRate(top_k=5)]
    )
    collection(preds, target, indexes)
    result = collection.compute()
    assert float(result["RetrievalRecallAtK"]) == pytest.approx(want, abs=1e-6)
    assert float(result["RetrievalRecallAtK"]) == pytest.approx(float(result["RetrievalHitRate"]))
    mrr = RetrievalMRR()
    mrr.update(preds, target, indexes)
    assert float(result["RetrievalMRR"]) == pytest.approx(float(mrr.compute()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_float_relevance_in_a_collection_beside_torchmetrics_retrieval_metrics(
    dtype: torch.dtype,
) -> None:
    """torchmetrics' retrieval metrics take float 0./1. relevance; a collection holding ours
    beside them takes it too, in batches (forward) and with ``ignore_index``."""
    preds, target, indexes = _flat_tie_free(2)
    target[::7] = -1  # dropped by ignore_index
    kept = target != -1
    want = _flat_reference(preds[kept], target[kept], indexes[kept], (1, 5))
    collection = MetricCollection(
        {
            "r1": RetrievalRecallAtK(k=1, ignore_index=-1),
            "r5": RetrievalRecallAtK(k=5, ignore_index=-1),
            "hit1": RetrievalHitRate(top_k=1, ignore_index=-1),
            "hit5": RetrievalHitRate(top_k=5, ignore_index=-1),
            "mrr": RetrievalMRR(ignore_index=-1),
        }
    )
    for rows in torch.arange(preds.shape[0]).split(25):
        collection(preds[rows], target[rows].to(dtype), indexes[rows])
    result = {name: float(value) for name, value in collection.compute().items()}
    assert result["r1"] == pytest.approx(want[0], abs=1e-6)
    assert result["r5"] == pytest.approx(want[1], abs=1e-6)
    assert result["r1"] == pytest.approx(result["hit1"], abs=1e-6)
    assert result["r5"] == pytest.approx(result["hit5"], abs=1e-6)
    mrr = RetrievalMRR()
    mrr.update(preds[kept], target[kept], indexes[kept])
    assert result["mrr"] == pytest.approx(float(mrr.compute()))


@pytest.mark.parametrize("validate_args", [True, False])
def test_float_mask_targets_count_as_their_integer_mask(validate_args: bool) -> None:
    """The dense form takes a float 0./1. ``[Q, G]`` mask as the flat form takes float
    relevance: the same values as the integer mask, on the CPU block path and with
    ``ignore`` (the select path)."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 4, (40, 9), generator=gen).float()  # heavy ties
    mask = (torch.rand(40, 9, generator=gen) < 0.2).long()
    ignore = torch.rand(40, 9, generator=gen) < 0.1
    ks = (1, 2, 5)
    keys = [f"recall@{k}" for k in ks]
    for dtype in (torch.float32, torch.float64, torch.float16):
        for extra in ({}, {"ignore": ignore}):
            want = _dense_reference(scores, mask, ks, ignore=extra.get("ignore"))
            got = retrieval_recall_at_k(
                scores, mask.to(dtype), ks, validate_args=validate_args, **extra
            )
            assert as_values(got, keys) == pytest.approx(dict(zip(keys, want, strict=True)))
            metric = RetrievalRecallAtK(k=ks, validate_args=validate_args)
            metric.update(scores, mask.to(dtype), **extra)
            assert as_values(metric.compute(), keys) == as_values(got, keys)


@pytest.mark.parametrize("validate_args", [True, False])
def test_negative_flat_indexes_are_ids_like_any_other(validate_args: bool) -> None:
    preds, target, indexes = _flat_tie_free(1)
    ks = (1, 2, 3)
    want = _flat_reference(preds, target, indexes, ks)
    metric = RetrievalRecallAtK(k=ks, validate_args=validate_args)
    metric.update(preds, target, -indexes - 1)  # ids -1 .. -8
    assert as_values(metric.compute(), ["recall@1", "recall@2", "recall@3"]) == pytest.approx(
        dict(zip(["recall@1", "recall@2", "recall@3"], want, strict=True))
    )
    hit_rate = RetrievalHitRate(top_k=2)
    hit_rate.update(preds, target, -indexes - 1)
    assert float(metric.compute()["recall@2"]) == pytest.approx(float(hit_rate.compute()))


@pytest.mark.parametrize("cls", [RetrievalRecallAtK, EmbeddingRecallAtK])
def test_top_k_is_an_error_naming_k(cls: type[Metric]) -> None:
    with pytest.raises(ValueError, match="`k`"):
        cls(top_k=5)


# ---------------------------------------------------------------- 2: inference_mode


def test_inference_mode_update_then_ordinary_updates_and_reset() -> None:
    gen = torch.Generator().manual_seed(2)
    scores = torch.randint(0, 4, (30, 12), generator=gen).float()
    target = torch.rand(30, 12, generator=gen) < 0.2
    ignore = torch.rand(30, 12, generator=gen) < 0.1
    ks = (1, 3)
    metric = RetrievalRecallAtK(k=ks)
    with torch.inference_mode():
        metric.update(scores[:10], target[:10], ignore=ignore[:10])
    metric.update(scores[10:20], target[10:20], ignore=ignore[10:20])
    metric(scores[20:], target[20:], ignore=ignore[20:])
    want = _dense_reference(scores, target, ks, ignore=ignore)
    assert list(metric.compute().values()) == pytest.approx(want)
    metric.reset()
    metric.update(scores[:10], target[:10], ignore=ignore[:10])
    want = _dense_reference(scores[:10], target[:10], ks, ignore=ignore[:10])
    assert list(metric.compute().values()) == pytest.approx(want)
    # torchmetrics' own metrics handle the same sequence
    theirs = RetrievalHitRate(top_k=1)
    with torch.inference_mode():
        theirs.update(scores[0], target[0], torch.zeros(12, dtype=torch.long))
    theirs.update(scores[1], target[1], torch.ones(12, dtype=torch.long))
    theirs.compute()


# ---------------------------------------------------------------- 3: scratch memory


def _storage_bytes(root: object) -> tuple[int, int]:
    """(bytes of every tensor storage reachable from ``root``, bytes of its states)."""
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}

    def walk(obj: object) -> None:
        if id(obj) in seen_objects:
            return
        seen_objects.add(id(obj))
        if isinstance(obj, Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = max(
                storages.get(storage.data_ptr(), 0), storage.nbytes()
            )
            return
        if isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple, set)):
            for value in obj:
                walk(value)
        elif isinstance(obj, torch.nn.Module) or (
            hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj)
        ):
            walk(vars(obj))

    walk(root)
    assert isinstance(root, Metric)
    state = 0
    for value in root.metric_state.values():
        for tensor in value if isinstance(value, list) else [value]:
            state += tensor.nbytes
    return sum(storages.values()), state


def _assert_holds_only_its_state(metric: Metric) -> None:
    """After ``compute()`` and after ``reset()``: the state and at most SCRATCH_BOUND."""
    for step in ("compute", "reset"):
        getattr(metric, step)()
        held, state = _storage_bytes(metric)
        assert held <= state + SCRATCH_BOUND, (
            f"after {step}(): {held} bytes for a {state}-byte state"
        )


SCRATCH_BOUND = 64 * 2**10


@pytest.mark.parametrize("target_form", ["mask_and_ignore", "index"])
def test_scratch_memory_is_released_at_compute_and_reset(target_form: str) -> None:
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(2048, 2000, generator=gen)
    metric = RetrievalRecallAtK(k=(1, 5, 10))
    if target_form == "index":
        metric.update(scores, torch.randint(-1, 2000, (2048,), generator=gen))
    else:
        mask = torch.rand(2048, 2000, generator=gen) < 0.01
        metric.update(scores, mask, ignore=torch.rand(2048, 2000, generator=gen) < 0.01)
    del scores
    _assert_holds_only_its_state(metric)


def test_embedding_metric_holds_only_its_state_after_compute_and_reset() -> None:
    gen = torch.Generator().manual_seed(4)
    metric = EmbeddingRecallAtK(k=(1, 5), chunk_bytes=2**20)
    metric.update(
        torch.randn(1500, 32, generator=gen), torch.randint(0, 50, (1500,), generator=gen)
    )
    _assert_holds_only_its_state(metric)


# ---------------------------------------------------------------- 4: dtype casts keep counts


ALL_TIED_QUERIES = 20_000


def _all_tied() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.zeros(ALL_TIED_QUERIES, 3), torch.randint(0, 3, (ALL_TIED_QUERIES,), generator=gen)


CASTS: dict[str, Callable[[Metric], Any]] = {
    "to(float16)": lambda m: m.to(torch.float16),
    "half()": lambda m: m.half(),
    "to(bfloat16)": lambda m: m.to(torch.bfloat16),
    "set_dtype(float16)": lambda m: m.set_dtype(torch.float16),
    "set_dtype(bfloat16)": lambda m: m.set_dtype(torch.bfloat16),
}


@pytest.mark.parametrize("cast", list(CASTS))
def test_dtype_casts_keep_expected_counts_exact(cast: str) -> None:
    scores, target = _all_tied()
    metric = RetrievalRecallAtK(k=(1, 2), ties="expected")
    dtypes = {
        name: value.dtype
        for name, value in metric.metric_state.items()
        if isinstance(value, Tensor)
    }
    CASTS[cast](metric)
    assert {
        name: value.dtype
        for name, value in metric.metric_state.items()
        if isinstance(value, Tensor)
    } == dtypes, "a module cast changed a count state's dtype"
    half_scores = scores.to(torch.bfloat16 if "bfloat16" in cast else torch.float16)
    for rows in torch.arange(ALL_TIED_QUERIES).split(4096):
        metric.update(half_scores[rows], target[rows])
    result = metric.compute()
    assert float(result["recall@1"]) == pytest.approx(1 / 3, rel=1e-6, abs=0)
    assert float(result["recall@2"]) == pytest.approx(2 / 3, rel=1e-6, abs=0)
    # a cast after counting, and back, loses nothing either
    CASTS[cast](metric)
    metric.float()
    assert float(metric.compute()["recall@1"]) == pytest.approx(1 / 3, rel=1e-6, abs=0)


# ---------------------------------------------------------------- 8: complete flat queries


def test_complete_queries_count_a_repeated_query_once() -> None:
    preds = torch.tensor([0.5, 0.9, 0.8])
    target = torch.tensor([1, 0, 0])
    indexes = torch.tensor([7, 7, 7])
    once = RetrievalRecallAtK(k=3)
    once.update(preds, target, indexes)
    assert float(once.compute()) == 1.0
    twice = RetrievalRecallAtK(k=3)
    twice.update(preds, target, indexes)
    twice.update(preds, target, indexes)
    assert float(twice.compute()) == 0.0  # torchmetrics' convention: the items add up
    complete = RetrievalRecallAtK(k=3, complete_queries=True)
    complete.update(preds, target, indexes)
    complete.update(preds, target, indexes)  # DistributedSampler padding: a repeat
    assert float(complete.compute()) == 1.0


def _flat_state_bytes(metric: Metric) -> int:
    total = 0
    for value in metric.metric_state.values():
        for tensor in value if isinstance(value, list) else [value]:
            total += tensor.nbytes
    return total


def test_complete_queries_state_is_queries_times_max_k() -> None:
    gen = torch.Generator().manual_seed(6)
    queries, max_k = 200, 3
    sizes = []
    for items in (50, 100):
        metric = RetrievalRecallAtK(k=(1, max_k), complete_queries=True)
        preds = torch.rand(queries * items, generator=gen)
        target = (torch.rand(queries * items, generator=gen) < 0.1).long()
        indexes = torch.arange(queries).repeat_interleave(items)
        for part in torch.arange(queries).split(50):
            rows = (indexes.unsqueeze(1) == part.unsqueeze(0)).any(1)
            metric.update(preds[rows], target[rows], indexes[rows])
        for part in torch.arange(queries).split(50)[:2]:  # padding repeats
            rows = (indexes.unsqueeze(1) == part.unsqueeze(0)).any(1)
            metric.update(preds[rows], target[rows], indexes[rows])
        sizes.append(_flat_state_bytes(metric))
    # O(items) would be at least 8 bytes an item: 80,000 and 160,000 bytes here.
    bound = 2 * queries * (max_k + 16) * 8
    assert max(sizes) <= bound, f"{sizes} bytes of state for {queries} queries (bound {bound})"


# ---------------------------------------------------------------- 9: torchmetrics' wrappers


class _ReferenceHits(Metric):
    """Recall@k of a dense index target through the brute-force reference (for wrappers)."""

    full_state_update = False

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.add_state("hits", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        value = _dense_reference(preds, target, (self.k,))[0]
        self.hits += value * preds.shape[0]
        self.total += preds.shape[0]

    def compute(self) -> Tensor:
        return (self.hits / self.total).float()


def _epochs() -> Iterator[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(7)
    for epoch in range(3):
        scores = torch.rand(40, 10, generator=gen)
        target = torch.randint(0, 10, (40,), generator=gen)
        scores[: 10 * epoch, :] = 0
        scores[torch.arange(10 * epoch), target[: 10 * epoch]] = 1  # better every epoch
        yield scores, target


def test_metric_tracker_with_an_int_k() -> None:
    tracker = MetricTracker(RetrievalRecallAtK(k=2))
    wants = []
    for scores, target in _epochs():
        tracker.increment()
        tracker.update(scores[:25], target[:25])
        tracker(scores[25:], target[25:])
        wants.append(_dense_reference(scores, target, (2,))[0])
    assert tracker.compute_all().tolist() == pytest.approx(wants)
    best, step = tracker.best_metric(return_step=True)
    assert best == pytest.approx(max(wants))
    assert step == wants.index(max(wants))


def test_metric_tracker_with_several_k_through_a_collection() -> None:
    """Sequence ``k``: wrap the metric in a MetricCollection (``best_metric`` per key)."""
    tracker = MetricTracker(MetricCollection([RetrievalRecallAtK(k=(1, 3))]), maximize=True)
    wants: list[list[float]] = []
    for scores, target in _epochs():
        tracker.increment()
        tracker.update(scores, target)
        wants.append(_dense_reference(scores, target, (1, 3)))
    best, steps = tracker.best_metric(return_step=True)
    assert isinstance(best, dict) and isinstance(steps, dict)
    for i, key in enumerate(["recall@1", "recall@3"]):
        column = [w[i] for w in wants]
        assert best[key] == pytest.approx(max(column))
        assert steps[key] == column.index(max(column))


@pytest.mark.parametrize("strategy", ["poisson", "multinomial"])
def test_bootstrapper_with_an_int_k_resamples_queries(strategy: str) -> None:
    scores, target = next(_epochs())
    results = []
    for inner in (RetrievalRecallAtK(k=3), _ReferenceHits(k=3)):
        torch.manual_seed(8)
        wrapper = BootStrapper(inner, num_bootstraps=20, sampling_strategy=strategy, quantile=0.5)
        wrapper.update(scores[:20], target[:20])
        wrapper.update(scores[20:], target[20:])
        results.append({name: float(value) for name, value in wrapper.compute().items()})
    ours, theirs = results
    assert ours == pytest.approx(theirs, abs=1e-6)
    assert ours["std"] > 0  # the queries were resampled


def test_bootstrapper_per_k_for_several_k() -> None:
    """Several K: one BootStrapper per K in a MetricCollection, keyed by K."""
    scores, target = next(_epochs())
    collection = MetricCollection(
        {f"recall@{k}": BootStrapper(RetrievalRecallAtK(k=k), num_bootstraps=10) for k in (1, 3)}
    )
    collection.update(scores, target)
    result = collection.compute()
    assert sorted(result) == ["recall@1_mean", "recall@1_std", "recall@3_mean", "recall@3_std"]
    wants = _dense_reference(scores, target, (1, 3))
    for k, want in zip((1, 3), wants, strict=True):
        assert abs(float(result[f"recall@{k}_mean"]) - want) < 0.2


# ---------------------------------------------------------------- 10: small inputs


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32])
def test_small_integer_index_targets(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    scores = torch.randint(0, 3, (20, 6), generator=gen).float()
    target = torch.randint(-1, 6, (20,), generator=gen)
    metric = RetrievalRecallAtK(k=(1, 2))
    metric.update(scores, target.to(dtype))
    assert list(metric.compute().values()) == pytest.approx(
        _dense_reference(scores, target, (1, 2))
    )


@pytest.mark.parametrize("cls", [RetrievalRecallAtK, EmbeddingRecallAtK])
def test_numpy_integral_k(cls: type[Metric]) -> None:
    single = cls(k=np.int64(5))
    several = cls(k=(np.int64(1), np.int32(5)))
    gen = torch.Generator().manual_seed(10)
    if cls is RetrievalRecallAtK:
        args: tuple[Tensor, ...] = (
            torch.rand(6, 8, generator=gen),
            torch.randint(0, 8, (6,), generator=gen),
        )
    else:
        args = (torch.randn(9, 4, generator=gen), torch.randint(0, 3, (9,), generator=gen))
    single.update(*args)
    several.update(*args)
    value = single.compute()
    assert isinstance(value, Tensor) and value.dim() == 0
    result = several.compute()
    assert list(result) == ["recall@1", "recall@5"]
    assert float(result["recall@5"]) == pytest.approx(float(value))


@pytest.mark.parametrize("cls", [RetrievalRecallAtK, EmbeddingRecallAtK])
@pytest.mark.parametrize("k", [True, 5.0, 0, -1, (1, 1), (1, 2.5), "5"])
def test_bad_k_is_a_value_error(cls: type[Metric], k: Any) -> None:
    with pytest.raises(ValueError, match="`k`"):
        cls(k=k)


@pytest.mark.parametrize("cls", [RetrievalRecallAtK, EmbeddingRecallAtK])
@pytest.mark.parametrize("key", ["r@{{k}}", "{k}/{split}", "recall", "{0}", "{k!z}"])
def test_bad_key_templates_are_value_errors(cls: type[Metric], key: str) -> None:
    with pytest.raises(ValueError, match="`key`"):
        cls(k=(1, 5), key=key)


@pytest.mark.parametrize("cls", [RetrievalRecallAtK, EmbeddingRecallAtK])
def test_format_spec_key_templates_work(cls: type[Metric]) -> None:
    metric = cls(k=(1, 5, 10), key="R{k:03d}")
    assert list(metric.per_k()) == ["R001", "R005", "R010"]
    if cls is RetrievalRecallAtK:
        metric.update(torch.rand(4, 12), torch.randint(0, 12, (4,)))
    else:
        metric.update(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    assert list(metric.compute()) == ["R001", "R005", "R010"]


def test_merge_state_without_groups_into_same_group_is_an_error() -> None:
    gen = torch.Generator().manual_seed(11)
    grouped = EmbeddingRecallAtK(k=1, exclude="same_group")
    grouped.update(
        torch.randn(6, 3, generator=gen), torch.randint(0, 2, (6,)), groups=torch.arange(6) % 2
    )
    plain = EmbeddingRecallAtK(k=1)
    plain.update(torch.randn(6, 3, generator=gen), torch.randint(0, 2, (6,)))
    # the error may come at merge_state or at the compute that follows, never a value
    with pytest.raises(ValueError, match="`groups`"):
        grouped.merge_state(plain)
        grouped.compute()
    empty = EmbeddingRecallAtK(k=1, exclude="same_group")
    with pytest.raises(ValueError, match="`groups`"):
        empty.merge_state(plain)
        empty.compute()


@pytest.mark.parametrize("k", [1, (1, 5)])
@pytest.mark.parametrize("cls", [RetrievalRecallAtK, EmbeddingRecallAtK])
def test_compute_before_any_update_warns_and_is_nan(cls: type[Metric], k: Any) -> None:
    metric = cls(k=k)
    with pytest.warns(UserWarning, match="NaN"):
        result = metric.compute()
    values = [result] if isinstance(result, Tensor) else list(result.values())
    assert len(values) == (1 if isinstance(k, int) else 2)
    assert all(math.isnan(float(v)) for v in values)


def test_bidirectional_compute_before_any_update_is_nan_for_every_key() -> None:
    metric = EmbeddingRecallAtK(k=(1, 5), bidirectional=True)
    with pytest.warns(UserWarning, match="NaN"):
        result = metric.compute()
    assert list(result) == ["q2g/recall@1", "q2g/recall@5", "g2q/recall@1", "g2q/recall@5"]
    assert all(math.isnan(float(v)) for v in result.values())


def test_query_ids_reused_by_the_caller_do_not_change_the_state() -> None:
    gen = torch.Generator().manual_seed(12)
    scores = torch.randint(0, 3, (8, 5), generator=gen).float()
    target = torch.randint(0, 5, (8,), generator=gen)
    want = _dense_reference(scores, target, (1, 2))
    ids = torch.arange(8)
    dense = RetrievalRecallAtK(k=(1, 2))
    dense.update(scores.clone(), target.clone(), query_ids=ids)
    ids.fill_(0)  # the caller's buffer, reused for the next batch
    dense.update(scores[:0], target[:0], query_ids=ids[:0])
    assert list(dense.compute().values()) == pytest.approx(want)


def test_flat_inputs_reused_by_the_caller_do_not_change_the_state() -> None:
    flat = RetrievalRecallAtK(k=(1, 2))
    preds, relevant, indexes = _flat_tie_free(3)
    want_flat = _flat_reference(preds, relevant, indexes, (1, 2))
    buffers = (preds.clone(), relevant.clone(), indexes.clone())
    flat.update(buffers[0], buffers[1], indexes=buffers[2])
    for buffer in buffers:
        buffer.zero_()
    assert list(flat.compute().values()) == pytest.approx(want_flat)


def test_embedding_inputs_reused_by_the_caller_do_not_change_the_state() -> None:
    gen = torch.Generator().manual_seed(13)
    embeddings = torch.randn(10, 4, generator=gen)
    labels = torch.randint(0, 3, (10,), generator=gen)
    groups, sample_ids = torch.arange(10) % 3, torch.arange(10)
    metric = EmbeddingRecallAtK(k=(1, 2), exclude="same_group")
    metric.update(embeddings.clone(), labels.clone(), groups=groups.clone(), ids=sample_ids.clone())
    want_emb = metric.compute()
    reused = EmbeddingRecallAtK(k=(1, 2), exclude="same_group")
    buffers = (embeddings.clone(), labels.clone(), groups.clone(), sample_ids.clone())
    reused.update(buffers[0], buffers[1], groups=buffers[2], ids=buffers[3])
    for buffer in buffers:
        buffer.zero_()
    assert reused.compute() == want_emb


class _Holder(torch.nn.Module):
    def __init__(self, metric: Metric) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)
        self.metric = metric

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
# (a FutureWarning from torch 2.15 on)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
# torch.jit.script reads every property of the module, torchmetrics' deprecated
# `_update_called` among them.
@pytest.mark.filterwarnings("ignore:This property will be removed in 2.0.0:DeprecationWarning")
@pytest.mark.parametrize("cls", [RetrievalRecallAtK, EmbeddingRecallAtK])
def test_jit_script_of_a_module_holding_the_metric(cls: type[Metric]) -> None:
    torch.jit.script(_Holder(RetrievalHitRate()))  # torchmetrics' own: it scripts
    holder = _Holder(cls(k=(1, 5)))
    scripted = torch.jit.script(holder)
    x = torch.randn(2, 4)
    assert torch.equal(scripted(x), holder(x))


@pytest.mark.filterwarnings("ignore:No query was counted")
def test_merge_state_after_compute_counts_the_merged_state() -> None:
    """A result computed before ``merge_state`` is not returned again after it."""
    gen = torch.Generator().manual_seed(11)
    scores = torch.rand(6, 9, generator=gen)
    target = torch.randint(-1, 9, (6,), generator=gen)
    first, second = RetrievalRecallAtK(k=(1, 3)), RetrievalRecallAtK(k=(1, 3))
    first.update(scores[:3], target[:3])
    second.update(scores[3:], target[3:])
    first.compute()
    views = first.per_k()
    first.merge_state(second)
    whole = RetrievalRecallAtK(k=(1, 3))
    whole.update(scores, target)
    expected = whole.compute()
    assert first.compute() == expected
    assert {key: view.compute() for key, view in views.items()} == expected
