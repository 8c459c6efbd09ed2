"""Property-based agreement of the flat form and of EmbeddingRecallAtK with the references."""

from __future__ import annotations

import math
import random
import warnings

import torch
from embedding_reference import Batch, reference_embedding_recall
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_recall
from strategies import ACTIONS, LEVELS, TIES

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

PROPERTY = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
IGNORE = -100


def _same(got: dict[str, torch.Tensor] | torch.Tensor, want: dict[str, float]) -> bool:
    assert isinstance(got, dict)
    for key, value in want.items():
        actual = float(got[key])
        if not ((math.isnan(actual) and math.isnan(value)) or abs(actual - value) <= 1e-6):
            return False
    return True


@st.composite
def flat_cases(draw: st.DrawFn) -> dict[str, object]:
    levels = draw(st.lists(st.sampled_from(LEVELS), min_size=1, max_size=4, unique=True))
    use_ignore = draw(st.booleans())
    items: list[tuple[int, float, int]] = []
    for query in range(draw(st.integers(1, 6))):
        for _ in range(draw(st.integers(0, 8))):
            target = draw(st.sampled_from([0, 1, IGNORE] if use_ignore else [0, 1]))
            items.append((query * 7 + 3, draw(st.sampled_from(levels)), target))  # sparse ids
    return {
        "items": items,
        "ignore_index": IGNORE if use_ignore else None,
        "ks": tuple(draw(st.lists(st.integers(1, 10), min_size=1, max_size=3, unique=True))),
        "ties": draw(st.sampled_from(TIES)),
        "action": draw(st.sampled_from(ACTIONS)),
        "seed": draw(st.integers(0, 2**16)),
        "batches": draw(st.integers(1, 5)),
    }


@PROPERTY
@given(case=flat_cases())
def test_flat_form_matches_reference(case: dict[str, object]) -> None:
    items: list[tuple[int, float, int]] = case["items"]  # type: ignore[assignment]
    ks: tuple[int, ...] = case["ks"]  # type: ignore[assignment]
    ties, action = str(case["ties"]), str(case["action"])
    # Reference: one row per query that keeps at least one item after ignore_index.
    rows: dict[int, list[tuple[float, int]]] = {}
    for query, score, target in items:
        if target != IGNORE:
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
        assert _same(metric.compute(), want)


@st.composite
def embedding_cases(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(2, 9))
    similarity = draw(st.sampled_from(["dot", "euclidean", "cosine"]))
    # Scores must be exact in float32 whatever kernel the matrix product uses (a fused
    # multiply-add rounds differently, see the README): small integers for dot and
    # euclidean; for cosine, vectors whose normalised entries are exact (an axis times
    # 1 or 2, or four entries of +-1, norm 2), so every cosine is in {0, +-0.5, +-1}.
    embeddings: list[list[float]] = []
    for _ in range(n):
        if similarity == "cosine":
            kind = draw(st.sampled_from(["axis", "signs"]))
            if kind == "axis":
                vector = [0.0] * 4
                vector[draw(st.integers(0, 3))] = draw(st.sampled_from([-2.0, -1.0, 1.0, 2.0]))
            else:
                vector = [draw(st.sampled_from([-1.0, 1.0])) for _ in range(4)]
        else:
            coords = st.sampled_from([-1.0, 0.0, 1.0, 2.0])
            vector = [draw(coords), draw(coords)]
        embeddings.append(vector)
    roles = draw(st.sampled_from(["both", "split"]))
    return {
        "embeddings": embeddings,
        "labels": [draw(st.integers(0, 2)) for _ in range(n)],
        "groups": [draw(st.integers(0, 1)) for _ in range(n)],
        "use_ids": draw(st.booleans()),
        "roles": roles,
        "similarity": similarity,
        "exclude": draw(st.sampled_from(["none", "same_group", "same_label_and_group"])),
        "ks": tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3, unique=True))),
        "ties": draw(st.sampled_from(TIES)),
        "action": draw(st.sampled_from(("neg", "pos", "skip"))),
        "chunk_bytes": draw(st.sampled_from([1, 12, 64, 2**20])),
        "bidirectional": roles == "split" and draw(st.booleans()),
    }


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
        assert _same(metric.compute(), want)
