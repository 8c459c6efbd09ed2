"""Flat workload (issue 3): DESIGN section 4's dense workload fed as flat batches.

Q = 20,000 queries x G = 5,000 gallery items, float32 scores, one true item a query, in
blocks of 256 queries, K = (1, 5, 10). Every query is split over two flat
``(preds, target, indexes)`` batches: batch j holds the second half of block j - 1's
items and the first half of block j's (1.28 M items, 512 query ids). Contestants, each
fed the same batches, each in a fresh subprocess of its own so that peak memory compares:

- ``amax floor``: ``preds.view(-1, G / 2).amax(dim=1)`` per batch (one read of the scores);
- ``RetrievalRecallAtK`` (``validate_args=True``, the default, then ``False``), and once
  more with the items of every batch shuffled (no grouping by query to exploit);
- ``torchmetrics RetrievalHitRate x 3``: ``top_k`` = 1, 5, 10 in one ``MetricCollection``
  (default ``compute_groups=True``: the three share one stored copy of the items).

Time is update + compute, end to end, excluding the generation of the batches: the
median of ``--repeats`` runs (default 3) in one subprocess, except for torchmetrics (one
run); wall-clock time and the process's CPU time. Every contestant runs with
``--threads`` torch threads (default 1): on a shared machine a multi-threaded kernel
waits for its slowest thread, so one thread a contestant keeps the ratios steady. Peak
memory is the resident-set high-water mark (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``; ``torch.cuda.max_memory_allocated`` on CUDA) over what was
resident when the contestant started, measured in a subprocess of its own that runs with
``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB: glibc then hands every freed large buffer
back at once, so the high-water mark is live memory rather than heap the allocator kept
(with its default, the 1.28 M-item batches alone leave a few hundred MiB of RSS behind).
torchmetrics is timed in that same run: its large allocations are few, so the setting
does not change its time.

torchmetrics is stopped at ``--time-limit`` seconds (none by default) and not started
when its estimated peak memory exceeds 80% of the available memory; its row says so.

Run: ``python benchmarks/flat.py [--quick] [--device cpu|cuda] [--no-torchmetrics]
[--repeats N] [--threads N] [--time-limit S] [--no-write]``. ``--quick`` uses Q = 2,000.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from measure import (
    Measurement,
    TimeBoundError,
    fmt_bytes,
    fmt_ratio,
    fmt_seconds,
    machine,
    memory_ratio,
    over_memory_bound,
    peak_since,
    run_child,
    start_peak,
    sync,
    time_bound,
    time_ratio,
    timed_out,
    write_section,
)

KS = (1, 5, 10)
BATCH = 256
GALLERY = 5_000

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

FLOOR = "amax floor"
OURS = "RetrievalRecallAtK"
OURS_UNCHECKED = "RetrievalRecallAtK, validate_args=False"
OURS_SHUFFLED = "RetrievalRecallAtK, items shuffled in each batch"
TORCHMETRICS = "torchmetrics RetrievalHitRate x 3"
CONTESTANTS = (FLOOR, OURS, OURS_UNCHECKED, OURS_SHUFFLED, TORCHMETRICS)

# Peak bytes per item of the torchmetrics peer (7.5 GiB for the 100 M items of the full
# workload), used to decide whether it can run within the memory bound.
TORCHMETRICS_BYTES_PER_ITEM = 80


# ------------------------------------------------------------------------------ data


def flat_batches(
    num_queries: int, gallery: int, device: str, shuffle: bool = False, seed: int = 0
) -> Iterator[Batch]:
    """The workload's flat batches, generated one at a time (same data for every seed)."""
    gen = torch.Generator().manual_seed(seed)
    shuffler = torch.Generator().manual_seed(seed + 1)
    half = gallery // 2
    previous: Batch | None = None

    def halves(block: Batch, columns: slice) -> Batch:
        scores, mask, ids = block
        width = len(range(gallery)[columns])
        return (
            scores[:, columns].reshape(-1),
            mask[:, columns].reshape(-1),
            ids.repeat_interleave(width),
        )

    def join(*parts: Batch) -> Batch:
        preds, target, indexes = (torch.cat([p[i] for p in parts]) for i in range(3))
        if shuffle:
            order = torch.randperm(preds.numel(), generator=shuffler)
            preds, target, indexes = preds[order], target[order], indexes[order]
        return preds.to(device), target.to(device), indexes.to(device)

    for start in range(0, num_queries, BATCH):
        rows = min(BATCH, num_queries - start)
        scores = torch.randn(rows, gallery, generator=gen)
        true = torch.randint(0, gallery, (rows,), generator=gen)
        scores[torch.arange(rows), true] += 2.0  # a model that is right often enough to matter
        mask = torch.zeros(rows, gallery, dtype=torch.bool)
        mask[torch.arange(rows), true] = True
        block = (scores, mask, torch.arange(start, start + rows))
        first = halves(block, slice(0, half))
        yield join(halves(previous, slice(half, gallery)), first) if previous else join(first)
        previous = block
    if previous is not None:
        yield join(halves(previous, slice(half, gallery)))


