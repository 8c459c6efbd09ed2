"""``EmbeddingRecallAtK(sharded=True)``: a gallery sharded across real gloo processes gives
bit for bit the one-process result, protocol report, confidence intervals and per-query
outcomes.

Each spawn runs a batch of scenarios (every process holds its own share of the items; a
scenario's items are stored in rank order, as a gather would order them); the parent
runs one process on the same items in that order and compares with ``torch.equal`` /
``==``. Scenarios: leave-one-out, query/gallery, bidirectional, ids with padded repeats
on other processes, groups with both exclude rules, every tie policy and similarity,
uneven shares, a process without items, bitwise and rounding copies planted, a process
group covering two of three processes, and a ``chunk_bytes`` small enough that the
gallery passes by a row or two at a time.
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from embedding_reference import (
    KS,
    SCENARIOS,
    Batch,
    reference_embedding_recall,
    signs,
    small_ints,
    split,
)
from helpers import TIES, assert_recall_close, run_distributed
from memory_probe import ENV, TIMEOUT_S
from torch import Tensor

from recall_at_k import EmbeddingRecallAtK
from recall_at_k.ranking import engine as _engine
from recall_at_k.ranking.stored import BroadcastRows

NEAR = {"cosine": 0.75, "dot": 3.0, "euclidean": -2.0}
"""A near-duplicate threshold per similarity that some pairs of the scenarios reach."""


def _planted_copies() -> tuple[list[Batch], dict[str, Any]]:
    """Leave-one-out with bitwise copies and copies equal up to rounding (another
    sample each), of the same and of other labels."""
    g = torch.Generator().manual_seed(21)
    emb = signs(40, 16, g) * 0.37
    labels = torch.randint(0, 4, (40,), generator=g)
    emb[30:34] = emb[:4]  # bitwise copies
    emb[34:38] = emb[4:8] * (1 + 2.0**-20)  # copies up to rounding
    labels[32] = (labels[2] + 1) % 4  # a copy of another label
    return split(emb, labels, [12, 28]), {"similarity": "cosine"}


def _large_groups() -> tuple[list[Batch], dict[str, Any]]:
    """Query/gallery, same-label-and-group junk, few wide classes (dense-mask route in
    one process), euclidean on integer vectors (ties)."""
    g = torch.Generator().manual_seed(22)
    q_emb, g_emb = small_ints(18, 3, g), small_ints(50, 3, g)
    q_lab, g_lab = torch.randint(0, 2, (18,), generator=g), torch.randint(0, 2, (50,), generator=g)
    q_grp, g_grp = torch.randint(0, 2, (18,), generator=g), torch.randint(0, 2, (50,), generator=g)
    batches = [
        Batch(g_emb[:25], g_lab[:25], "gallery", g_grp[:25]),
        Batch(q_emb, q_lab, "query", q_grp),
        Batch(g_emb[25:], g_lab[25:], "gallery", g_grp[25:]),
    ]
    return batches, {"similarity": "euclidean", "exclude": "same_label_and_group"}


def _offset_euclidean() -> tuple[list[Batch], dict[str, Any]]:
    """Leave-one-out, euclidean, integer vectors moved by 3,000 (ties; the fast path
    centres them)."""
    g = torch.Generator().manual_seed(23)
    emb = small_ints(36, 4, g) + 3000.0
    labels = torch.randint(0, 4, (36,), generator=g)
    return split(emb, labels, [20, 16]), {"similarity": "euclidean"}


def _mixed_dtypes() -> tuple[list[Batch], dict[str, Any]]:
    """One batch of float64 embeddings among float32 ones: all ranked in float64."""
    g = torch.Generator().manual_seed(24)
    emb = signs(30, 16, g) + torch.randn(30, 16, generator=g).round(decimals=1)
    labels = torch.randint(0, 3, (30,), generator=g)
    batches = split(emb, labels, [10, 10, 10])
    wide = batches[1]
    batches[1] = Batch(wide.embeddings.double(), wide.labels)
    return batches, {"similarity": "dot"}


SCENARIO_NAMES = [name for name in SCENARIOS if name != "callable_similarity"]
EXTRA = {
    "planted_copies": _planted_copies,
    "large_groups": _large_groups,
    "offset_euclidean": _offset_euclidean,
    "mixed_dtypes": _mixed_dtypes,
}


def _scenario(name: str) -> tuple[list[Batch], dict[str, Any]]:
    return EXTRA[name]() if name in EXTRA else SCENARIOS[name]()


def _owners(num: int, world: int, layout: str, seed: int) -> Tensor:
    """The process of each item: round robin (``"even"``), random shares of unequal
    sizes (``"uneven"``), as ``"uneven"`` with the last process given nothing, or the
    whole batch to one process (``"by_batch"``)."""
    if layout == "even":
        return torch.arange(num) % world
    if layout == "by_batch":  # seed counts the batches: batch i goes to process i % world
        return torch.full((num,), seed % world)
    g = torch.Generator().manual_seed(seed)
    holders = world - 1 if layout == "empty_last" else world
    weights = torch.tensor([float(2**r) for r in range(holders)])
    return torch.multinomial(weights, num, replacement=True, generator=g)


def _shares(batches: Sequence[Batch], world: int, layout: str, seed: int) -> list[list[Batch]]:
    """Each process's batches: every batch split by :func:`_owners`."""
    shares: list[list[Batch]] = [[] for _ in range(world)]
    for index, batch in enumerate(batches):
        owners = _owners(batch.embeddings.shape[0], world, layout, seed + index)
        for rank in range(world):
            rows = (owners == rank).nonzero().view(-1)
            if rows.numel():
                shares[rank].append(batch.take(rows))
    return shares


