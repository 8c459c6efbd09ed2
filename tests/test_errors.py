"""Every input error of every entry point, with its message: one table ``(call, match)``.

Each case is a call that must raise ``ValueError`` whose message matches ``match``:
constructor options and ``k`` of both metrics and the functional API; the dense form
(metric update, ``retrieval_recall_at_k``, ``retrieval_first_hit_rank``); the flat form;
``query_ids``; ``recall_at_k_from_ranks``; EmbeddingRecallAtK's update and compute;
``compute`` with ``empty_target_action="error"``; a corrupted state; ``plot``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _pytest.mark import ParameterSet
from embedding_reference import query_gallery_junk, run_metric
from helpers import tied_rows

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK, functional
from recall_at_k.functional import (
    embedding_recall_at_k,
    recall_at_k_from_ranks,
    retrieval_first_hit_rank,
    retrieval_recall_at_k,
)

S = torch.rand(3, 4)
T = torch.tensor([0, 1, -1])
CASES: list[ParameterSet] = []


def case(name: str, call: Callable[[], object], match: str) -> None:
    CASES.append(pytest.param(call, match, id=name))


def _then(*calls: Callable[[], object]) -> Callable[[], object]:
    """Run the calls in order (the last one is meant to raise)."""

    def run() -> object:
        result = None
        for call in calls:
            result = call()
        return result

    return run


# ------------------------------------------------------------- k and the options

for k, match in [
    ((), r"`k` must not be empty"),
    ((1, 5, 1), r"`k` must not contain duplicates"),
    ((1, 2.0), r"`k` must contain only ints, got 2.0"),
    ((1, True), r"`k` must contain only ints, got True"),
    (0, r"`k` values must be >= 1, got 0"),
    ((5, -1), r"`k` values must be >= 1, got -1"),
    ("5", r"`k` must be a positive int or a sequence"),
    (2.5, r"`k` must be a positive int or a sequence"),
    (True, r"`k` must be a positive int or a sequence"),
]:
    case(f"metric-k={k!r}", lambda k=k: RetrievalRecallAtK(k=k), match)
    case(f"functional-k={k!r}", lambda k=k: retrieval_recall_at_k(S, T, k=k), match)

case(
    "ties",
    lambda: RetrievalRecallAtK(ties="random"),  # type: ignore[arg-type]
    r"`ties` must be one of 'pessimistic', 'optimistic'",
)
case(
    "empty_target_action",
    lambda: RetrievalRecallAtK(empty_target_action="drop"),  # type: ignore[arg-type]
    r"`empty_target_action` must be one of 'neg'",
)
case(
    "key",
    lambda: RetrievalRecallAtK(key="recall"),
    r"`key` must give a distinct key for every K",
)
case(
    "ignore_index",
    lambda: RetrievalRecallAtK(ignore_index=1.5),  # type: ignore[arg-type]
    r"`ignore_index` must be an int or None, got 1.5",
)
case(
    "first_hit_rank-expected",
    lambda: retrieval_first_hit_rank(S, T, ties="expected"),  # type: ignore[arg-type]
    r"`ties` must be one of 'pessimistic', 'optimistic', got",
)

# ------------------------------------------------------------------ dense inputs

DENSE: list[tuple[str, Any, Any, Any, str]] = [
    (
        "int-scores",
        torch.randint(0, 5, (3, 4)),
        T,
        None,
        r"`scores` must be a floating point tensor of shape \[Q, G\], got shape \[3, 4\] and dtype torch.int64",
    ),
    (
        "3d-scores",
        torch.rand(2, 3, 4),
        T,
        None,
        r"`scores` must be a floating point .* got shape \[2, 3, 4\]",
    ),
    (
        "column-length",
        S,
        torch.tensor([0, 1]),
        None,
        r"`target` of one dimension must be a signed integer \(int64\) tensor of shape \[Q\] = \[3\].*got shape \[2\]",
    ),
    (
        "float-column",
        S,
        torch.tensor([0.0, 1.0, 2.0]),
        None,
        r"`target` of one dimension .* dtype torch.float32",
    ),
    (
        "bool-column",
        S,
        torch.tensor([True, False, True]),
        None,
        r"`target` of one dimension .* dtype torch.bool",
    ),
    (
        "mask-shape",
        S,
        torch.zeros(3, 5, dtype=torch.bool),
        None,
        r"`target` of two dimensions must be a bool, 0/1 integer or 0./1. float tensor of the same shape as `scores` \[3, 4\], got shape \[3, 5\]",
    ),
    (
        "complex-mask",
        S,
        torch.zeros(3, 4, dtype=torch.complex64),
        None,
        r"`target` of two dimensions .* dtype torch.complex64",
    ),
    (
        "3d-target",
        S,
        torch.zeros(3, 4, 1, dtype=torch.bool),
        None,
        r"`target` must be a \[Q, G\] bool/0-1 mask or a \[Q\] int64 column index",
    ),
    (
        "float-ignore",
        S,
        T,
        torch.zeros(3, 4),
        r"`ignore` must be a bool tensor of the same shape as `scores` \[3, 4\], got shape \[3, 4\] and dtype torch.float32",
    ),
    (
        "ignore-shape",
        S,
        T,
        torch.zeros(4, 3, dtype=torch.bool),
        r"`ignore` must be a bool tensor .* got shape \[4, 3\]",
    ),
    (
        "ignore-device",
        S,
        T,
        torch.zeros(3, 4, dtype=torch.bool, device="meta"),
        r"`ignore` is on device meta but `scores` is on cpu",
    ),
    ("target-device", S, T.to("meta"), None, r"`target` is on device meta but `scores` is on cpu"),
    ("target-list", S, [0, 1, 2], None, r"`target` must be a torch.Tensor, got list"),
    (
        "nan",
        torch.tensor([[0.1, float("nan")], [0.2, 0.3]]),
        torch.tensor([0, 1]),
        None,
        r"`scores` must not contain NaN, found 1 NaN value\(s\)",
    ),
    (
        "column-too-large",
        S,
        torch.tensor([0, 4, -1]),
        None,
        r"`target` column indices must lie in \[-1, 4\) \(the gallery has 4 items; -1 = no true item\), got values in \[-1, 4\]",
    ),
    (
        "column-below-minus-one",
        S,
        torch.tensor([0, -2, 1]),
        None,
        r"`target` column indices must lie in \[-1, 4\).*got values in \[-2, 1\]",
    ),
    (
        "mask-values",
        S,
        torch.tensor([[0, 1, 2, 0]] * 3),
        None,
        r"`target` mask values must be 0 or 1, got 3 other value\(s\), e.g. 2",
    ),
    (
        "float-mask-values",
        S,
        torch.tensor([[0.0, 1.0, 0.5, 0.0]] * 3),
        None,
        r"`target` mask values must be 0 or 1, got 3 other value\(s\), e.g. 0.5; binarise"
        r" graded relevance first, for example `target > 0`",
    ),
]
for name, scores, target, ignore, match in DENSE:
    case(
        f"dense-update-{name}",
        lambda s=scores, t=target, i=ignore: RetrievalRecallAtK().update(s, t, ignore=i),
        match,
    )
    case(
        f"dense-recall-{name}",
        lambda s=scores, t=target, i=ignore: retrieval_recall_at_k(s, t, ignore=i),
        match,
    )
    case(
        f"dense-first-hit-rank-{name}",
        lambda s=scores, t=target, i=ignore: retrieval_first_hit_rank(s, t, ignore=i),
        match,
    )

case(
    "dense-0d-scores",
    lambda: retrieval_recall_at_k(torch.tensor(0.5), torch.tensor(0)),
    r"`scores` must be a floating point tensor of shape \[Q, G\], got shape \[\]",
)
case(
    "dense-3d-scores-update",
    lambda: RetrievalRecallAtK().update(torch.rand(2, 2, 2), torch.tensor([0, 1])),
    r"got shape \[2, 2, 2\]",
)
case(
    "dense-1d-preds-points-to-the-flat-form",
    lambda: RetrievalRecallAtK()(torch.rand(4), torch.tensor([0, 1, 0, 0])),
    r"`preds` of shape \[4\] is the flat form: pass the query ids too, `update\(preds, target, indexes\)`",
)
case(
    "dense-1d-scores-functional",
    lambda: retrieval_recall_at_k(torch.rand(3), T),
    r"`scores` must be a floating point .* got shape \[3\]",
)


def _empty_targets(target: list[int]) -> Callable[[], object]:
    metric = RetrievalRecallAtK(k=1, empty_target_action="error")
    return _then(lambda: metric.update(torch.rand(4, 3), torch.tensor(target)), metric.compute)


case(
    "dense-empty-target-two",
    _empty_targets([0, -1, -1, 2]),
    r"2 queries had no valid positive target",
)
case(
    "dense-empty-target-one", _empty_targets([0, -1, 1, 2]), r"1 query had no valid positive target"
)

# ------------------------------------------------------------------------ ranks

case(
    "ranks-2d",
    lambda: recall_at_k_from_ranks(torch.ones(2, 2), k=1),
    r"`ranks` must be a 1-D integer tensor of ranks, got shape \[2, 2\]",
)
case(
    "ranks-bool",
    lambda: recall_at_k_from_ranks(torch.ones(2, dtype=torch.bool), k=1),
    r"`ranks` must be a 1-D integer tensor .* torch.bool",
)
case("ranks-empty-k", lambda: recall_at_k_from_ranks([1, 2], k=()), r"`k` must not be empty")
case(
    "ranks-key",
    lambda: recall_at_k_from_ranks([1, 2], k=1, key=5),  # type: ignore[call-overload]
    r"`key` must be a str template such as",
)

# ------------------------------------------------------------------- flat inputs


def _flat_ok() -> dict[str, Any]:
    return {
        "preds": torch.tensor([0.3, 0.7, 0.1]),
        "target": torch.tensor([0, 1, 0]),
        "indexes": torch.tensor([0, 0, 1]),
    }


for name, change, match in [
    ("int-preds", {"preds": torch.tensor([1, 2, 3])}, r"`preds` must be a floating point tensor"),
    ("list-preds", {"preds": [0.1, 0.2, 0.3]}, r"`preds` must be a torch.Tensor, got list"),
    (
        "complex-target",
        {"target": torch.tensor([0.0, 1.0, 0.0], dtype=torch.complex64)},
        r"`target` must be a bool, 0/1 integer or 0./1. float tensor of relevance, got shape"
        r" \[3\] and dtype torch.complex64",
    ),
    (
        "float-target-values",
        {"target": torch.tensor([0.0, 0.5, 1.0])},
        r"`target` values must be 0 or 1, got 1 other value\(s\), e.g. 0.5 \(pass `ignore_index`"
        r" .*\); binarise graded relevance first, for example `target > 0`",
    ),
    (
        "float-target-nan",
        {"target": torch.tensor([0.0, float("nan"), 1.0])},
        r"`target` values must be 0 or 1, got 1 other value\(s\), e.g. nan",
    ),
    (
        "float-indexes",
        {"indexes": torch.tensor([0.0, 0.0, 1.0])},
        r"`indexes` must be an integer \(int64\)",
    ),
    (
        "bool-indexes",
        {"indexes": torch.tensor([True, False, True])},
        r"`indexes` must be an integer",
    ),
    (
        "short-indexes",
        {"indexes": torch.tensor([0, 0])},
        r"equal length .* got shapes \[3\], \[3\] and \[2\]",
    ),
    (
        "short-target",
        {"target": torch.tensor([0, 1])},
        r"equal length .* got shapes \[3\], \[2\] and \[3\]",
    ),
    (
        "0d",
        {"preds": torch.tensor(0.5), "target": torch.tensor(1), "indexes": torch.tensor(0)},
        r"must be 1-D tensors of equal length",
    ),
    (
        "nan",
        {"preds": torch.tensor([0.3, float("nan"), 0.1])},
        r"`preds` must not contain NaN, found 1",
    ),
    (
        "target-values",
        {"target": torch.tensor([0, 2, 0])},
        r"`target` values must be 0 or 1, got 1 other .* e\.g\. 2",
    ),
    (
        "target-device",
        {"target": torch.tensor([0, 1, 0], device="meta")},
        r"`target` is on device meta",
    ),
    (
        "target-hints-at-ignore-index",
        {"target": torch.tensor([0, 1, -100])},
        r"pass `ignore_index`",
    ),
]:
    args = {**_flat_ok(), **change}
    case(
        f"flat-{name}",
        lambda a=args: RetrievalRecallAtK().update(a["preds"], a["target"], indexes=a["indexes"]),
        match,
    )

_FLAT = _flat_ok()
case(
    "flat-dense-ignore-mask",
    lambda: RetrievalRecallAtK().update(
        _FLAT["preds"], _FLAT["target"], _FLAT["indexes"], ignore=torch.zeros(3, dtype=torch.bool)
    ),
    r"`ignore` is the dense form's \[Q, G\] mask",
)
case(
    "flat-target-names-ignore-index",
    lambda: RetrievalRecallAtK(ignore_index=-100).update(
        _FLAT["preds"], torch.tensor([0, 7, -100]), indexes=_FLAT["indexes"]
    ),
    r"equals `ignore_index`=-100 are dropped",
)


def _flat_empty_target() -> object:
    metric = RetrievalRecallAtK(k=1, empty_target_action="error")
    metric.update(
        torch.tensor([0.3, 0.7, 0.1]), torch.tensor([0, 0, 1]), indexes=torch.tensor([0, 0, 1])
    )
    return metric.compute()


case("flat-empty-target", _flat_empty_target, r"^1 query had no valid positive target")

# --------------------------------------------------------------------- query_ids

_ROWS = tied_rows()
for name, ids, match in [
    (
        "length",
        torch.arange(30),
        r"`query_ids` must be an integer \(int64\) tensor of shape \[Q\] = \[31\], one id per row of `scores`, got shape \[30\]",
    ),
    ("float", torch.arange(31).float(), r"`query_ids` must be an integer .* dtype torch.float32"),
    ("list", list(range(31)), r"`query_ids` must be a torch.Tensor, got list"),
    (
        "device",
        torch.arange(31, device="meta"),
        r"`query_ids` is on device meta but `preds` is on cpu",
    ),
]:
    case(
        f"query-ids-{name}",
        lambda ids=ids: RetrievalRecallAtK().update(*_ROWS, query_ids=ids),
        match,
    )
case(
    "query-ids-in-the-flat-form",
    lambda: RetrievalRecallAtK().update(
        torch.rand(3),
        torch.tensor([1, 0, 0]),
        indexes=torch.zeros(3, dtype=torch.int64),
        query_ids=torch.arange(3),
    ),
    r"`query_ids` is for the dense form; in the flat form `indexes` already are the query ids",
)

# ------------------------------------------------------------- embedding: update

EMB, LABELS = torch.randn(3, 2), torch.tensor([0, 1, 0])
SHAPE = r"`embeddings` must be a floating point tensor of shape \[B, D\], got shape"
ONE_PER = r"must be an integer \(int64\) tensor of shape \[3\], one entry per row"
for name, call, match in [
    ("1d", lambda m: m.update(torch.randn(3), LABELS), SHAPE + r" \[3\]"),
    ("int", lambda m: m.update(EMB.long(), LABELS), SHAPE + r" \[3, 2\] and dtype torch.int64"),
    ("list", lambda m: m.update([[1.0]], LABELS), r"`embeddings` must be a torch.Tensor, got list"),
    (
        "labels-length",
        lambda m: m.update(EMB, LABELS[:2]),
        r"`labels` " + ONE_PER + r".*shape \[2\]",
    ),
    (
        "labels-float",
        lambda m: m.update(EMB, LABELS.float()),
        r"`labels` " + ONE_PER + r".*torch.float32",
    ),
    ("groups-length", lambda m: m.update(EMB, LABELS, groups=LABELS[:1]), r"`groups` " + ONE_PER),
    (
        "ids-length",
        lambda m: m.update(EMB, LABELS, ids=torch.zeros(4, dtype=torch.long)),
        r"`ids` " + ONE_PER,
    ),
    (
        "ids-float",
        lambda m: m.update(EMB, LABELS, ids=LABELS.float()),
        r"`ids` " + ONE_PER + r".*torch.float32",
    ),
    (
        "role",
        lambda m: m.update(EMB, LABELS, role="queries"),
        r"`role` must be one of 'query', 'gallery', 'both', got 'queries'",
    ),
    ("labels-device", lambda m: m.update(EMB, LABELS.to("meta")), r"`labels` is on device meta"),
    (
        "not-finite",
        lambda m: m.update(torch.tensor([[float("nan"), float("inf")]]), LABELS[:1]),
        r"`embeddings` must be finite, found 1 NaN and 1 infinite",
    ),
    (
        "width",
        lambda m: _then(
            lambda: m.update(EMB, LABELS, role="query"),
            lambda: m.update(torch.randn(2, 3), LABELS[:2], role="gallery"),
        )(),
        r"`embeddings` of role 'gallery' have width 3, but earlier embeddings \(role 'query'\)"
        r" have width 2",
    ),
]:
    case(f"embedding-update-{name}", lambda call=call: call(EmbeddingRecallAtK()), match)
# Zero-width embeddings (D = 0): the same error from the metric and the function.
ZERO_WIDTH = r"must have at least one column \(D >= 1\), got shape \[{}, 0\]"
for rows in (3, 0):
    case(
        f"embedding-update-zero-width-{rows}",
        lambda rows=rows: EmbeddingRecallAtK().update(torch.zeros(rows, 0), LABELS[:rows]),
        r"`embeddings` " + ZERO_WIDTH.format(rows),
    )
    case(
        f"embedding-functional-zero-width-queries-{rows}",
        lambda rows=rows: embedding_recall_at_k(torch.zeros(rows, 0), LABELS[:rows], k=1),
        r"`queries` " + ZERO_WIDTH.format(rows),
    )
case(
    "embedding-functional-zero-width-gallery",
    lambda: embedding_recall_at_k(EMB, LABELS, torch.zeros(3, 0), LABELS, k=1),
    r"`gallery` " + ZERO_WIDTH.format(3),
)
case(
    "embedding-update-groups-required",
    lambda: EmbeddingRecallAtK(exclude="same_label_and_group").update(EMB, LABELS),
    r"`groups` are required with exclude='same_label_and_group'",
)

# -------------------------------------------------------- embedding: constructor

case(
    "embedding-similarity",
    lambda: EmbeddingRecallAtK(similarity="l2"),  # type: ignore[arg-type]
    r"`similarity` must be one of 'cosine', 'dot', 'euclidean', got 'l2'",
)
case(
    "embedding-exclude",
    lambda: EmbeddingRecallAtK(exclude="x"),  # type: ignore[arg-type]
    r"`exclude` must be one of 'none', 'same_group', 'same_label_and_group', got 'x'",
)
for bad in (("a", "a"), ("a",), "ab", (1, 2), ("a", "")):
    case(
        f"embedding-directions={bad!r}",
        lambda bad=bad: EmbeddingRecallAtK(directions=bad),
        r"`directions` must be two distinct non-empty strings",
    )
for chunk in (0, -5, 1.5, True):
    case(
        f"embedding-chunk_bytes={chunk!r}",
        lambda chunk=chunk: EmbeddingRecallAtK(chunk_bytes=chunk),
        r"`chunk_bytes` must be a positive int, got",
    )
case("embedding-k", lambda: EmbeddingRecallAtK((1, 1)), r"`k` must not contain duplicates")
case("embedding-ties", lambda: EmbeddingRecallAtK(ties="random"), r"`ties` must be one of")  # type: ignore[arg-type]
case(
    "embedding-empty_target_action",
    lambda: EmbeddingRecallAtK(empty_target_action="x"),  # type: ignore[arg-type]
    r"`empty_target_action` must be one of",
)
case(
    "embedding-key",
    lambda: EmbeddingRecallAtK(key="recall"),
    r"`key` must give a distinct key for every K",
)

# ------------------------------------------------------------ embedding: compute


def _computed(metric: EmbeddingRecallAtK, *updates: tuple[Any, ...]) -> Callable[[], object]:
    """Compute after the updates ``(embeddings, labels, role)``; build the metric lazily."""

    def run() -> object:
        for embeddings, labels, role in updates:
            metric.update(embeddings, labels, role=role)
        return metric.compute()

    return run


case(
    "embedding-no-queries",
    lambda: _computed(EmbeddingRecallAtK(), (EMB, LABELS, "gallery"))(),
    r"`role`: direction 'q2g' \(query -> gallery\) has no queries at compute\(\): add"
    r" embeddings with role='query' or role='both'",
)
case(
    "embedding-no-gallery",
    lambda: _computed(
        EmbeddingRecallAtK(bidirectional=True, directions=("i2t", "t2i")), (EMB, LABELS, "query")
    )(),
    r"`role`: direction 'i2t' \(query -> gallery\) has no gallery",
)


def _merged_widths() -> object:
    a, b = EmbeddingRecallAtK(), EmbeddingRecallAtK()
    a.update(EMB, LABELS)
    b.update(torch.randn(2, 5), LABELS[:2])
    a.merge_state(b)
    return a.compute()


case(
    "embedding-merged-widths",
    _merged_widths,
    r"`embeddings` must all have one width: got widths \[2, 5\]",
)
case(
    "embedding-similarity-shape",
    lambda: _computed(
        EmbeddingRecallAtK(similarity=lambda q, g: q @ g.T[:, :1]), (EMB, LABELS, "both")
    )(),
    r"`similarity` must return floating point scores of shape \[3, 3\]",
)
case(
    "embedding-similarity-nan",
    lambda: _computed(
        EmbeddingRecallAtK(similarity=lambda q, g: torch.full((q.shape[0], g.shape[0]), math.nan)),
        (EMB, LABELS, "both"),
    )(),
    r"`similarity` returned NaN scores for 3 quer",
)


def _corrupted() -> object:
    metric = EmbeddingRecallAtK(k=1)
    metric.update(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]))
    metric.embedding_values[0] = metric.embedding_values[0][:-1]  # one value lost
    return metric.compute()


case(
    "embedding-corrupted-state",
    _corrupted,
    r"`embeddings`: the state holds 11 values for 4 items of width 3; it was corrupted",
)


def _junk_with_error_action() -> object:
    batches, kwargs = query_gallery_junk()
    return run_metric(batches, empty_target_action="error", **kwargs)


case("embedding-empty-target", _junk_with_error_action, r"\d+ quer(y|ies) had no valid positive")


def _one_direction_without_match() -> object:
    emb = torch.eye(4)
    metric = EmbeddingRecallAtK(1, bidirectional=True, empty_target_action="error")
    metric.update(emb[:2], torch.tensor([0, 1]), role="query")
    metric.update(emb[2:], torch.tensor([0, 0]), role="gallery")  # label 1 has no match
    return metric.compute()


case(
    "embedding-empty-target-names-the-direction",
    _one_direction_without_match,
    r"direction 'q2g': 1 query had no valid positive",
)

# ------------------------------------------------------------------------- plot

case(
    "plot-missing-key",
    lambda: RetrievalRecallAtK(k=(1, 5)).plot({"recall@5": torch.tensor(0.5)}),
    r"`val` must hold the key 'recall@1' \(optionally with a prefix ending in '/'\)",
)


@pytest.mark.parametrize(("call", "match"), CASES)
def test_error_message(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- torchmetrics' argument names


@pytest.mark.parametrize("cls", [RetrievalRecallAtK, EmbeddingRecallAtK])
def test_aggregation_is_an_error_naming_what_to_use(cls: type) -> None:
    with pytest.raises(
        ValueError,
        match=r"`aggregation` is torchmetrics' choice .* \(got 'median'\); Recall@K here is"
        r" always the mean .* use recall_at_k.functional.retrieval_first_hit_rank",
    ):
        cls(aggregation="median")


FUNCTIONAL_CALLS = {
    "retrieval_recall_at_k": lambda **kw: functional.retrieval_recall_at_k(
        torch.rand(3, 4), torch.zeros(3, dtype=torch.long), **kw
    ),
    "retrieval_first_hit_rank": lambda **kw: functional.retrieval_first_hit_rank(
        torch.rand(3, 4), torch.zeros(3, dtype=torch.long), **kw
    ),
    "recall_at_k_from_ranks": lambda **kw: functional.recall_at_k_from_ranks([1, 2], **kw),
    "embedding_recall_at_k": lambda **kw: functional.embedding_recall_at_k(
        torch.rand(3, 4), torch.zeros(3, dtype=torch.long), **kw
    ),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONAL_CALLS))
def test_functional_top_k_and_aggregation_name_what_to_use(name: str) -> None:
    call = FUNCTIONAL_CALLS[name]
    with pytest.raises(ValueError, match=r"`top_k` is torchmetrics' name for one K; .* pass k=5"):
        call(top_k=5)
    with pytest.raises(ValueError, match=r"`aggregation` .*functional.retrieval_first_hit_rank"):
        call(aggregation="median")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_one_value_not_finite_in_any_float_dtype_is_an_error(
    dtype: torch.dtype, bad: float
) -> None:
    """``validate_args`` finds a single NaN or infinity (either sign) anywhere in a batch of
    any float dtype; a batch of finite values at the dtype's extremes passes."""
    metric = EmbeddingRecallAtK((1,))
    info = torch.finfo(dtype)
    extremes = torch.tensor([[info.max, info.min, info.tiny, -info.tiny, 0.0]], dtype=dtype)
    metric.update(extremes.repeat(3, 1), torch.arange(3))  # finite: accepted
    batch = torch.randn(4, 5).to(dtype)
    batch[2, 3] = bad
    found = (1, 0) if math.isnan(bad) else (0, 1)
    with pytest.raises(ValueError, match=rf"found {found[0]} NaN and {found[1]} infinite"):
        metric.update(batch, torch.arange(4))