# ----------------------------------------------------------------------- contestants


def _contestant(
    name: str, gallery: int, device: str
) -> tuple[Callable[[Batch], None], Callable[[], Any]]:
    """``(update, compute)`` of a fresh contestant."""
    if name == FLOOR:
        half = gallery // 2
        sink: list[torch.Tensor] = []

        def floor_update(batch: Batch) -> None:
            sink.append(batch[0].view(-1, half).amax(dim=1))

        return floor_update, lambda: torch.cat(sink).shape
    if name in (OURS, OURS_UNCHECKED, OURS_SHUFFLED):
        from recall_at_k import RetrievalRecallAtK

        metric = RetrievalRecallAtK(KS, validate_args=name != OURS_UNCHECKED).to(device)

        def ours_update(batch: Batch) -> None:
            metric.update(batch[0], batch[1], indexes=batch[2])

        return ours_update, metric.compute
    if name == TORCHMETRICS:
        from torchmetrics import MetricCollection
        from torchmetrics.retrieval import RetrievalHitRate

        collection = MetricCollection({f"recall@{k}": RetrievalHitRate(top_k=k) for k in KS}).to(
            device
        )

        def theirs_update(batch: Batch) -> None:
            collection.update(batch[0], batch[1], indexes=batch[2])

        return theirs_update, collection.compute
    raise ValueError(f"unknown contestant {name!r}")


def run_contestant(
    name: str,
    num_queries: int,
    gallery: int,
    device: str,
    repeats: int = 1,
    time_limit: float | None = None,
) -> dict[str, Any]:
    """Run one contestant ``repeats`` times in this process.

    Returns:
        ``times`` (update + compute of each run, seconds), ``peak_bytes`` (of the first
        run) and the Recall@K ``values``; or, when a run passes ``time_limit`` seconds,
        ``timed_out`` and the peak memory up to then.
    """
    try:
        with time_bound(time_limit):
            return _run_contestant(name, num_queries, gallery, device, repeats)
    except TimeBoundError:
        return {"name": name, "timed_out": True}


def _run_contestant(
    name: str, num_queries: int, gallery: int, device: str, repeats: int
) -> dict[str, Any]:
    shuffle = name == OURS_SHUFFLED
    # Warm up kernels and thread pools on a small workload, then start clean.
    update, compute = _contestant(name, 200, device)
    for batch in flat_batches(2 * BATCH, 200, device, shuffle, seed=1):
        update(batch)
    compute()
    del update, compute

    times: list[float] = []
    cpu_times: list[float] = []
    peaks: list[int] = []
    result: Any = None
    for _ in range(repeats):
        update, compute = _contestant(name, gallery, device)
        baseline = start_peak(device)
        wall = cpu = 0.0
        for batch in flat_batches(num_queries, gallery, device, shuffle):
            sync(device)
            begin, begin_cpu = time.perf_counter(), time.process_time()
            update(batch)
            sync(device)
            wall += time.perf_counter() - begin
            cpu += time.process_time() - begin_cpu
            del batch
        begin, begin_cpu = time.perf_counter(), time.process_time()
        result = compute()
        sync(device)
        times.append(wall + time.perf_counter() - begin)
        cpu_times.append(cpu + time.process_time() - begin_cpu)
        peaks.append(peak_since(device, baseline))
        del update, compute
    values = {k: float(v) for k, v in result.items()} if isinstance(result, dict) else {}
    return {
        "name": name,
        "times": times,
        "cpu_times": cpu_times,
        "peak_bytes": peaks[0],
        "values": values,
    }


