"""Embedding workload of DESIGN section 4: EmbeddingRecallAtK against its peers and the floor.

N = 20,000 items, D = 128, leave-one-out, cosine similarity, 100 classes (class centres
plus noise), K = (1, 5, 10). Contestants, each in a fresh subprocess of its own so that
peak memory compares:

- ``matmul floor``: the N x N product of the L2-normalised embeddings in tiles of 32 MiB
  of scores, written into one reused buffer (the least any exact method must do);
- ``matmul, one N x N product``: the same product as a single matrix;
- ``EmbeddingRecallAtK``: ``update`` in batches of 256, then ``compute``; with the
  default ``chunk_bytes`` (256 MiB) and with ``chunk_bytes = 32 MiB``;
- ``pytorch-metric-learning AccuracyCalculator``: ``precision_at_1`` (= R@1) with its
  default faiss-cpu k-NN (``IndexFlatL2`` on the normalised embeddings: the cosine
  order), ``k = 10`` neighbours, ``ref_includes_query=True`` (leave-one-out);
- ``full N x N matrix + topk``: the whole score matrix, the diagonal set to -inf, then
  ``topk(10)``.

Each contestant runs once per round, ``--repeats`` rounds (default 3) that interleave
the contestants, each run after a warm-up on a small workload: time is the median over
rounds (``update`` + ``compute`` for the metric), ratios the median of the per-round
ratios. Peak memory is the resident-set
high-water mark during the compute step (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``) over what was resident just before it (for the metric: with
the embeddings already stored), in a subprocess that runs with ``MALLOC_MMAP_THRESHOLD_``
fixed at 128 KiB so that freed buffers leave the resident set at once.

Run: ``python benchmarks/embedding.py [--quick] [--repeats N] [--threads T] [--device cpu|cuda]
[--no-write]``; on CUDA everything but pytorch-metric-learning (faiss-cpu) runs on the GPU.
``--quick`` uses N = 4,000. Peers that are not installed get a row saying so.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from measure import (
    Measurement,
    elapsed,
    fmt_bytes,
    fmt_ratio,
    fmt_seconds,
    machine,
    peak_since,
    run_child,
    start_peak,
    write_section,
)

KS = (1, 5, 10)
BATCH = 256
DIM = 128
CLASSES = 100
NOISE = 2.5  # per-dimension noise around the class centres: R@1 about 0.57 at N = 20,000
TILE_BYTES = 32 * 2**20

FLOOR = "matmul floor (32 MiB tiles)"
FULL_MATMUL = "matmul, one N x N product"
OURS = "EmbeddingRecallAtK, leave-one-out (default chunk_bytes = 256 MiB)"
OURS_TILED = "EmbeddingRecallAtK, leave-one-out, chunk_bytes = 32 MiB"
PML = "pytorch-metric-learning AccuracyCalculator (faiss-cpu)"
FULL_TOPK = "full N x N matrix + topk"
CONTESTANTS = (FLOOR, FULL_MATMUL, OURS, OURS_TILED, PML, FULL_TOPK)


class NotInstalledError(RuntimeError):
    """A peer's package is missing."""


def make_data(num: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num, 128]`` float32 embeddings around 100 class centres, and their labels."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, DIM, generator=gen)
    labels = torch.randint(0, CLASSES, (num,), generator=gen)
    embeddings = centres[labels] + NOISE * torch.randn(num, DIM, generator=gen)
    return embeddings, labels


