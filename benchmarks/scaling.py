"""Scaling of RetrievalRecallAtK: time against Q x G and against the number of K, state size.

- time against Q x G (dense form, batches of 256 rows, K = (1, 5, 10), index and mask
  targets, ``validate_args=False``) beside the ``amax`` floor over the same batches, at
  three or more sizes: the cost per score should stay flat (linear scaling);
- time against the number of K (K = 1..n, index target): should be flat, the state is a
  histogram of first-hit ranks and every K is read off it at ``compute``;
- the size of the state in bytes against Q: constant for the dense form; for comparison
  the flat form (O(queries x max K)) and ``EmbeddingRecallAtK`` (O(items x D)).

Tables plus one figure (``scaling.png`` beside the results).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from dense import floor, make_data, ours
from measure import Contestant, Section, fmt_bytes, fmt_seconds, markdown_table, measure_interleaved
from torchmetrics import Metric

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

STATE_GALLERY = 8  # items a query in the state sweep (the dense state does not depend on it)
EMBEDDING_DIM = 128


def state_bytes(metric: Metric) -> int:
    """Bytes held by a metric's states (tensors and lists of tensors)."""
    total = 0
    for value in metric.metric_state.values():
        parts = value if isinstance(value, list) else [value]
        total += sum(part.numel() * part.element_size() for part in parts)
    return total


def time_against_size(
    grid: list[tuple[int, int]], repeats: int, device: str
) -> list[dict[str, Any]]:
    rows = []
    for num_queries, gallery in grid:
        scores, index, mask = make_data(num_queries, gallery, device)
        measured = measure_interleaved(
            [
                Contestant("floor", floor(scores), repeats),
                Contestant("index", ours(scores, index, False), repeats),
                Contestant("mask", ours(scores, mask, False), repeats),
            ],
            device,
        )
        times = {row.name: row.seconds for row in measured}
        rows.append({"queries": num_queries, "gallery": gallery, **times})
        del scores, index, mask
    return rows


def time_against_k(
    size: tuple[int, int], counts: list[int], repeats: int, device: str
) -> list[dict[str, Any]]:
    scores, index, _ = make_data(*size, device)
    measured = measure_interleaved(
        [
            Contestant(str(n), ours(scores, index, False, tuple(range(1, n + 1))), repeats)
            for n in counts
        ],
        device,
    )
    return [{"ks": n, "seconds": m.seconds} for n, m in zip(counts, measured, strict=True)]


def state_against_queries(queries: list[int], device: str) -> list[dict[str, Any]]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for num in queries:
        dense = RetrievalRecallAtK((1, 5, 10), validate_args=False).to(device)
        flat = RetrievalRecallAtK((1, 5, 10), validate_args=False).to(device)
        embedding = EmbeddingRecallAtK((1, 5, 10), validate_args=False).to(device)
        for start in range(0, num, 4096):
            rows_here = min(4096, num - start)
            scores = torch.randn(rows_here, STATE_GALLERY, generator=gen).to(device)
            target = torch.randint(0, STATE_GALLERY, (rows_here,), generator=gen).to(device)
            dense.update(scores, target)
            mask = torch.zeros_like(scores, dtype=torch.bool)
            mask[torch.arange(rows_here, device=device), target] = True
            ids = torch.arange(start, start + rows_here, device=device)
            flat.update(
                scores.flatten(), mask.flatten(), indexes=ids.repeat_interleave(STATE_GALLERY)
            )
            embeddings = torch.randn(rows_here, EMBEDDING_DIM, generator=gen).to(device)
            embedding.update(embeddings, target)
        states = {"dense": dense, "flat": flat, "embedding": embedding}
        rows.append({"queries": num, **{key: state_bytes(m) for key, m in states.items()}})
    return rows


SIZE_HEAD: tuple[str, ...] = ("Q", "G", "Q x G", "amax floor", "index target", "mask target")
SIZE_HEAD += ("ns / score: floor", "index", "mask", "index / floor", "mask / floor")
TIMED = ("floor", "index", "mask")


