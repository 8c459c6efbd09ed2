"""Compare two embedding models on the same queries: a paired test per K, and both CMC curves.

Two "models" embed scikit-learn's digits (1,797 8x8 images, no download), and every image
is a query against all the others (leave-one-out, cosine):

- A: the raw pixels (64 dimensions);
- B: the pixels projected on their first 16 principal components.

Their Recall@K differ by a fraction of a point, and their Wilson intervals (from
``confidence_interval()``) overlap at every K. Both models rank the same queries,
though, and ``recall_at_k.paired_comparison`` looks query by query: ``only A`` /
``only B`` count the queries one model hits and the other misses, the p-value is the
exact McNemar test on those, and the interval is Newcombe's paired score interval for
B - A. The ``ids`` passed to ``update`` identify the queries, so the two metrics could
equally have been fed in different orders or on different processes.

The script prints the table and saves both curves, each with its confidence band, with
the metrics' ``plot()``.

Run: ``python examples/compare_models.py [--plot compare_models.png]``
"""

from __future__ import annotations

import argparse
import os

import torch
from sklearn.datasets import load_digits

from recall_at_k import EmbeddingRecallAtK, paired_comparison

KS = (1, 5, 10)


def evaluate(
    embeddings: torch.Tensor, labels: torch.Tensor
) -> EmbeddingRecallAtK[dict[str, torch.Tensor]]:
    """A validation loop's metric: every image added in batches, with its index as id."""
    metric = EmbeddingRecallAtK(k=KS)  # cosine, leave-one-out (role="both")
    ids = torch.arange(len(labels))
    for batch in ids.split(128):
        metric.update(embeddings[batch], labels[batch], ids=batch)
    return metric


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", default="compare_models.png", help="where to save the figure")
    args = parser.parse_args()

    digits = load_digits()
    pixels = torch.tensor(digits.data, dtype=torch.float32)
    labels = torch.tensor(digits.target)
    centred = pixels - pixels.mean(dim=0)
    components = torch.linalg.svd(centred, full_matrices=False).Vh[:16]
    models = {"A": evaluate(pixels, labels), "B": evaluate(centred @ components.T, labels)}
    print("A: raw pixels (64-d)    B: first 16 principal components (16-d)")

    values = {name: metric.compute() for name, metric in models.items()}
    intervals = {name: metric.confidence_interval() for name, metric in models.items()}
    paired = paired_comparison(models["A"], models["B"])  # B - A, query by query
    print(
        f"{'':10s} {'A':>7s} {'A 95% CI':>17s} {'B':>7s} {'B 95% CI':>17s}"
        f" {'B - A':>8s} {'paired 95% CI':>19s} {'p':>7s} {'only A':>6s} {'only B':>6s}"
    )
    for key, result in paired.items():
        a, b = values["A"][key], values["B"][key]
        (a_low, a_high), (b_low, b_high) = (
            intervals["A"][key].tolist(),
            intervals["B"][key].tolist(),
        )
        print(
            f"{key:10s} {a:7.4f} [{a_low:.4f}, {a_high:.4f}] {b:7.4f} [{b_low:.4f}, {b_high:.4f}]"
            f" {result.difference:+8.4f} [{result.low:+.4f}, {result.high:+.4f}]"
            f" {result.p_value:7.4f} {result.only_a:6d} {result.only_b:6d}"
        )
    print(f"({paired['recall@1'].queries} queries, the same for both models)")
    overlap = all(
        max(intervals["A"][key][0], intervals["B"][key][0])
        <= min(intervals["A"][key][1], intervals["B"][key][1])
        for key in paired
    )
    print(f"the Wilson intervals of A and B overlap at every K: {overlap}")
    print(f"yet the paired test tells them apart at K = 1: {paired['recall@1'].p_value < 0.05}")

    os.environ.setdefault("MPLBACKEND", "Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    for name, metric in models.items():
        metric.plot(values[name], ax=ax, interval=intervals[name])
    lines = ax.get_lines()
    ax.legend(lines, ["A: raw pixels", "B: 16 principal components"])
    ax.set_ylim(0.9, 1.0)
    ax.set_title("Leave-one-out Recall@K on digits, with 95% Wilson bands")
    fig.savefig(args.plot)
    print(f"saved both CMC curves to {args.plot}")


if __name__ == "__main__":
    main()