def _recall_from_topk(neighbour_labels: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    hits = neighbour_labels == labels.unsqueeze(1)
    first = torch.where(hits.any(dim=1), hits.float().argmax(dim=1) + 1, len(hits[0]) + 1)
    return {f"recall@{k}": float((first <= k).double().mean()) for k in KS}


def _contestant(
    name: str, embeddings: torch.Tensor, labels: torch.Tensor, device: str = "cpu"
) -> tuple[Callable[[], Any], Callable[[Any], dict[str, float]]]:
    """``(prepare, compute)``: ``prepare`` is timed but outside the memory window.

    Everything runs on ``device`` except pytorch-metric-learning, whose faiss-cpu k-NN
    runs on the CPU.
    """
    num = embeddings.shape[0]
    if name != PML:
        embeddings, labels = embeddings.to(device), labels.to(device)
    if name in (FLOOR, FULL_MATMUL):
        normalised = torch.nn.functional.normalize(embeddings, dim=1)
        rows = num if name == FULL_MATMUL else max(1, TILE_BYTES // (num * 4))

        def floor(_: Any) -> dict[str, float]:
            out = torch.empty(rows, num, device=normalised.device)
            for start in range(0, num, rows):
                block = normalised[start : start + rows]
                torch.matmul(block, normalised.T, out=out[: block.shape[0]])
            return {}

        return lambda: None, floor
    if name in (OURS, OURS_TILED):
        from recall_at_k import EmbeddingRecallAtK

        tiled = name == OURS_TILED

        def fill() -> Any:
            metric = (
                EmbeddingRecallAtK(KS, chunk_bytes=TILE_BYTES) if tiled else EmbeddingRecallAtK(KS)
            )
            metric = metric.to(embeddings.device)
            for start in range(0, num, BATCH):
                metric.update(embeddings[start : start + BATCH], labels[start : start + BATCH])
            return metric

        def ours(metric: Any) -> dict[str, float]:
            return {key: float(value) for key, value in metric.compute().items()}

        return fill, ours
    if name == PML:
        try:
            import faiss  # noqa: F401
            from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
        except ImportError as err:
            raise NotInstalledError(
                f"not installed ({err.name}): pip install --no-deps pytorch-metric-learning"
                " faiss-cpu"
            ) from err
        calculator = AccuracyCalculator(
            include=("precision_at_1",), k=max(KS), device=torch.device("cpu")
        )
        normalised = torch.nn.functional.normalize(embeddings, dim=1)

        def theirs(_: Any) -> dict[str, float]:
            result = calculator.get_accuracy(normalised, labels)
            return {"recall@1": float(result["precision_at_1"])}

        return lambda: None, theirs
    if name == FULL_TOPK:
        normalised = torch.nn.functional.normalize(embeddings, dim=1)

        def full(_: Any) -> dict[str, float]:
            scores = normalised @ normalised.T
            scores.fill_diagonal_(float("-inf"))
            top = scores.topk(max(KS), dim=1).indices
            del scores
            return _recall_from_topk(labels[top], labels)

        return lambda: None, full
    raise ValueError(f"unknown contestant {name!r}")


def _timed_call(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """``fn()`` and the seconds it took (CUDA events on a GPU)."""
    out: list[Any] = []
    seconds = elapsed(lambda: out.append(fn()), device)
    return out[0], seconds


def run_contestant(name: str, num: int, repeats: int, device: str = "cpu") -> dict[str, Any]:
    """Run one contestant ``repeats`` times in this process (after a small warm-up).

    Returns:
        ``times`` (seconds, prepare + compute; CUDA events on a GPU), ``peak_bytes``
        (compute step of the first timed run, over the memory in use before it) and the
        Recall@K ``values``; or the ``error`` of a peer that is not installed.
    """
    try:
        small, small_labels = make_data(512, seed=1)
        prepare, compute = _contestant(name, small, small_labels, device)
        compute(prepare())
        embeddings, labels = make_data(num)
        prepare, compute = _contestant(name, embeddings, labels, device)
    except NotInstalledError as err:
        return {"name": name, "error": str(err)}
    times: list[float] = []
    peaks: list[int] = []
    values: dict[str, float] = {}
    for _ in range(repeats):
        state, prepared = _timed_call(prepare, device)
        baseline = start_peak(device)
        values, computed = _timed_call(functools.partial(compute, state), device)
        peaks.append(peak_since(device, baseline))
        times.append(prepared + computed)
        del state
    return {"name": name, "times": times, "peak_bytes": peaks[0], "values": values}


def _in_subprocess(
    names: list[str],
    num: int,
    repeats: int,
    threads: int | None,
    device: str,
    inline: bool = False,
) -> list[dict[str, Any]]:
    """Run contestants one after the other in one child process (live-memory malloc).

    ``inline`` runs them in this process instead (tests: no interpreter start-up).
    """
    if inline:
        runs = [run_contestant(name, num, repeats, device) for name in names]
        return list(json.loads(json.dumps(runs)))
    args = ["--child", ";".join(names), "--n", str(num), "--repeats", str(repeats)]
    args += ["--device", device]
    if threads is not None:
        args += ["--threads", str(threads)]
    out: list[dict[str, Any]] = run_child(__file__, args, live_memory=True)
    return out


@dataclass
class Row(Measurement):
    """A contestant's median time and peak, with its time in every round."""

    rounds: list[float] = field(default_factory=list)


def rows(
    quick: bool = False,
    repeats: int = 3,
    threads: int | None = None,
    *,
    num: int | None = None,
    device: str = "cpu",
    grouped: bool = False,
    inline: bool = False,
) -> tuple[str, list[Row]]:
    """Run every contestant ``repeats`` rounds, each run in a subprocess of its own.

    Rounds interleave the contestants, so that a change of load on a shared machine
    touches them alike; ratios are taken within a round, then their median. A row's
    ``note`` holds its Recall@K values (or why it did not run). ``grouped`` (quick runs)
    runs a round's contestants one after the other in one subprocess instead, ``inline``
    (tests) in this process.
    """
    num = num or (4_000 if quick else 20_000)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTESTANTS}
    groups = [list(CONTESTANTS)] if grouped else [[name] for name in CONTESTANTS]
    for _ in range(repeats):
        for group in groups:
            for out in _in_subprocess(group, num, 1, threads, device, inline):
                runs[out["name"]].append(out)
    measured = []
    for name, outs in runs.items():
        if "error" in outs[0]:
            measured.append(Row(name, None, None, outs[0]["error"]))
            continue
        values = ", ".join(f"{k} = {v:.4f}" for k, v in outs[0]["values"].items())
        times = [out["times"][0] for out in outs]
        peak = int(statistics.median(out["peak_bytes"] for out in outs))
        measured.append(Row(name, statistics.median(times), peak, values or "—", rounds=times))
    title = (
        f"N = {num:,} items, D = {DIM}, {CLASSES} classes, leave-one-out, cosine,"
        f" K = {KS}, update in batches of {BATCH}, device {device}"
    )
    return title, measured


def ratio(row: Row, base: Row) -> float | None:
    """Median over rounds of ``row``'s time over ``base``'s."""
    if row.seconds is None or base.seconds is None:
        return None
    return statistics.median(a / b for a, b in zip(row.rounds, base.rounds, strict=True))


def table(measured: list[Row], num: int) -> str:
    by_name = {row.name: row for row in measured}
    floor, ours = by_name[FLOOR], by_name[OURS]
    matrix = num * num * 4
    lines = [
        "| contestant | time | time / floor | time / this metric | peak memory during compute"
        " | full N x N matrix / peak | Recall@K |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in measured:
        if row.seconds is None:
            lines.append(f"| {row.name} | — | — | — | — | — | {row.note} |")
            continue
        vs_floor, vs_ours = ratio(row, floor), ratio(row, ours)
        peak = row.peak_bytes or 0
        lines.append(
            f"| {row.name} | {fmt_seconds(row.seconds)} |"
            f" {fmt_ratio(vs_floor)} |"
            f" {fmt_ratio(vs_ours)} |"
            f" {fmt_bytes(row.peak_bytes)} | {f'{matrix / peak:.1f}x' if peak else '—'} |"
            f" {row.note} |"
        )
    return "\n".join(lines)


def summary(measured: list[Row], num: int) -> str:
    by_name = {row.name: row for row in measured}
    parts = []
    for name in (OURS, OURS_TILED):
        row = by_name[name]
        vs_floor = ratio(row, by_name[FLOOR])
        text = (
            f"{name}: {vs_floor or math.nan:.2f}x the floor (target <= 1.5x); peak memory"
            f" {num * num * 4 / max(row.peak_bytes or 1, 1):.1f}x below the full matrix"
            " (target >= 10x)"
        )
        peer = ratio(by_name[PML], row)
        if peer is not None:
            text += f"; AccuracyCalculator takes {peer:.2f}x its time (target > 1x)"
        parts.append(text)
    return "\n".join(f"- {p}." for p in parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 4,000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch/faiss threads")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--no-write", action="store_true", help="do not touch RESULTS.md")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=20_000, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        with contextlib.suppress(ImportError):
            import faiss

            faiss.omp_set_num_threads(args.threads)
    if args.child:
        outs = [
            run_contestant(name, args.n, args.repeats, args.device)
            for name in args.child.split(";")
        ]
        print(json.dumps(outs))
        return
    title, measured = rows(
        quick=args.quick, repeats=args.repeats, threads=args.threads, device=args.device
    )
    num = 4_000 if args.quick else 20_000
    text = table(measured, num)
    notes = summary(measured, num)
    print(f"{title}\n\n{text}\n\n{notes}")
    if args.no_write:
        return
    command = " ".join(["python benchmarks/embedding.py", *sys.argv[1:]])
    body = (
        f"## Embedding workload\n\n{title}. {machine(args.device)}. Each contestant runs in a"
        f" subprocess of its own, {args.repeats} interleaved rounds.\n\n"
        f"Command: `{command}`\n\n{text}\n\n{notes}\n"
    )
    write_section("embedding", body)


if __name__ == "__main__":
    main()