def _in_subprocess(
    names: Sequence[str],
    num_queries: int,
    gallery: int,
    device: str,
    repeats: int,
    threads: int,
    live_memory: bool,
    time_limit: float | None = None,
    inline: bool = False,
) -> list[dict[str, Any]] | None:
    """Run contestants one after the other in one child; ``None``: killed (safety net).

    ``inline`` runs them in this process instead (tests: no interpreter start-up).
    """
    if inline:
        runs = [
            run_contestant(name, num_queries, gallery, device, repeats, time_limit)
            for name in names
        ]
        return list(json.loads(json.dumps(runs)))
    args = ["--child", ";".join(names), "--queries", str(num_queries), "--gallery", str(gallery)]
    args += ["--device", device, "--repeats", str(repeats), "--threads", str(threads)]
    if time_limit is not None:
        args += ["--time-limit", str(time_limit)]
    safety = None if time_limit is None else 2 * time_limit + 300
    out: list[dict[str, Any]] | None = run_child(
        __file__, args, live_memory=live_memory, timeout=safety
    )
    return out


# ---------------------------------------------------------------------------- report


@dataclass
class FlatMeasurement(Measurement):
    """A :class:`measure.Measurement` plus the process CPU time and the Recall@K values."""

    cpu_seconds: float = 0.0
    values: dict[str, float] = field(default_factory=dict)


def _by_k(item: tuple[str, float]) -> int:
    return int(item[0].rsplit("@", 1)[1])


def rows(
    quick: bool = False,
    device: str = "cpu",
    with_torchmetrics: bool = True,
    repeats: int = 3,
    threads: int = 1,
    *,
    num_queries: int | None = None,
    gallery: int = GALLERY,
    time_limit: float | None = None,
    grouped: bool = False,
    inline: bool = False,
) -> tuple[str, list[FlatMeasurement]]:
    """Run every contestant in subprocesses; ``(title, measurements)``.

    Each contestant gets one subprocess for its peak memory and, except torchmetrics
    (timed in that same run), one for ``repeats`` timed runs (the median is kept).
    ``grouped`` (quick runs) runs the contestants other than torchmetrics one after the
    other in one subprocess for memory and one for time instead; ``inline`` (tests) runs
    everything in this process. torchmetrics is stopped
    at ``time_limit`` seconds, and not started when its estimated peak memory exceeds 80%
    of the available memory; its row then says so.
    """
    num_queries = num_queries or (2_000 if quick else 20_000)
    names = [n for n in CONTESTANTS if n != TORCHMETRICS]
    groups = [names] if grouped else [[n] for n in names]
    memory: dict[str, dict[str, Any]] = {}
    timed: dict[str, dict[str, Any]] = {}
    for group in groups:
        for live, into, runs in ((True, memory, 1), (False, timed, repeats)):
            out = _in_subprocess(
                group, num_queries, gallery, device, runs, threads, live, inline=inline
            )
            assert out is not None
            into.update((o["name"], o) for o in out)
    measured = [_measurement(name, memory[name], timed[name]) for name in names]
    if with_torchmetrics:
        measured.append(_torchmetrics(num_queries, gallery, device, threads, time_limit, inline))
    title = (
        f"Q = {num_queries:,} x G = {gallery:,}, float32, one true item a query, blocks of"
        f" {BATCH} queries, each query split over two flat batches"
        f" ({2 * BATCH * gallery // 2 / 1e6:.2f} M items each), K = {KS},"
        f" {threads} thread{'s' if threads > 1 else ''} a contestant"
    )
    return title, measured


def _measurement(name: str, memory: dict[str, Any], timed: dict[str, Any]) -> FlatMeasurement:
    values = dict(sorted(memory["values"].items(), key=_by_k))
    return FlatMeasurement(
        name,
        statistics.median(timed["times"]),
        memory["peak_bytes"],
        ", ".join(f"{k} = {v:.4f}" for k, v in values.items()),
        cpu_seconds=statistics.median(timed["cpu_times"]),
        values=values,
    )


