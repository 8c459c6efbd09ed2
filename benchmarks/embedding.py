"""Embedding workload: EmbeddingRecallAtK against its peers and the floor.

N items, D = 128, leave-one-out, cosine similarity, 100 classes (class centres plus
noise), K = (1, 5, 10). Contestants, each in a fresh child process so that peak memory
compares:

- ``matmul floor``: the N x N product of the L2-normalised embeddings in tiles of 32 MiB
  of scores, written into one reused buffer (the least any exact method must do);
- ``matmul, one N x N product``: the same product as a single matrix;
- ``EmbeddingRecallAtK``: ``update`` in batches of 256, then ``compute``; with the
  default ``chunk_bytes`` (256 MiB) and with ``chunk_bytes = 32 MiB``; with
  ``near_duplicate = 0.99`` where the metric has that option; on quantised
  embeddings (values in {-1, 0, 1}, the same labels), whose scores tie often; and the
  same leave-one-out stated as queries against a gallery (each item added with
  ``role="query"`` and ``role="gallery"``, one id), which the general route ranks:
  leave-one-out computes each score once for both of its items, this row twice;
- the same at D = 512 (CLIP-size embeddings): the floor, leave-one-out and the
  query/gallery form, each row's ratio against the floor of its own D;
- ``pytorch-metric-learning AccuracyCalculator``: ``precision_at_1`` (= R@1) with its
  default faiss-cpu k-NN (``IndexFlatL2`` on the normalised embeddings: the cosine
  order), ``k = 10`` neighbours, ``ref_includes_query=True`` (leave-one-out);
- ``full N x N matrix + topk``: the whole score matrix, the diagonal set to -inf, then
  ``topk(10)``.

Each contestant runs once per round (after a warm-up), in rounds that interleave them:
time is the median over rounds (``update`` + ``compute`` for the metric), ratios the
median of the per-round ratios. Every contestant runs at the torch thread count of
the run (``--threads``; the metric then ranks its tiles on that many worker threads);
peak memory that of the compute step (the metric's
embeddings already stored), in a child under :func:`measure.live_memory` settings. On
CUDA all but pytorch-metric-learning (faiss-cpu) runs on the GPU. A peer not installed,
or an option the metric lacks, keeps a row saying so. The metric's rows show the gallery
items a query re-scored (``last_compute_rescored``, else "n/a").
"""

from __future__ import annotations

import functools
import inspect
import statistics
from collections.abc import Callable
from typing import Any

import torch
from measure import (
    RECALL_COLUMN,
    TIME_COLUMN,
    Measurement,
    Section,
    Setup,
    by_name,
    call_each,
    contestant_table,
    fmt_ratio,
    peak_column,
    peak_since,
    start_peak,
    time_ratio,
    time_ratio_column,
    timed,
)

from recall_at_k import EmbeddingRecallAtK

KS = (1, 5, 10)
BATCH = 256
DIM = 128
CLASSES = 100
NOISE = 2.5  # per-dimension noise around the class centres: R@1 about 0.57 at N = 20,000
TILE_BYTES = 32 * 2**20
NEAR_DUPLICATE = 0.99
WIDE_DIM = 512  # CLIP-size embeddings

