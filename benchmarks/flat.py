"""Flat workload: the dense workload fed as flat ``(preds, target, indexes)`` batches.

Q queries x G gallery items, float32 scores, one true item a query, in blocks of 256
queries, K = (1, 5, 10). Every query is split over two flat batches: batch j holds the
second half of block j - 1's items and the first half of block j's (512 query ids).
Contestants, each fed the same batches, each in a fresh child process of its own so that
peak memory compares:

- ``amax floor``: ``preds.view(-1, G / 2).amax(dim=1)`` per batch (one read of the scores);
- ``RetrievalRecallAtK`` (``validate_args=True``, the default, then ``False``), and once
  more with the items of every batch shuffled (no grouping by query to exploit);
- ``torchmetrics RetrievalHitRate x 3``: ``top_k`` = 1, 5, 10 in one ``MetricCollection``
  (default ``compute_groups=True``: the three share one stored copy of the items).

Time (wall-clock and CPU) is update + compute, end to end, without the generation of the
batches: the median of the timed runs in one child, except for torchmetrics (one run,
timed in its memory run: its large allocations are few). Peak memory is measured in a
child of its own under :func:`measure.live_memory` settings (with glibc's defaults the
1.28 M-item batches alone leave a few hundred MiB of RSS behind).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import torch
from dense import random_block
from measure import (
    RECALL_COLUMN,
    TIME_COLUMN,
    Measurement,
    Section,
    Setup,
    TimeBoundError,
    bounded_peer,
    by_name,
    call_each,
    contestant_table,
    fmt_ratio,
    fmt_seconds,
    memory_ratio,
    memory_ratio_column,
    peak_column,
    peak_since,
    start_peak,
    sync,
    time_bound,
    time_ratio,
    time_ratio_column,
    timed_out,
)

KS = (1, 5, 10)
BATCH = 256

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

FLOOR = "amax floor"
OURS = "RetrievalRecallAtK"
OURS_UNCHECKED = "RetrievalRecallAtK, validate_args=False"
OURS_SHUFFLED = "RetrievalRecallAtK, items shuffled in each batch"
TORCHMETRICS = "torchmetrics RetrievalHitRate x 3"
OURS_AND_FLOOR = (FLOOR, OURS, OURS_UNCHECKED, OURS_SHUFFLED)

# Peak bytes per item of the torchmetrics peer (7.5 GiB for the 100 M items of the full
# workload), used to decide whether it can run within the memory bound.
TORCHMETRICS_BYTES_PER_ITEM = 80


def flat_batches(
    num_queries: int, gallery: int, device: str, shuffle: bool = False, seed: int = 0
) -> Iterator[Batch]:
    """The workload's flat batches, generated one at a time (same data for every seed)."""
    gen = torch.Generator().manual_seed(seed)
    shuffler = torch.Generator().manual_seed(seed + 1)
    half = gallery // 2
    previous: Batch | None = None

    def halves(block: Batch, columns: slice) -> Batch:
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
        rows = min(BATCH, num_queries - start)
        scores, _, mask = random_block(rows, gallery, gen)
        block = (scores, mask, torch.arange(start, start + rows))
        first = halves(block, slice(0, half))
        yield join(halves(previous, slice(half, gallery)), first) if previous else join(first)
        previous = block
    if previous is not None:
        yield join(halves(previous, slice(half, gallery)))


def _contestant(
    name: str, gallery: int, device: str
) -> tuple[Callable[[Batch], None], Callable[[], Any]]:
    """``(update, compute)`` of a fresh contestant."""
    if name == FLOOR:
        half = gallery // 2
        sink: list[torch.Tensor] = []

        def floor_update(batch: Batch) -> None:
            sink.append(batch[0].view(-1, half).amax(dim=1))

        return floor_update, lambda: torch.cat(sink).shape
    if name == TORCHMETRICS:
        from torchmetrics import MetricCollection
        from torchmetrics.retrieval import RetrievalHitRate

        metric: Any = MetricCollection({f"recall@{k}": RetrievalHitRate(top_k=k) for k in KS})
    else:
        from recall_at_k import RetrievalRecallAtK

        metric = RetrievalRecallAtK(KS, validate_args=name != OURS_UNCHECKED)
    metric = metric.to(device)

    def update(batch: Batch) -> None:
        metric.update(batch[0], batch[1], indexes=batch[2])

    return update, metric.compute


def run_contestants(
    names: list[str],
    num_queries: int,
    gallery: int,
    device: str,
    repeats: int,
    time_limit: float | None = None,
) -> list[dict[str, Any]]:
    """Run each contestant ``repeats`` times in this process, one after the other.

    Returns, per contestant: ``times`` and ``cpu_times`` (update + compute of each run,
    seconds), ``peak_bytes`` (of the first run) and the Recall@K ``values``; or, when a
    run passes ``time_limit`` seconds, ``timed_out``.
    """
    out = []
    for name in names:
        try:
            with time_bound(time_limit):
                out.append(_run_contestant(name, num_queries, gallery, device, repeats))
        except TimeBoundError:
            out.append({"name": name, "timed_out": True})
    return out


