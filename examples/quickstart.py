"""Quickstart: Recall@1/5/10 of raw-pixel retrieval on scikit-learn's digits (no download).

Every digit image is a query against all the others (leave-one-out): the score matrix
is the cosine similarity of the pixels, the relevance mask says "same digit", and the
diagonal is ignored so that no image retrieves itself.

Run: ``python examples/quickstart.py``
"""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits

from recall_at_k import RetrievalRecallAtK


def main() -> dict[str, float]:
    digits = load_digits()
    x = torch.nn.functional.normalize(torch.tensor(digits.data, dtype=torch.float32), dim=1)
    labels = torch.tensor(digits.target)

    metric = RetrievalRecallAtK(k=(1, 5, 10))
    for rows in torch.arange(len(x)).split(256):  # one batch of complete queries at a time
        scores = x[rows] @ x.T  # [B, N]
        target = labels[rows, None] == labels[None, :]  # [B, N] bool: same digit
        itself = torch.zeros_like(target)
        itself[torch.arange(len(rows)), rows] = True  # never retrieve yourself
        metric.update(scores, target, ignore=itself)
    result = metric.compute()
    assert isinstance(result, dict)
    for key, value in result.items():
        print(f"{key}: {float(value):.4f}")
    return {key: float(value) for key, value in result.items()}


if __name__ == "__main__":
    main()
