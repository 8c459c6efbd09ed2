"""Dense workload of DESIGN section 4: RetrievalRecallAtK against its peers and the floor.

Q = 20,000 queries x G = 5,000 gallery items, float32 scores, in batches of 256 rows,
K = (1, 5, 10), for a ``[Q]`` index target (one true item a query) and for the same
positives as a ``[Q, G]`` bool mask. Contestants, each fed the same batches:

- ``amax floor``: ``scores.amax(dim=1)`` over every batch (one read of the scores);
- ``RetrievalRecallAtK`` (``validate_args=False``, then ``True``), update + compute;
- ``argsort per query``: the re-ID scripts' way (sort each row, find the true item);
- ``torchmetrics RetrievalHitRate x 3``: ``top_k`` = 1, 5, 10 in a ``MetricCollection``,
  fed the flat ``(preds, target, indexes)`` form of the same batches.

Run: ``python benchmarks/dense.py [--quick] [--device cpu|cuda] [--no-torchmetrics]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from measure import Measurement, machine, measure, table, write_section

from recall_at_k import RetrievalRecallAtK

KS = (1, 5, 10)
BATCH = 256


def make_data(
    num_queries: int, gallery: int, device: str, seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Score batches, their ``[B]`` true columns and the same positives as ``[B, G]`` masks."""
    gen = torch.Generator().manual_seed(seed)
    scores, index, mask = [], [], []
    for start in range(0, num_queries, BATCH):
        rows = min(BATCH, num_queries - start)
        s = torch.randn(rows, gallery, generator=gen)
        t = torch.randint(0, gallery, (rows,), generator=gen)
        s[torch.arange(rows), t] += 2.0  # a model that is right often enough to matter
        m = torch.zeros(rows, gallery, dtype=torch.bool)
        m[torch.arange(rows), t] = True
        scores.append(s.to(device))
        index.append(t.to(device))
        mask.append(m.to(device))
    return scores, index, mask


def ours(
    scores: list[torch.Tensor], targets: list[torch.Tensor], validate: bool
) -> Callable[[], object]:
    def run() -> object:
        metric = RetrievalRecallAtK(KS, validate_args=validate).to(scores[0].device)
        for s, t in zip(scores, targets, strict=True):
            metric.update(s, t)
        return metric.compute()

    return run


def floor(scores: list[torch.Tensor]) -> Callable[[], object]:
    def run() -> object:
        return [s.amax(dim=1) for s in scores]

    return run


def argsort_per_query(
    scores: list[torch.Tensor], index: list[torch.Tensor]
) -> Callable[[], object]:
    def run() -> object:
        ranks = []
        for s, t in zip(scores, index, strict=True):
            order = torch.argsort(s, dim=1, descending=True)
            ranks.append((order == t.unsqueeze(1)).int().argmax(dim=1) + 1)
        r = torch.cat(ranks)
        return {k: (r <= k).float().mean() for k in KS}

    return run


def torchmetrics_hit_rate(
    scores: list[torch.Tensor], index: list[torch.Tensor]
) -> Callable[[], object]:
    from torchmetrics import MetricCollection
    from torchmetrics.retrieval import RetrievalHitRate

    def run() -> object:
        device = scores[0].device
        collection = MetricCollection(
            {f"hit@{k}": RetrievalHitRate(top_k=k) for k in KS}, compute_groups=False
        ).to(device)
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


def run(quick: bool, device: str, with_torchmetrics: bool = True) -> tuple[str, list[Measurement]]:
    num_queries, gallery = (2_000, 5_000) if quick else (20_000, 5_000)
    scores, index, mask = make_data(num_queries, gallery, device)
    rows = [
        measure("amax floor", floor(scores), device=device),
        measure("RetrievalRecallAtK, [Q] index target", ours(scores, index, False), device=device),
        measure("RetrievalRecallAtK, [Q, G] mask target", ours(scores, mask, False), device=device),
        measure("... index target, validate_args=True", ours(scores, index, True), device=device),
        measure("... mask target, validate_args=True", ours(scores, mask, True), device=device),
        measure(
            "argsort per query (re-ID scripts)",
            argsort_per_query(scores, index),
            repeats=1,
            device=device,
        ),
    ]
    if with_torchmetrics:
        rows.append(
            measure(
                "torchmetrics RetrievalHitRate x 3 (flat form)",
                torchmetrics_hit_rate(scores, index),
                repeats=1,
                device=device,
                time_limit=0.0,
            )
        )
    title = f"Q = {num_queries:,} x G = {gallery:,}, float32, batches of {BATCH}, K = {KS}"
    return title, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Q = 2,000 instead of 20,000")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--no-torchmetrics", action="store_true", help="skip the slow peer")
    parser.add_argument("--no-write", action="store_true", help="do not touch RESULTS.md")
    args = parser.parse_args()
    title, rows = run(args.quick, args.device, not args.no_torchmetrics)
    text = table(rows, reference="RetrievalRecallAtK, [Q] index target", floor="amax floor")
    command = " ".join(["python benchmarks/dense.py", *sys.argv[1:]])
    body = (
        f"## Dense workload\n\n{title}. {machine(args.device)}.\n\nCommand: `{command}`\n\n{text}\n"
    )
    print(body)
    if not args.no_write:
        write_section(f"dense-{args.device}{'-quick' if args.quick else ''}", body)


if __name__ == "__main__":
    main()