FLOOR = "matmul floor (32 MiB tiles)"
FULL_MATMUL = "matmul, one N x N product"
OURS = "EmbeddingRecallAtK, leave-one-out (default chunk_bytes = 256 MiB)"
OURS_TILED = "EmbeddingRecallAtK, leave-one-out, chunk_bytes = 32 MiB"
OURS_NEAR_DUPLICATE = f"EmbeddingRecallAtK, leave-one-out, near_duplicate = {NEAR_DUPLICATE}"
OURS_QUANTISED = "EmbeddingRecallAtK, leave-one-out, quantised {-1, 0, 1}^D embeddings"
OURS_QUERY_GALLERY = (
    "EmbeddingRecallAtK, the same items as queries and as a gallery (ids=), no symmetry"
)
FLOOR_WIDE = f"matmul floor (32 MiB tiles), D = {WIDE_DIM}"
OURS_WIDE = f"EmbeddingRecallAtK, leave-one-out, D = {WIDE_DIM}"
OURS_QUERY_GALLERY_WIDE = f"EmbeddingRecallAtK, queries and gallery (ids=), D = {WIDE_DIM}"
PML = "pytorch-metric-learning AccuracyCalculator (faiss-cpu)"
FULL_TOPK = "full N x N matrix + topk"
METRIC_ROWS = (
    OURS,
    OURS_TILED,
    OURS_NEAR_DUPLICATE,
    OURS_QUANTISED,
    OURS_QUERY_GALLERY,
    OURS_WIDE,
    OURS_QUERY_GALLERY_WIDE,
)
QUERY_GALLERY_ROWS = (OURS_QUERY_GALLERY, OURS_QUERY_GALLERY_WIDE)
WIDE_ROWS = (FLOOR_WIDE, OURS_WIDE, OURS_QUERY_GALLERY_WIDE)
CONTESTANTS = (FLOOR, FULL_MATMUL, *METRIC_ROWS, FLOOR_WIDE, PML, FULL_TOPK)


class NotRunError(RuntimeError):
    """A contestant cannot run here (a peer's package is missing, an option too)."""


def make_data(num: int, seed: int = 0, dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num, dim]`` float32 embeddings around 100 class centres, and their labels
    (the noise scaled with ``sqrt(dim / 128)``: about the same recall at every width)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, dim, generator=gen)
    labels = torch.randint(0, CLASSES, (num,), generator=gen)
    noise = NOISE * (dim / DIM) ** 0.5
    embeddings = centres[labels] + noise * torch.randn(num, dim, generator=gen)
    return embeddings, labels


