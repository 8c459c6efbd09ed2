"""Dense workload: RetrievalRecallAtK against its peers and the floor.

Q queries x G gallery items, float32 scores, in batches of 256 rows, K = (1, 5, 10), for
a ``[Q]`` index target (one true item a query) and for the same positives as a
``[Q, G]`` bool mask. Contestants, each fed the same batches:

- ``amax floor``: ``scores.amax(dim=1)`` over every batch (one read of the scores);
- ``RetrievalRecallAtK`` (``validate_args=False``, then ``True``), update + compute;
- ``argsort per query``: the re-ID scripts' way (torchreid's ``eval_market1501``): a numpy
  ``argsort`` of each batch, then a Python loop over the queries building each CMC row;
- ``CLIP-benchmark topk``: clip_benchmark's ``recall_at_k``: the full ``[Q, G]`` score
  matrix and positive mask (the batches concatenated), then per K, in batches of 64
  queries, ``topk`` + ``one_hot`` + a product with the mask (ties broken by sort order);
- ``torchmetrics RetrievalHitRate x 3``: ``top_k`` = 1, 5, 10 in a ``MetricCollection``
  (its default compute groups: the three share one stored copy), fed the flat
  ``(preds, target, indexes)`` form of the same batches. It runs in a child process,
  stopped at a time bound, and is not started when its estimated memory exceeds the
  memory bound; its row then says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from measure import (
    TIME_COLUMN,
    Contestant,
    Section,
    Setup,
    bounded_peer,
    by_name,
    contestant_table,
    measure_bounded,
    measure_interleaved,
    memory_ratio_column,
    peak_column,
    time_ratio_column,
)

from recall_at_k import RetrievalRecallAtK

KS = (1, 5, 10)
BATCH = 256
CLIP_BATCH = 64  # clip_benchmark's default --batch_size

FLOOR = "amax floor"
OURS_INDEX = "RetrievalRecallAtK, [Q] index target"
OURS_MASK = "RetrievalRecallAtK, [Q, G] mask target"
OURS_INDEX_CHECKED = "... index target, validate_args=True"
OURS_MASK_CHECKED = "... mask target, validate_args=True"
ARGSORT = "argsort per query (re-ID scripts)"
CLIP = "CLIP-benchmark topk over the full matrix"
TORCHMETRICS = "torchmetrics RetrievalHitRate x 3 (flat form)"

# Peak bytes per (query, item) pair of the torchmetrics peer (stored int64 indexes and
# targets, float32 scores, their concatenation and sort at compute), used to decide
# whether it can run within the memory bound.
TORCHMETRICS_BYTES_PER_ITEM = 100

Batches = list[torch.Tensor]


def random_block(
    rows: int, gallery: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[rows, G]`` scores, each row's true column and the same positive as a bool mask."""
    scores = torch.randn(rows, gallery, generator=gen)
    true = torch.randint(0, gallery, (rows,), generator=gen)
    scores[torch.arange(rows), true] += 2.0  # a model that is right often enough to matter
    mask = torch.zeros(rows, gallery, dtype=torch.bool)
    mask[torch.arange(rows), true] = True
    return scores, true, mask


def make_data(
    num_queries: int, gallery: int, device: str, seed: int = 0
) -> tuple[Batches, Batches, Batches]:
    """Score batches, their ``[B]`` true columns and the same positives as ``[B, G]`` masks."""
    gen = torch.Generator().manual_seed(seed)
    scores: Batches = []
    index: Batches = []
    mask: Batches = []
    for start in range(0, num_queries, BATCH):
        block = random_block(min(BATCH, num_queries - start), gallery, gen)
        for into, part in zip((scores, index, mask), block, strict=True):
            into.append(part.to(device))
    return scores, index, mask


def ours(
    scores: Batches, targets: Batches, validate: bool, ks: tuple[int, ...] = KS
) -> Callable[[], object]:
    def run() -> object:
        metric = RetrievalRecallAtK(ks, validate_args=validate).to(scores[0].device)
        for s, t in zip(scores, targets, strict=True):
            metric.update(s, t)
        return metric.compute()

    return run


def floor(scores: Batches) -> Callable[[], object]:
    return lambda: [s.amax(dim=1) for s in scores]


def argsort_per_query(scores: Batches, index: Batches) -> Callable[[], object]:
    """torchreid's ``eval_market1501`` CMC: numpy argsort, then a loop over the queries."""

    def run() -> object:
        max_rank = max(KS)
        all_cmc = []
        for s, t in zip(scores, index, strict=True):
            indices = np.argsort(-s.cpu().numpy(), axis=1)
            matches = (indices == t.cpu().numpy()[:, np.newaxis]).astype(np.int32)
            for q_idx in range(matches.shape[0]):
                cmc = matches[q_idx].cumsum()
                cmc[cmc > 1] = 1
                all_cmc.append(cmc[:max_rank])
        mean_cmc = np.asarray(all_cmc, dtype=np.float32).mean(axis=0)
        return {k: float(mean_cmc[k - 1]) for k in KS}

    return run


