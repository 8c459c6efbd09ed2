"""Large galleries: ``EmbeddingRecallAtK.compute()`` time, per-process peak memory and
bytes received against the number of items, in three configurations: one process, 4
gloo processes gathered (every process ranks its queries against a copy of every item)
and 4 gloo processes sharded (``sharded=True``: the gallery passes round the processes
in blocks; reported as not available where ``EmbeddingRecallAtK`` has no ``sharded``).

Leave-one-out, cosine, D = 128, ``ids=``, ``chunk_bytes`` 4 MiB; each process runs one
torch thread and holds its share of the items. After a warm-up ``compute()`` of the same
items and options on the same processes (as ``tests/memory_probe.py`` warms up: the
code that the measured one runs is paged in before it), each process measures its own
``compute()``, on a thread of its own (:func:`measure.on_own_thread`):
the time (after a barrier), the peak resident memory it adds (``measure.start_peak`` /
``measure.peak_since``: VmHWM over the resident set before,
``MALLOC_MMAP_THRESHOLD_=131072``), and the bytes that its ``torch.distributed`` calls
receive (:class:`Traffic`). A row's time is the slowest
process's (the least over ``--repeats`` computes); its memory and bytes the largest
process's. "time / pair" is that time over the N x (N - 1) scores ranked by all
processes together; "bytes / item" the peak over N; "x gathered bytes" the peak over N x
D x 4, the bytes of one copy of every item. With more processes than cores the processes
share the cores: times then include waiting for a core.

The projection to 10M x 1024-d items on 8 GPUs is computed from these measurements and
the memory formula (``tests/memory_formula.py``, stated in ``docs/large-galleries.md``).

Run alone: ``python benchmarks/scale.py [--sizes 20000,50000,100000]
[--configs single,gathered,sharded] [--repeats 1] [--results benchmarks/RESULTS.md]``
(the results file gets the section ``scale`` and ``scale.png`` beside it; without
``--results`` the section is printed). On two quiet cores the three configurations at the
three sizes take about 7.5 minutes (435 s on 2026-12-05, each ``compute()`` run twice:
the warm-up and the measured one; ``compute()`` grows as N^2, and a run of 4 processes
takes about 12 s to start and fill).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import inspect
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import memory_formula as formula  # noqa: E402
from measure import (  # noqa: E402
    LIVE_MEMORY_MMAP_THRESHOLD,
    Section,
    fmt_bytes,
    markdown_table,
    on_own_thread,
    peak_since,
    start_peak,
    write_section,
)

DIM = 128
CHUNK = 4 * 2**20
KS = (1, 5, 10)
PROCESSES = 4
FULL_SIZES = (20_000, 50_000, 100_000)
METRIC = "recall_at_k:EmbeddingRecallAtK"
BATCH = 1000


@dataclass(frozen=True)
class Config:
    """A configuration: its label, processes, and ``sharded=`` (None: not passed)."""

    label: str
    world: int
    sharded: bool | None


CONFIGS = {
    "single": Config("one process", 1, None),
    "gathered": Config(f"{PROCESSES} processes, gathered", PROCESSES, False),
    "sharded": Config(f"{PROCESSES} processes, sharded", PROCESSES, True),
}

# A projection: 10M x 1024-d float32 items on 8 GPUs.
TARGET_ITEMS, TARGET_DIM, TARGET_WORLD = 10_000_000, 1024, 8


def sizes_for(reference: int) -> list[int]:
    """The sizes of a benchmark mode, from its distributed embedding size (10,000 in
    the full run, 2,000 quick, 300 tiny)."""
    if reference >= 10_000:
        return list(FULL_SIZES)
    return [reference] if reference < 1_000 else [reference, 2 * reference]


def load(target: str) -> Any:
    """``"module:name"``: the object."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def accepts_sharded(cls: Callable[..., Any]) -> bool:
    """Whether the metric class takes a ``sharded`` argument."""
    return "sharded" in inspect.signature(cls).parameters


# ----------------------------------------------------------------------- traffic