def _options(name: str, ties: str, chunk_bytes: int) -> tuple[list[Batch], dict[str, Any]]:
    batches, kwargs = _scenario(name)
    similarity = kwargs.get("similarity", "cosine")
    options = {
        **kwargs,
        "ties": ties,
        "chunk_bytes": chunk_bytes,
        "near_duplicate": NEAR[similarity],
    }
    return batches, options


CASES = [
    # (scenario, ties, chunk_bytes, layout): every scenario, each tie policy somewhere,
    # tiny blocks (a row or two a run) and larger ones.
    *[
        (name, TIES[i % 3], 64 if i % 2 else 4096, "uneven")
        for i, name in enumerate(SCENARIO_NAMES)
    ],
    *[
        (name, ties, 128, "even")
        for name in ("leave_one_out_tied_dot", "planted_copies")
        for ties in TIES
    ],
    ("large_groups", "expected", 96, "uneven"),
    ("offset_euclidean", "expected", 64, "uneven"),
    ("mixed_dtypes", "pessimistic", 256, "by_batch"),
    ("cross_modal", "pessimistic", 64, "even"),
    ("leave_one_out_tied_euclidean", "optimistic", 2**20, "empty_last"),
    ("query_gallery_junk", "expected", 64, "empty_last"),
]


def _outcome(metric: EmbeddingRecallAtK[Any]) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = metric.compute()
        report = metric.protocol_report()
        interval = metric.confidence_interval()
        try:
            outcomes = metric.query_outcomes()
        except ValueError as err:  # ids given to some queries only: an error, alike
            outcomes = None
            per_query: Any = str(err)
    if outcomes is not None:
        per_query = (
            {key: value._asdict() for key, value in outcomes.items()}
            if isinstance(outcomes, dict)
            else outcomes._asdict()
        )
    return {"result": result, "report": report, "interval": interval, "outcomes": per_query}


def _metric(shares: list[Batch], options: dict[str, Any], **extra: Any) -> EmbeddingRecallAtK[Any]:
    metric: EmbeddingRecallAtK[Any] = EmbeddingRecallAtK(KS, **options, **extra)
    for batch in shares:
        metric.update(batch.embeddings, batch.labels, **batch.kwargs())
    return metric


