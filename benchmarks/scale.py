"""Large galleries: ``EmbeddingRecallAtK.compute()`` time, per-process peak memory and
bytes received against the number of items, in three configurations: one process, 4
gloo processes gathered (every process ranks its queries against a copy of every item)
and 4 gloo processes sharded (``sharded=True``: the gallery passes round the processes
in blocks).

Each process (:func:`measure.call`) runs one torch thread and holds its share of the
items; after a first ``compute()`` of the same items, it measures its own on a thread of
its own (:func:`measure.on_own_thread`). The projection to 10M x 1024-d items on 8 GPUs
comes from the rows and the memory formula (``tests/memory_formula.py``).

Alone: ``python benchmarks/scale.py [--sizes 20000,50000,100000] [--configs
single,gathered,sharded] [--repeats 1] [--results benchmarks/RESULTS.md]``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import memory_formula as formula  # noqa: E402
from measure import Probe, Section, call, fmt_bytes, on_own_thread, write_section  # noqa: E402
from measure import table as markdown_table  # noqa: E402

from recall_at_k import EmbeddingRecallAtK  # noqa: E402

DIM = 128
CHUNK = 4 * 2**20
KS = (1, 5, 10)
PROCESSES = 4
FULL_SIZES = (20_000, 50_000, 100_000)
BATCH = 1000
TARGET_ITEMS, TARGET_DIM, TARGET_WORLD = 10_000_000, 1024, 8  # the projection's
Rows = list[dict[str, Any]]


class Config(NamedTuple):
    label: str
    world: int  # processes
    sharded: bool | None  # None: not passed


CONFIGS = {
    "single": Config("one process", 1, None),
    "gathered": Config(f"{PROCESSES} processes, gathered", PROCESSES, False),
    "sharded": Config(f"{PROCESSES} processes, sharded", PROCESSES, True),
}


@contextlib.contextmanager
def traffic() -> Iterator[dict[str, int]]:
    """Bytes that this process's ``torch.distributed`` calls receive in the block: the
    tensors a collective or a receive fills, less this process's own part (a broadcast
    from it, its slot of a gather); an all-reduce counts its tensor once. Floating-point
    tensors (embeddings, scores) and the others (labels, ids) apart."""
    received = {"floating": 0, "other": 0}

    def add(tensor: torch.Tensor, share: float = 1.0) -> None:
        size = int(tensor.numel() * tensor.element_size() * share)
        received["floating" if tensor.is_floating_point() else "other"] += size

    def count(call: str, a: dict[str, Any]) -> None:  # a: the arguments by name, as passed
        if call == "broadcast":
            src, rank = a.get("group_src"), dist.get_rank(a.get("group"))
            add(a["tensor"], float(a.get("src") != dist.get_rank() if src is None else src != rank))
        elif call == "all_gather":
            for index, part in enumerate(a["tensor_list"]):
                add(part, float(index != dist.get_rank(a.get("group"))))
        elif call == "all_gather_into_tensor":
            add(a["output_tensor"])
            add(a["input_tensor"], -1.0)
        else:  # all_reduce, recv, irecv
            add(a["tensor"])

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def call(*args: Any, **kwargs: Any) -> Any:
            count(name, signature.bind(*args, **kwargs).arguments)
            return original(*args, **kwargs)

        return call

    calls = ("broadcast", "all_gather", "all_gather_into_tensor", "all_reduce", "recv", "irecv")
    with contextlib.ExitStack() as stack:
        for name in calls:
            stack.enter_context(mock.patch.object(dist, name, counted(name, getattr(dist, name))))
        yield received


def _worker(num: int, repeats: int, sharded: bool | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    options = {"chunk_bytes": CHUNK, "compute_with_cache": False}
    options.update({} if sharded is None else {"sharded": sharded})
    gen = torch.Generator().manual_seed(0)
    embeddings = torch.randn(num, DIM, generator=gen)
    labels = torch.randint(0, max(1, num // 10), (num,), generator=gen)
    ids = torch.arange(num)
    mine = slice(num * rank // world, num * (rank + 1) // world)
    # A first compute() of the same items and options on every process, unmeasured: the
    # code the measured one runs is then paged in, and torch.distributed's buffers for
    # the first collectives are in place.
    warm, measured = EmbeddingRecallAtK(KS, **options), EmbeddingRecallAtK(KS, **options)
    warm.update(embeddings[mine], labels[mine], ids=ids[mine])
    warm.compute()
    for first in range(mine.start, mine.stop, BATCH):
        rows = slice(first, min(mine.stop, first + BATCH))
        measured.update(embeddings[rows], labels[rows], ids=ids[rows])
    del embeddings, labels, ids, warm
    probes = [Probe("cpu") for _ in range(repeats)]
    for probe in probes:
        dist.barrier()
        if probe is probes[0]:  # on a thread of its own, as the memory tests measure it
            with probe.window(), traffic() as received, probe.timed():
                result = on_own_thread(measured.compute)
        else:
            with probe.timed():
                measured.compute()
    return {
        "seconds": min(probe.seconds for probe in probes),
        "peak": probes[0].peak_bytes,
        "received": received["floating"],
        "received_other": received["other"],
        "values": {key: float(value) for key, value in result.items()},
    }


def measure(sizes: list[int], configs: list[str], repeats: int = 1) -> Rows:
    """A row per (size, configuration): the slowest process's time and the largest peak
    and bytes received; whether every process returns the one-process values."""
    rows: Rows = []
    for num in sizes:
        for name in configs:
            world, sharded = CONFIGS[name].world, CONFIGS[name].sharded
            kwargs = {"num": num, "repeats": repeats, "sharded": sharded}
            parts = call(_worker, kwargs, world=world) or []
            row = {"num": num, "config": name, "world": world, "sharded": sharded}
            row |= {key: max(p[key] for p in parts) for key in ("seconds", "peak", "received")}
            row["received_other"] = max(p["received_other"] for p in parts)
            row["same"] = all(p["values"] == parts[0]["values"] for p in parts)
            rows.append({**row, "values": parts[0]["values"]})
    single = {r["num"]: r["values"] for r in rows if r["config"] == "single"}
    for r in rows:
        r["as_single"] = r["values"] == single.get(r["num"], r["values"])
    return rows


def slope(rows: Rows, key: str) -> float:
    """Least squares: ``key`` a further item (over rows of two sizes or more)."""
    return statistics.linear_regression([r["num"] for r in rows], [r[key] for r in rows]).slope


class Projection(NamedTuple):
    """A configuration's memory and traffic per process at the target size."""

    config: str
    bytes_per_item: float  # measured added peak a (gathered) item, at DIM
    copies: float  # of that, in copies of a process's embedding bytes per item
    added: float  # projected peak added by compute() per process
    total: float  # added + the process's own stored share
    received: float  # projected embedding bytes received per process


