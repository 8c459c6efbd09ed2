"""The benchmarks' one command line: every workload side by side, at one mode's sizes.

``python benchmarks/run.py [--quick | --tiny] [--device cpu|cuda] [--only dense,flat]
[--threads 1,all] [--results PATH] [--time-limit SECONDS]``: the full run (the reference
sizes) rewrites its sections of the committed ``benchmarks/RESULTS.md`` and the figures
beside it; ``--quick`` and ``--tiny`` (the tests) write under the git-ignored
``benchmarks/out/<mode>/``. ``--threads``: the thread counts at which every threaded
workload runs, side by side, every process with that many torch (and OpenMP) threads.
``--time-limit`` bounds a torchmetrics peer: stopped there, it keeps its row.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

import dense
import distributed
import embedding
import flat
import measure
import scale
import scaling
import small

BENCHMARKS = Path(__file__).parent

# Every workload's keyword arguments in each mode. repeats: timed runs of a contestant
# (dense: of this package and the floor; slow_repeats: of the argsort and topk peers);
# rounds: interleaved rounds; calls: update calls a timed block. isolation: how the flat
# and embedding contestants run (measure.isolated); time_limit: the torchmetrics peers'.
# fmt: off
MODES: dict[str, dict[str, Any]] = {
    "full": {
        "isolation": "process", "time_limit": 120.0,
        "dense": dict(size=(20_000, 5_000), repeats=7, slow_repeats=2),
        "flat": dict(size=(20_000, 5_000), repeats=3),
        "embedding": dict(num=20_000, rounds=3), "small": dict(calls=500, rounds=9),
        "scaling": dict(grid=[(2_500, 2_000), (5_000, 4_000), (10_000, 8_000), (20_000, 10_000)],
                        k_size=(10_000, 5_000), k_counts=[1, 3, 10, 30, 100],
                        state_queries=[10, 1_000, 100_000], repeats=5),
        "distributed": dict(dense_size=(4_096, 5_000), embedding_num=10_000, repeats=3),
        "scale": dict(sizes=list(scale.FULL_SIZES)),
    },
    "quick": {
        "isolation": "grouped", "time_limit": 60.0,
        "dense": dict(size=(1_024, 2_000), repeats=3, slow_repeats=1),
        "flat": dict(size=(1_024, 2_000), repeats=1),
        "embedding": dict(num=3_000, rounds=1), "small": dict(calls=200, rounds=5),
        "scaling": dict(grid=[(500, 1_000), (1_000, 2_000), (2_000, 4_000)],
                        k_size=(1_000, 2_000), k_counts=[1, 3, 10, 30, 100],
                        state_queries=[10, 1_000, 100_000], repeats=3),
        "distributed": dict(dense_size=(1_024, 1_000), embedding_num=2_000, repeats=2),
        "scale": dict(sizes=[2_000, 4_000]),
    },
    "tiny": {
        "isolation": "inline", "time_limit": 60.0,
        "dense": dict(size=(160, 200), repeats=1, slow_repeats=1),
        "flat": dict(size=(160, 200), repeats=1),
        "embedding": dict(num=300, rounds=1), "small": dict(calls=20, rounds=1),
        "scaling": dict(grid=[(128, 100), (256, 200), (512, 400)], k_size=(256, 200),
                        k_counts=[1, 3, 10], state_queries=[10, 100, 1_000], repeats=1),
        "distributed": dict(dense_size=(256, 100), embedding_num=300, repeats=1),
        # one process: tests/test_benchmarks.py runs the gathered and sharded ones alone
        "scale": dict(sizes=[300], configs=["single"]),
    },
}
# fmt: on

# A section: its heading, its module (whose ``run(**sizes, setup=, figure=)`` returns it)
# and whether it runs at every thread count (else once: one torch thread a process, by
# design, as it measures the cost of the sync).
# fmt: off
WORKLOADS = {
    "dense": ("Dense workload", dense, True), "flat": ("Flat workload", flat, True),
    "embedding": ("Embedding workload", embedding, True), "small": ("Small updates", small, True),
    "scaling": ("Scaling", scaling, True), "distributed": ("Distributed cost", distributed, False),
    "scale": ("Large galleries", scale, False),
}
# fmt: on

Rows = dict[str, measure.Measurement]
Value = Callable[[Rows, dict[str, Any]], tuple[float | None, bool]]  # and: a lower bound?


def _time(row: str, base: str) -> Value:
    return lambda rows, mode: (measure.time_ratio(rows[row], rows[base]), rows[row].at_least)


TM, WIDE, UPDATE = "torchmetrics RetrievalHitRate x 3", embedding.WIDE_DIM, "ours / torchmetrics"
UPDATE += ", one 8 x 100 update"
# The acceptance targets: (workload, target, bound, at least (else at most), value).
# fmt: off
TARGETS: tuple[tuple[str, str, float, bool, Value], ...] = (
    ("dense", f"{TM} time / ours (index target, defaults)", 300, True,
     _time(dense.TORCHMETRICS, dense.OURS_INDEX_CHECKED)),
    ("dense", f"{TM} time / ours (mask target, defaults)", 300, True,
     _time(dense.TORCHMETRICS, dense.OURS_MASK_CHECKED)),
    ("dense", "ours / amax floor (index target, validate_args=False)", 2.5, False,
     _time(dense.OURS_INDEX, dense.FLOOR)),
    ("dense", "ours / amax floor (mask target, validate_args=False)", 3, False,
     _time(dense.OURS_MASK, dense.FLOOR)),
    ("flat", f"{TM} time / ours", 50, True, _time(flat.TORCHMETRICS, flat.OURS)),
    ("flat", "torchmetrics peak memory / ours", 10, True,
     lambda rows, mode: (measure.memory_ratio(rows[flat.TORCHMETRICS], rows[flat.OURS]), False)),
    ("embedding", "ours / matmul floor (leave-one-out, D = 128)", 0.75, False,
     _time(embedding.OURS, embedding.FLOOR)),
    ("embedding", "ours / matmul floor (queries and gallery, ids=, D = 128)", 1.3, False,
     _time(embedding.OURS_QUERY_GALLERY, embedding.FLOOR)),
    ("embedding", f"ours / matmul floor (leave-one-out, D = {WIDE})", 0.75, False,
     _time(embedding.OURS_WIDE, embedding.FLOOR_WIDE)),
    ("embedding", f"ours / matmul floor (queries and gallery, ids=, D = {WIDE})", 1.3, False,
     _time(embedding.OURS_QUERY_GALLERY_WIDE, embedding.FLOOR_WIDE)),
    ("embedding", "AccuracyCalculator time / ours", 1, True, _time(embedding.PML, embedding.OURS)),
    ("embedding", "full N x N matrix / ours' peak memory during compute", 10, True,
     lambda rows, mode: (embedding.matrix_over_peak(rows[embedding.OURS], mode["embedding"]["num"]),
                         False)),
    ("small", f"{UPDATE} (dense index target)", 2.5, False,
     _time(small.DENSE_INDEX, small.TORCHMETRICS)),
    ("small", f"{UPDATE} (dense mask target)", 3.5, False,
     _time(small.DENSE_MASK, small.TORCHMETRICS)),
    ("small", f"{UPDATE} (flat form)", 4.5, False, _time(small.FLAT, small.TORCHMETRICS)),
)
# fmt: on


def targets_section(
    rows: dict[str, dict[int, Rows]], mode: dict[str, Any], threads: list[int]
) -> str | None:
    """The acceptance targets of the sections that ran (``rows`` by section, then by
    thread count): the value and the result at each thread count; None if none ran."""
    body = []
    for workload, what, bound, at_least, value in (t for t in TARGETS if t[0] in rows):
        cells = [workload, what, f"{'>=' if at_least else '<='} {bound:g}x"]
        for count in threads:
            measured, lower = value(rows[workload][count], mode)
            if measured is None:
                cells += ["—", "not measured"]
                continue
            if measured >= bound if at_least else measured <= bound:
                result = "met"
            elif not at_least:
                result = f"missed by {measured / bound:.2f}x"
            else:
                result = (
                    "unknown (lower bound)" if lower else f"missed: {bound / measured:.2f}x short"
                )
            cells += [f"{'>= ' if lower else ''}{measured:.2f}x", result]
        body.append(cells)
    head = ["workload", "target", "bound"]
    for count in threads:
        head += [f"measured, {threads_label(count)}", "result"]
    return f"## Acceptance targets\n\n{measure.table(head, body)}" if body else None


def thread_counts(text: str) -> list[int]:
    """``--threads``: comma-separated counts or ``all`` (every core), in order, distinct."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part == "all" or (part.isdigit() and int(part) > 0) for part in parts):
        raise argparse.ArgumentTypeError(
            f"thread counts are positive ints or 'all' (every core), got {text!r}"
        )
    return list(dict.fromkeys((os.cpu_count() or 1) if p == "all" else int(p) for p in parts))


