"""Property-based agreement of the dense form with the brute-force reference."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from reference import reference_recall
from strategies import DenseCase, dense_cases

from recall_at_k import RetrievalRecallAtK
from recall_at_k.functional import retrieval_recall_at_k

PROPERTY = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _values(result: object, ks: tuple[int, ...]) -> list[float]:
    assert isinstance(result, dict)
    return [float(result[f"recall@{k}"]) for k in ks]


def _same(got: list[float], want: list[float]) -> bool:
    return all(
        (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-6
        for a, b in zip(got, want, strict=True)
    )


def _expected(case: DenseCase) -> list[float] | None:
    try:
        return reference_recall(
            case.scores, case.mask, case.ignored, case.ks, case.ties, case.action
        )
    except ValueError:
        return None


@PROPERTY
@given(case=dense_cases())
def test_functional_matches_reference(case: DenseCase) -> None:
    scores, target, ignore = case.tensors()
    want = _expected(case)

    def run() -> object:
        return retrieval_recall_at_k(
            scores, target, case.ks, ignore=ignore, ties=case.ties, empty_target_action=case.action
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if want is None:
            with pytest.raises(ValueError, match="had no valid positive"):
                run()
            return
        got = run()
    assert _same(_values(got, case.ks), want)


@PROPERTY
@given(case=dense_cases())
def test_metric_is_invariant_to_batching_order_and_precision(case: DenseCase) -> None:
    want = _expected(case)
    if want is None:
        return
    results = []
    for dtype, reverse in ((torch.float32, False), (torch.float64, True)):
        scores, target, ignore = case.tensors(dtype)
        metric = RetrievalRecallAtK(case.ks, ties=case.ties, empty_target_action=case.action)
        batches = case.batches()
        for lo, hi in reversed(batches) if reverse else batches:
            metric.update(
                scores[lo:hi], target[lo:hi], ignore=None if ignore is None else ignore[lo:hi]
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results.append(_values(metric.compute(), case.ks))
    assert _same(results[0], want)
    assert _same(results[1], want)