def _worker(rank: int, world: int, payload: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for case in payload["cases"]:
        name, ties, chunk_bytes, layout = case
        batches, options = _options(name, ties, chunk_bytes)
        shares = _shares(batches, world, layout, seed=len(out))
        metric = _metric(shares[rank], options, sharded=True)
        outcome = _outcome(metric)
        outcome["ranked"] = dict(metric.last_compute_num_queries_ranked)
        out[repr(case)] = outcome
    if payload.get("extras"):
        out.update(_extras(rank, world))
    return out


def _extras(rank: int, world: int) -> dict[str, Any]:
    """A process group of two of the three processes, a progress bar, the blocks read."""
    out: dict[str, Any] = {}
    batches, options = _options("leave_one_out_tied_cosine", "expected", 64)
    subgroup = dist.new_group([0, 1])
    if rank in (0, 1):
        shares = _shares(batches, 2, "uneven", seed=5)
        metric = _metric(shares[rank], options, sharded=True, process_group=subgroup)
        out["subgroup"] = _outcome(metric)
    shares = _shares(batches, world, "even", seed=6)
    metric = _metric(shares[rank], options, sharded=True, progress=True)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        metric.compute()
    out["progress"] = stderr.getvalue()
    # The gallery passes by twice, in blocks of at most a tile.
    blocks: list[tuple[int, int]] = []
    plain = BroadcastRows.broadcast

    def broadcast(self: BroadcastRows, rows: int, *args: Any) -> Any:
        blocks.append((rows, self.shape[1] * self.dtype.itemsize))
        return plain(self, rows, *args)

    BroadcastRows.broadcast = broadcast  # type: ignore[method-assign]
    try:
        batches, options = _options("leave_one_out_tied_dot", "pessimistic", 256)
        shares = _shares(batches, world, "even", seed=7)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            _metric(shares[rank], options, sharded=True).compute()
    finally:
        BroadcastRows.broadcast = plain  # type: ignore[method-assign]
    out["blocks"] = blocks
    # A failure on one process: every process raises, none waits forever.
    failing = _metric(shares[rank], options, sharded=True)
    positives = _engine.positives

    def broken(*args: Any) -> None:
        raise RuntimeError("a failure on process 1")

    if rank == 1:
        _engine.positives = broken  # type: ignore[assignment]
    try:
        failing.compute()
    except RuntimeError as err:
        out["failure"] = str(err)
    finally:
        _engine.positives = positives
    # The audit's warning points at the line that called compute().
    batches, options = _options("planted_copies", "pessimistic", 128)
    warned = _metric(_shares(batches, world, "even", seed=8)[rank], options, sharded=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warned.compute()
    out["warned_at"] = [w.filename for w in caught if "protocol_report()" in str(w.message)]
    return out


def _one_process(batches: list[Batch], options: dict[str, Any]) -> dict[str, Any]:
    return _outcome(_metric(batches, options))


def _same(got: Any, want: Any) -> bool:
    """Bit for bit: tensors by ``torch.equal`` (NaN where NaN), dicts key by key."""
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(_same(got[k], want[k]) for k in want)
        )
    if isinstance(want, Tensor):
        return (
            isinstance(got, Tensor)
            and got.dtype == want.dtype
            and torch.equal(got.isnan(), want.isnan())
            and torch.equal(got.nan_to_num(), want.nan_to_num())
        )
    return bool(got == want)


def _check(results: list[dict[str, Any]], cases: list[tuple[Any, ...]], world: int) -> None:
    for case in cases:
        name, ties, chunk_bytes, layout = case
        batches, options = _options(name, ties, chunk_bytes)
        shares = _shares(batches, world, layout, seed=cases.index(case))
        in_rank_order = [batch for share in shares for batch in share]
        want = _one_process(in_rank_order, options)
        for rank, result in enumerate(results):
            got = result[repr(case)]
            for part in ("result", "report", "interval", "outcomes"):
                assert _same(got[part], want[part]), (case, rank, part, got[part], want[part])
        # every query ranked once, on the process that holds it
        ranked = [result[repr(case)]["ranked"] for result in results]
        totals = {key: sum(r[key] for r in ranked) for key in ranked[0]}
        queries = want["report"].get("queries")
        if queries is not None:
            assert sum(totals.values()) == queries, (case, totals, queries)
        if layout == "empty_last":  # a process holding no item ranks no query
            assert sum(ranked[-1].values()) == 0, (case, ranked)
        # and the brute-force reference (float64 scores; the tied data are exact)
        if name != "leave_one_out_continuous":
            reference = {
                k: v for k, v in options.items() if k not in ("chunk_bytes", "near_duplicate")
            }
            expected = reference_embedding_recall(in_rank_order, KS, **reference)
            assert_recall_close(want["result"], expected, where=case)


@pytest.fixture(scope="module")
def two_processes() -> list[dict[str, Any]]:
    return run_distributed(_worker, world_size=2, payload={"cases": CASES})


THREE = [
    ("leave_one_out_padded_ids", "pessimistic", 64, "uneven"),
    ("mixed_roles_with_ids", "expected", 128, "empty_last"),
    ("query_gallery_same_group", "optimistic", 64, "even"),
    ("planted_copies", "expected", 256, "uneven"),
]


@pytest.fixture(scope="module")
def three_processes() -> list[dict[str, Any]]:
    return run_distributed(_worker, world_size=3, payload={"cases": THREE, "extras": True})


@pytest.mark.ddp
def test_two_processes_equal_one_process_bit_for_bit(two_processes: list[dict[str, Any]]) -> None:
    _check(two_processes, CASES, 2)


@pytest.mark.ddp
@pytest.mark.slow
def test_three_processes_equal_one_process_bit_for_bit(
    three_processes: list[dict[str, Any]],
) -> None:
    _check(three_processes, THREE, 3)


@pytest.mark.slow
@pytest.mark.ddp
def test_a_process_group_of_two_of_three_processes(three_processes: list[dict[str, Any]]) -> None:
    batches, options = _options("leave_one_out_tied_cosine", "expected", 64)
    shares = _shares(batches, 2, "uneven", seed=5)
    want = _one_process([batch for share in shares for batch in share], options)
    for rank in (0, 1):
        got = three_processes[rank]["subgroup"]
        for part in ("result", "report", "interval", "outcomes"):
            assert _same(got[part], want[part]), (rank, part)
    assert "subgroup" not in three_processes[2]


@pytest.mark.ddp
def test_progress_bar_over_blocks_on_rank_zero_only(three_processes: list[dict[str, Any]]) -> None:
    assert "sharded gallery" in three_processes[0]["progress"]
    assert "block" in three_processes[0]["progress"]
    assert three_processes[1]["progress"] == ""
    assert three_processes[2]["progress"] == ""


@pytest.mark.ddp
def test_the_gallery_passes_by_twice_in_blocks_of_at_most_a_tile(
    three_processes: list[dict[str, Any]],
) -> None:
    for result in three_processes:
        assert len(result["blocks"]) == 2  # positives, negatives: the only reads of the rows
        for rows, row_bytes in result["blocks"]:
            assert rows * row_bytes <= 256  # the chunk_bytes of that metric


@pytest.mark.ddp
def test_a_failure_on_one_process_raises_on_every_process(
    three_processes: list[dict[str, Any]],
) -> None:
    assert three_processes[1]["failure"] == "a failure on process 1"
    for rank in (0, 2):
        assert "failed on another process" in three_processes[rank]["failure"]


@pytest.mark.ddp
def test_the_audit_warning_points_at_the_caller_of_compute(
    three_processes: list[dict[str, Any]],
) -> None:
    assert [result["warned_at"] for result in three_processes] == [[__file__]] * 3


def test_sharded_is_off_by_default() -> None:
    assert EmbeddingRecallAtK(KS).sharded is False


def test_the_large_galleries_page_states_the_tested_memory() -> None:
    page = " ".join(
        (Path(__file__).resolve().parents[1] / "docs" / "large-galleries.md").read_text().split()
    )
    assert "## Sharded gallery" in page
    assert f"within {MEMORY_SHARE}x the gathered embeddings' bytes" in page
    assert f"about {MEMORY_TILES} tiles and {MEMORY_FIXED // 2**20} MiB of fixed buffers" in page
    assert "with 4 processes" in page and "the default, `sharded=False`" in page
    assert (
        f"with 4 processes, {NARROW_NUM:,} items and `chunk_bytes` {NARROW_CHUNK // 2**20} MiB,"
        " `tests/test_sharded.py` measures `compute()` and `protocol_report()` together"
        f" within {NARROW_SHARE}x the gathered embeddings' bytes, everything included"
    ) in page
    assert f"At `D = {NARROW_DIM}` ({NARROW_DIM * 4} bytes an item)" in page


@pytest.mark.ddp
def test_planted_copies_are_in_the_report(two_processes: list[dict[str, Any]]) -> None:
    """The audit's scenario finds what was planted (so the comparison compares something)."""
    case = ("planted_copies", "pessimistic", 128, "even")
    report = two_processes[0][repr(case)]["report"]
    assert report["duplicate_gallery_items"] >= 4
    assert report["rounding_duplicate_gallery_items"] >= 4
    assert report["identical_negative"] >= 1
    assert report["near_positive"] >= 1


def test_sharded_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="`sharded` must be a bool"):
        EmbeddingRecallAtK(KS, sharded="yes")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="`sharded` must be a bool"):
        EmbeddingRecallAtK(KS, sharded=1)  # type: ignore[call-overload]