class Traffic:
    """Bytes that this process's ``torch.distributed`` calls receive while installed:
    the tensors a collective or a receive fills, less what this process itself
    contributes (a broadcast from it, its own part of a gather). Floating-point tensors
    (embeddings, scores) and the others (labels, ids, counts) are counted apart.
    An all-reduce counts its tensor once."""

    def __init__(self) -> None:
        self.floating = 0
        self.other = 0

    def add(self, tensor: torch.Tensor, times: float = 1.0) -> None:
        size = int(tensor.numel() * tensor.element_size() * times)
        if tensor.is_floating_point():
            self.floating += size
        else:
            self.other += size

    @contextlib.contextmanager
    def installed(self) -> Iterator[Traffic]:
        originals: dict[str, Callable[..., Any]] = {}

        def wrap(name: str, count: Callable[..., None]) -> None:
            original = getattr(dist, name, None)
            if original is None:
                return
            originals[name] = original
            signature = inspect.signature(original)

            @functools.wraps(original)
            def counted(*args: Any, **kwargs: Any) -> Any:
                count(**signature.bind(*args, **kwargs).arguments)
                return original(*args, **kwargs)

            setattr(dist, name, counted)

        def group_rank(group: Any) -> int:
            return int(dist.get_rank(group))

        def broadcast(
            tensor: torch.Tensor, src: int | None = None, group: Any = None, **kw: Any
        ) -> None:
            group_src = kw.get("group_src")
            if group_src is not None:
                sending = group_src == group_rank(group)
            else:
                sending = src == dist.get_rank()
            if not sending:
                self.add(tensor)

        def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, **kw: Any) -> None:
            for part in tensor_list:
                self.add(part)
            self.add(tensor, -1.0)

        def into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, **kw: Any) -> None:
            self.add(output_tensor)
            self.add(input_tensor, -1.0)

        def all_reduce(tensor: torch.Tensor, **kw: Any) -> None:
            self.add(tensor)

        def receive(tensor: torch.Tensor, **kw: Any) -> None:
            self.add(tensor)

        def all_to_all(
            output_tensor_list: list[torch.Tensor], input_tensor_list: Any, **kw: Any
        ) -> None:
            for index, part in enumerate(output_tensor_list):
                if index != group_rank(kw.get("group")):
                    self.add(part)

        def all_to_all_single(output: torch.Tensor, input: torch.Tensor, **kw: Any) -> None:
            splits = kw.get("output_split_sizes")
            world = dist.get_world_size(kw.get("group"))
            rows = output.shape[0] if output.dim() else 1
            mine = splits[group_rank(kw.get("group"))] if splits else rows // world
            self.add(output, (rows - mine) / rows if rows else 0.0)

        wrap("broadcast", broadcast)
        wrap("all_gather", all_gather)
        wrap("all_gather_into_tensor", into_tensor)
        wrap("all_reduce", all_reduce)
        wrap("recv", receive)
        wrap("irecv", receive)
        wrap("all_to_all", all_to_all)
        wrap("all_to_all_single", all_to_all_single)
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)


# ------------------------------------------------------------------------ worker


