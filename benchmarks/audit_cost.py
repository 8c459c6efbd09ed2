"""What the protocol audit of EmbeddingRecallAtK costs, side by side with ``compute()``.

The reference embedding workload (:mod:`embedding`'s data: N = 20,000, D = 128, 100
classes, leave-one-out, cosine, K = (1, 5, 10)), one torch thread. Each round fills fresh
metrics (``update`` in batches of 256, not timed) and times, interleaved:

- ``compute()`` with ``near_duplicate=None`` (the exact audit included: a sort of the
  embeddings' bit patterns);
- ``compute()`` with ``near_duplicate=0.99`` (plus the near-duplicate pass);
- ``protocol_report()`` on demand, without and with ``near_duplicate`` (the audit alone,
  no ranking).

Ratios are medians of the per-round ratios to the first row.

Run: ``python benchmarks/audit_cost.py [--num 20000] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from embedding import make_data

from recall_at_k import EmbeddingRecallAtK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    embeddings, labels = make_data(args.num)

    def filled(near: float | None) -> EmbeddingRecallAtK[dict[str, torch.Tensor]]:
        metric = EmbeddingRecallAtK(k=(1, 5, 10), near_duplicate=near)
        for start in range(0, args.num, 256):
            metric.update(embeddings[start : start + 256], labels[start : start + 256])
        return metric

    def timed(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    contestants: dict[str, Callable[[], float]] = {
        "compute(), near_duplicate=None": lambda: timed(filled(None).compute),
        "compute(), near_duplicate=0.99": lambda: timed(filled(0.99).compute),
        "protocol_report() alone, near_duplicate=None": lambda: timed(filled(None).protocol_report),
        "protocol_report() alone, near_duplicate=0.99": lambda: timed(filled(0.99).protocol_report),
    }
    times: dict[str, list[float]] = {name: [] for name in contestants}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name, run in contestants.items():
            elapsed = run()
            if round_:
                times[name].append(elapsed)
    base = times["compute(), near_duplicate=None"]
    print(f"N = {args.num:,}, D = 128, leave-one-out, cosine; median of {args.rounds} rounds")
    print("| contestant | time | time / compute() |")
    print("|---|---:|---:|")
    for name, values in times.items():
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(f"| {name} | {statistics.median(values):.3f} s | {ratio:.3f}x |")


if __name__ == "__main__":
    main()
