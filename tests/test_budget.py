"""The one budget: what a ranking holds at once, by share of ``chunk_bytes``, adds up to
at most ``chunk_bytes`` beside the one copy of the embeddings and the per-item
bookkeeping (``tests/test_memory.py`` measures the same bound on resident memory)."""

from __future__ import annotations

import pytest

from recall_at_k.ranking import budget

MiB = 2**20


@pytest.mark.parametrize("items", [1, 100, 24_000, 96_000, 1_000_000, 10_000_000])
@pytest.mark.parametrize("width", [1, 64, 256, 2048])
@pytest.mark.parametrize("chunk_bytes", [None, 4 * MiB, 32 * MiB, 256 * MiB, 8 * 2**30])
@pytest.mark.parametrize("sharded", [False, True])
def test_the_shares_of_a_compute_add_up_to_at_most_chunk_bytes(
    items: int, width: int, chunk_bytes: int | None, sharded: bool
) -> None:
    least = budget.least_chunk_bytes(items, width)
    chunk = least if chunk_bytes is None else chunk_bytes
    sizes = budget.budget(chunk, items, width)
    shares = sizes.shares(sharded)
    assert all(value >= 0 for value in shares.values())
    # Below the least chunk_bytes the ranking takes up to the least scratch (a run of
    # RUN_MIN_ROWS rows); at or above it, the scratch holds every share.
    least_scratch = least - budget.bookkeeping_bytes(items)
    assert sum(shares.values()) <= (
        sizes.scratch if chunk >= least else max(sizes.scratch, least_scratch)
    )
    # The scratch and the bookkeeping fill chunk_bytes, or the least chunk_bytes the
    # items need (a smaller chunk_bytes is raised to it).
    assert budget.bookkeeping_bytes(items) + sizes.scratch <= max(chunk, least)
    # Every block a ranking takes is one of the shares.
    assert sizes.tile_bytes <= shares["tiles"]
    assert sizes.pending_bytes <= shares["pending"]
    assert sizes.canonical_bytes <= shares["decisions"]
    assert (2 * sizes.run_bytes if sharded else 0) <= shares["run"]


def test_the_least_chunk_bytes_holds_row_blocks_of_the_least_rows() -> None:
    for items, width in [(100_000, 128), (24_000, 256), (10, 4096)]:
        least = budget.least_chunk_bytes(items, width)
        sizes = budget.budget(least, items, width)
        assert sizes.row_block_rows() >= budget.MIN_BLOCK_ROWS
        assert sizes.scratch >= budget.min_scratch_bytes(items)


SIZE_SUFFIXES = ("_BYTES", "_SHARE", "_ROWS", "_BATCH", "_CHUNK", "_ITEMS", "_PAIRS", "_TERMS")
SIZE_SUFFIXES += ("_BLOCK", "_TARGETS", "_COLUMNS")
SCHEMA_WIDTHS = ("META_COLUMNS",)  # the flat metadata's columns: a layout, not a size


def test_no_module_but_the_budget_defines_a_size() -> None:
    """Every byte, share, row or item count the package works in is a constant of
    :mod:`recall_at_k.ranking.budget`: no other module assigns a number to a name that
    says it is a size (module level or in a class)."""
    import ast
    from pathlib import Path

    import recall_at_k

    root = Path(recall_at_k.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "budget.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.Assign, ast.AnnAssign)):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            numeric = node.value is not None and not any(
                isinstance(n, (ast.Name, ast.Attribute, ast.Call)) for n in ast.walk(node.value)
            )
            sized = [
                n for n in names if n.upper() == n and f"_{n.lstrip('_')}".endswith(SIZE_SUFFIXES)
            ]
            sized = [n for n in sized if n not in SCHEMA_WIDTHS]
            if sized and numeric:
                found.append(f"{path.relative_to(root)}: {sized}")
    assert not found, found
    sizes = [name for name in vars(budget) if name.endswith(SIZE_SUFFIXES)]
    assert {"PAIRED_TERMS", "DENSE_SMALL_BATCH", "AUDIT_HASH_DIM_BLOCK"} <= set(sizes)


def test_the_least_chunk_bytes_holds_runs_of_the_least_rows() -> None:
    """A sharded gallery passes by in runs of at least ``RUN_MIN_ROWS`` float32 rows, which
    the run's share of the least ``chunk_bytes`` holds (below it, the runs take more)."""
    for items, width in [(100_000, 128), (24_000, 256), (2_000, 2048), (10, 4096)]:
        least = budget.budget(budget.least_chunk_bytes(items, width), items, width)
        assert least.run_bytes == least.scratch // budget.RUN_SHARE
        assert least.run_bytes >= budget.RUN_MIN_ROWS * 4 * width
        small = budget.budget(2**19, items, width)
        assert small.run_bytes >= budget.RUN_MIN_ROWS * 4 * width