def _torchmetrics(
    num_queries: int,
    gallery: int,
    device: str,
    threads: int,
    time_limit: float | None,
    inline: bool = False,
) -> FlatMeasurement:
    """The torchmetrics peer (timed in its memory run), within the bounds."""
    skipped = over_memory_bound(
        TORCHMETRICS, TORCHMETRICS_BYTES_PER_ITEM * num_queries * gallery, device
    )
    if skipped is not None:
        return FlatMeasurement(skipped.name, None, None, skipped.note)
    out = _in_subprocess(
        [TORCHMETRICS], num_queries, gallery, device, 1, threads, True, time_limit, inline
    )
    if out is None or out[0].get("timed_out"):
        assert time_limit is not None
        row = timed_out(TORCHMETRICS, time_limit)
        return FlatMeasurement(row.name, row.seconds, None, row.note, at_least=True)
    return _measurement(TORCHMETRICS, out[0], out[0])


def table(measured: Sequence[FlatMeasurement]) -> str:
    """Markdown table with ratios to this metric (default settings) and to the floor."""
    by_name = {m.name: m for m in measured}
    ref, low = by_name[OURS], by_name[FLOOR]
    lines = [
        "| contestant | time | CPU time | peak memory | time / this metric"
        " | CPU time / this metric | memory / this metric | time / floor | Recall@K |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in measured:
        cpu = m.cpu_seconds / ref.cpu_seconds if m.cpu_seconds and ref.cpu_seconds else None
        lines.append(
            f"| {m.name} | {fmt_seconds(m.seconds, m.at_least)}"
            f" | {fmt_seconds(m.cpu_seconds or None)} | {fmt_bytes(m.peak_bytes)}"
            f" | {fmt_ratio(time_ratio(m, ref), m.at_least)} | {fmt_ratio(cpu)}"
            f" | {fmt_ratio(memory_ratio(m, ref), digits=1)}"
            f" | {fmt_ratio(time_ratio(m, low), m.at_least, digits=1)} | {m.note or '—'} |"
        )
    return "\n".join(lines)


def summary(measured: Sequence[FlatMeasurement]) -> str:
    """One sentence: torchmetrics against this metric, and whether the results agree."""
    by_name = {m.name: m for m in measured}
    if TORCHMETRICS not in by_name:
        return ""
    ours, theirs = by_name[OURS], by_name[TORCHMETRICS]
    if not (ours.seconds and theirs.seconds and ours.peak_bytes and theirs.peak_bytes):
        return f"torchmetrics: {theirs.note}."
    agree = all(abs(ours.values[k] - v) < 1e-6 for k, v in theirs.values.items())
    return (
        f"torchmetrics takes {theirs.seconds / ours.seconds:.0f}x the time"
        f" ({theirs.cpu_seconds / ours.cpu_seconds:.0f}x the CPU time) and"
        f" {theirs.peak_bytes / ours.peak_bytes:.0f}x the peak memory of RetrievalRecallAtK"
        f" (targets: >= 50x, >= 10x); the Recall@K values {'agree' if agree else 'DIFFER'}."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Q = 2,000 instead of 20,000")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--no-torchmetrics", action="store_true", help="skip the slow peer")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads a contestant")
    parser.add_argument("--no-write", action="store_true", help="do not touch RESULTS.md")
    parser.add_argument("--time-limit", type=float, default=None, help="torchmetrics bound (s)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--queries", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gallery", type=int, default=GALLERY, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        out = [
            run_contestant(
                name, args.queries, args.gallery, args.device, args.repeats, args.time_limit
            )
            for name in args.child.split(";")
        ]
        print(json.dumps(out))
        return

    title, measured = rows(
        args.quick,
        args.device,
        not args.no_torchmetrics,
        args.repeats,
        args.threads,
        time_limit=args.time_limit,
    )
    command = " ".join(["python benchmarks/flat.py", *sys.argv[1:]])
    body = (
        f"## Flat workload\n\n{title}. {machine(args.device)}. Each contestant runs in"
        f" subprocesses of its own.\n\nCommand: `{command}`\n\n{table(measured)}\n\n"
        f"{summary(measured)}\n"
    )
    print(body)
    if not args.no_write:
        write_section(f"flat-{args.device}{'-quick' if args.quick else ''}", body)


if __name__ == "__main__":
    main()
