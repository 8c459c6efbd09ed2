"""Dense workload: RetrievalRecallAtK against its peers and the floor.

Q queries x G items, float32 scores, in batches of 256 rows, K = (1, 5, 10), for a
``[Q]`` index target (one true item a query) and the same positives as a ``[Q, G]`` mask.
Contestants, each fed the same batches, update + compute end to end:

- ``amax floor``: ``scores.amax(dim=1)`` over every batch (one read of the scores);
- ``RetrievalRecallAtK`` (``validate_args=False``, then ``True``);
- ``argsort per query``: the re-ID scripts' way (torchreid's ``eval_market1501``): a numpy
  ``argsort`` of each batch, then a Python loop over the queries building each CMC row;
- ``CLIP-benchmark topk``: clip_benchmark's ``recall_at_k``: the full score matrix and
  mask, then per K, in batches of 64 queries, ``topk`` + ``one_hot`` + a product with
  the mask (ties broken by sort order);
- ``torchmetrics RetrievalHitRate x 3``: ``top_k`` = 1, 5, 10 in a ``MetricCollection``
  (one stored copy), fed the flat form of the same batches, in a child process.
"""

from __future__ import annotations

from collections.abc import Callable

import measure
import numpy as np
import torch

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
HERE = (FLOOR, OURS_INDEX, OURS_MASK, OURS_INDEX_CHECKED, OURS_MASK_CHECKED, ARGSORT, CLIP)
# The torchmetrics peer's peak bytes a (query, item) pair: stored int64 indexes and
# targets, float32 scores, their concatenation and sort at compute.
TORCHMETRICS_BYTES_PER_ITEM = 100

Batches = list[torch.Tensor]


def random_block(rows: int, gallery: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``[rows, G]`` scores, each row's true column and the same positive as a bool mask."""
    scores = torch.randn(rows, gallery, generator=gen)
    true = torch.randint(0, gallery, (rows,), generator=gen)
    scores[torch.arange(rows), true] += 2.0  # a model that is right often enough to matter
    mask = torch.zeros(rows, gallery, dtype=torch.bool)
    mask[torch.arange(rows), true] = True
    return scores, true, mask


def make_data(num_queries: int, gallery: int, device: str, seed: int = 0) -> tuple[Batches, ...]:
    """Score batches, their ``[B]`` true columns and the same positives as ``[B, G]`` masks."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [
        random_block(min(BATCH, num_queries - i), gallery, gen)
        for i in range(0, num_queries, BATCH)
    ]
    scores, index, mask = ([block[part].to(device) for block in blocks] for part in range(3))
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
        all_cmc = []
        for s, t in zip(scores, index, strict=True):
            indices = np.argsort(-s.cpu().numpy(), axis=1)
            matches = (indices == t.cpu().numpy()[:, np.newaxis]).astype(np.int32)
            for q_idx in range(matches.shape[0]):
                cmc = matches[q_idx].cumsum()
                cmc[cmc > 1] = 1
                all_cmc.append(cmc[: max(KS)])
        mean_cmc = np.asarray(all_cmc, dtype=np.float32).mean(axis=0)
        return {f"recall@{k}": float(mean_cmc[k - 1]) for k in KS}

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
                _clip_recall_at_k(full[i : i + CLIP_BATCH], positive_pairs[i : i + CLIP_BATCH], k)
                for i in range(0, full.shape[0], CLIP_BATCH)
            ]
            out[f"recall@{k}"] = (torch.cat(parts) > 0).float().mean().item()
        return out

    return run


def torchmetrics_hit_rate(scores: Batches, index: Batches) -> Callable[[], object]:
    from torchmetrics import MetricCollection
    from torchmetrics.retrieval import RetrievalHitRate

    def run() -> object:
        device = scores[0].device
        hit_rates = {f"recall@{k}": RetrievalHitRate(top_k=k) for k in KS}
        collection = MetricCollection(hit_rates).to(device)
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


def contestants(
    names: list[str], *, size: list[int], device: str, repeats: int = 0, slow_repeats: int = 0
) -> list[measure.Contestant]:
    """The named contestants on the same batches; the torchmetrics peer (timed in its first
    run) warms up on small batches of its own."""
    scores, index, mask = make_data(*size, device)
    runs = {
        FLOOR: floor(scores),
        OURS_INDEX: ours(scores, index, False),
        OURS_MASK: ours(scores, mask, False),
        OURS_INDEX_CHECKED: ours(scores, index, True),
        OURS_MASK_CHECKED: ours(scores, mask, True),
        ARGSORT: argsort_per_query(scores, index),
        CLIP: clip_topk(scores, mask),
        TORCHMETRICS: torchmetrics_hit_rate(scores, index),
    }
    small, small_index, _ = make_data(64, 100, device, seed=1)
    made = [measure.Contestant(name, measure.whole(runs[name]), repeats) for name in names]
    for c in made:
        if c.name in (ARGSORT, CLIP):
            c.repeats, c.note = slow_repeats, "ties broken by sort order" if c.name == CLIP else ""
        if c.name == TORCHMETRICS:
            c.repeats, c.warm = 0, measure.whole(torchmetrics_hit_rate(small, small_index))
            c.need = TORCHMETRICS_BYTES_PER_ITEM * size[0] * size[1]
    return made


def run(
    size: list[int], *, repeats: int, slow_repeats: int, setup: measure.Setup, **_: object
) -> measure.Section:
    """Every contestant on the same batches of ``size`` = (Q, G): ``repeats`` timed runs
    of this package and the floor, ``slow_repeats`` of the argsort and topk peers."""
    counts = {"repeats": repeats, "slow_repeats": slow_repeats}
    rows = measure.compare(
        contestants(list(HERE), size=size, device=setup.device, **counts), setup.device
    )
    rows += measure.isolated("dense", [TORCHMETRICS], {"size": size}, setup)  # its own batches
    named = measure.by_name(rows)
    columns = [
        measure.TIME_COLUMN,
        measure.peak_column(),
        measure.time_ratio_column("time / this metric", named[OURS_INDEX]),
        measure.memory_ratio_column("memory / this metric", named[OURS_INDEX]),
        measure.time_ratio_column("time / floor", named[FLOOR]),
        ("note", lambda row: row.note),
    ]
    body = (
        f"Q = {size[0]:,} x G = {size[1]:,}, float32, batches of {BATCH}, K = {KS}."
        " update + compute, end to end, from the same batches."
    )
    return f"{body}\n\n{measure.contestant_table(rows, columns)}", named