def _clip_recall_at_k(scores: torch.Tensor, positive_pairs: torch.Tensor, k: int) -> torch.Tensor:
    """clip_benchmark's ``recall_at_k`` (zeroshot_retrieval.py), verbatim in substance."""
    nb_queries, nb_gallery = scores.shape
    topk_indices = torch.topk(scores, k, dim=1)[1]
    nb_positive = positive_pairs.sum(dim=1)
    topk_indices_onehot = torch.nn.functional.one_hot(topk_indices, num_classes=nb_gallery)
    positive_pairs_reshaped = positive_pairs.view(nb_queries, 1, nb_gallery)
    nb_true_positive = (topk_indices_onehot * positive_pairs_reshaped).sum(dim=(1, 2))
    return nb_true_positive / nb_positive


def clip_topk(scores: Batches, mask: Batches) -> Callable[[], object]:
    """clip_benchmark's way: the full score matrix, then ``batchify(recall_at_k)`` per K."""

    def run() -> object:
        full, positive_pairs = torch.cat(scores), torch.cat(mask)
        out = {}
        for k in KS:
            parts = [
                _clip_recall_at_k(
                    full[start : start + CLIP_BATCH], positive_pairs[start : start + CLIP_BATCH], k
                )
                for start in range(0, full.shape[0], CLIP_BATCH)
            ]
            out[k] = (torch.cat(parts) > 0).float().mean().item()
        return out

    return run


def torchmetrics_hit_rate(scores: Batches, index: Batches) -> Callable[[], object]:
    from torchmetrics import MetricCollection
    from torchmetrics.retrieval import RetrievalHitRate

    def run() -> object:
        device = scores[0].device
        collection = MetricCollection({f"hit@{k}": RetrievalHitRate(top_k=k) for k in KS}).to(
            device
        )
        offset = 0
        for s, t in zip(scores, index, strict=True):
            rows, gallery = s.shape
            target = torch.zeros_like(s, dtype=torch.bool)
            target[torch.arange(rows, device=device), t] = True
            ids = torch.arange(offset, offset + rows, device=device).repeat_interleave(gallery)
            collection.update(s.flatten(), target.flatten(), indexes=ids)
            offset += rows
        return collection.compute()

    return run


def torchmetrics_peer(
    num_queries: int, gallery: int, device: str, time_limit: float | None
) -> dict[str, Any]:
    """The torchmetrics peer, in a child process: a small warm-up, then one bounded run."""
    small, small_index, _ = make_data(64, 100, device, seed=1)
    torchmetrics_hit_rate(small, small_index)()
    scores, index, _ = make_data(num_queries, gallery, device)
    run = torchmetrics_hit_rate(scores, index)
    return asdict(measure_bounded(TORCHMETRICS, run, device=device, time_limit=time_limit))


def run(size: tuple[int, int], *, repeats: int, slow_repeats: int, setup: Setup) -> Section:
    """Every contestant on the same batches of ``size`` = (Q, G) queries x items.

    ``repeats`` timed runs (after the warm-up) for this package and the floor,
    ``slow_repeats`` for the argsort and topk peers; the torchmetrics peer runs in a
    child process (:func:`measure.bounded_peer`), the others in this process.
    """
    num_queries, gallery = size
    device = setup.device
    scores, index, mask = make_data(num_queries, gallery, device)
    rows = measure_interleaved(
        [
            Contestant(FLOOR, floor(scores), repeats),
            Contestant(OURS_INDEX, ours(scores, index, False), repeats),
            Contestant(OURS_MASK, ours(scores, mask, False), repeats),
            Contestant(OURS_INDEX_CHECKED, ours(scores, index, True), repeats),
            Contestant(OURS_MASK_CHECKED, ours(scores, mask, True), repeats),
            Contestant(ARGSORT, argsort_per_query(scores, index), slow_repeats),
            Contestant(CLIP, clip_topk(scores, mask), slow_repeats, "ties broken by sort order"),
        ],
        device,
    )
    del scores, index, mask  # the child makes its own copy
    need = TORCHMETRICS_BYTES_PER_ITEM * num_queries * gallery
    kwargs = {"num_queries": num_queries, "gallery": gallery, "device": device}
    rows.append(bounded_peer(TORCHMETRICS, need, torchmetrics_peer, kwargs, setup))
    named = by_name(rows)
    table = contestant_table(
        rows,
        [
            TIME_COLUMN,
            peak_column(),
            time_ratio_column("time / this metric", named[OURS_INDEX]),
            memory_ratio_column("memory / this metric", named[OURS_INDEX]),
            time_ratio_column("time / floor", named[FLOOR]),
            ("note", lambda row: row.note),
        ],
    )
    body = (
        f"Q = {num_queries:,} x G = {gallery:,}, float32, batches of {BATCH}, K = {KS}."
        f" update + compute, end to end, from the same batches.\n\n{table}"
    )
    return Section(body, named)
