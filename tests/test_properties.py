"""Property-based agreement of every form with the brute-force references (hypothesis).

Dense: the functional API, and the metric over any batching, order and precision. Flat:
queries split over batches in any order, with ``ignore_index``. Embedding: every
similarity, exclusion rule, role layout, id repeats and chunk size.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from embedding_reference import Batch, reference_embedding_recall
from helpers import (
    FLAT_IGNORE,
    DenseCase,
    assert_recall_close,
    dense_cases,
    embedding_cases,
    flat_cases,
)
from hypothesis import HealthCheck, given, settings
from reference import reference_recall

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK
from recall_at_k.functional import retrieval_recall_at_k

# Sweeps over random inputs (hypothesis): `python -m pytest -m slow` runs them, as CI does.
pytestmark = pytest.mark.slow

PROPERTY = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _expected(case: DenseCase) -> list[float] | None:
    try:
        return reference_recall(
            case.scores, case.mask, case.ignored, case.ks, case.ties, case.action
        )
    except ValueError:
        return None


# -------------------------------------------------------------------------- dense


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
    assert_recall_close(got, want, case.ks)


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
            results.append(metric.compute())
    assert_recall_close(results[0], want, case.ks)
    assert_recall_close(results[1], want, case.ks)


# --------------------------------------------------------------- flat and embedding


@PROPERTY
@given(case=flat_cases())
def test_flat_form_matches_reference(case: dict[str, object]) -> None:
    items: list[tuple[int, float, int]] = case["items"]  # type: ignore[assignment]
    ks: tuple[int, ...] = case["ks"]  # type: ignore[assignment]
    ties, action = str(case["ties"]), str(case["action"])
    # Reference: one row per query that keeps at least one item after ignore_index.
    rows: dict[int, list[tuple[float, int]]] = {}
    for query, score, target in items:
        if target != FLAT_IGNORE:
            rows.setdefault(query, []).append((score, target))
    scores = [[s for s, _ in row] for row in rows.values()]
    relevant = [[t == 1 for _, t in row] for row in rows.values()]
    try:
        want_values = reference_recall(scores, relevant, None, ks, ties, action)
    except ValueError:
        return  # the "error" action: checked by the dense and flat example tests
    want = {f"recall@{k}": v for k, v in zip(ks, want_values, strict=True)}

    shuffled = list(items)
    random.Random(int(case["seed"])).shuffle(shuffled)  # type: ignore[call-overload]
    metric = RetrievalRecallAtK(
        ks,
        ties=ties,
        empty_target_action=action,
        ignore_index=case["ignore_index"],  # type: ignore[arg-type]
    )
    parts = int(case["batches"])  # type: ignore[call-overload]
    for b in range(parts):
        chunk = shuffled[b::parts]
        metric.update(
            torch.tensor([s for _, s, _ in chunk], dtype=torch.float32),
            torch.tensor([t for _, _, t in chunk], dtype=torch.int64),
            indexes=torch.tensor([q for q, _, _ in chunk], dtype=torch.int64),
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_recall_close(metric.compute(), want)


@PROPERTY
@given(case=embedding_cases())
def test_embedding_metric_matches_reference(case: dict[str, object]) -> None:
    emb = torch.tensor(case["embeddings"], dtype=torch.float32)
    labels = torch.tensor(case["labels"])
    groups = torch.tensor(case["groups"])
    n = len(labels)
    ids = torch.arange(n) % max(n - 1, 1) if case["use_ids"] else None  # one repeated id
    if case["roles"] == "both":
        batches = [Batch(emb, labels, "both", groups, ids)]
    else:
        half = n // 2
        batches = [
            Batch(
                emb[:half],
                labels[:half],
                "query",
                groups[:half],
                None if ids is None else ids[:half],
            ),
            Batch(
                emb[half:],
                labels[half:],
                "gallery",
                groups[half:],
                None if ids is None else ids[half:] + 100,
            ),
        ]
        if half == 0:
            return
    options = {
        "similarity": case["similarity"],
        "exclude": case["exclude"],
        "bidirectional": case["bidirectional"],
        "ties": case["ties"],
        "empty_target_action": case["action"],
    }
    want = reference_embedding_recall(batches, case["ks"], **options)  # type: ignore[arg-type]
    metric = EmbeddingRecallAtK(case["ks"], chunk_bytes=case["chunk_bytes"], **options)  # type: ignore[arg-type]
    for batch in batches:
        metric.update(
            batch.embeddings, batch.labels, role=batch.role, groups=batch.groups, ids=batch.ids
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_recall_close(metric.compute(), want)
