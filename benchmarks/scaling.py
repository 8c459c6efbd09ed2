"""Scaling of RetrievalRecallAtK: time against Q x G and against the number of K, state size.

- time against Q x G (dense form, batches of 256 rows, K = (1, 5, 10), index and mask
  targets, ``validate_args=False``) beside the ``amax`` floor: the cost per score should
  stay flat;
- time against the number of K (K = 1..n): flat, as every K is read off one histogram;
- state bytes against Q: constant for the dense form; for comparison the flat form
  (O(queries x max K)) and ``EmbeddingRecallAtK`` (O(items x D)). Figure: ``scaling.png``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import measure
import torch
from dense import floor, make_data, ours

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

STATE_GALLERY = 8  # items a query in the state sweep (the dense state does not depend on it)
EMBEDDING_DIM = 128
TIMED = {"floor": "amax floor", "index": "index target", "mask": "mask target"}
STATES = {"dense": "RetrievalRecallAtK, dense", "flat": "RetrievalRecallAtK, flat"}
STATES["embedding"] = "EmbeddingRecallAtK"
Rows = list[dict[str, Any]]


def _times(runs: dict[str, Callable[[], object]], repeats: int, device: str) -> dict[str, Any]:
    made = [measure.Contestant(name, measure.whole(fn), repeats) for name, fn in runs.items()]
    return {row.name: row.seconds for row in measure.compare(made, device)}


def time_against_size(grid: list[list[int]], repeats: int, device: str) -> Rows:
    rows = []
    for num_queries, gallery in grid:
        scores, index, mask = make_data(num_queries, gallery, device)
        runs = {"floor": floor(scores), "index": ours(scores, index, False)}
        runs["mask"] = ours(scores, mask, False)
        rows.append({"queries": num_queries, "gallery": gallery, **_times(runs, repeats, device)})
        del scores, index, mask, runs  # before the next size's
    return rows


def state_against_queries(queries: list[int], device: str) -> Rows:
    """Bytes of every metric's states (tensors and lists of tensors) at each Q."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for num in queries:
        dense, flat = (RetrievalRecallAtK((1, 5, 10), validate_args=False).to(device) for _ in "12")
        embedding = EmbeddingRecallAtK((1, 5, 10), validate_args=False).to(device)
        for start in range(0, num, 4096):
            rows_here = min(4096, num - start)
            scores = torch.randn(rows_here, STATE_GALLERY, generator=gen).to(device)
            target = torch.randint(0, STATE_GALLERY, (rows_here,), generator=gen).to(device)
            dense.update(scores, target)
            mask = torch.nn.functional.one_hot(target, STATE_GALLERY).bool()
            ids = torch.arange(start, start + rows_here, device=device)
            flat.update(scores.flatten(), mask.flatten(), ids.repeat_interleave(STATE_GALLERY))
            embedding.update(
                torch.randn(rows_here, EMBEDDING_DIM, generator=gen).to(device), target
            )
        row = {"queries": num}
        for key, metric in {"dense": dense, "flat": flat, "embedding": embedding}.items():
            parts = [
                p for v in metric.metric_state.values() for p in (v if isinstance(v, list) else [v])
            ]
            row[key] = sum(part.numel() * part.element_size() for part in parts)
        rows.append(row)
    return rows


def plot(sizes: Rows, ks: Rows, states: Rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.5))
    cells = [r["queries"] * r["gallery"] for r in sizes]
    for key, label in TIMED.items():
        left.plot(cells, [r[key] for r in sizes], "o-", label=label)
    per_cell = sizes[0]["index"] / cells[0]
    left.plot(cells, [c * per_cell for c in cells], ":", color="grey", label="linear")
    left.set(xscale="log", yscale="log", xlabel="Q x G", ylabel="seconds")
    middle.plot([r["ks"] for r in ks], [r["seconds"] for r in ks], "o-")
    middle.set(xscale="log", xlabel="number of K (K = 1..n)", ylabel="seconds", ylim=(0, None))
    for key, label in STATES.items():
        right.plot([r["queries"] for r in states], [r[key] for r in states], "o-", label=label)
    right.set(xscale="log", yscale="log", xlabel="Q", ylabel="state bytes")
    titles = ("time against Q x G", "time against the number of K", "state size against Q")
    for axes, title in zip((left, middle, right), titles, strict=True):
        axes.set_title(title)
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(
    *,
    grid: list[list[int]],
    k_size: list[int],
    k_counts: list[int],
    state_queries: list[int],
    repeats: int,
    setup: measure.Setup,
    figure: Path | None,
) -> measure.Section:
    """Time against every (Q, G) of ``grid``, against K = 1..n for every n of ``k_counts``
    (at ``k_size``), state size at every Q of ``state_queries``; the figure at ``figure``."""
    sizes = time_against_size(grid, repeats, setup.device)
    scores, index, _ = make_data(*k_size, setup.device)
    runs = {str(n): ours(scores, index, False, tuple(range(1, n + 1))) for n in k_counts}
    times = _times(runs, repeats, setup.device)
    ks = [{"ks": n, "seconds": times[str(n)]} for n in k_counts]
    del scores, index, runs
    states = state_against_queries(state_queries, setup.device)
    size_rows = []
    for r in sizes:
        cells = r["queries"] * r["gallery"]
        size_rows.append(
            [f"{count:,}" for count in (r["queries"], r["gallery"], cells)]
            + [measure.fmt_seconds(r[key]) for key in TIMED]
            + [f"{r[key] / cells * 1e9:.2f}" for key in TIMED]
            + [f"{r[key] / r['floor']:.2f}x" for key in ("index", "mask")]
        )
    size_head = ["Q", "G", "Q x G", *TIMED.values(), "ns / score: floor", "index", "mask"]
    base = ks[0]["seconds"]
    k_rows = [
        [r["ks"], measure.fmt_seconds(r["seconds"]), f"{r['seconds'] / base:.2f}x"] for r in ks
    ]
    state_rows = [[f"{r['queries']:,}", f"{r['dense']:,} B"] for r in states]
    for cells, r in zip(state_rows, states, strict=True):
        cells += [measure.fmt_bytes(r["flat"]), measure.fmt_bytes(r["embedding"])]
    body = (
        "Time against Q x G (dense form, update + compute, `validate_args=False`; the cost"
        " per score should stay flat):\n\n"
        + measure.table([*size_head, "index / floor", "mask / floor"], size_rows)
        + "\n\nTime against the number of K (index target):\n\n"
        + measure.table(["number of K (K = 1..n)", "time", "time / one K"], k_rows)
        + f"\n\nState size against Q (dense and flat: {STATE_GALLERY} items a query;"
        f" embedding: D = {EMBEDDING_DIM}, float32). The dense state is a histogram of max K"
        " ranks plus two counts; the flat form keeps max K scores a query; EmbeddingRecallAtK"
        " keeps the embeddings:\n\n"
        + measure.table(["Q", "dense state", "flat state", "EmbeddingRecallAtK state"], state_rows)
    )
    if figure is not None:
        plot(sizes, ks, states, figure)
        body += f"\n\n![scaling]({figure.name})"
    return body, {}