def project(rows: Rows, name: str) -> Projection | None:
    """Scale a configuration's measured rows to 10M x 1024-d items on 8 processes: the
    added peak, fitted as bytes an item times N, is the formula's bookkeeping an item
    (which grows with neither D nor the processes) and the rest, which grows with D and,
    sharded, with a process's share of the items. The gathered ranking's bookkeeping and
    scratch come out of the default ``chunk_bytes`` (``formula.chunk_bound``); the sharded
    one keeps ``SHARDED_SCRATCH_TILES`` tiles of it beside its bookkeeping. Received: the
    measured bytes an item received, at the target's D and items received."""
    mine = [r for r in rows if r["config"] == name]
    if len({r["num"] for r in mine}) < 2:
        return None
    world = CONFIGS[name].world
    per_item = slope(mine, "peak")
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
    # the measured bytes over the items this process did not hold, at the target
    others = (1 - 1 / TARGET_WORLD) / (1 - 1 / world) if world > 1 else 0.0
    received = slope(mine, "received") * others * widen * TARGET_ITEMS
    # in copies of the embedding bytes of every item (gathered) or of a share (sharded)
    copies = embedding / (DIM * 4) * (world if name == "sharded" else 1)
    return Projection(name, per_item, copies, added, added + stored, received)


def projection_text(rows: Rows) -> str:
    gb, stored_all = 1e9, TARGET_ITEMS * TARGET_DIM * 4
    stored = stored_all // TARGET_WORLD
    gathered, sharded = project(rows, "gathered"), project(rows, "sharded")
    sizes = sorted({r["num"] for r in rows})
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
    every = "a copy of every item on every process, whatever their number"
    share = "its embedding terms scale with a process's share of the items"
    scopes = {"gathered": (every, "every item"), "sharded": (share, "a process's share")}
    for name, found in (("gathered", gathered), ("sharded", sharded)):
        if found is None:
            asked = any(r["config"] == name for r in rows)
            why = "measured at one size" if asked else "not measured"
            text += f" {name.title()}: not projected ({why})."
            continue
        scope, whose = scopes[name]
        text += (
            f" {name.title()} ({scope}): {found.bytes_per_item:.0f} bytes an item measured at"
            f" D = {DIM}, {found.copies:.2f}x the embedding bytes of {whose} beyond the"
            f" bookkeeping; projected, `compute()` adds {found.added / gb:.1f} GB per GPU,"
            f" {found.total / gb:.1f} GB with the stored share"
        )
        received = f", and each process receives {found.received / gb:.1f} GB of embeddings"
        text += (received if found.received else "") + "."
    if gathered is not None and sharded is not None:
        text += (
            f" Sharding takes {sharded.total / gathered.total:.2f}x the memory per GPU"
            f" and moves {sharded.received / max(gathered.received, 1.0):.1f}x the"
            " bytes of the gathered ranking."
        )
    return text