def threads_label(threads: int) -> str:
    every = " (every core)" if threads == os.cpu_count() else ""
    return f"{threads} thread{'' if threads == 1 else 's'}{every}"


def header(mode_name: str, device: str, command: str, seconds: float, threads: list[int]) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    sizes = "the reference sizes"
    if mode_name != "full":
        sizes = f"{mode_name} sizes (the acceptance targets are set at the reference sizes;"
        sizes += f" run without `--{mode_name}` for those)"
    counts = " and at ".join(threads_label(count) for count in threads)
    return (
        f"Machine: {measure.machine(device)}.\n\n"
        f"Command: `{command}` ({sizes}; {when}; {seconds:.0f} s in all).\n\n"
        "Every ratio is measured side by side in this one run: time, the median of repeated"
        " runs after a warm-up; peak memory, what a contestant adds to the resident set"
        f" (`torch.cuda.max_memory_allocated` on a GPU). Every workload runs at {counts}"
        " (`--threads`): every process, peers included, with that many torch (and OpenMP)"
        " threads, except the distributed ones (one thread a process)."
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    size.add_argument("--tiny", action="store_true", help="tiny sizes (seconds; the tests)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--results", type=Path, help="markdown file to write")
    parser.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated sections")
    parser.add_argument("--time-limit", type=float, help="time bound of the torchmetrics peers")
    threads = "comma-separated thread counts, each a run of every workload; 'all' = every core"
    parser.add_argument("--threads", type=thread_counts, default="1,all", help=threads)
    args = parser.parse_args(argv)
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(args.only) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {tuple(WORKLOADS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    mode_name = "tiny" if args.tiny else "quick" if args.quick else "full"
    mode = MODES[mode_name]
    default = BENCHMARKS / ("RESULTS.md" if mode_name == "full" else f"out/{mode_name}/RESULTS.md")
    results: Path = args.results or default
    results.parent.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)])
    begin, threads = time.perf_counter(), args.threads
    time_limit = args.time_limit or mode["time_limit"]
    bodies: dict[str, str] = {}
    rows: dict[str, dict[int, Rows]] = {}
    for name in (name for name in WORKLOADS if name in args.only):
        heading, module, threaded = WORKLOADS[name]
        started = time.perf_counter()
        parts: dict[int, str] = {}
        for count in threads if threaded else threads[:1]:
            torch.set_num_threads(count)
            setup = measure.Setup(args.device, count, mode["isolation"], time_limit)
            figure = None if parts else results.with_name(f"{name}.png")  # the first count's
            parts[count], rows.setdefault(name, {})[count] = module.run(
                **mode[name], setup=setup, figure=figure
            )
        several = len(parts) > 1  # a sub-heading a thread count
        body = "\n\n".join(
            f"### {threads_label(n)}\n\n{p}" if several else p for n, p in parts.items()
        )
        seconds = time.perf_counter() - started
        bodies[name] = f"## {heading}\n\n{body}\n\n({name}: {seconds:.0f} s)"
        print(bodies[name] + "\n", flush=True)
    targets = targets_section(rows, mode, threads)
    if targets is not None:
        bodies["targets"] = targets
        print(targets + "\n")
    bodies["header"] = header(mode_name, args.device, command, time.perf_counter() - begin, threads)
    for name in ("header", "targets", *WORKLOADS):
        if name in bodies:
            measure.write_section(name, bodies[name], results)
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
