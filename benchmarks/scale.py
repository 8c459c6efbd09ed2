"""Large galleries: ``EmbeddingRecallAtK.compute()`` time and per-process peak memory
against the number of items, on one process and on 4 gloo processes (gathered).

Leave-one-out, cosine, D = 128, ``ids=``, ``chunk_bytes`` 4 MiB; each process runs one
torch thread and holds its share of the items. A process measures its own
``compute()``: the time (after a barrier) and the peak resident memory it adds (VmHWM
over the resident set before, ``MALLOC_MMAP_THRESHOLD_=131072``, after a warm-up
compute). A row's time is the slowest process's; its memory the largest process's.
"time / pair" is that time over the N x (N - 1) scores ranked by all processes
together; "bytes / item" the peak over N. The projection applies the memory formula of
``docs/large-galleries.md`` with the measured bytes per item.

Run alone: ``python benchmarks/scale.py [--sizes 20000,50000,100000] [--figure f.png]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from measure import Section, markdown_table  # noqa: E402

DIM = 128
CHUNK = 4 * 2**20
WORLDS = (1, 4)
FULL_SIZES = (20_000, 50_000, 100_000)


def sizes_for(reference: int) -> list[int]:
    """The sizes of a benchmark mode, from its distributed embedding size (10,000 in
    the full run, 2,000 quick, 300 tiny)."""
    if reference >= 10_000:
        return list(FULL_SIZES)
    return [reference] if reference < 1_000 else [reference, 2 * reference]


def _worker(rank: int, world: int, payload: dict[str, Any]) -> dict[str, float]:
    from memory_probe import items, peak_since, start

    from recall_at_k import EmbeddingRecallAtK

    torch.set_num_threads(1)
    num = payload["num"]
    warm = EmbeddingRecallAtK((1, 5, 10), chunk_bytes=CHUNK, sync_on_compute=False)
    warm_items, warm_labels = items(400, DIM, 1, "cpu")
    warm.update(warm_items, warm_labels)
    warm.compute()
    embeddings, labels = items(num, DIM, 0, "cpu")
    mine = slice(num * rank // world, num * (rank + 1) // world)
    metric = EmbeddingRecallAtK((1, 5, 10), chunk_bytes=CHUNK)
    for first in range(mine.start, mine.stop, 1000):
        rows = slice(first, min(mine.stop, first + 1000))
        metric.update(embeddings[rows], labels[rows], ids=torch.arange(num)[rows])
    del embeddings, labels, warm, warm_items, warm_labels
    dist.barrier()
    baseline = start("cpu")
    begin = time.perf_counter()
    result = metric.compute()
    seconds = time.perf_counter() - begin
    return {
        "seconds": seconds,
        "peak": float(peak_since("cpu", baseline)),
        "recall@1": float(result["recall@1"]),
    }


def measure(sizes: list[int]) -> list[dict[str, Any]]:
    """One row per (size, processes)."""
    from helpers import run_distributed

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # inherited by the processes
    rows = []
    for num in sizes:
        for world in WORLDS:
            parts = run_distributed(_worker, world_size=world, payload={"num": num})
            rows.append(
                {
                    "num": num,
                    "world": world,
                    "seconds": max(p["seconds"] for p in parts),
                    "peak": max(p["peak"] for p in parts),
                    "same": len({p["recall@1"] for p in parts}) == 1,
                    "recall@1": parts[0]["recall@1"],
                }
            )
    return rows


def projection(rows: list[dict[str, Any]]) -> str:
    """10M x 1024-d float32 items on 8 GPUs, from the formula and the measured scratch."""
    largest = max(rows, key=lambda r: (r["num"], r["world"]))
    stored = largest["num"] * DIM * 4
    extra_per_item = max(0.0, (largest["peak"] - stored) / largest["num"])
    num, dim, world = 10_000_000, 1024, 8
    copy = num * dim * 4
    scratch = 8 * 256 * 2**20
    bookkeeping = 256 * num
    moved = (num - num // world) * dim * 4
    return (
        f"**Projection: 10M x 1024-d float32 items on 8 GPUs.** Each GPU holds its"
        f" {num // world:,} items ({copy / world / 1e9:.1f} GB) and, during `compute()`,"
        f" one copy of all of them ({copy / 1e9:.1f} GB) plus at most"
        f" {scratch / 2**30:.0f} GiB of scratch (8 tiles of the default 256 MiB) and"
        f" {bookkeeping / 1e9:.1f} GB of bookkeeping (256 bytes an item; measured here:"
        f" {extra_per_item:.0f} bytes an item beyond the copy at N = {largest['num']:,},"
        f" D = {DIM}, scratch included): about"
        f" {(copy + scratch + bookkeeping) / 1e9:.0f} GB per GPU. Each process receives"
        f" {moved / 1e9:.1f} GB (every other process's embeddings, by broadcast) and ranks"
        f" {num // world:,} queries against all {num:,} items. That does not fit a"
        " 40 GB GPU beside a model: a gallery of this size needs a sharded ranking, in"
        " which no process holds every item (not available yet)."
    )


def figure(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for world in WORLDS:
        mine = [r for r in rows if r["world"] == world]
        sizes = [r["num"] for r in mine]
        label = "1 process" if world == 1 else f"{world} processes, gathered"
        left.plot(sizes, [r["seconds"] for r in mine], marker="o", label=label)
        right.plot(sizes, [r["peak"] / 2**20 for r in mine], marker="o", label=label)
    sizes = sorted({r["num"] for r in rows})
    right.plot(sizes, [n * DIM * 4 / 2**20 for n in sizes], "k--", label="one copy (N x D x 4)")
    left.set(xlabel="items N", ylabel="compute() seconds", xscale="log", yscale="log")
    right.set(xlabel="items N", ylabel="peak added per process (MiB)", xscale="log")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run(sizes: list[int], figure_path: Path | None = None) -> Section:
    rows = measure(sizes)
    head = ("N", "processes", "compute() time", "time / pair", "peak added / process")
    head += ("bytes / item", "one copy (N x D x 4)", "same result on every process")
    body = []
    for r in rows:
        pairs = r["num"] * (r["num"] - 1)
        body.append(
            [
                f"{r['num']:,}",
                f"{r['world']} ({'one process' if r['world'] == 1 else 'gathered'})",
                f"{r['seconds']:.2f} s",
                f"{r['seconds'] / pairs * 1e9:.2f} ns",
                f"{r['peak'] / 2**20:.1f} MiB",
                f"{r['peak'] / r['num']:.0f}",
                f"{r['num'] * DIM * 4 / 2**20:.1f} MiB",
                "yes" if r["same"] else "NO",
            ]
        )
    plotted = figure_path is not None and figure(rows, figure_path)
    text = (
        "Leave-one-out, cosine, D = 128, `ids=`, `chunk_bytes` 4 MiB, gloo on 127.0.0.1,"
        " one torch thread a process. Time: the slowest process's `compute()`; memory:"
        " the largest peak a process's `compute()` adds.\n\n"
        + markdown_table(head, body)
        + ("\n\n![compute() time and memory against N](scale.png)" if plotted else "")
        + "\n\n"
        + projection(rows)
    )
    return Section(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(str(n) for n in FULL_SIZES))
    parser.add_argument("--figure", type=Path)
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    print(run(sizes, args.figure).body)


if __name__ == "__main__":
    main()
