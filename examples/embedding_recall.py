"""Leave-one-out Recall@K of embeddings on scikit-learn's digits (no download).

Every one of the 1,797 digit images is a query against all the others, the way a
metric-learning validation loop ranks its validation set at the end of an epoch: the
embeddings arrive batch by batch (``update``) and ``compute`` ranks them all, in tiles,
never building the full score matrix. Two "models" are compared:

- raw pixels (64 dimensions), cosine similarity;
- a fixed random projection of the pixels to 16 dimensions (seeded), cosine similarity:
  a worse embedding, which Recall@K should show.

Run: ``python examples/embedding_recall.py``
"""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits

from recall_at_k import EmbeddingRecallAtK


def recall_of(embeddings: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    metric = EmbeddingRecallAtK(k=(1, 5, 10))  # cosine, leave-one-out (role="both")
    for batch in torch.arange(len(embeddings)).split(128):  # as a validation loop would
        metric.update(embeddings[batch], labels[batch])
    result = metric.compute()
    assert isinstance(result, dict)
    return {key: float(value) for key, value in result.items()}


def main() -> dict[str, dict[str, float]]:
    digits = load_digits()
    pixels = torch.tensor(digits.data, dtype=torch.float32)
    labels = torch.tensor(digits.target)
    projection = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    results = {
        "raw pixels (64-d)": recall_of(pixels, labels),
        "random projection (16-d)": recall_of(pixels @ projection, labels),
    }
    for name, values in results.items():
        print(f"{name:26s} " + "  ".join(f"{k} = {v:.4f}" for k, v in values.items()))
    return results


if __name__ == "__main__":
    main()
