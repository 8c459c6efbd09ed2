"""Every claim of docs/large-galleries.md, checked against the constants it comes from:
the memory formula (``tests/memory_formula.py``, which ``tests/test_memory.py`` measures
``compute()`` against), the package's defaults, and the scale benchmark's options and
columns (``benchmarks/scale.py``, run in ``tests/test_benchmarks.py``). Change a
constant and these tests name the sentence to rewrite."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import memory_formula as formula

from recall_at_k import EmbeddingRecallAtK
from recall_at_k.ranking import budget

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "large-galleries.md").read_text(encoding="utf-8")
TEXT = " ".join(PAGE.split())  # sentences wrapped over lines, on one line
KiB, MiB = 2**10, 2**20
GPU = 40e9  # the example GPU's memory
TIMES = {1: "once", 2: "twice"}


def _scale() -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("scale")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def section(heading: str) -> str:
    body = PAGE.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return " ".join(body.split())


def test_the_formula_constants_are_the_package_defaults() -> None:
    assert formula.CPU_TILE_BYTES == budget.CPU_TILE_BYTES
    default = inspect.signature(EmbeddingRecallAtK).parameters["chunk_bytes"].default
    assert default == formula.DEFAULT_CHUNK_BYTES


def test_the_page_states_the_tested_formula() -> None:
    assert f"\n    {formula.COPIES} x N x D x 4 bytes " in PAGE
    assert "\n  + chunk_bytes " in PAGE
    per_item = formula.BOOKKEEPING_BYTES_PER_ITEM
    assert f"and {per_item} bytes x N of bookkeeping" in TEXT
    reserved, least_scratch = budget.RESERVED_BYTES // KiB, budget.MIN_SCRATCH_BYTES // KiB
    per_width = budget.ROW_BLOCK_SHARE * budget.MIN_BLOCK_ROWS * 16
    assert f"(and {reserved} KiB for the interpreter and the C heap)" in TEXT
    scratch_per_item = budget.MIN_SCRATCH_BYTES_PER_ITEM
    assert (
        f"the bound needs at least {per_item} bytes x N + {reserved} KiB + the least"
        f" scratch, {least_scratch} KiB (or {scratch_per_item} bytes x N or {per_width:,}"
        " bytes x D, if larger)." in TEXT
    )
    # "256 KiB of scratch ... 800,000 bytes": the least scratch of 100,000 items before
    # and now
    assert budget.min_scratch_bytes(100_000) == 800_000 > budget.MIN_SCRATCH_BYTES == 256 * KiB
    assert "256 KiB of scratch added" in TEXT and "its least scratch now, 800,000 bytes" in TEXT
    assert budget.scratch_bytes(4 * MiB, 100_000) == budget.min_scratch_bytes(100_000)
    least = formula.least_chunk_bytes(100_000, 128)
    before = least - budget.min_scratch_bytes(100_000) + budget.MIN_SCRATCH_BYTES
    assert f"(the least allowed {before / MiB:.1f} MiB, now {least / MiB:.1f} MiB)" in TEXT
    assert f"of that scratch (at least {budget.MIN_BLOCK_ROWS} rows)" in TEXT
    # "with the call on a thread of its own": the probe's; the DDP test's on the thread
    # of the first call
    probe_source = inspect.getsource(importlib.import_module("memory_probe").measure)
    assert "on_own_thread(lambda: compute_and_report(metric))" in probe_source
    assert "with the call on a thread of its own" in TEXT
    memory_test = (ROOT / "tests" / "test_memory.py").read_text(encoding="utf-8")
    assert "in two gloo processes on the thread that made the first call" in TEXT
    worker = memory_test[memory_test.index("def _peak_worker(") :]
    worker = worker[: worker.index("\n\n\n")]
    assert "_compute_and_report(warm)" in worker
    assert "result, report = _compute_and_report(metric)" in worker
    # "The tests allow nothing on top of the bound", each measured call a process's
    # second compute() and protocol_report() of the same items (seed 0, both)
    assert "The tests allow nothing on top of the bound." in TEXT
    assert not hasattr(formula, "SPREAD_BYTES")
    assert 'assert result["peak"] <= bound(result), (' in memory_test
    assert 'assert result["peak"] <= allowed, ' in memory_test
    assert (
        "a process's second `compute()` and `protocol_report()` of the same items, as in a"
        " validation epoch after the first" in TEXT
    )
    assert probe_source.count('items(case["num"], case["dim"], 0, device)') == 2
    assert "compute_and_report(warm)" in probe_source
    assert 'embeddings, labels = items(num, dim, 0, "cpu")' in memory_test
    assert "warm, metric = metrics" in memory_test and "_compute_and_report(warm)" in memory_test
    assert "and the same bound holds under DDP" in TEXT
    for items, width in ((10, 3), (10**6, 1024), (1600, 2048), (24_000, 256), (10**5, 128)):
        least = per_item * items + budget.RESERVED_BYTES
        least += max(budget.MIN_SCRATCH_BYTES, scratch_per_item * items, per_width * width)
        assert formula.least_chunk_bytes(items, width) == least
        for chunk in (1, least, 2 * least):
            assert formula.chunk_bound(1000, chunk, items, width) == 1000 + max(chunk, least)
    # the scratch the ranking takes is what the bookkeeping leaves of chunk_bytes
    least = formula.least_chunk_bytes(24_000, 256)
    assert budget.scratch_bytes(4 * MiB, 24_000) == 4 * MiB - budget.bookkeeping_bytes(24_000)
    assert budget.scratch_bytes(least, 24_000) >= budget.MIN_SCRATCH_BYTES


def test_the_example_adds_up() -> None:
    items, width = 10**6, 1024
    stored = items * width * 4
    default = formula.chunk_bound(stored, formula.DEFAULT_CHUNK_BYTES, items, width)
    smaller = formula.chunk_bound(stored, 160 * MiB, items, width)
    assert formula.least_chunk_bytes(items, width) < 160 * MiB
    assert f"({stored / 1e9:.1f} GB stored)" in TEXT
    terms = (
        f"{stored / 1e9:.1f} GB + {formula.DEFAULT_CHUNK_BYTES // MiB} MiB, about"
        f" {default / 1e9:.1f} GB, on a GPU"
    )
    assert terms in TEXT
    assert f"`chunk_bytes={formula.DEFAULT_CHUNK_BYTES // MiB} * 2**20`" in TEXT
    bookkeeping = formula.BOOKKEEPING_BYTES_PER_ITEM * items
    assert f"their bookkeeping takes {bookkeeping / 1e6:.0f} MB of it." in TEXT
    assert f"`chunk_bytes=160 * 2**20` the peak falls to about {smaller / 1e9:.1f} GB." in TEXT
    assert (
        f"On CPU a tile never exceeds {formula.CPU_TILE_BYTES // MiB} MiB, whatever"
        " `chunk_bytes`." in TEXT
    )


def test_when_to_shard() -> None:
    text = section("When to shard")
    world, width = 8, 1024
    small, large = 10**6, 10**7
    small_copy, large_copy = small * width * 4, large * width * 4
    added = formula.chunk_bound(small_copy, formula.DEFAULT_CHUNK_BYTES, small, width)
    assert f"on {world} GPUs of {GPU / 1e9:.0f} GB" in text
    assert f"one million {width}-d float32 items take a {small_copy / 1e9:.1f} GB copy" in text
    assert f"({added / 1e9:.1f} GB added in all with the default `chunk_bytes`), which fits" in text
    assert added + small_copy / world < GPU
    assert f"ten million take a {large_copy / 1e9:.1f} GB copy on each GPU, which does not" in text
    assert large_copy > GPU
    # the gathered ranking does 1 / SHARDED_PASSES of the sharded one's products and bytes
    assert formula.SHARDED_PASSES == 2
    assert "the gathered ranking computes half the products and receives half the bytes" in text


def test_what_sharding_costs() -> None:
    text = section("What sharding costs")
    passes = TIMES[formula.SHARDED_PASSES]
    assert f"the gallery goes round the processes {passes}:" in text
    assert f"so the products cost {passes} the gathered ranking's" in text
    assert f"receives the gallery's embeddings minus its own share in each pass, {passes}" in text
    items, width, world = 10**7, 1024, 8
    gathered = formula.gathered_bytes_received(items, width, world)
    sharded = formula.ring_bytes_received(items, width, world)
    assert sharded == formula.SHARDED_PASSES * gathered
    assert f"ten million {width}-d float32 items on {world} processes" in text
    assert f"receives {gathered / 1e9:.1f} GB gathered and {sharded / 1e9:.1f} GB sharded" in text


def test_the_sections_and_the_sharded_api_heading() -> None:
    headings = re.findall(r"^## (.+)$", PAGE, re.MULTILINE)
    assert headings == [
        "The memory formula",
        "What it costs under DDP",
        "When to shard",
        "What sharding costs",
        "Sharded gallery",
        "Reading the scale benchmark",
    ]


def test_reading_the_scale_benchmark() -> None:
    scale = _scale()
    text = section("Reading the scale benchmark")
    command = re.search(r"`(python benchmarks/scale\.py[^`]*)`", text)
    assert command is not None
    args = scale.parse(command.group(1).split()[2:])
    assert args.sizes == list(scale.FULL_SIZES) and args.configs == list(scale.CONFIGS)
    assert str(args.results) == "benchmarks/RESULTS.md"
    assert f"at D = {scale.DIM}, N = 20,000, 50,000 and 100,000" in text
    assert scale.FULL_SIZES == (20_000, 50_000, 100_000)
    assert scale.PROCESSES == 4 and "one process, 4 gloo processes gathered, and 4 gloo" in text
    assert set(scale.CONFIGS) == {"single", "gathered", "sharded"}
    assert "Each process runs one torch thread;" in text  # scale._worker sets 1 thread
    assert "torch.set_num_threads(1)" in inspect.getsource(scale._worker)
    for option in ("--sizes", "--configs", "--repeats"):
        assert f"`{option}`" in text
        assert scale.parse([option, {"--configs": "single"}.get(option, "1")])
    assert 'writes the section "Large galleries"' in text and "`scale.png` beside it" in text
    assert '"## Large galleries' in inspect.getsource(scale.main)
    assert 'with_name("scale.png")' in inspect.getsource(scale.main)
    columns = re.findall(r"\*\*([^*]+)\*\*", text)
    assert columns and set(columns) <= set(scale.HEAD), set(columns) - set(scale.HEAD)
    assert set(scale.HEAD) - set(columns) == {"N", "configuration"}
    assert "`N x (N - 1)` scores" in text
    assert 'pairs = r["num"] * (r["num"] - 1)' in inspect.getsource(scale.table)
    assert "ten million 1024-d items on 8 GPUs" in text
    projection = inspect.getsource(scale.project)
    assert "formula.BOOKKEEPING_BYTES_PER_ITEM" in projection
    assert "widen = TARGET_DIM / DIM" in projection
    assert 'share = world / TARGET_WORLD if name == "sharded" else 1.0' in projection
    assert (scale.TARGET_ITEMS, scale.TARGET_DIM, scale.TARGET_WORLD) == (10**7, 1024, 8)


def test_the_sharded_bookkeeping_as_the_scale_benchmark_measured_it() -> None:
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    rows = {}
    for line in results.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 9 and cells[0] == "100,000":
            rows[cells[1]] = cells[6]  # "x gathered bytes"
    sharded, gathered = rows["4 processes, sharded"], rows["4 processes, gathered"]
    text = section("Sharded gallery")
    assert (
        f"sharded `compute()` at 100,000 items on 4 processes added {sharded} the gathered"
        f" embeddings' bytes ({gathered} gathered;" in text
    )
    # "At D = 128 (512 bytes an item) the bookkeeping is what remains": the projection's
    # fitted bytes an item of the sharded configuration, measured at D = 128, lie between
    # the gathered metadata (5 integers an item) and one item's embedding bytes
    fitted = re.search(r"Sharded \(.*?\): (\d+) bytes an item measured at D = 128", results)
    assert fitted is not None and 5 * 8 <= int(fitted.group(1)) < 128 * 4
    assert "(512 bytes an item) the bookkeeping is what remains" in text
    assert "no process copies even its own share" in text
    assert float(sharded.rstrip("x")) <= 1.0  # a fraction of the gathered bytes


def test_the_scale_benchmarks_rows_hold_the_formula() -> None:
    """Every one-process and gathered row of the committed scale run is within the
    formula (one copy of the gathered embeddings plus ``chunk_bytes`` or the least);
    its MiB are rounded to a tenth."""
    scale = _scale()
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    checked = 0
    for line in results.split("<!-- scale:start -->", 1)[1].splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) != 9 or cells[1] not in ("one process", "4 processes, gathered"):
            continue
        items = int(cells[0].replace(",", ""))
        value, unit = cells[4].split()
        assert unit == "MiB", cells
        allowed = formula.chunk_bound(items * scale.DIM * 4, scale.CHUNK, items, scale.DIM)
        assert float(value) * MiB <= allowed + 0.05 * MiB, (cells, allowed / MiB)
        checked += 1
    assert checked == 2 * len(scale.FULL_SIZES)
