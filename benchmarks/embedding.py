"""Embedding workload: EmbeddingRecallAtK against its peers and the floor.

N items, D = 128, leave-one-out, cosine, 100 classes (class centres plus noise),
K = (1, 5, 10); each contestant in a child process of its own (:func:`measure.isolated`):

- ``matmul floor``: the N x N product of the L2-normalised embeddings in tiles of 32 MiB
  of scores, into one reused buffer (the least any exact method must do); and as one
  N x N product;
- ``EmbeddingRecallAtK``: ``update`` in batches of 256, then ``compute``; with the
  default ``chunk_bytes`` and 32 MiB; with ``near_duplicate = 0.99``; on quantised
  embeddings (values in {-1, 0, 1}), whose scores tie often; and the same leave-one-out
  as queries against a gallery (each item added as both, one id), which computes each
  score twice where leave-one-out computes it once for both its items;
- the floor, leave-one-out and the query/gallery form at D = 512 (CLIP-size), each
  row's ratio against the floor of its own D;
- ``pytorch-metric-learning AccuracyCalculator``: ``precision_at_1`` (= R@1) with its
  default faiss-cpu k-NN on the normalised embeddings (the cosine order), ``k = 10``;
- ``full N x N matrix + topk``: the whole score matrix, the diagonal -inf, ``topk(10)``.

Time: ``update`` + ``compute``; peak memory: the compute step's, after a warm-up on 512
other items; one run a round, in rounds that interleave the contestants. On CUDA all but
faiss run on the GPU. A peer not installed keeps a row saying so.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import measure
import torch

from recall_at_k import EmbeddingRecallAtK

KS = (1, 5, 10)
BATCH = 256
DIM = 128
CLASSES = 100
NOISE = 2.5  # per-dimension noise around the class centres at D = 128
TILE_BYTES = 32 * 2**20
WIDE_DIM = 512  # CLIP-size embeddings

FLOOR = "matmul floor (32 MiB tiles)"
OURS = "EmbeddingRecallAtK, leave-one-out (default chunk_bytes = 256 MiB)"
OURS_QUERY_GALLERY = (
    "EmbeddingRecallAtK, the same items as queries and as a gallery (ids=), no symmetry"
)
FLOOR_WIDE = f"matmul floor (32 MiB tiles), D = {WIDE_DIM}"
OURS_WIDE = f"EmbeddingRecallAtK, leave-one-out, D = {WIDE_DIM}"
OURS_QUERY_GALLERY_WIDE = f"EmbeddingRecallAtK, queries and gallery (ids=), D = {WIDE_DIM}"
PML = "pytorch-metric-learning AccuracyCalculator (faiss-cpu)"
# Every contestant: its D, what runs, and the metric's options.
# fmt: off
SPECS: dict[str, tuple[int, str, dict[str, Any]]] = {
    FLOOR: (DIM, "tiles", {}),
    "matmul, one N x N product": (DIM, "product", {}),
    OURS: (DIM, "metric", {}),
    "EmbeddingRecallAtK, leave-one-out, chunk_bytes = 32 MiB": (
        DIM, "metric", {"chunk_bytes": TILE_BYTES}),
    "EmbeddingRecallAtK, leave-one-out, near_duplicate = 0.99": (
        DIM, "metric", {"near_duplicate": 0.99}),
    "EmbeddingRecallAtK, leave-one-out, quantised {-1, 0, 1}^D embeddings": (
        DIM, "quantised", {}),
    OURS_QUERY_GALLERY: (DIM, "query/gallery", {}),
    OURS_WIDE: (WIDE_DIM, "metric", {}),
    OURS_QUERY_GALLERY_WIDE: (WIDE_DIM, "query/gallery", {}),
    FLOOR_WIDE: (WIDE_DIM, "tiles", {}),
    PML: (DIM, "pml", {}),
    "full N x N matrix + topk": (DIM, "topk", {}),
}
# fmt: on


def make_data(num: int, seed: int = 0, dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num, dim]`` float32 embeddings around 100 class centres, and their labels
    (the noise scaled with ``sqrt(dim / 128)``: about the same recall at every width)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, dim, generator=gen)
    labels = torch.randint(0, CLASSES, (num,), generator=gen)
    embeddings = centres[labels] + NOISE * (dim / DIM) ** 0.5 * torch.randn(num, dim, generator=gen)
    return embeddings, labels


Steps = tuple[Callable[[], Any], Callable[[Any], Any]]  # (fill, compute of what fill made)


def _steps(kind: str, embeddings: torch.Tensor, labels: torch.Tensor, options: Any) -> Steps:
    """A contestant's two timed steps; the peak memory is that of the second."""
    if kind in ("metric", "quantised", "query/gallery"):

        def fill() -> Any:
            metric = EmbeddingRecallAtK(KS, **options).to(embeddings.device)
            for start in range(0, embeddings.shape[0], BATCH):
                batch = embeddings[start : start + BATCH], labels[start : start + BATCH]
                if kind != "query/gallery":
                    metric.update(*batch)
                    continue
                # Each item's two copies share an id, so a query ignores itself.
                ids = torch.arange(start, start + batch[1].shape[0], device=embeddings.device)
                metric.update(*batch, role="query", ids=ids)
                metric.update(*batch, role="gallery", ids=ids)
            return metric

        return fill, lambda metric: metric.compute()
    normalised = torch.nn.functional.normalize(embeddings, dim=1)
    if kind == "pml":
        from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

        calculator = AccuracyCalculator(
            include=("precision_at_1",), k=max(KS), device=torch.device("cpu")
        )
        return lambda: None, lambda _: {
            "recall@1": calculator.get_accuracy(normalised, labels)["precision_at_1"]
        }
    num = normalised.shape[0]
    if kind == "topk":

        def full(_: Any) -> Any:
            scores = normalised @ normalised.T
            scores.fill_diagonal_(float("-inf"))
            hits = labels[scores.topk(max(KS), dim=1).indices] == labels.unsqueeze(1)
            del scores
            first = torch.where(hits.any(dim=1), hits.float().argmax(dim=1) + 1, max(KS) + 1)
            return {f"recall@{k}": (first <= k).double().mean() for k in KS}

        return lambda: None, full
    rows = num if kind == "product" else max(1, TILE_BYTES // (num * 4))

    def product(_: Any) -> None:
        out = torch.empty(rows, num, device=normalised.device)
        for start in range(0, num, rows):
            block = normalised[start : start + rows]
            torch.matmul(block, normalised.T, out=out[: block.shape[0]])

    return lambda: None, product


def _run(name: str, num: int, seed: int, device: str) -> Callable[[measure.Probe], Any]:
    """One run on ``num`` items: the data made (untimed), then the two steps."""
    dim, kind, options = SPECS[name]

    def run(probe: measure.Probe) -> Any:
        embeddings, labels = make_data(num, seed, dim)
        if kind == "quantised":  # many exactly tied scores
            gen = torch.Generator().manual_seed(seed + 1)
            embeddings = torch.randint(-1, 2, (num, dim), generator=gen).float()
        if kind != "pml":  # faiss-cpu
            embeddings, labels = embeddings.to(device), labels.to(device)
        fill, compute = _steps(kind, embeddings, labels, options)
        with probe.timed():
            state = fill()
        with probe.window(), probe.timed():
            values = compute(state)
        if isinstance(state, EmbeddingRecallAtK):  # gallery items a query re-scored
            rescored = getattr(state, "last_compute_rescored", None)
            per_query = [f"{key}: {total / num:.2f}" for key, total in (rescored or {}).items()]
            probe.details["rescored"] = ", ".join(per_query) if rescored is not None else "n/a"
        return values

    return run


def contestants(names: list[str], *, num: int, device: str) -> list[measure.Contestant]:
    """The named contestants on ``num`` items, each warmed up on 512 others; a peer not
    installed keeps a row saying so."""
    missing = ""
    try:
        import faiss  # noqa: F401
        import pytorch_metric_learning  # noqa: F401
    except ImportError as err:
        missing = f"not installed ({err.name}): pip install --no-deps pytorch-metric-learning"
        missing += " faiss-cpu"
    return [
        measure.Contestant(name, None, note=missing)
        if missing and SPECS[name][1] == "pml"
        else measure.Contestant(name, _run(name, num, 0, device), warm=_run(name, 512, 1, device))
        for name in names
    ]


def matrix_over_peak(row: measure.Measurement, num: int) -> float | None:
    """How many times the bytes of a full N x N float32 score matrix the row's peak is."""
    return num * num * 4 / row.peak_bytes if row.peak_bytes else None


def run(num: int, *, rounds: int, setup: measure.Setup, **_: object) -> measure.Section:
    """Every contestant on ``num`` embeddings, in ``rounds`` interleaved rounds."""
    by_round = [measure.isolated("embedding", [*SPECS], {"num": num}, setup) for _ in range(rounds)]
    rows = []
    for runs in zip(*by_round, strict=True):  # a contestant's row of every round
        row = runs[0]
        if row.seconds is not None:
            row.rounds = [out.seconds for out in runs]
            row.seconds = statistics.median(row.rounds)
            row.peak_bytes = int(statistics.median(out.peak_bytes for out in runs))
        rows.append(row)
    named = measure.by_name(rows)

    def over(row: measure.Measurement, base: str) -> str:
        """``row``'s time over ``base``'s; a floor of the row's own D."""
        if base == FLOOR and SPECS[row.name][0] == WIDE_DIM:
            base = FLOOR_WIDE
        return measure.fmt_ratio(measure.time_ratio(row, named[base]), row.at_least)

    columns = [
        measure.TIME_COLUMN,
        ("time / floor (of its D)", lambda row: over(row, FLOOR)),
        ("time / this metric", lambda row: over(row, OURS)),
        measure.peak_column("peak memory during compute"),
        (
            "full N x N matrix / peak",
            lambda r: measure.fmt_ratio(matrix_over_peak(r, num), digits=1),
        ),
        ("gallery items re-scored a query", lambda row: row.details.get("rescored", "—")),
        measure.RECALL_COLUMN,
    ]
    title = (
        f"N = {num:,} items, D = {DIM} (and {WIDE_DIM} where the row says), {CLASSES} classes,"
        f" leave-one-out, cosine, K = {KS}, update in batches of {BATCH}, device"
        f" {setup.device}, {setup.threads} torch thread(s)"
    )
    return f"{title}.\n\n{measure.contestant_table(rows, columns)}", named
