"""The benchmarks' one command line: every workload side by side, at one mode's sizes.

This file alone defines the modes (full, ``--quick``, ``--tiny``), every workload's
sizes and the acceptance targets; each workload module exports a ``run(...)`` that takes
its sizes and returns its section (markdown and rows). The run prints the tables and
writes them with the machine, the exact command and the targets, met or not. Ratios are
measured side by side in one run; absolute times mean little on a shared machine.

Run: ``python benchmarks/run.py [--quick | --tiny] [--device cpu|cuda]``. The full run
(reference sizes, every threaded workload at 1 thread and at every core: about fifteen
minutes on an otherwise idle two-core machine, estimated from the sections' quiet
one-thread times, plus the large-galleries section, whose time ``scale.py`` states)
rewrites the committed
``benchmarks/RESULTS.md`` and ``scaling.png``; ``--quick`` (minutes) and ``--tiny``
(seconds, the tests) write under the git-ignored ``benchmarks/out/<mode>/``. ``--results
PATH`` writes elsewhere (the figure beside it); ``--only dense,flat`` runs (and
rewrites) only those sections; ``--threads 1,all`` (the default): the thread counts at
which every workload runs, side by side (``all`` = every core, ``os.cpu_count()``), each
process with that many torch (and OpenMP) threads; ``--threads 1`` or ``--threads all``
runs one of them. ``--time-limit SECONDS`` bounds each run of the torchmetrics peers
(120 s in the full run, 60 s otherwise; quiet, they take about 90 s at the reference
sizes): a peer stopped there keeps its row, which gives its time as a lower bound (">"
before its time, ">=" before its ratios) and says so; so a loaded machine cannot stretch
the peers' part of a full run much.

A workload is one entry of :data:`WORKLOADS` (its heading, its run at a mode's sizes,
and whether it runs at every thread count) plus its rows in :data:`TARGETS`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import dense
import distributed
import embedding
import flat
import scale
import scaling
import small
from measure import (
    Measurement,
    Section,
    Setup,
    child_main,
    machine,
    markdown_table,
    memory_ratio,
    time_ratio,
    write_section,
)

BENCHMARKS = Path(__file__).parent
COMMITTED_RESULTS = BENCHMARKS / "RESULTS.md"  # the full run's, with scaling.png beside it
UNCOMMITTED = BENCHMARKS / "out"  # git-ignored: the other modes write under out/<mode>/


@dataclass(frozen=True)
class Mode:
    """The sizes and settings of every workload in one mode."""

    dense: tuple[int, int]  # (Q, G)
    flat: tuple[int, int]  # (Q, G)
    embedding: int  # N
    repeats: int  # timed runs of this package and the floors (dense)
    slow_repeats: int  # timed runs of the argsort and topk peers (dense)
    rounds: int  # timed runs (flat), interleaved rounds (embedding)
    time_limit: float  # seconds: the bound of the torchmetrics peers
    isolation: str  # flat and embedding contestants: "process" each, "grouped", "inline"
    scaling_grid: tuple[tuple[int, int], ...]  # (Q, G) of the time against Q x G
    scaling_k_size: tuple[int, int]  # (Q, G) of the time against the number of K
    scaling_k_counts: tuple[int, ...]  # K = 1..n for every n
    scaling_state_queries: tuple[int, ...]  # Q of the state size
    scaling_repeats: int
    distributed_dense: tuple[int, int]  # (Q, G) over all processes
    distributed_embedding: int  # N over all processes
    distributed_repeats: int
    small_calls: int  # update calls a timed block (small updates)
    small_rounds: int  # interleaved rounds of blocks (small updates)


# fmt: off
MODES = {
    "full": Mode(
        dense=(20_000, 5_000), flat=(20_000, 5_000), embedding=20_000,
        repeats=7, slow_repeats=2, rounds=3, time_limit=120.0, isolation="process",
        scaling_grid=((2_500, 2_000), (5_000, 4_000), (10_000, 8_000), (20_000, 10_000)),
        scaling_k_size=(10_000, 5_000), scaling_k_counts=(1, 3, 10, 30, 100),
        scaling_state_queries=(10, 1_000, 100_000), scaling_repeats=5,
        distributed_dense=(4_096, 5_000), distributed_embedding=10_000, distributed_repeats=3,
        small_calls=500, small_rounds=9,
    ),
    "quick": Mode(
        dense=(1_024, 2_000), flat=(1_024, 2_000), embedding=3_000,
        repeats=3, slow_repeats=1, rounds=1, time_limit=60.0, isolation="grouped",
        scaling_grid=((500, 1_000), (1_000, 2_000), (2_000, 4_000)),
        scaling_k_size=(1_000, 2_000), scaling_k_counts=(1, 3, 10, 30, 100),
        scaling_state_queries=(10, 1_000, 100_000), scaling_repeats=3,
        distributed_dense=(1_024, 1_000), distributed_embedding=2_000, distributed_repeats=2,
        small_calls=200, small_rounds=5,
    ),
    "tiny": Mode(
        dense=(160, 200), flat=(160, 200), embedding=300,
        repeats=1, slow_repeats=1, rounds=1, time_limit=60.0, isolation="inline",
        scaling_grid=((128, 100), (256, 200), (512, 400)),
        scaling_k_size=(256, 200), scaling_k_counts=(1, 3, 10),
        scaling_state_queries=(10, 100, 1_000), scaling_repeats=1,
        distributed_dense=(256, 100), distributed_embedding=300, distributed_repeats=1,
        small_calls=20, small_rounds=1,
    ),
}
# fmt: on

Rows = dict[str, Measurement]
Measured = tuple[float | None, bool]  # a target's value, and whether it is a lower bound


def _time_over(row: str, base: str) -> Callable[[Rows, Mode], Measured]:
    return lambda rows, mode: (time_ratio(rows[row], rows[base]), rows[row].at_least)


def _memory_over(row: str, base: str) -> Callable[[Rows, Mode], Measured]:
    return lambda rows, mode: (memory_ratio(rows[row], rows[base]), False)


def _matrix_over_peak(rows: Rows, mode: Mode) -> Measured:
    return embedding.matrix_over_peak(rows[embedding.OURS], mode.embedding), False


@dataclass(frozen=True)
class Target:
    """An acceptance target: the measured value against ``bound`` (at least or at most)."""

    workload: str
    what: str
    bound: float
    at_least: bool
    measure: Callable[[Rows, Mode], Measured]

    def row(self, rows: Rows, mode: Mode) -> list[str]:
        value, lower_bound = self.measure(rows, mode)
        shown = "—" if value is None else f"{'>= ' if lower_bound else ''}{value:.2f}x"
        bound = f"{'>=' if self.at_least else '<='} {self.bound:g}x"
        return [self.workload, self.what, bound, shown, self._result(value, lower_bound)]

    def _result(self, value: float | None, lower_bound: bool) -> str:
        if value is None:
            return "not measured"
        if value >= self.bound if self.at_least else value <= self.bound:
            return "met"
        if not self.at_least:
            return f"missed by {value / self.bound:.2f}x"
        if lower_bound:
            return "unknown (lower bound)"
        return f"missed: {self.bound / value:.2f}x short"


TORCHMETRICS = "torchmetrics RetrievalHitRate x 3"
WIDE = embedding.WIDE_DIM
# fmt: off
TARGETS = (
    Target("dense", f"{TORCHMETRICS} time / ours (index target, defaults)", 300, True,
           _time_over(dense.TORCHMETRICS, dense.OURS_INDEX_CHECKED)),
    Target("dense", f"{TORCHMETRICS} time / ours (mask target, defaults)", 300, True,
           _time_over(dense.TORCHMETRICS, dense.OURS_MASK_CHECKED)),
    Target("dense", "ours / amax floor (index target, validate_args=False)", 2.5, False,
           _time_over(dense.OURS_INDEX, dense.FLOOR)),
    Target("dense", "ours / amax floor (mask target, validate_args=False)", 3, False,
           _time_over(dense.OURS_MASK, dense.FLOOR)),
    Target("flat", f"{TORCHMETRICS} time / ours", 50, True,
           _time_over(flat.TORCHMETRICS, flat.OURS)),
    Target("flat", "torchmetrics peak memory / ours", 10, True,
           _memory_over(flat.TORCHMETRICS, flat.OURS)),
    Target("embedding", "ours / matmul floor (leave-one-out, D = 128)", 0.75, False,
           _time_over(embedding.OURS, embedding.FLOOR)),
    Target("embedding", "ours / matmul floor (queries and gallery, ids=, D = 128)", 1.3, False,
           _time_over(embedding.OURS_QUERY_GALLERY, embedding.FLOOR)),
    Target("embedding", f"ours / matmul floor (leave-one-out, D = {WIDE})", 0.75, False,
           _time_over(embedding.OURS_WIDE, embedding.FLOOR_WIDE)),
    Target("embedding", f"ours / matmul floor (queries and gallery, ids=, D = {WIDE})", 1.3, False,
           _time_over(embedding.OURS_QUERY_GALLERY_WIDE, embedding.FLOOR_WIDE)),
    Target("embedding", "AccuracyCalculator time / ours", 1, True,
           _time_over(embedding.PML, embedding.OURS)),
    Target("embedding", "full N x N matrix / ours' peak memory during compute", 10, True,
           _matrix_over_peak),
    Target("small", "ours / torchmetrics, one 8 x 100 update (dense index target)", 2.5, False,
           _time_over(small.DENSE_INDEX, small.TORCHMETRICS)),
    Target("small", "ours / torchmetrics, one 8 x 100 update (dense mask target)", 3.5, False,
           _time_over(small.DENSE_MASK, small.TORCHMETRICS)),
    Target("small", "ours / torchmetrics, one 8 x 100 update (flat form)", 4.5, False,
           _time_over(small.FLAT, small.TORCHMETRICS)),
)
# fmt: on


@dataclass(frozen=True)
class Workload:
    """A section of the results: its heading, its run at a mode's sizes (given how the
    contestants run and where a figure goes, None: no figure) and whether it runs at
    every thread count of the run (False: once, at the processes' own setting)."""

    heading: str
    run: Callable[[Mode, Setup, Path | None], Section]
    threaded: bool = True


# fmt: off
WORKLOADS = {
    "dense": Workload("Dense workload", lambda mode, setup, figure: dense.run(
        mode.dense, repeats=mode.repeats, slow_repeats=mode.slow_repeats, setup=setup)),
    "flat": Workload("Flat workload", lambda mode, setup, figure: flat.run(
        mode.flat, repeats=mode.rounds, setup=setup)),
    "embedding": Workload("Embedding workload", lambda mode, setup, figure: embedding.run(
        mode.embedding, repeats=mode.rounds, setup=setup)),
    "small": Workload("Small updates", lambda mode, setup, figure: small.run(
        calls=mode.small_calls, rounds=mode.small_rounds, setup=setup)),
    "scaling": Workload("Scaling", lambda mode, setup, figure: scaling.run(
        list(mode.scaling_grid), k_size=mode.scaling_k_size,
        k_counts=list(mode.scaling_k_counts),
        state_queries=list(mode.scaling_state_queries), repeats=mode.scaling_repeats,
        figure_path=figure, device=setup.device)),
    # One torch thread a process, by design: it measures the cost of the sync.
    "distributed": Workload("Distributed cost", lambda mode, setup, figure: distributed.run(
        mode.distributed_dense, mode.distributed_embedding, repeats=mode.distributed_repeats),
        threaded=False),
    # Processes of one torch thread each, by design (as the distributed cost).
    "scale": Workload("Large galleries", lambda mode, setup, figure: scale.run(
        scale.sizes_for(mode.distributed_embedding), figure), threaded=False),
}
# fmt: on
HEADINGS = {name: workload.heading for name, workload in WORKLOADS.items()}


def thread_counts(text: str) -> list[int]:
    """``--threads``: comma-separated counts or ``all`` (every core), in order, distinct."""
    counts: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if part == "all":
            count = os.cpu_count() or 1
        elif part.isdigit() and int(part) > 0:
            count = int(part)
        else:
            raise argparse.ArgumentTypeError(
                f"thread counts are positive ints or 'all' (every core), got {part!r} in {text!r}"
            )
        if count not in counts:
            counts.append(count)
    return counts


def threads_label(threads: int) -> str:
    every = " (every core)" if threads == os.cpu_count() else ""
    return f"{threads} thread{'' if threads == 1 else 's'}{every}"


def header(mode_name: str, device: str, command: str, seconds: float, threads: list[int]) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    sizes = (
        "the reference sizes"
        if mode_name == "full"
        else f"{mode_name} sizes (the acceptance targets are set at the reference sizes;"
        f" run without `--{mode_name}` for those)"
    )
    counts = " and at ".join(threads_label(count) for count in threads)
    return (
        f"Machine: {machine(device)}.\n\n"
        f"Command: `{command}` ({sizes}; {when}; {seconds:.0f} s in all).\n\n"
        "Every ratio is measured side by side in this one run. Time is the median of"
        " repeated runs after a warm-up (CUDA events on a GPU), peak memory the"
        " resident-set high-water mark over what was resident before the contestant"
        " started (`torch.cuda.max_memory_allocated` on a GPU). A peer that cannot"
        " finish within the time or memory bound keeps its row, which says so. Every"
        f" workload runs at {counts} (`--threads`): every process, peers included, with"
        " that many torch (and OpenMP) threads, except the distributed one (one thread a"
        " process). On a shared machine a multi-threaded kernel waits for its slowest"
        " thread, which makes small kernels, the floors first, look slower than they are."
    )


def targets_section(rows: dict[str, dict[int, Rows]], mode: Mode, threads: list[int]) -> str | None:
    """The acceptance targets of the sections that ran (``rows`` by section, then by
    thread count), one measured column and result a thread count; or None."""
    measured = []
    for target in TARGETS:
        if target.workload not in rows:
            continue
        by_count = rows[target.workload]
        cells: list[str] = []
        for count in threads:
            cells += target.row(by_count[count], mode)[3:] if count in by_count else ["—", "—"]
        first = next(iter(by_count.values()))
        measured.append([*target.row(first, mode)[:3], *cells])
    if not measured:
        return None
    head = ["workload", "target", "bound"]
    for count in threads:
        head += [f"measured, {threads_label(count)}", "result"]
    return f"## Acceptance targets\n\n{markdown_table(head, measured)}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    size.add_argument("--tiny", action="store_true", help="tiny sizes (seconds; the tests)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--results", type=Path, help="markdown file to write")
    parser.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated sections")
    parser.add_argument("--time-limit", type=float, help="time bound of the torchmetrics peers")
    parser.add_argument(
        "--threads",
        type=thread_counts,
        default=thread_counts("1,all"),
        help="comma-separated torch (and OpenMP) thread counts of every process, each one"
        " a run of every workload; 'all' = every core (default: 1,all)",
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # measure.call's children
    args = parser.parse_args(argv)
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(args.only) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {tuple(WORKLOADS)}")
    return args


def section_body(name: str, parts: dict[int, str], seconds: float) -> str:
    """A workload's section: its body at each thread count, under a heading each when
    there are several."""
    if len(parts) == 1:
        (body,) = parts.values()
    else:
        body = "\n\n".join(f"### {threads_label(count)}\n\n{part}" for count, part in parts.items())
    return f"## {WORKLOADS[name].heading}\n\n{body}\n\n({name}: {seconds:.0f} s)"


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.child:
        torch.set_num_threads(args.threads[0])
        child_main(*args.child)
        return
    mode_name = "tiny" if args.tiny else "quick" if args.quick else "full"
    mode = MODES[mode_name]
    default = COMMITTED_RESULTS if mode_name == "full" else UNCOMMITTED / mode_name / "RESULTS.md"
    results: Path = args.results or default
    results.parent.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)])
    begin = time.perf_counter()
    time_limit = args.time_limit or mode.time_limit
    threads: list[int] = args.threads
    bodies: dict[str, str] = {}
    rows: dict[str, dict[int, Rows]] = {}
    for name, workload in WORKLOADS.items():
        if name not in args.only:
            continue
        started = time.perf_counter()
        parts: dict[int, str] = {}
        for count in threads if workload.threaded else threads[:1]:
            torch.set_num_threads(count)
            setup = Setup(args.device, count, mode.isolation, time_limit)
            # The figure (scaling) comes from the first thread count.
            figure = results.with_name(f"{name}.png") if not parts else None
            section = workload.run(mode, setup, figure)
            parts[count] = section.body
            rows.setdefault(name, {})[count] = section.rows
        bodies[name] = section_body(name, parts, time.perf_counter() - started)
        print(bodies[name] + "\n", flush=True)
    targets = targets_section(rows, mode, threads)
    if targets is not None:
        bodies["targets"] = targets
        print(targets + "\n")
    bodies["header"] = header(mode_name, args.device, command, time.perf_counter() - begin, threads)

    if set(args.only) == set(WORKLOADS):
        results.write_text("# Benchmark results\n")  # a full run rewrites the whole file
    for name in ("header", "targets", *WORKLOADS):
        if name in bodies:
            write_section(name, bodies[name], results)
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
