"""RetrievalRecallAtK beside torchmetrics' retrieval metrics in one MetricCollection.

The flat form, ``update(preds, target, indexes=indexes)``, is torchmetrics' retrieval
convention: one row per (query, item) pair, ``indexes`` saying which query the pair
belongs to. So :class:`recall_at_k.RetrievalRecallAtK` joins a ``MetricCollection``
with ``RetrievalMRR`` and ``RetrievalNormalizedDCG`` unchanged, fed by the same call.

The data (synthetic, no download): 400 search queries, each with 20 to 60 candidate
items of which one to three are relevant, scored by a noisy model (a click probability).
The pairs are shuffled and batched, so a query's items arrive in several batches: every
metric here assembles each query from its pieces, across batches (and, under DDP,
across processes). ``RetrievalRecallAtK`` keeps only each query's best relevant score
and its top max K other scores, not every item.

Recall@K here is "a relevant item is in the top K" (torchmetrics calls it the hit rate;
the example checks that the two agree). torchmetrics' ``RetrievalRecall`` is another
quantity: the share of a query's relevant items that are in the top K.

Run: ``python examples/torchmetrics_collection.py``
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.retrieval import RetrievalHitRate, RetrievalMRR, RetrievalNormalizedDCG

from recall_at_k import RetrievalRecallAtK

NUM_QUERIES = 400
KS = (1, 5, 10)


def search_log(seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Flat (query, item) pairs: ``preds`` float, ``target`` bool, ``indexes`` int64."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(20, 61, (NUM_QUERIES,), generator=gen)
    indexes = torch.repeat_interleave(torch.arange(NUM_QUERIES), sizes)
    target = torch.zeros(len(indexes), dtype=torch.bool)
    starts = torch.cumsum(sizes, 0) - sizes
    for query in range(NUM_QUERIES):
        num_relevant = int(torch.randint(1, 4, (1,), generator=gen))
        picked = torch.randperm(int(sizes[query]), generator=gen)[:num_relevant]
        target[starts[query] + picked] = True
    logits = 1.5 * target.float() + torch.randn(len(indexes), generator=gen)
    return torch.sigmoid(logits), target, indexes


def main() -> dict[str, float]:
    preds, target, indexes = search_log()
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(
        TensorDataset(preds, target, indexes), batch_size=1024, shuffle=True, generator=generator
    )

    collection = MetricCollection(
        {
            "recall": RetrievalRecallAtK(k=KS),  # -> recall@1, recall@5, recall@10
            "mrr": RetrievalMRR(),
            "ndcg@10": RetrievalNormalizedDCG(top_k=10),
            # torchmetrics' name for the same quantity, one metric per K, to compare:
            **{f"hit_rate@{k}": RetrievalHitRate(top_k=k) for k in KS},
        }
    )
    for batch_preds, batch_target, batch_indexes in loader:
        collection(batch_preds, batch_target, indexes=batch_indexes)
    results = {key: float(value) for key, value in collection.compute().items()}

    print(
        f"{NUM_QUERIES} queries, {len(preds)} (query, item) pairs in {len(loader)} shuffled"
        " batches (a query's items arrive in several)\n"
    )
    for key in ("recall@1", "recall@5", "recall@10", "mrr", "ndcg@10"):
        print(f"  {key:10s} {results[key]:.4f}")
    agree = all(abs(results[f"recall@{k}"] - results[f"hit_rate@{k}"]) < 1e-6 for k in KS)
    hit_rates = ", ".join(f"hit_rate@{k} = {results[f'hit_rate@{k}']:.4f}" for k in KS)
    print(f"\ntorchmetrics RetrievalHitRate: {hit_rates}")
    print(f"recall@K equals torchmetrics' hit rate@K: {agree}")
    return results


if __name__ == "__main__":
    main()