def _run_contestant(
    name: str, num_queries: int, gallery: int, device: str, repeats: int
) -> dict[str, Any]:
    shuffle = name == OURS_SHUFFLED
    # Warm up kernels and thread pools on a small workload, then start clean.
    update, compute = _contestant(name, 200, device)
    for batch in flat_batches(2 * BATCH, 200, device, shuffle, seed=1):
        update(batch)
    compute()
    del update, compute

    times: list[float] = []
    cpu_times: list[float] = []
    peaks: list[int] = []
    result: Any = None
    for _ in range(repeats):
        update, compute = _contestant(name, gallery, device)
        baseline = start_peak(device)
        wall = cpu = 0.0
        for batch in flat_batches(num_queries, gallery, device, shuffle):
            sync(device)
            begin, begin_cpu = time.perf_counter(), time.process_time()
            update(batch)
            sync(device)
            wall += time.perf_counter() - begin
            cpu += time.process_time() - begin_cpu
            del batch
        begin, begin_cpu = time.perf_counter(), time.process_time()
        result = compute()
        sync(device)
        times.append(wall + time.perf_counter() - begin)
        cpu_times.append(cpu + time.process_time() - begin_cpu)
        peaks.append(peak_since(device, baseline))
        del update, compute
    values = {k: float(v) for k, v in result.items()} if isinstance(result, dict) else {}
    return dict(name=name, times=times, cpu_times=cpu_times, peak_bytes=peaks[0], values=values)


def _measurement(memory_run: dict[str, Any], timed_run: dict[str, Any]) -> Measurement:
    return Measurement(
        memory_run["name"],
        statistics.median(timed_run["times"]),
        memory_run["peak_bytes"],
        cpu_seconds=statistics.median(timed_run["cpu_times"]),
        values=memory_run["values"],
    )


def torchmetrics_peer(
    num_queries: int, gallery: int, device: str, time_limit: float | None
) -> dict[str, Any]:
    """The torchmetrics peer's row (timed in its memory run), stopped at ``time_limit``."""
    out = run_contestants([TORCHMETRICS], num_queries, gallery, device, 1, time_limit)[0]
    if out.get("timed_out"):
        assert time_limit is not None
        return asdict(timed_out(TORCHMETRICS, time_limit))
    return asdict(_measurement(out, out))


def run(size: tuple[int, int], *, repeats: int, setup: Setup) -> Section:
    """Every contestant on the flat batches of ``size`` = (Q, G) queries x items.

    Each contestant other than torchmetrics gets a run for its peak memory and one of
    ``repeats`` timed runs (the median is kept), isolated as :func:`measure.call_each`
    says; torchmetrics runs as :func:`measure.bounded_peer` says.
    """
    num_queries, gallery = size
    workload = {"num_queries": num_queries, "gallery": gallery, "device": setup.device}

    def runs(repeats_each: int, live_memory: bool) -> dict[str, dict[str, Any]]:
        kwargs = {**workload, "repeats": repeats_each}
        outs = call_each(run_contestants, OURS_AND_FLOOR, kwargs, setup, live_memory)
        return {out["name"]: out for out in outs}

    memory_runs, timed_runs = runs(1, True), runs(repeats, False)
    rows = [_measurement(memory_runs[name], timed_runs[name]) for name in OURS_AND_FLOOR]
    need = TORCHMETRICS_BYTES_PER_ITEM * num_queries * gallery
    rows.append(bounded_peer(TORCHMETRICS, need, torchmetrics_peer, workload, setup))
    named = by_name(rows)
    title = (
        f"Q = {num_queries:,} x G = {gallery:,}, float32, one true item a query, blocks of"
        f" {BATCH} queries, each query split over two flat batches"
        f" ({2 * BATCH * gallery // 2 / 1e6:.2f} M items each), K = {KS},"
        f" {setup.threads} thread{'s' if setup.threads > 1 else ''} a contestant"
    )
    return Section(f"{title}.\n\n{_table(rows)}\n\n{_summary(named)}", named)


def _table(rows: list[Measurement]) -> str:
    ours, floor = by_name(rows)[OURS], by_name(rows)[FLOOR]

    def cpu_ratio(row: Measurement) -> str:
        if not (row.cpu_seconds and ours.cpu_seconds):
            return "—"
        return fmt_ratio(row.cpu_seconds / ours.cpu_seconds)

    return contestant_table(
        rows,
        [
            TIME_COLUMN,
            ("CPU time", lambda row: fmt_seconds(row.cpu_seconds)),
            peak_column(),
            time_ratio_column("time / this metric", ours),
            ("CPU time / this metric", cpu_ratio),
            memory_ratio_column("memory / this metric", ours),
            time_ratio_column("time / floor", floor, digits=1),
            RECALL_COLUMN,
        ],
    )


def _summary(rows: dict[str, Measurement]) -> str:
    """One sentence: torchmetrics against this metric, and whether the results agree."""
    ours, theirs = rows[OURS], rows[TORCHMETRICS]
    if not (theirs.seconds and theirs.peak_bytes and theirs.cpu_seconds):
        return f"torchmetrics: {theirs.note}."
    assert ours.cpu_seconds
    agree = all(abs(ours.values[k] - v) < 1e-6 for k, v in theirs.values.items())
    return (
        f"torchmetrics takes {time_ratio(theirs, ours):.0f}x the time"
        f" ({theirs.cpu_seconds / ours.cpu_seconds:.0f}x the CPU time) and"
        f" {memory_ratio(theirs, ours):.0f}x the peak memory of RetrievalRecallAtK;"
        f" the Recall@K values {'agree' if agree else 'DIFFER'}."
    )
