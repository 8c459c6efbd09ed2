"""Every benchmark (dense, flat, embedding, scaling, distributed cost) in one run.

Prints markdown tables (time: median of repeated runs after a warm-up; peak memory; the
ratio of every peer to this package and of every contestant to the floor) and rewrites
``benchmarks/RESULTS.md`` with them, the machine, the exact command and the acceptance
targets of the benchmark issue, met or not. Ratios are measured side by side in this
one run (DESIGN section 4); absolute times mean little on a shared machine.

Run: ``python benchmarks/run.py [--quick] [--device cpu|cuda]``. ``--quick`` uses small
sizes (under two minutes on two cores); without it the sizes of DESIGN section 4 (ten to
twenty minutes, most of it the torchmetrics peers). ``--results PATH`` writes elsewhere;
``--only dense,flat`` runs (and rewrites) only those sections; ``--threads N`` sets the
torch threads of every process (default 1: steady ratios on a shared machine).
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

sys.path.insert(0, str(Path(__file__).parent))

import dense
import distributed
import embedding
import flat
import scaling
from measure import (
    RESULTS,
    Measurement,
    machine,
    markdown_table,
    memory_ratio,
    time_ratio,
    write_section,
)

SECTIONS = ("dense", "flat", "embedding", "scaling", "distributed")

# Per mode: dense (Q, G), flat (Q, G), embedding N, timed repeats (dense: this package and the
# floor; dense: the argsort and topk peers; flat and embedding), and the time bound of the
# torchmetrics peers (seconds).
MODES: dict[str, dict[str, object]] = {
    "full": {
        "dense": dense.FULL_SIZE,
        "flat": (20_000, flat.GALLERY),
        "embedding": 20_000,
        "repeats": (7, 2, 3),
        "time_limit": 900.0,
    },
    "quick": {
        "dense": (1_024, 2_000),
        "flat": (1_024, 2_000),
        "embedding": 3_000,
        "repeats": (3, 1, 1),
        "time_limit": 60.0,
    },
    "tiny": {
        "dense": (160, 200),
        "flat": (160, 200),
        "embedding": 300,
        "repeats": (1, 1, 1),
        "time_limit": 60.0,
    },
}


@dataclass
class Target:
    """An acceptance target: ``value`` compared with ``bound`` (``at_least`` or at most)."""

    workload: str
    what: str
    value: float | None
    bound: float
    at_least: bool
    lower_bound: bool = False  # ``value`` is itself a lower bound (a peer hit its bound)

    def met(self) -> str:
        if self.value is None:
            return "not measured"
        ok = self.value >= self.bound if self.at_least else self.value <= self.bound
        if ok:
            return "met"
        if self.at_least and self.lower_bound:
            return "unknown (lower bound)"
        return (
            f"missed by {self.value / self.bound:.2f}x"
            if not self.at_least
            else (f"missed: {self.bound / self.value:.2f}x short")
        )

    def row(self) -> list[str]:
        value = "—" if self.value is None else f"{self.value:.2f}x"
        if self.lower_bound and self.value is not None:
            value = f">= {value}"
        bound = f"{'>=' if self.at_least else '<='} {self.bound:g}x"
        return [self.workload, self.what, bound, value, self.met()]


M = TypeVar("M", bound=Measurement)


def _by_name(rows: Sequence[M]) -> dict[str, M]:
    return {row.name: row for row in rows}


def _speedup(rows: dict[str, M], peer: str, ours: str) -> tuple[float | None, bool]:
    if peer not in rows or ours not in rows:
        return None, False
    return time_ratio(rows[peer], rows[ours]), rows[peer].at_least


def dense_section(
    mode: str, device: str, time_limit: float, threads: int
) -> tuple[str, list[Target]]:
    sizes = MODES[mode]
    size = sizes["dense"]
    repeats = sizes["repeats"]
    assert isinstance(size, tuple) and isinstance(repeats, tuple)
    title, rows = dense.run(
        device=device,
        size=size,
        repeats=repeats[0],
        slow_repeats=repeats[1],
        time_limit=time_limit,
        threads=threads,
    )
    by_name = _by_name(rows)
    targets = []
    for ours, form in ((dense.OURS_INDEX_CHECKED, "index"), (dense.OURS_MASK_CHECKED, "mask")):
        value, lower = _speedup(by_name, dense.TORCHMETRICS, ours)
        what = f"torchmetrics RetrievalHitRate x 3 time / ours ({form} target, defaults)"
        targets.append(Target("dense", what, value, 300, True, lower))
    for ours, form, bound in ((dense.OURS_INDEX, "index", 3), (dense.OURS_MASK, "mask", 6)):
        value = time_ratio(by_name[ours], by_name[dense.FLOOR])
        what = f"ours / amax floor ({form} target, validate_args=False)"
        targets.append(Target("dense", what, value, bound, False))
    body = (
        f"## Dense workload\n\n{title}. update + compute, end to end, from the same"
        f" batches.\n\n{dense.render(rows)}"
    )
    return body, targets


def flat_section(
    mode: str, device: str, time_limit: float, threads: int
) -> tuple[str, list[Target]]:
    sizes = MODES[mode]
    repeats = sizes["repeats"]
    size = sizes["flat"]
    assert isinstance(repeats, tuple) and isinstance(size, tuple)
    title, rows = flat.rows(
        device=device,
        repeats=repeats[2],
        threads=threads,
        num_queries=size[0],
        gallery=size[1],
        time_limit=time_limit,
        grouped=mode == "quick",
        inline=mode == "tiny",
    )
    by_name = _by_name(rows)
    value, lower = _speedup(by_name, flat.TORCHMETRICS, flat.OURS)
    memory = None
    if flat.TORCHMETRICS in by_name:
        memory = memory_ratio(by_name[flat.TORCHMETRICS], by_name[flat.OURS])
    targets = [
        Target("flat", "torchmetrics RetrievalHitRate x 3 time / ours", value, 50, True, lower),
        Target("flat", "torchmetrics peak memory / ours", memory, 10, True),
    ]
    body = f"## Flat workload\n\n{title}.\n\n{flat.table(rows)}\n\n{flat.summary(rows)}"
    return body, targets


def embedding_section(mode: str, device: str, threads: int) -> tuple[str, list[Target]]:
    sizes = MODES[mode]
    repeats = sizes["repeats"]
    num = sizes["embedding"]
    assert isinstance(repeats, tuple) and isinstance(num, int)
    title, rows = embedding.rows(
        repeats=repeats[2],
        threads=threads,
        num=num,
        device=device,
        grouped=mode == "quick",
        inline=mode == "tiny",
    )
    by_name = _by_name(rows)
    ours, floor, peer = by_name[embedding.OURS], by_name[embedding.FLOOR], by_name[embedding.PML]
    matrix = num * num * 4
    targets = [
        Target("embedding", "ours / matmul floor", embedding.ratio(ours, floor), 1.5, False),
        Target(
            "embedding",
            "AccuracyCalculator time / ours",
            embedding.ratio(peer, ours),
            1,
            True,
        ),
        Target(
            "embedding",
            "full N x N matrix / ours' peak memory during compute",
            matrix / ours.peak_bytes if ours.peak_bytes else None,
            10,
            True,
        ),
    ]
    body = (
        f"## Embedding workload\n\n{title}.\n\n{embedding.table(rows, num)}\n\n"
        f"{embedding.summary(rows, num)}"
    )
    return body, targets


def header(mode: str, device: str, command: str, seconds: float) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    sizes = (
        "the sizes of DESIGN section 4"
        if mode == "full"
        else f"{mode} sizes (the acceptance targets are set at DESIGN section 4's sizes;"
        " run without `--quick` for those)"
    )
    return (
        f"Machine: {machine(device)}.\n\n"
        f"Command: `{command}` ({sizes}; {when}; {seconds:.0f} s in all).\n\n"
        "Every ratio is measured side by side in this one run. Time is the median of"
        " repeated runs after a warm-up (CUDA events on a GPU), peak memory the"
        " resident-set high-water mark over what was resident before the contestant"
        " started (`torch.cuda.max_memory_allocated` on a GPU). A peer that cannot"
        " finish within the time or memory bound keeps its row, which says so. Every"
        f" process runs {torch.get_num_threads()} torch thread(s) (`--threads`): on a"
        " shared machine a multi-threaded kernel waits for its slowest thread, which"
        " makes small kernels, the floors first, look slower than they are."
    )


def targets_section(targets: list[Target]) -> str:
    table = markdown_table(
        ["workload", "target", "bound", "measured", "result"], [t.row() for t in targets]
    )
    return f"## Acceptance targets\n\n{table}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (< 2 min, 2 cores)")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--results", type=Path, default=RESULTS, help="markdown file to write")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--time-limit", type=float, help="time bound of the torchmetrics peers")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch (and faiss) threads of every process"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    time_limit = args.time_limit or float(MODES[mode]["time_limit"])  # type: ignore[arg-type]
    results: Path = args.results
    results.parent.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)])
    begin = time.perf_counter()

    runners: dict[str, Callable[[], tuple[str, list[Target]]]] = {
        "dense": lambda: dense_section(mode, args.device, time_limit, args.threads),
        "flat": lambda: flat_section(mode, args.device, time_limit, args.threads),
        "embedding": lambda: embedding_section(mode, args.device, args.threads),
        "scaling": lambda: (
            "## Scaling\n\n"
            + scaling.run(mode, args.device, results.with_name(scaling.FIGURE.name)),
            [],
        ),
        "distributed": lambda: (
            "## Distributed cost\n\n" + distributed.run(mode),
            [],
        ),
    }
    bodies: dict[str, str] = {}
    targets: list[Target] = []
    for name in SECTIONS:
        if name not in only:
            continue
        started = time.perf_counter()
        body, found = runners[name]()
        body += f"\n\n({name}: {time.perf_counter() - started:.0f} s)"
        print(body + "\n", flush=True)
        bodies[name] = body
        targets += found
    if targets:
        bodies["targets"] = targets_section(targets)
        print(bodies["targets"] + "\n")
    bodies["header"] = header(mode, args.device, command, time.perf_counter() - begin)

    if set(only) == set(SECTIONS):
        results.write_text("# Benchmark results\n")  # a full run rewrites the whole file
    for name in ("header", "targets", *SECTIONS):
        if name in bodies:
            write_section(name, bodies[name], results)
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
