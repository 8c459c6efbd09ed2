"""The one-process ranking's per-item bookkeeping: int32 where the items allow, views of
the ordered items where a side is one run of them, and the same results whatever the
labels' range (int64 labels and groups beyond int32 are ranked as they are)."""

from __future__ import annotations

import pytest
import torch

from recall_at_k import EmbeddingRecallAtK, _items
from recall_at_k.ranking import ordered as _ordered
from recall_at_k.ranking.gallery import (
    Side,
    gallery_of,
    identities,
    index_dtype,
    queries_of,
    select,
)

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


def test_label_columns_are_int32_where_they_fit() -> None:
    meta = torch.tensor([[5, 7, 0, 0, 3], [-3, 2**31 - 1, 0, 0, 3]])
    columns = _items.label_columns(meta, True)
    assert columns.dtype == torch.int32 and columns.tolist() == [[5, -3], [7, 2**31 - 1]]
    alone = _items.label_columns(meta, False)  # the groups a view of the labels
    assert alone.dtype == torch.int32 and alone.stride(0) == 0
    assert alone.tolist() == [[5, -3], [5, -3]]
    order = torch.tensor([1, 0], dtype=torch.int32)
    assert _items.take_columns(columns, order).tolist() == [[-3, 5], [2**31 - 1, 7]]
    assert _items.take_columns(alone, order).stride(0) == 0
    for wide in (2**31, -(2**31) - 1):
        meta[1, 1] = wide
        assert _items.label_columns(meta, True).dtype == torch.int64
        assert _items.label_columns(meta, False).dtype == torch.int32  # groups not read
    assert index_dtype(2**31 - 1) == torch.int32 and index_dtype(2**31) == torch.int64


def _ordered_sides(
    labels: torch.Tensor, flags: torch.Tensor, ids: torch.Tensor, has_id: torch.Tensor
) -> tuple[list[tuple[Side, Side] | None], torch.Tensor, torch.Tensor]:
    """Each direction's sides renumbered to the ranking's order, the items in that
    order, and ``order``."""
    identity = identities(ids, has_id)
    directions: list[tuple[Side, Side] | None] = [
        (select(flags & 1 != 0, identity), select(flags & 2 != 0, identity)),
        (select(flags & 2 != 0, identity), select(flags & 1 != 0, identity)),
    ]
    directions = _items.narrow_sides(directions, labels.shape[0])
    embeddings = torch.randn(labels.shape[0], 4)
    source = _ordered.RowSource([embeddings[:7], embeddings[7:]], *embeddings.shape, torch.float32)
    ordered = _ordered.ordered_items(source, labels, directions, None)
    return ordered.directions, ordered.embeddings, ordered.order


@pytest.mark.parametrize("protocol", ["loo", "qg"])
def test_sides_read_the_ordered_items_as_views(protocol: str) -> None:
    """In the ranking's order each gallery, and the queries in label order, are one run
    of the items: their labels and groups are views of the items', the leave-one-out
    queries the gallery's own, and every index int32."""
    gen = torch.Generator().manual_seed(1)
    num = 40
    labels = torch.randint(0, 6, (num,), generator=gen)
    flags = torch.full((num,), 3) if protocol == "loo" else 1 + (torch.arange(num) % 2)
    ids = torch.arange(num)
    has_id = torch.zeros(num, dtype=torch.bool) if protocol == "loo" else ids < num
    directions, embeddings, order = _ordered_sides(labels, flags, ids, has_id)
    meta = torch.stack([labels, labels % 3], dim=1)
    columns = _items.take_columns(_items.label_columns(meta, True), order)
    items_labels, items_groups = columns[0], columns[1]
    storage = columns.untyped_storage().data_ptr()
    for sides in directions:
        assert sides is not None
        assert all(side.rows.dtype == torch.int32 for side in sides)
        gallery = gallery_of(embeddings, items_labels, items_groups, sides[1], "cosine")
        share = queries_of(items_labels, items_groups, sides[0], gallery)
        for tensor in (gallery.labels, gallery.groups, share.labels, share.groups):
            assert tensor.untyped_storage().data_ptr() == storage
        assert gallery.embeddings.untyped_storage().data_ptr() == embeddings.data_ptr()
        for tensor in (share.rows, share.block_start, share.block_count, share.self_column):
            assert tensor.dtype == torch.int32
        assert share.position.dtype == torch.int32
        assert gallery.block_counts.dtype == torch.int32
        assert gallery.block_labels.untyped_storage().nbytes() == gallery.block_labels.nbytes
        if protocol == "loo":
            assert share.rows is gallery.rows
            assert torch.equal(share.self_column, torch.arange(num, dtype=torch.int32))
        # The same queries, labels and runs as read from the items directly.
        rows = share.rows.long()
        assert torch.equal(share.labels, items_labels[rows])
        assert torch.equal(gallery.labels, items_labels[gallery.rows.long()])
        positions = sides[0].rows.long()[share.position.long()]
        assert torch.equal(positions, rows)