def test_sharded_with_a_callable_similarity_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"`sharded=True` needs a built-in `similarity`"):
        EmbeddingRecallAtK(KS, similarity=lambda q, g: q @ g.T, sharded=True)
    EmbeddingRecallAtK(KS, similarity=lambda q, g: q @ g.T, sharded=False)


def test_one_process_ignores_sharded() -> None:
    batches, options = _options("cross_modal", "expected", 64)
    sharded = _metric(batches, options, sharded=True)
    plain = _metric(batches, options)
    assert _same(_outcome(sharded), _outcome(plain))
    assert sharded.query_outcomes() is not None  # ranked as without sharding
    assert math.isfinite(float(sharded.compute()["i2t/recall@1"]))


# ---------------------------------------------------------------- memory

MEMORY_NUM, MEMORY_DIM, MEMORY_CHUNK = 2000, 2048, 2**19  # 15.6 MiB gathered
MEMORY_SHARE = 0.6
"""The peak that ``compute()`` (then ``protocol_report()``) adds on each of 4 processes,
as a share of the gathered embeddings' bytes, beyond a few tiles and fixed buffers (:func:`_allowed`)."""
MEMORY_TILES = 4
"""Tiles of ``chunk_bytes`` a sharded ranking holds: the run of gallery rows received,
prepared, its fast scores (float32 and float64) and masks."""
MEMORY_FIXED = 2 * 2**20
"""Buffers of a fixed size: rows prepared and re-scored canonically a MiB at a time."""


