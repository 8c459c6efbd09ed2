"""The one-process ranking's per-item bookkeeping: int32 where the items allow, views of
the ordered items where a side is one run of them, and the same results whatever the
labels' range (int64 labels and groups beyond int32 are ranked as they are)."""

from __future__ import annotations

import pytest
import torch

from recall_at_k import EmbeddingRecallAtK
from recall_at_k.ranking import plan
from recall_at_k.ranking.blocks import LocalSource
from recall_at_k.ranking.stored import StoredRows

PROTOCOLS = ["loo", "qg", "bidirectional"]
EXCLUDES = ["none", "same_group", "same_label_and_group"]


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(90, 6, generator=gen)
    embeddings[40:45] = embeddings[:5]  # bitwise copies: the protocol report counts them
    labels = torch.randint(0, 9, (90,), generator=gen)
    groups = torch.randint(0, 4, (90,), generator=gen)
    return embeddings, labels, groups


def _metric(protocol: str, exclude: str, similarity: str) -> EmbeddingRecallAtK:
    return EmbeddingRecallAtK(
        (1, 2, 5),
        similarity=similarity,  # type: ignore[arg-type]
        exclude=exclude,  # type: ignore[arg-type]
        bidirectional=protocol == "bidirectional",
        near_duplicate=0.9,
    )


def _fill(
    metric: EmbeddingRecallAtK,
    protocol: str,
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    groups: torch.Tensor,
) -> None:
    if protocol == "loo":
        for part in range(0, 90, 30):  # several stored blocks
            rows = slice(part, part + 30)
            metric.update(embeddings[rows], labels[rows], groups=groups[rows])
        return
    ids = torch.arange(90) % 70  # repeats of a sample count once
    metric.update(embeddings[:40], labels[:40], groups=groups[:40], ids=ids[:40], role="query")
    metric.update(embeddings[40:], labels[40:], groups=groups[40:], ids=ids[40:], role="gallery")


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("exclude", EXCLUDES)
@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
def test_labels_beyond_int32_rank_as_small_ones(
    protocol: str, exclude: str, similarity: str
) -> None:
    """Labels and groups beyond the int32 range (kept int64) give the results and the
    protocol report of small ones of the same order (narrowed to int32)."""
    embeddings, labels, groups = _data()
    results, reports = [], []
    for scale, shift in ((1, 0), (2**33, 2**40)):
        metric = _metric(protocol, exclude, similarity)
        _fill(metric, protocol, embeddings, labels * scale - shift, groups + shift)
        results.append(metric.compute())
        reports.append(metric.protocol_report())
    first, second = _flatten(results[0]), _flatten(results[1])
    assert len(first) == len(second)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert reports[0] == reports[1]


def _flatten(result: object) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    assert isinstance(result, dict)
    return [t for key in sorted(result) for t in _flatten(result[key])]


def test_labels_and_groups_are_int32_where_they_fit() -> None:
    labels, groups = torch.tensor([5, -3]), torch.tensor([7, 2**31 - 1])
    narrow_labels, narrow_groups = plan.narrow_columns(labels, groups)
    assert narrow_labels.dtype == narrow_groups.dtype == torch.int32
    assert narrow_labels.tolist() == [5, -3] and narrow_groups.tolist() == [7, 2**31 - 1]
    alone, same = plan.narrow_columns(labels, None)  # the groups: the labels (not read)
    assert alone.data_ptr() == same.data_ptr() and alone.dtype == torch.int32
    for wide in (2**31, -(2**31) - 1):
        groups[1] = wide
        assert plan.narrow_columns(labels, groups)[0].dtype == torch.int64
        assert plan.narrow_columns(labels, None)[0].dtype == torch.int32  # groups not read


@pytest.mark.parametrize("protocol", ["loo", "qg"])
def test_sides_read_the_ordered_items_as_views(protocol: str) -> None:
    """In the ranking's order each gallery, and the queries in label order, are one run
    of the items: the gallery's rows, labels and groups are views of the plan's, the
    leave-one-out queries the gallery's own, and the sides int32."""
    gen = torch.Generator().manual_seed(1)
    num = 40
    labels = torch.randint(0, 6, (num,), generator=gen)
    roles = torch.full((num,), 3) if protocol == "loo" else 1 + (torch.arange(num) % 2)
    ids = torch.arange(num)
    has_id = torch.zeros(num, dtype=torch.bool) if protocol == "loo" else ids < num
    items = plan.Items(labels, labels % 3, ids, has_id, roles)
    embeddings = torch.randn(num, 4)
    rows = StoredRows([embeddings[:7], embeddings[7:]], 4)
    sides = plan.directions(items, 2)
    planned = plan.make_plan(rows, items, sides, "same_group", 2**20)  # type: ignore[arg-type]
    order = plan.ranking_order(labels, sides)  # type: ignore[arg-type]
    assert planned.embeddings is not None
    assert torch.equal(planned.embeddings, embeddings[order])
    for sides in planned.directions:
        assert sides is not None
        assert all(side.rows.dtype == torch.int32 for side in sides)
        source = LocalSource(planned, sides, (0, sides[0].rows.shape[0]), "cosine")
        gallery, queries = source.gallery, source.queries
        for tensor in (gallery.labels, gallery.groups, queries.labels, queries.groups):
            assert tensor.untyped_storage().data_ptr() in (
                planned.labels.untyped_storage().data_ptr(),
                planned.groups.untyped_storage().data_ptr(),
            )
        assert gallery.canonical.untyped_storage().data_ptr() == planned.embeddings.data_ptr()
        assert source.leave_one_out == (protocol == "loo")
        # The same queries and labels as read from the plan directly.
        assert torch.equal(queries.labels, planned.labels[queries.rows.long()])
        assert torch.equal(sides[0].rows.long()[queries.position], queries.rows.long())
