"""CUDA subset: results on the GPU equal the CPU results, for every input form.

Every input form (dense ``[Q]`` index target, dense ``[Q, G]`` mask target, both with an
``ignore`` mask, the flat ``(preds, target, indexes)`` form, ``EmbeddingRecallAtK``
leave-one-out and query/gallery), in float32, float16 and bfloat16 scores, under every
tie policy. Skipped on machines without a CUDA GPU.

The inputs are built on the CPU, cast to the score dtype there, and copied to the GPU,
so both devices see bit-identical values. Scores are multiples of 1/8 in [-2, 2] (heavy
ties, exact in every dtype); embeddings are small integers ranked by dot product or
negative squared distance, so every score is an integer that any summation order
computes exactly. Ranks and counts are therefore identical on both devices: results must
be equal, up to float64 rounding for ``ties="expected"`` (its closed form runs through
``lgamma``/``exp``, whose last bits may differ between devices).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import TIES

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

DEVICE = "cuda"

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KS = (1, 2, 5, 10)
GALLERY = 37
BATCHES = (5, 16, 11)  # queries in each dense batch

Result = torch.Tensor | dict[str, torch.Tensor]
Feed = Callable[[Any, str], None]  # feed(metric, device) updates the metric


def _scores(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-16, 17, (rows, cols), generator=gen).float() / 8


def _dense_batches(
    target_form: str, with_ignore: bool, dtype: torch.dtype
) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(1)
    batches: list[tuple[torch.Tensor, ...]] = []
    for rows in BATCHES:
        scores = _scores(rows, GALLERY, gen).to(dtype)
        if target_form == "index":
            target = torch.randint(-1, GALLERY, (rows,), generator=gen)  # -1: no positive
        else:
            target = torch.rand(rows, GALLERY, generator=gen) < 0.1
            target[0] = False  # a query without a positive
        batch: tuple[torch.Tensor, ...] = (scores, target)
        if with_ignore:
            batch += (torch.rand(rows, GALLERY, generator=gen) < 0.15,)
        batches.append(batch)
    return batches


def _dense_feed(target_form: str, with_ignore: bool, dtype: torch.dtype) -> Feed:
    batches = _dense_batches(target_form, with_ignore, dtype)

    def feed(metric: Any, device: str) -> None:
        for batch in batches:
            moved = [t.to(device) for t in batch]
            metric.update(*moved[:2], ignore=moved[2] if len(moved) > 2 else None)

    return feed


def _flat_feed(dtype: torch.dtype) -> Feed:
    """Queries of different lengths, each split over two batches, items shuffled."""
    gen = torch.Generator().manual_seed(2)
    num_queries = 24
    lengths = torch.randint(1, 30, (num_queries,), generator=gen)
    indexes = torch.repeat_interleave(torch.arange(num_queries) * 3 + 7, lengths)
    preds = (torch.randint(-16, 17, (indexes.numel(),), generator=gen).float() / 8).to(dtype)
    target = (torch.rand(indexes.numel(), generator=gen) < 0.2).long()
    target[torch.rand(indexes.numel(), generator=gen) < 0.1] = -1  # ignore_index
    order = torch.randperm(indexes.numel(), generator=gen)
    halves = order.chunk(2)

    def feed(metric: Any, device: str) -> None:
        for part in halves:
            metric.update(
                preds[part].to(device), target[part].to(device), indexes=indexes[part].to(device)
            )

    return feed


def _integer_embeddings(num: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(-2, 3, (num, 8), generator=gen).float().to(dtype)


def _leave_one_out_feed(dtype: torch.dtype) -> Feed:
    gen = torch.Generator().manual_seed(3)
    embeddings = _integer_embeddings(70, gen, dtype)
    labels = torch.randint(0, 6, (70,), generator=gen)

    def feed(metric: Any, device: str) -> None:
        for start in range(0, 70, 32):
            stop = start + 32
            metric.update(embeddings[start:stop].to(device), labels[start:stop].to(device))

    return feed


def _query_gallery_feed(dtype: torch.dtype) -> Feed:
    gen = torch.Generator().manual_seed(4)
    queries, gallery = _integer_embeddings(30, gen, dtype), _integer_embeddings(55, gen, dtype)
    query_labels = torch.randint(0, 8, (30,), generator=gen)
    gallery_labels = torch.randint(0, 8, (55,), generator=gen)
    query_groups = torch.randint(0, 3, (30,), generator=gen)
    gallery_groups = torch.randint(0, 3, (55,), generator=gen)

    def feed(metric: Any, device: str) -> None:
        metric.update(
            queries.to(device),
            query_labels.to(device),
            role="query",
            groups=query_groups.to(device),
        )
        metric.update(
            gallery.to(device),
            gallery_labels.to(device),
            role="gallery",
            groups=gallery_groups.to(device),
        )

    return feed


def _case(form: str, ties: str, dtype: torch.dtype) -> tuple[Callable[[], Any], Feed]:
    """``(make_metric, feed)`` of one input form."""
    if form in ("index", "mask", "index+ignore", "mask+ignore"):
        target_form, _, ignore = form.partition("+")
        return (
            lambda: RetrievalRecallAtK(KS, ties=ties),
            _dense_feed(target_form, bool(ignore), dtype),
        )
    if form == "flat":
        return lambda: RetrievalRecallAtK(KS, ties=ties, ignore_index=-1), _flat_feed(dtype)
    if form == "leave-one-out":
        # Tiles smaller than a row of scores: the tiled path as well.
        return (
            lambda: EmbeddingRecallAtK(KS, similarity="dot", ties=ties, chunk_bytes=64),
            _leave_one_out_feed(dtype),
        )
    assert form == "query/gallery"
    return (
        lambda: EmbeddingRecallAtK(
            KS,
            similarity="euclidean",
            exclude="same_label_and_group",
            empty_target_action="skip",
            bidirectional=True,
            ties=ties,
        ),
        _query_gallery_feed(dtype),
    )


def _compute(make: Callable[[], Any], feed: Feed, device: str) -> dict[str, torch.Tensor]:
    metric = make().to(device)
    feed(metric, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result: Result = metric.compute()
    assert isinstance(result, dict)
    return result


FORMS = (
    "index",
    "mask",
    "index+ignore",
    "mask+ignore",
    "flat",
    "leave-one-out",
    "query/gallery",
)


@pytest.mark.parametrize("ties", TIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_cuda_equals_cpu(form: str, dtype: torch.dtype, ties: str) -> None:
    make, feed = _case(form, ties, dtype)
    expected = _compute(make, feed, "cpu")
    actual = _compute(make, feed, DEVICE)
    assert actual.keys() == expected.keys()
    for key, value in actual.items():
        assert value.device.type == torch.device(DEVICE).type, key
        if ties == "expected":
            torch.testing.assert_close(value.cpu(), expected[key], rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(value.cpu(), expected[key]), (key, value, expected[key])
    # Not vacuous: some, but not all, queries hit at K = 1.
    values = torch.stack([v.double() for v in expected.values()])
    assert values.nan_to_num(0.0).max() > 0
    assert values.nan_to_num(1.0).min() < 1