def _allowed(gathered: int) -> float:
    return MEMORY_SHARE * gathered + MEMORY_TILES * MEMORY_CHUNK + MEMORY_FIXED


def _warm_up(options: dict[str, Any], dim: int, rank: int, world: int) -> None:
    """One small sharded compute() first, so that the measured one finds the process
    group, the allocator and the BLAS warm (its own memory is freed before the mark)."""
    from memory_probe import items

    warm_items, warm_labels = items(400, dim, 1, "cpu")
    part = slice(400 * rank // world, 400 * (rank + 1) // world)
    warm = EmbeddingRecallAtK((1, 5, 10), **options)
    warm.update(warm_items[part], warm_labels[part], ids=torch.arange(400)[part])
    warm.compute()


def _memory_worker(rank: int, world: int, payload: dict[str, Any]) -> dict[str, Any]:
    """Each process holds a quarter of the items (with ids): the peak ``compute()`` and
    ``protocol_report()`` add, and within it the peak of the ranking alone, after the
    audit (its window starts as the ranking does: ``start`` hands freed memory back and
    resets the mark; the whole window's peak is the larger of the two windows')."""
    from memory_probe import items, peak_since, start

    from recall_at_k.ranking import engine

    torch.set_num_threads(1)
    num, dim = payload["num"], payload["dim"]
    options = {"chunk_bytes": payload["chunk"], "sharded": True, "near_duplicate": 0.5}
    _warm_up(options, dim, rank, world)
    embeddings, labels = items(num, dim, 0, "cpu")
    mine = slice(num * rank // world, num * (rank + 1) // world)
    metric = EmbeddingRecallAtK((1, 5, 10), **options)
    metric.update(embeddings[mine], labels[mine], ids=torch.arange(num)[mine])
    del embeddings, labels
    peaks = {"before": 0, "ranking": 0}
    plain = engine.rank

    def measured(*args: Any, **kwargs: Any) -> Any:
        peaks["before"] = max(peaks["before"], peak_since("cpu", baseline))
        before = start("cpu")
        try:
            return plain(*args, **kwargs)
        finally:
            peaks["ranking"] = max(peaks["ranking"], peak_since("cpu", before))

    baseline = start("cpu")
    engine.rank = measured  # type: ignore[assignment]
    try:
        result = metric.compute()
    finally:
        engine.rank = plain  # type: ignore[assignment]
    report = metric.protocol_report()
    whole = max(peaks["before"], peak_since("cpu", baseline))
    return {"whole": whole, "ranking": peaks["ranking"], "result": result, "report": report}


@pytest.fixture(scope="module")
def memory(monkeypatch_module: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to measure the resident set")
    for name, value in ENV.items():
        monkeypatch_module.setenv(name, value)  # inherited by the spawned processes
    payload = {"num": MEMORY_NUM, "dim": MEMORY_DIM, "chunk": MEMORY_CHUNK}
    # Fresh processes: they measure their own resident set, with ENV from their start;
    # four of them on a small machine may take minutes (memory_probe.TIMEOUT_S).
    return run_distributed(_memory_worker, 4, payload, fresh=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _memory_single() -> tuple[Any, Any]:
    from memory_probe import items

    single = EmbeddingRecallAtK((1, 5, 10), chunk_bytes=MEMORY_CHUNK, near_duplicate=0.5)
    embeddings, labels = items(MEMORY_NUM, MEMORY_DIM, 0, "cpu")
    single.update(embeddings, labels, ids=torch.arange(MEMORY_NUM))
    return single.compute(), single.protocol_report()


@pytest.mark.memory
@pytest.mark.ddp
def test_the_sharded_ranking_adds_under_0_6x_the_gathered_bytes(
    memory: list[dict[str, Any]],
) -> None:
    """4 processes: the ranking (after the audit) adds at most 0.6x the gathered
    embeddings on each process (its own queries prepared are 0.25x), plus a few tiles
    and fixed buffers, and the result and report are the one-process ones. (Each
    process of the gathered ranking adds over 1x.)"""
    gathered = MEMORY_NUM * MEMORY_DIM * 4
    want, report = _memory_single()
    for result in memory:
        assert result["ranking"] <= _allowed(gathered), result["ranking"] / gathered
        assert _same(result["result"], want)
        assert result["report"] == report


@pytest.mark.memory
@pytest.mark.ddp
def test_sharded_compute_adds_under_0_6x_the_gathered_bytes(
    memory: list[dict[str, Any]],
) -> None:
    """4 processes: compute() and protocol_report() together, the audit included."""
    gathered = MEMORY_NUM * MEMORY_DIM * 4
    for result in memory:
        assert result["whole"] <= _allowed(gathered), result["whole"] / gathered


# ------------------------------------------------------- memory, narrow embeddings

NARROW_NUM, NARROW_DIM, NARROW_CHUNK = 20_000, 128, 4 * 2**20  # 9.8 MiB gathered
"""Narrow embeddings, many items: a sharded ranking's bookkeeping (a few hundred bytes
an item in all: the gathered metadata, the sides, the audit's codes, each query's state)
weighs as much as the embeddings (512 bytes an item), and ``chunk_bytes`` is two fifths
of them."""

NARROW_SHARE = 0.6
"""What the narrow test allows: it reads 0.40-0.44x the gathered bytes from run to run
(``benchmarks/RESULTS.md``, "Large galleries", has the scale benchmark's)."""


def _narrow_memory_worker(rank: int, world: int, payload: dict[str, Any]) -> dict[str, Any]:
    """Leave-one-out with ids, as the scale benchmark ranks it: the peak ``compute()``
    and ``protocol_report()`` add on this process."""
    from memory_probe import items, peak_since, start

    torch.set_num_threads(1)
    num, dim = payload["num"], payload["dim"]
    options = {"chunk_bytes": payload["chunk"], "sharded": True, "compute_with_cache": False}
    _warm_up(options, dim, rank, world)
    embeddings, labels = items(num, dim, 0, "cpu")
    ids = torch.arange(num)
    metric = EmbeddingRecallAtK((1, 5, 10), **options)
    first, stop = num * rank // world, num * (rank + 1) // world
    for begin in range(first, stop, 1000):
        rows = slice(begin, min(stop, begin + 1000))
        metric.update(embeddings[rows], labels[rows], ids=ids[rows])
    del embeddings, labels, ids
    dist.barrier()
    baseline = start("cpu")
    result = metric.compute()
    report = metric.protocol_report()
    return {"peak": peak_since("cpu", baseline), "result": result, "report": report}


@pytest.mark.memory
@pytest.mark.ddp
def test_sharded_compute_of_narrow_embeddings_adds_under_0_6x_the_gathered_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """4 processes, 20,000 x 128 items, ``chunk_bytes`` 4 MiB: compute() and
    protocol_report() add at most 0.6x the gathered embeddings' bytes on every process,
    the fixed buffers and the per-item bookkeeping included (no allowance beyond it;
    with a copy of its own share and wider bookkeeping it took 1.47x),
    and every process returns the same result and report."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to measure the resident set")
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)  # inherited by the spawned processes
    payload = {"num": NARROW_NUM, "dim": NARROW_DIM, "chunk": NARROW_CHUNK}
    found = run_distributed(_narrow_memory_worker, 4, payload, fresh=True, timeout=TIMEOUT_S)
    gathered = NARROW_NUM * NARROW_DIM * 4
    for result in found:
        assert result["peak"] <= NARROW_SHARE * gathered, result["peak"] / gathered
        assert _same(result["result"], found[0]["result"])
        assert result["report"] == found[0]["report"]


# ---------------------------------------------------------------- Lightning


@pytest.mark.ddp
def test_a_lightning_ddp_validation_logs_the_one_process_values() -> None:
    """``Trainer(strategy=..., devices=2)`` (``ddp_spawn``'s launcher, workers forked:
    ``lightning_models.forked_ddp``) validating with ``sharded=True``
    (45 items: the sampler pads one repeat, which ``ids=`` drop) logs bit for bit
    what one process computes on the items."""
    import lightning.pytorch as pl
    from lightning_models import KS as LIGHTNING_KS
    from lightning_models import EndProcessGroup, ShardedEmbedder, embedding_data, forked_ddp
    from torch.utils.data import DataLoader

    model, data = ShardedEmbedder(), embedding_data(45, seed=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=forked_ddp(),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[EndProcessGroup()],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logged = trainer.validate(model, DataLoader(data, batch_size=8), verbose=False)[0]
    single = EmbeddingRecallAtK(LIGHTNING_KS)
    features, labels, ids = data.tensors
    with torch.no_grad():
        single.update(model.layer(features), labels, ids=ids)
    want = {f"val/{key}": float(value) for key, value in single.compute().items()}
    assert {key: float(value) for key, value in logged.items()} == want
