"""Flat workload: the dense workload fed as flat ``(preds, target, indexes)`` batches.

Q queries x G gallery items, float32 scores, one true item a query, in blocks of 256
queries, K = (1, 5, 10). Every query is split over two flat batches: batch j holds the
second half of block j - 1's items and the first half of block j's (512 query ids).
Contestants, each fed the same batches (made one at a time, untimed), each in a child
process of its own (:func:`measure.isolated`):

- ``amax floor``: ``preds.view(-1, G / 2).amax(dim=1)`` per batch (one read of the scores);
- ``RetrievalRecallAtK`` (``validate_args=True``, the default, then ``False``), and once
  more with the items of every batch shuffled (no grouping by query to exploit);
- ``torchmetrics RetrievalHitRate x 3``: ``top_k`` = 1, 5, 10 in one ``MetricCollection``
  (its compute groups: the three share one stored copy), stopped at the time bound.

Time (wall-clock and CPU) is update + compute; peak memory that of the whole run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import measure
import torch
from dense import random_block

KS = (1, 5, 10)
BATCH = 256

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

FLOOR = "amax floor"
OURS = "RetrievalRecallAtK"
OURS_UNCHECKED = "RetrievalRecallAtK, validate_args=False"
OURS_SHUFFLED = "RetrievalRecallAtK, items shuffled in each batch"
TORCHMETRICS = "torchmetrics RetrievalHitRate x 3"
OURS_AND_FLOOR = (FLOOR, OURS, OURS_UNCHECKED, OURS_SHUFFLED)

# The torchmetrics peer's peak bytes an item: whether it can run within the memory bound.
TORCHMETRICS_BYTES_PER_ITEM = 80


def flat_batches(
    num_queries: int, gallery: int, device: str, shuffle: bool = False, seed: int = 0
) -> Iterator[Batch]:
    """The workload's flat batches, made one at a time (the same data for every seed)."""
    gen, shuffler = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    first, second = slice(0, gallery // 2), slice(gallery // 2, gallery)  # a block's halves
    previous: Batch | None = None

    def half(block: Batch, columns: slice) -> Batch:
        scores, mask, ids = block
        width = len(range(gallery)[columns])
        return (
            scores[:, columns].reshape(-1),
            mask[:, columns].reshape(-1),
            ids.repeat_interleave(width),
        )

    def join(*parts: Batch) -> Batch:
        preds, target, indexes = (torch.cat([p[i] for p in parts]) for i in range(3))
        if shuffle:
            order = torch.randperm(preds.numel(), generator=shuffler)
            preds, target, indexes = preds[order], target[order], indexes[order]
        return preds.to(device), target.to(device), indexes.to(device)

    for start in range(0, num_queries, BATCH):
        scores, _, mask = random_block(min(BATCH, num_queries - start), gallery, gen)
        block = (scores, mask, torch.arange(start, start + scores.shape[0]))
        head = half(block, first)
        yield join(half(previous, second), head) if previous else join(head)
        previous = block
    if previous is not None:
        yield join(half(previous, second))


def _metric(name: str, gallery: int, device: str) -> tuple[Callable[[Batch], None], Callable]:
    """``(update, compute)`` of a fresh contestant."""
    if name == FLOOR:
        sink: list[torch.Tensor] = []

        def floor(batch: Batch) -> None:
            sink.append(batch[0].view(-1, gallery // 2).amax(dim=1))

        return floor, lambda: torch.cat(sink).shape
    if name == TORCHMETRICS:
        from torchmetrics import MetricCollection
        from torchmetrics.retrieval import RetrievalHitRate

        metric: Any = MetricCollection({f"recall@{k}": RetrievalHitRate(top_k=k) for k in KS})
    else:
        from recall_at_k import RetrievalRecallAtK

        metric = RetrievalRecallAtK(KS, validate_args=name != OURS_UNCHECKED)
    metric = metric.to(device)
    return lambda batch: metric.update(batch[0], batch[1], indexes=batch[2]), metric.compute


def contestants(
    names: list[str], *, size: list[int], device: str, repeats: int = 0
) -> list[measure.Contestant]:
    """The named contestants, each warmed up on a small workload; ``repeats`` timed runs
    but for torchmetrics (timed in its first run)."""

    def runs(name: str, queries: int, items: int, seed: int) -> Callable[[measure.Probe], Any]:
        def run(probe: measure.Probe) -> Any:
            update, compute = _metric(name, items, device)
            with probe.window():
                for batch in flat_batches(queries, items, device, name == OURS_SHUFFLED, seed):
                    with probe.timed():
                        update(batch)
                    del batch  # before the next is made
                with probe.timed():
                    return compute()

        return run

    made = [
        measure.Contestant(n, runs(n, *size, 0), repeats, warm=runs(n, 2 * BATCH, 200, 1))
        for n in names
    ]
    for c in made:
        if c.name == TORCHMETRICS:  # timed in its first run
            c.repeats, c.need = 0, TORCHMETRICS_BYTES_PER_ITEM * size[0] * size[1]
    return made


def run(size: list[int], *, repeats: int, setup: measure.Setup, **_: object) -> measure.Section:
    """Every contestant on the flat batches of ``size`` = (Q, G) queries x items."""
    rows = measure.isolated("flat", OURS_AND_FLOOR, {"size": size, "repeats": repeats}, setup)
    rows += measure.isolated("flat", [TORCHMETRICS], {"size": size}, setup)
    named = measure.by_name(rows)
    ours = named[OURS]

    def cpu_ratio(row: measure.Measurement) -> float | None:
        return row.cpu_seconds / ours.cpu_seconds if row.cpu_seconds and ours.cpu_seconds else None

    columns = [
        measure.TIME_COLUMN,
        ("CPU time", lambda row: measure.fmt_seconds(row.cpu_seconds)),
        measure.peak_column(),
        measure.time_ratio_column("time / this metric", ours),
        ("CPU time / this metric", lambda row: measure.fmt_ratio(cpu_ratio(row))),
        measure.memory_ratio_column("memory / this metric", ours),
        measure.time_ratio_column("time / floor", named[FLOOR], digits=1),
        measure.RECALL_COLUMN,
    ]
    title = (
        f"Q = {size[0]:,} x G = {size[1]:,}, float32, one true item a query, blocks of"
        f" {BATCH} queries, each query split over two flat batches"
        f" ({BATCH * size[1] / 1e6:.2f} M items each), K = {KS},"
        f" {setup.threads} thread{'s' if setup.threads > 1 else ''} a contestant"
    )
    return f"{title}.\n\n{measure.contestant_table(rows, columns)}", named