def _size_row(row: dict[str, Any]) -> list[str]:
    scores = row["queries"] * row["gallery"]
    return [
        *(f"{count:,}" for count in (row["queries"], row["gallery"], scores)),
        *(fmt_seconds(row[key]) for key in TIMED),
        *(f"{row[key] / scores * 1e9:.2f}" for key in TIMED),
        *(f"{row[key] / row['floor']:.2f}x" for key in ("index", "mask")),
    ]


def tables(
    size_rows: list[dict[str, Any]], k_rows: list[dict[str, Any]], state_rows: list[dict[str, Any]]
) -> str:
    size_table = markdown_table(SIZE_HEAD, [_size_row(row) for row in size_rows])
    base = k_rows[0]["seconds"]
    k_table = markdown_table(
        ["number of K (K = 1..n)", "time", "time / one K"],
        [[r["ks"], fmt_seconds(r["seconds"]), f"{r['seconds'] / base:.2f}x"] for r in k_rows],
    )
    state_table = markdown_table(
        ["Q", "dense state", "flat state", "EmbeddingRecallAtK state"],
        [
            [
                f"{r['queries']:,}",
                f"{r['dense']:,} B",
                fmt_bytes(r["flat"]),
                fmt_bytes(r["embedding"]),
            ]
            for r in state_rows
        ],
    )
    return (
        "Time against Q x G (dense form, update + compute, `validate_args=False`; the cost"
        " per score should stay flat):\n\n"
        f"{size_table}\n\n"
        "Time against the number of K (index target):\n\n"
        f"{k_table}\n\n"
        f"State size against Q (dense and flat: {STATE_GALLERY} items a query; embedding:"
        f" D = {EMBEDDING_DIM}, float32). The dense state is a histogram of max K ranks plus"
        " two counts; the flat form keeps max K scores a query; EmbeddingRecallAtK keeps"
        " the embeddings:\n\n"
        f"{state_table}"
    )


def figure(
    size_rows: list[dict[str, Any]],
    k_rows: list[dict[str, Any]],
    state_rows: list[dict[str, Any]],
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    cells = [r["queries"] * r["gallery"] for r in size_rows]
    for key, label in (("floor", "amax floor"), ("index", "index target"), ("mask", "mask target")):
        axes[0].plot(cells, [r[key] for r in size_rows], "o-", label=label)
    ref = size_rows[0]["index"] / cells[0]
    axes[0].plot(cells, [c * ref for c in cells], ":", color="grey", label="linear")
    axes[0].set(xscale="log", yscale="log", xlabel="Q x G", ylabel="seconds")
    axes[0].set_title("time against Q x G")
    axes[0].legend()
    axes[1].plot([r["ks"] for r in k_rows], [r["seconds"] for r in k_rows], "o-")
    axes[1].set(xscale="log", xlabel="number of K (K = 1..n)", ylabel="seconds")
    axes[1].set_ylim(bottom=0)
    axes[1].set_title("time against the number of K")
    queries = [r["queries"] for r in state_rows]
    for key, label in (
        ("dense", "RetrievalRecallAtK, dense"),
        ("flat", "RetrievalRecallAtK, flat"),
        ("embedding", "EmbeddingRecallAtK"),
    ):
        axes[2].plot(queries, [r[key] for r in state_rows], "o-", label=label)
    axes[2].set(xscale="log", yscale="log", xlabel="Q", ylabel="state bytes")
    axes[2].set_title("state size against Q")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(
    grid: list[tuple[int, int]],
    *,
    k_size: tuple[int, int],
    k_counts: list[int],
    state_queries: list[int],
    repeats: int,
    figure_path: Path | None,
    device: str = "cpu",
) -> Section:
    """Time against every (Q, G) of ``grid``, against K = 1..n for every n of ``k_counts``
    (at ``k_size``), state size at every Q of ``state_queries``; saves the figure (none
    without ``figure_path``)."""
    size_rows = time_against_size(grid, repeats, device)
    k_rows = time_against_k(k_size, k_counts, repeats, device)
    state_rows = state_against_queries(state_queries, device)
    body = tables(size_rows, k_rows, state_rows)
    if figure_path is None:
        return Section(body)
    figure(size_rows, k_rows, state_rows, figure_path)
    return Section(f"{body}\n\n![scaling]({figure_path.name})")
