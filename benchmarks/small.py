"""Small updates: the fixed cost of one ``update`` call against torchmetrics'.

One batch of Q = 8 queries x G = 100 items (float32 scores, one true item a query),
K = (1, 5, 10), fed again and again to a metric made before the timed calls:

- ``torchmetrics RetrievalHitRate``: ``RetrievalHitRate(top_k=10).update`` of the flat
  ``(preds, target, indexes)`` form of the batch (its checks always run; it appends the
  batch to its list states);
- ``RetrievalRecallAtK``: the same batch as a ``[Q]`` index target, as a ``[Q, G]`` mask
  and in the flat form, with the default ``validate_args=True`` (what the ratios compare)
  and with ``validate_args=False``.

Time is per call: the median over interleaved rounds of a block of calls each. Peak
memory is what a block of calls adds (torchmetrics keeps every batch; the dense state
does not grow).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from measure import (
    Measurement,
    Section,
    Setup,
    by_name,
    contestant_table,
    fmt_bytes,
    live_memory,
    peak_since,
    release_memory,
    start_peak,
    time_ratio_column,
)

from recall_at_k import RetrievalRecallAtK

KS = (1, 5, 10)
QUERIES, GALLERY = 8, 100

TORCHMETRICS = "torchmetrics RetrievalHitRate(top_k=10).update"
DENSE_INDEX = "RetrievalRecallAtK, dense [Q] index target"
DENSE_MASK = "RetrievalRecallAtK, dense [Q, G] mask target"
FLAT = "RetrievalRecallAtK, flat (preds, target, indexes)"
UNCHECKED = ", validate_args=False"

Update = Callable[[], None]


def make_batch(device: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(QUERIES, GALLERY, generator=generator)
    index = torch.randint(0, GALLERY, (QUERIES,), generator=generator)
    mask = torch.zeros(QUERIES, GALLERY, dtype=torch.bool)
    mask[torch.arange(QUERIES), index] = True
    ids = torch.arange(QUERIES).repeat_interleave(GALLERY)
    batch = {"scores": scores, "index": index, "mask": mask, "ids": ids}
    return {name: tensor.to(device) for name, tensor in batch.items()}


def contestants(batch: dict[str, torch.Tensor]) -> dict[str, Callable[[], Update]]:
    """Each contestant: a factory that makes a fresh metric and returns its update."""
    scores, index, mask, ids = batch["scores"], batch["index"], batch["mask"], batch["ids"]
    flat_scores, flat_target = scores.flatten(), mask.flatten()
    device = scores.device

    def torchmetrics_update() -> Update:
        from torchmetrics.retrieval import RetrievalHitRate

        metric = RetrievalHitRate(top_k=max(KS)).to(device)
        return lambda: metric.update(flat_scores, flat_target, indexes=ids)

    def ours(form: str, validate: bool) -> Callable[[], Update]:
        def make() -> Update:
            metric = RetrievalRecallAtK(KS, validate_args=validate).to(device)
            if form == "index":
                return lambda: metric.update(scores, index)
            if form == "mask":
                return lambda: metric.update(scores, mask)
            return lambda: metric.update(flat_scores, flat_target, ids)

        return make

    return {
        TORCHMETRICS: torchmetrics_update,
        DENSE_INDEX: ours("index", True),
        DENSE_MASK: ours("mask", True),
        FLAT: ours("flat", True),
        DENSE_INDEX + UNCHECKED: ours("index", False),
        DENSE_MASK + UNCHECKED: ours("mask", False),
        FLAT + UNCHECKED: ours("flat", False),
    }


def _block(make: Callable[[], Update], calls: int, device: str) -> float:
    """Seconds per call over ``calls`` calls of a fresh metric's update (made untimed)."""
    update = make()
    update()  # the first call of a metric does one-off work (torchmetrics' and ours)
    if device == "cuda":
        torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        update()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - begin) / calls


def run(*, calls: int, rounds: int, setup: Setup) -> Section:
    """Every contestant: ``rounds`` interleaved rounds of a block of ``calls`` updates."""
    device = setup.device
    makers = contestants(make_batch(device))
    peaks = {}
    with live_memory():
        for name, make in makers.items():
            baseline = start_peak(device)
            _block(make, calls, device)
            peaks[name] = peak_since(device, baseline)
    release_memory()
    times: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(rounds):
        for name, make in makers.items():
            times[name].append(_block(make, calls, device))
    rows = [
        Measurement(name, statistics.median(times[name]), peaks[name], rounds=times[name])
        for name in makers
    ]
    named = by_name(rows)
    table = contestant_table(
        rows,
        [
            ("time a call", lambda row: f"{(row.seconds or 0) * 1e6:.1f} us"),
            time_ratio_column("time / torchmetrics", named[TORCHMETRICS]),
            (f"peak memory of {calls:,} calls", lambda row: fmt_bytes(row.peak_bytes)),
        ],
    )
    body = (
        f"One batch of Q = {QUERIES} queries x G = {GALLERY} items, float32, K = {KS},"
        f" {calls:,} `update` calls a block, median of {rounds} interleaved rounds (the ratio"
        " is the median of the per-round ratios). torchmetrics always checks its inputs;"
        " the ratios compare it with this package's default `validate_args=True`.\n\n"
        f"{table}"
    )
    return Section(body, named)