def quantised(num: int, seed: int = 0) -> torch.Tensor:
    """``[num, 128]`` embeddings with values in {-1, 0, 1}: many exactly tied scores."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(-1, 2, (num, DIM), generator=gen).float()


def _recall_from_topk(neighbour_labels: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    hits = neighbour_labels == labels.unsqueeze(1)
    first = torch.where(hits.any(dim=1), hits.float().argmax(dim=1) + 1, len(hits[0]) + 1)
    return {f"recall@{k}": float((first <= k).double().mean()) for k in KS}


def _metric_options(name: str) -> dict[str, Any]:
    """The constructor options of a metric contestant (``near_duplicate`` where it exists)."""
    options: dict[str, Any] = {"chunk_bytes": TILE_BYTES} if name == OURS_TILED else {}
    if "near_duplicate" in inspect.signature(EmbeddingRecallAtK).parameters:
        options["near_duplicate"] = NEAR_DUPLICATE if name == OURS_NEAR_DUPLICATE else None
    elif name == OURS_NEAR_DUPLICATE:
        raise NotRunError("skipped: this EmbeddingRecallAtK has no near_duplicate option")
    return options


def _rescored_per_query(metric: EmbeddingRecallAtK[Any], num: int) -> str:
    """Gallery items a query re-scored in the last ``compute``, per direction."""
    rescored = getattr(metric, "last_compute_rescored", None)
    if rescored is None:
        return "n/a"
    return ", ".join(f"{direction}: {total / num:.2f}" for direction, total in rescored.items())


Prepare = Callable[[], Any]
Compute = Callable[[Any], dict[str, Any]]


def _metric(name: str, embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[Prepare, Compute]:
    num = embeddings.shape[0]
    options = _metric_options(name)

    def fill() -> Any:
        metric = EmbeddingRecallAtK(KS, **options).to(embeddings.device)
        for start in range(0, num, BATCH):
            batch = embeddings[start : start + BATCH], labels[start : start + BATCH]
            if name not in QUERY_GALLERY_ROWS:
                metric.update(*batch)
                continue
            # Leave-one-out as a query/gallery protocol: each item's two copies share an
            # id, so a query ignores itself; ranked by the general route.
            ids = torch.arange(start, start + batch[1].shape[0], device=embeddings.device)
            metric.update(*batch, role="query", ids=ids)
            metric.update(*batch, role="gallery", ids=ids)
        return metric

    def compute(metric: Any) -> dict[str, Any]:
        values = {key: float(value) for key, value in metric.compute().items()}
        return {"values": values, "rescored": _rescored_per_query(metric, num)}

    return fill, compute


def _pml(embeddings: torch.Tensor, labels: torch.Tensor) -> Compute:
    try:
        import faiss  # noqa: F401
        from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
    except ImportError as err:
        raise NotRunError(
            f"not installed ({err.name}): pip install --no-deps pytorch-metric-learning faiss-cpu"
        ) from err
    calculator = AccuracyCalculator(
        include=("precision_at_1",), k=max(KS), device=torch.device("cpu")
    )
    normalised = torch.nn.functional.normalize(embeddings, dim=1)

    def theirs(_: Any) -> dict[str, Any]:
        result = calculator.get_accuracy(normalised, labels)
        return {"values": {"recall@1": float(result["precision_at_1"])}}

    return theirs


def _matmul(normalised: torch.Tensor, rows: int) -> Compute:
    num = normalised.shape[0]

    def product(_: Any) -> dict[str, Any]:
        out = torch.empty(rows, num, device=normalised.device)
        for start in range(0, num, rows):
            block = normalised[start : start + rows]
            torch.matmul(block, normalised.T, out=out[: block.shape[0]])
        return {}

    return product


def _full_topk(normalised: torch.Tensor, labels: torch.Tensor) -> Compute:
    def full(_: Any) -> dict[str, Any]:
        scores = normalised @ normalised.T
        scores.fill_diagonal_(float("-inf"))
        top = scores.topk(max(KS), dim=1).indices
        del scores
        return {"values": _recall_from_topk(labels[top], labels)}

    return full


def _contestant(name: str, num: int, seed: int, device: str) -> tuple[Prepare, Compute]:
    """``(prepare, compute)``: ``prepare`` is timed but outside the memory window.

    Everything runs on ``device`` except pytorch-metric-learning, whose faiss-cpu k-NN
    runs on the CPU.
    """
    embeddings, labels = make_data(num, seed, WIDE_DIM if name in WIDE_ROWS else DIM)
    if name == PML:
        return lambda: None, _pml(embeddings, labels)
    if name == OURS_QUANTISED:
        embeddings = quantised(num, seed)
    embeddings, labels = embeddings.to(device), labels.to(device)
    if name in METRIC_ROWS:
        return _metric(name, embeddings, labels)
    normalised = torch.nn.functional.normalize(embeddings, dim=1)
    if name in (FLOOR, FLOOR_WIDE):
        return lambda: None, _matmul(normalised, max(1, TILE_BYTES // (num * 4)))
    if name == FULL_MATMUL:
        return lambda: None, _matmul(normalised, num)
    if name == FULL_TOPK:
        return lambda: None, _full_topk(normalised, labels)
    raise ValueError(f"unknown contestant {name!r}")


def run_contestants(names: list[str], num: int, device: str) -> list[dict[str, Any]]:
    """Run each contestant once in this process, one after the other (after a warm-up).

    Returns, per contestant: ``seconds`` (prepare + compute; CUDA events on a GPU),
    ``peak_bytes`` (compute step, over the memory in use before it), the Recall@K
    ``values`` and, for the metric, ``rescored``; or the ``error`` of one that cannot run.
    """
    out: list[dict[str, Any]] = []
    for name in names:
        try:
            prepare, compute = _contestant(name, 512, 1, device)
            compute(prepare())
            prepare, compute = _contestant(name, num, 0, device)
        except NotRunError as err:
            out.append({"name": name, "error": str(err)})
            continue
        state, prepared = timed(prepare, device)
        baseline = start_peak(device)
        result, computed = timed(functools.partial(compute, state), device)
        peak = peak_since(device, baseline)
        del state
        out.append({"name": name, "seconds": prepared + computed, "peak_bytes": peak, **result})
    return out


def _row(name: str, rounds: list[dict[str, Any]]) -> Measurement:
    """A contestant's median time and peak over its rounds."""
    first = rounds[0]
    if "error" in first:
        return Measurement(name, None, None, first["error"])
    times = [out["seconds"] for out in rounds]
    median, values = statistics.median(times), first.get("values", {})
    peak = int(statistics.median(out["peak_bytes"] for out in rounds))
    details = {"rescored": first["rescored"]} if "rescored" in first else {}
    return Measurement(name, median, peak, values=values, rounds=times, details=details)