def _data(num: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    embeddings = torch.randn(num, DIM, generator=gen)
    labels = torch.randint(0, max(1, num // 10), (num,), generator=gen)
    return embeddings, labels


def _worker(rank: int, world: int, payload: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    cls = load(payload["metric"])
    num, repeats = payload["num"], payload["repeats"]
    options: dict[str, Any] = {"chunk_bytes": CHUNK, "compute_with_cache": False}
    if payload["sharded"] is not None:
        options["sharded"] = payload["sharded"]
    embeddings, labels = _data(num)
    ids = torch.arange(num)
    mine = slice(num * rank // world, num * (rank + 1) // world)
    # A first compute() of the same items and options on every process, before
    # measuring (as tests/memory_probe.py warms up): the code the measured one runs is
    # then paged in, and torch.distributed's buffers for the first collectives are in
    # place.
    warm = cls(KS, **options)
    warm.update(embeddings[mine], labels[mine], ids=ids[mine])
    warm.compute()
    metric = cls(KS, **options)
    for first in range(mine.start, mine.stop, BATCH):
        rows = slice(first, min(mine.stop, first + BATCH))
        metric.update(embeddings[rows], labels[rows], ids=ids[rows])
    del embeddings, labels, ids, warm
    traffic = Traffic()
    seconds = []
    for attempt in range(repeats):
        if world > 1:
            dist.barrier()
        if attempt == 0:
            baseline = start_peak("cpu")
            with traffic.installed():
                begin = time.perf_counter()
                # On a thread of its own, so that its C heap is its own (as the memory
                # tests measure it: measure.on_own_thread).
                result = on_own_thread(metric.compute)
                seconds.append(time.perf_counter() - begin)
            peak = peak_since("cpu", baseline)
        else:
            begin = time.perf_counter()
            metric.compute()
            seconds.append(time.perf_counter() - begin)
    return {
        "seconds": min(seconds),
        "peak": peak,
        "received": traffic.floating,
        "received_other": traffic.other,
        "values": {key: float(value) for key, value in result.items()},
    }


@contextlib.contextmanager
def _live_memory_env() -> Iterator[None]:
    """The spawned processes inherit glibc's ``MALLOC_MMAP_THRESHOLD_`` at 128 KiB, so that
    freed buffers leave the resident set at once."""
    name = "MALLOC_MMAP_THRESHOLD_"
    before = os.environ.get(name)
    os.environ[name] = str(LIVE_MEMORY_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def measure(
    sizes: list[int], configs: list[str], *, metric: str = METRIC, repeats: int = 1
) -> list[dict[str, Any]]:
    """One row per (size, configuration): its measurements, or ``available`` False."""
    from helpers import run_distributed

    sharding = accepts_sharded(load(metric))
    rows = []
    with _live_memory_env():
        for num in sizes:
            for name in configs:
                config = CONFIGS[name]
                row: dict[str, Any] = {"num": num, "config": name, "world": config.world}
                if config.sharded is not None and not sharding:
                    if config.sharded:
                        rows.append({**row, "available": False})
                        continue
                    config = Config(config.label, config.world, None)  # gathered: the default
                payload = {"num": num, "metric": metric, "repeats": repeats}
                payload["sharded"] = config.sharded
                # New processes (they inherit the environment above), no time limit.
                parts = run_distributed(_worker, config.world, payload, fresh=True, timeout=None)
                row.update(
                    available=True,
                    sharded=config.sharded,
                    seconds=max(p["seconds"] for p in parts),
                    peak=max(p["peak"] for p in parts),
                    received=max(p["received"] for p in parts),
                    received_other=max(p["received_other"] for p in parts),
                    same=all(p["values"] == parts[0]["values"] for p in parts),
                    values=parts[0]["values"],
                )
                rows.append(row)
    single = {r["num"]: r["values"] for r in rows if r["config"] == "single"}
    for r in rows:
        if r["available"] and r["num"] in single:
            r["as_single"] = r["values"] == single[r["num"]]
    return rows


# -------------------------------------------------------------------- projection


def fit(rows: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """Least squares ``key = slope x N + intercept`` over the rows (of two sizes or
    more): bytes per item and fixed bytes."""
    points = [(float(r["num"]), float(r[key])) for r in rows]
    mean_n = sum(n for n, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    slope = sum((n - mean_n) * (v - mean_v) for n, v in points)
    slope /= sum((n - mean_n) ** 2 for n, _ in points)
    return slope, mean_v - slope * mean_n


@dataclass(frozen=True)
class Projection:
    """A configuration's memory and traffic per process at the target size."""

    config: str
    bytes_per_item: float  # measured added peak a (gathered) item, at DIM
    copies: float  # of that, in copies of a process's embedding bytes per item
    added: float  # projected peak added by compute() per process
    total: float  # added + the process's own stored share
    received: float  # projected embedding bytes received per process


def project(rows: list[dict[str, Any]], name: str) -> Projection | None:
    """Scale a configuration's measured rows to 10M x 1024-d items on 8 processes.

    The added peak, fitted as bytes per item times N, is split into the formula's
    ``BOOKKEEPING_BYTES_PER_ITEM`` of bookkeeping an item (which grows with neither D nor
    the processes) and the rest, which grows with D. The gathered ranking's bookkeeping
    and scratch come out of ``chunk_bytes`` (``formula.chunk_bound``, at the default
    ``chunk_bytes``); the sharded one keeps its bookkeeping beside
    ``SHARDED_SCRATCH_TILES`` tiles of the default ``chunk_bytes`` on a GPU. The
    gathered copy holds every item whatever the number of processes; the sharded
    configuration's embedding terms scale with a process's share of the items
    (N / processes).
    Received bytes: the measured floating-point bytes a process receives, per item
    received, scaled to the target's D and to the items it receives there.
    """
    mine = [r for r in rows if r["config"] == name and r["available"]]
    if len({r["num"] for r in mine}) < 2:
        return None
    world = CONFIGS[name].world
    per_item, _ = fit(mine, "peak")
    bookkeeping = min(float(formula.BOOKKEEPING_BYTES_PER_ITEM), max(per_item, 0.0))  # x N
    embedding = max(per_item - bookkeeping, 0.0)  # x N, grows with D
    # gathered: a copy of every item; sharded: of a process's share (N / processes)
    share = world / TARGET_WORLD if name == "sharded" else 1.0
    widen = TARGET_DIM / DIM
    copy = int(embedding * widen * share * TARGET_ITEMS)
    if name == "sharded":
        tiles = formula.SHARDED_SCRATCH_TILES * formula.DEFAULT_CHUNK_BYTES
        added = float(copy + bookkeeping * TARGET_ITEMS + tiles)
    else:
        chunk = formula.DEFAULT_CHUNK_BYTES
        added = float(formula.chunk_bound(copy, chunk, TARGET_ITEMS, TARGET_DIM))
    stored = TARGET_ITEMS // TARGET_WORLD * TARGET_DIM * 4
    per_received, _ = fit(mine, "received")
    if world > 1:
        # the measured bytes over the items this process did not hold, at the target
        measured_others = 1 - 1 / world
        target_others = 1 - 1 / TARGET_WORLD
        received = per_received / measured_others * target_others * widen * TARGET_ITEMS
    else:
        received = 0.0
    # in copies of the embedding bytes of every item (gathered) or of a share (sharded)
    copies = embedding / (DIM * 4) * (world if name == "sharded" else 1)
    return Projection(name, per_item, copies, added, added + stored, received)


def projection_text(rows: list[dict[str, Any]]) -> str:
    gb = 1e9
    stored_all = TARGET_ITEMS * TARGET_DIM * 4
    stored = stored_all // TARGET_WORLD
    gathered = project(rows, "gathered")
    sharded = project(rows, "sharded")
    sizes = sorted({r["num"] for r in rows if r["available"]})
    text = (
        f"**Projection: {TARGET_ITEMS / 1e6:.0f}M x {TARGET_DIM}-d float32 items on"
        f" {TARGET_WORLD} GPUs** (computed by `benchmarks/scale.py` from the rows above,"
        f" N = {', '.join(f'{n:,}' for n in sizes)}). Each GPU stores its"
        f" {TARGET_ITEMS // TARGET_WORLD:,} items ({stored / gb:.1f} GB; all of them:"
        f" {stored_all / gb:.1f} GB). The measured peak a process's `compute()` adds is"
        " fitted as bytes per item times N; the formula's"
        f" {formula.BOOKKEEPING_BYTES_PER_ITEM} bytes an item of bookkeeping are kept as"
        f" they are, the rest grows with D ({TARGET_DIM} / {DIM}); gathered, the"
        " bookkeeping and scratch come out of the default 256 MiB `chunk_bytes` (or the"
        " least that holds them); sharded, the scratch is"
        f" {formula.SHARDED_SCRATCH_TILES} x that `chunk_bytes` beside the bookkeeping."
    )
    for label, found in (("Gathered", gathered), ("Sharded", sharded)):
        if found is None:
            name = label.lower()
            asked = [r for r in rows if r["config"] == name]
            why = (
                "not measured"
                if not asked
                else "not available in this version"
                if not any(r["available"] for r in asked)
                else "measured at one size"
            )
            text += f" {label}: not projected ({why})."
            continue
        if found.config == "sharded":
            scope = "its embedding terms scale with a process's share of the items"
            whose = "a process's share"
        else:
            scope = "a copy of every item on every process, whatever their number"
            whose = "every item"
        received = (
            f" and each process receives {found.received / gb:.1f} GB of embeddings"
            if found.received
            else ""
        )
        text += (
            f" {label} ({scope}): {found.bytes_per_item:.0f} bytes an item measured at"
            f" D = {DIM}, {found.copies:.2f}x the embedding bytes of {whose} beyond the"
            f" bookkeeping; projected, `compute()` adds {found.added / gb:.1f} GB per GPU,"
            f" {found.total / gb:.1f} GB with the stored share,{received}."
        )
    if gathered is not None and sharded is not None:
        text += (
            f" Sharding takes {sharded.total / gathered.total:.2f}x the memory per GPU"
            f" and moves {sharded.received / max(gathered.received, 1.0):.1f}x the"
            " bytes of the gathered ranking."
        )
    return text


# ------------------------------------------------------------------------ report


def figure(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, config in CONFIGS.items():
        mine = [r for r in rows if r["config"] == name and r["available"]]
        if not mine:
            continue
        sizes = [r["num"] for r in mine]
        left.plot(sizes, [r["seconds"] for r in mine], marker="o", label=config.label)
        right.plot(sizes, [r["peak"] / 2**20 for r in mine], marker="o", label=config.label)
    sizes = sorted({r["num"] for r in rows})
    right.plot(sizes, [n * DIM * 4 / 2**20 for n in sizes], "k--", label="N x D x 4 (every item)")
    left.set(xlabel="items N", ylabel="compute() seconds", xscale="log", yscale="log")
    right.set(xlabel="items N", ylabel="peak added per process (MiB)", xscale="log")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


HEAD = (
    "N",
    "configuration",
    "compute() time",
    "time / pair",
    "peak added / process",
    "bytes / item",
    "x gathered bytes",
    "received / process",
    "same result",
)


def table(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        label = CONFIGS[r["config"]].label
        if not r["available"]:
            cells = ["not available (no `sharded` argument)"] + ["—"] * (len(HEAD) - 3)
            body.append([f"{r['num']:,}", label, *cells])
            continue
        pairs = r["num"] * (r["num"] - 1)
        gathered = r["num"] * DIM * 4
        same = r["same"] and r.get("as_single", True)
        body.append(
            [
                f"{r['num']:,}",
                label,
                f"{r['seconds']:.2f} s",
                f"{r['seconds'] / pairs * 1e9:.2f} ns",
                fmt_bytes(r["peak"]),
                f"{r['peak'] / r['num']:.0f}",
                f"{r['peak'] / gathered:.2f}x",
                fmt_bytes(r["received"] + r["received_other"]),
                "yes" if same else "NO",
            ]
        )
    return markdown_table(HEAD, body)


def run(
    sizes: list[int],
    figure_path: Path | None = None,
    *,
    configs: list[str] | None = None,
    metric: str = METRIC,
    repeats: int = 1,
) -> Section:
    rows = measure(sizes, list(configs or CONFIGS), metric=metric, repeats=repeats)
    plotted = figure_path is not None and figure(rows, figure_path)
    cores = os.cpu_count() or 1
    shared = (
        f" The {PROCESSES} processes share {cores} cores: their times include waiting for one."
        if cores < PROCESSES
        else ""
    )
    text = (
        f"Leave-one-out, cosine, D = {DIM}, `ids=`, `chunk_bytes` {CHUNK // 2**20} MiB, gloo"
        " on 127.0.0.1, one torch thread a process, each process's measured `compute()`"
        " its second (the first, of the same items, pages in the code it runs). Time: the"
        f" slowest process's `compute()` (the least of {repeats}); memory: the largest"
        " peak a process's `compute()` adds; x gathered bytes: that peak over N x D x 4,"
        " one copy of every item; received: the bytes a process's `torch.distributed`"
        " calls receive during `compute()`; same result: every process returns the"
        " one-process values."
        f"{shared}\n\n"
        + table(rows)
        + (f"\n\n![compute() time and memory against N]({figure_path.name})" if plotted else "")
        + "\n\n"
        + projection_text(rows)
    )
    return Section(text)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(str(n) for n in FULL_SIZES))
    parser.add_argument("--configs", default=",".join(CONFIGS), help="from: " + ", ".join(CONFIGS))
    parser.add_argument("--repeats", type=int, default=1, help="timed computes a row (least)")
    parser.add_argument("--results", type=Path, help="write the section here (scale.png beside)")
    parser.add_argument("--metric", default=METRIC, help=argparse.SUPPRESS)  # tests: a fake
    args = parser.parse_args(argv)
    args.sizes = [int(n) for n in args.sizes.split(",")]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    if args.repeats < 1:
        parser.error(f"--repeats: at least 1, got {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    begin = time.perf_counter()
    figure_path = args.results.with_name("scale.png") if args.results else None
    section = run(
        args.sizes, figure_path, configs=args.configs, metric=args.metric, repeats=args.repeats
    )
    command = shlex.join(
        ["python", "benchmarks/scale.py", *(sys.argv[1:] if argv is None else argv)]
    )
    seconds = time.perf_counter() - begin
    body = (
        f"## Large galleries\n\n{section.body}\n\nCommand: `{command}`\n\n(scale: {seconds:.0f} s)"
    )
    print(body)
    if args.results:
        write_section("scale", body, args.results)
        print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