def plot(rows: Rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, config in CONFIGS.items():
        mine = [r for r in rows if r["config"] == name]
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


HEAD = ("N", "configuration", "compute() time", "time / pair", "peak added / process")
HEAD += ("bytes / item", "x gathered bytes", "received / process", "same result")


def table(rows: Rows) -> str:
    body = []
    for r in rows:
        pairs = r["num"] * (r["num"] - 1)
        cells = [f"{r['num']:,}", CONFIGS[r["config"]].label, f"{r['seconds']:.2f} s"]
        cells += [
            f"{r['seconds'] / pairs * 1e9:.2f} ns",
            fmt_bytes(r["peak"]),
            f"{r['peak'] / r['num']:.0f}",
        ]
        cells += [
            f"{r['peak'] / (r['num'] * DIM * 4):.2f}x",
            fmt_bytes(r["received"] + r["received_other"]),
        ]
        body.append([*cells, "yes" if r["same"] and r["as_single"] else "NO"])
    return markdown_table(HEAD, body)


def run(
    sizes: list[int],
    figure: Path | None = None,
    configs: Sequence[str] = CONFIGS,
    repeats: int = 1,
    **_: object,
) -> Section:
    """The rows at ``sizes``, their table, the figure at ``figure`` (if any), the projection."""
    rows = measure(sizes, list(configs), repeats)
    text = (
        f"Leave-one-out, cosine, D = {DIM}, `ids=`, `chunk_bytes` {CHUNK // 2**20} MiB, gloo"
        " on 127.0.0.1, one torch thread a process, each process's measured `compute()`"
        " its second (the first, of the same items, pages in the code it runs). Time: the"
        f" slowest process's `compute()` (the least of {repeats}); memory: the largest"
        " peak a process's `compute()` adds; x gathered bytes: that peak over N x D x 4,"
        " one copy of every item; received: the bytes a process's `torch.distributed`"
        " calls receive during `compute()`; same result: every process returns the"
        " one-process values."
    )
    if (cores := os.cpu_count() or 1) < PROCESSES:
        text += f" The {PROCESSES} processes share {cores} cores: their times include waiting."
    text += f"\n\n{table(rows)}"
    if figure is not None:
        plot(rows, figure)
        text += f"\n\n![compute() time and memory against N]({figure.name})"
    return f"{text}\n\n{projection_text(rows)}", {}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(str(n) for n in FULL_SIZES))
    parser.add_argument("--configs", default=",".join(CONFIGS), help="from: " + ", ".join(CONFIGS))
    parser.add_argument("--repeats", type=int, default=1, help="timed computes a row (least)")
    parser.add_argument("--results", type=Path, help="write the section here (scale.png beside)")
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
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    begin = time.perf_counter()
    figure = args.results.with_name("scale.png") if args.results else None
    section, _ = run(args.sizes, figure, args.configs, args.repeats)
    command = shlex.join(["python", "benchmarks/scale.py", *argv])
    seconds = time.perf_counter() - begin
    body = f"## Large galleries\n\n{section}\n\nCommand: `{command}`\n\n(scale: {seconds:.0f} s)"
    print(body)
    if args.results:
        write_section("scale", body, args.results)
        print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