def run(num: int, *, repeats: int, setup: Setup) -> Section:
    """Every contestant on ``num`` embeddings, ``repeats`` interleaved rounds.

    Each round's runs are isolated as :func:`measure.call_each` says.
    """
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTESTANTS}
    kwargs = {"num": num, "device": setup.device}
    for _ in range(repeats):
        for out in call_each(run_contestants, CONTESTANTS, kwargs, setup, live_memory=True):
            runs[out["name"]].append(out)
    rows = [_row(name, rounds) for name, rounds in runs.items()]
    named = by_name(rows)
    title = (
        f"N = {num:,} items, D = {DIM} (and {WIDE_DIM} where the row says), {CLASSES} classes,"
        f" leave-one-out, cosine, K = {KS}, update in batches of {BATCH}, device"
        f" {setup.device}, {setup.threads} torch thread(s)"
    )
    return Section(f"{title}.\n\n{_table(rows, num)}\n\n{_summary(named, num)}", named)


def matrix_over_peak(row: Measurement, num: int) -> float | None:
    """How many times the bytes of a full N x N float32 score matrix the row's peak is."""
    return num * num * 4 / row.peak_bytes if row.peak_bytes else None


def _table(rows: list[Measurement], num: int) -> str:
    named = by_name(rows)
    floor, wide_floor, ours = named[FLOOR], named[FLOOR_WIDE], named[OURS]

    def over_floor(row: Measurement) -> str:
        """The row's time over the floor of its own D."""
        base = wide_floor if row.name in WIDE_ROWS else floor
        return fmt_ratio(time_ratio(row, base), row.at_least)

    def rescored(row: Measurement) -> str:
        return row.details.get("rescored", "—")

    return contestant_table(
        rows,
        [
            TIME_COLUMN,
            ("time / floor (of its D)", over_floor),
            time_ratio_column("time / this metric", ours),
            peak_column("peak memory during compute"),
            (
                "full N x N matrix / peak",
                lambda row: fmt_ratio(matrix_over_peak(row, num), digits=1),
            ),
            ("gallery items re-scored a query", rescored),
            RECALL_COLUMN,
        ],
    )


def _summary(rows: dict[str, Measurement], num: int) -> str:
    """Per setting of the metric: against the floor, the full matrix and the peer."""
    lines = []
    for name in (OURS, OURS_TILED, OURS_QUERY_GALLERY, OURS_WIDE, OURS_QUERY_GALLERY_WIDE):
        row = rows[name]
        floor = rows[FLOOR_WIDE if name in WIDE_ROWS else FLOOR]
        text = (
            f"- {name}: {fmt_ratio(time_ratio(row, floor))} the floor; peak memory"
            f" {fmt_ratio(matrix_over_peak(row, num), digits=1)} below the full matrix"
        )
        peer = None if name in WIDE_ROWS else time_ratio(rows[PML], row)
        if peer is not None:
            text += f"; AccuracyCalculator takes {peer:.2f}x its time"
        lines.append(text + ".")
    near = time_ratio(rows[OURS_NEAR_DUPLICATE], rows[OURS])
    if near is not None:
        lines.append(
            f"- the protocol audit's near-duplicate counts (near_duplicate = {NEAR_DUPLICATE}):"
            f" {near:.2f}x the time of near_duplicate = None."
        )
    return "\n".join(lines)
