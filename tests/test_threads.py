"""The CPU ranking on worker threads: with torch.get_num_threads() > 1 the tiles and the
symmetric blocks run on that many threads, each running torch on one thread; the
result, the protocol report and the caller's thread count are the same as with one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from embedding_reference import Batch, gen

from recall_at_k import EmbeddingRecallAtK
from recall_at_k._kernel import Workspace
from recall_at_k.ranking import panels as _panels
from recall_at_k.ranking import rank as _rank
from recall_at_k.ranking import symmetric as _symmetric
from recall_at_k.ranking.bands import Route
from recall_at_k.ranking.workers import Workers, caller_on_one_thread, worker_count

KS = (1, 2, 5)


@contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _batches(layout: str) -> list[Batch]:
    """Quantised embeddings (real scores tie) with a few exact copies (the audit)."""
    embeddings = torch.randint(-1, 2, (240, 12), generator=gen(3)).float()
    embeddings[200:210] = embeddings[:10]
    labels = torch.randint(0, 15, (240,), generator=gen(4))
    if layout == "leave-one-out":
        return [Batch(embeddings, labels)]
    ids = torch.arange(240)
    return [
        Batch(embeddings[:80], labels[:80], role="query", ids=ids[:80]),
        Batch(embeddings[80:], labels[80:], role="gallery", ids=ids[80:]),
    ]


def _run(batches: list[Batch], route: Route, **kwargs: Any) -> tuple[Any, Any, Any]:
    metric = EmbeddingRecallAtK(KS, near_duplicate=0.9, **kwargs)
    metric._route = route
    for batch in batches:
        metric.update(batch.embeddings, batch.labels, **batch.kwargs())
    values = {key: float(value) for key, value in metric.compute().items()}
    return values, metric.protocol_report(), metric.confidence_interval()


@pytest.mark.parametrize("layout", ["leave-one-out", "query-gallery"])
@pytest.mark.parametrize("ties", ["pessimistic", "expected"])
def test_bit_identical_for_one_two_and_three_threads(layout: str, ties: str) -> None:
    batches = _batches(layout)
    routes = (
        Route(),
        Route("symmetric", block_bytes=2**10),  # blocks narrower than a label
        Route("symmetric", block_bytes=2**12),  # spans of whole labels
        Route("tiles"),
        Route("dense"),
    )
    first = None
    for threads in (1, 2, 3):
        with _threads(threads):
            for chunk in (1, 4 * 240 * 9, 256 * 2**20):
                for route in routes:
                    got = _run(batches, route, ties=ties, chunk_bytes=chunk)
                    first = got if first is None else first
                    assert str(got) == str(first), (threads, chunk, route)


@pytest.mark.parametrize("layout", ["leave-one-out", "query-gallery"])
def test_compute_under_inference_mode_on_worker_threads(layout: str) -> None:
    """``compute()`` inside ``torch.inference_mode()`` with 2 threads (the workers take
    the caller's inference mode, so the protocol audit's blocks may write into the
    arrays the caller made there) gives the 1-thread result outside it."""
    batches = _batches(layout)
    with _threads(1):
        want = _run(batches, Route())
    with _threads(2), torch.inference_mode():
        got = _run(batches, Route())
    assert str(got) == str(want)


def test_workers_run_tasks_in_the_callers_inference_mode() -> None:
    with torch.inference_mode():
        made = torch.zeros(4)
        with Workers(lambda i, _: made[i : i + 1].add_(1), 2, Workspace()) as workers:
            list(workers.map(range(4)))
    assert made.tolist() == [1.0, 1.0, 1.0, 1.0]
    with Workers(lambda _, __: torch.is_inference_mode_enabled(), 2, Workspace()) as workers:
        assert list(workers.map(range(3))) == [False, False, False]


@pytest.mark.parametrize("layout", ["leave-one-out", "query-gallery"])
def test_tiles_and_blocks_run_on_worker_threads(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 2 threads each tile (query/gallery) or block (leave-one-out) runs on a worker
    thread whose torch runs on one thread; the caller's count is unchanged after."""
    seen: list[tuple[str, int]] = []
    name = "_scan_block" if layout == "leave-one-out" else "panel_band"
    module: Any = _symmetric if layout == "leave-one-out" else _panels
    original = getattr(module, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    if layout == "query-gallery":
        monkeypatch.setattr(_rank, "panel_band", spy)
    batches = _batches(layout)
    # Blocks of 60 rows (leave-one-out), tiles of 10 queries (query/gallery).
    route = Route("symmetric", block_bytes=4 * 60 * 60) if layout == "leave-one-out" else Route()
    with _threads(1):
        one = _run(batches, route, chunk_bytes=4 * 160 * 20)
    assert seen and all(thread == threading.current_thread().name for thread, _ in seen)
    seen.clear()
    with _threads(2):
        two = _run(batches, route, chunk_bytes=4 * 160 * 20)
        assert torch.get_num_threads() == 2
        with ThreadPoolExecutor(1) as fresh:  # threads started later keep the count too
            assert fresh.submit(torch.get_num_threads).result() == 2
    assert str(one) == str(two)
    workers = {thread for thread, _ in seen}
    assert len(workers) == 2 and all(t.startswith("recall-at-k") for t in workers), seen
    assert all(count == 1 for _, count in seen)


def test_results_come_in_order_and_errors_reach_the_caller() -> None:
    def task(item: int, workspace: Workspace) -> int:
        if item == 7:
            raise RuntimeError("task 7 failed")
        return item * item

    for count in (1, 3):
        with Workers(task, count, Workspace()) as pool:
            assert list(pool.map(range(7))) == [i * i for i in range(7)]
        with Workers(task, count, Workspace()) as pool, pytest.raises(RuntimeError, match="7"):
            list(pool.map(range(20)))


def test_the_caller_runs_torch_on_one_thread_while_its_workers_run() -> None:
    """While a pool of workers runs, the calling thread (which merges their results)
    runs torch on one thread (its own torch threads would spin beside the workers); its
    count is back after, also when a task fails."""

    def task(item: int, workspace: Workspace) -> int:
        if item == 5:
            raise RuntimeError("task 5 failed")
        return torch.get_num_threads()

    with _threads(2):
        with Workers(task, 2, Workspace()) as pool:
            inside = torch.get_num_threads()
            assert list(pool.map(range(4))) == [1, 1, 1, 1]
        assert inside == 1 and torch.get_num_threads() == 2
        with Workers(task, 2, Workspace()) as pool, pytest.raises(RuntimeError, match="5"):
            list(pool.map(range(8)))
        assert torch.get_num_threads() == 2
        with Workers(task, 1, Workspace()) as pool:  # no workers: the caller's own count
            assert list(pool.map(range(2))) == [2, 2]
        # Held around a whole compute(): one torch thread, the workers still counted.
        with caller_on_one_thread():
            assert torch.get_num_threads() == 1
            assert worker_count(torch.device("cpu")) == 2
            with Workers(task, 2, Workspace()) as pool:
                assert list(pool.map(range(4))) == [1, 1, 1, 1]
            assert torch.get_num_threads() == 1  # the outer hold keeps it
            with caller_on_one_thread():
                assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with caller_on_one_thread(hold=False):
            assert torch.get_num_threads() == 2
        seen: list[int] = []
        original = _rank.rank

        def spy(*args: Any, **kwargs: Any) -> Any:
            seen.append(torch.get_num_threads())
            return original(*args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_rank, "rank", spy)
            _run(_batches("query-gallery"), Route())
        assert seen and all(count == 1 for count in seen)
        assert torch.get_num_threads() == 2


def test_leave_one_out_spans_are_whole_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where every label fits a block, the symmetric route's spans are whole labels (each
    span's diagonal block gives its bands and its negatives at once), of about a block's
    rows and at most a tile's, covering every item in order; the counts are those of the
    dense route."""
    seen: set[tuple[int, int]] = set()  # (a report may rank again)
    original = _symmetric._diagonal

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.add((args[4].start, args[4].stop))
        return original(*args, **kwargs)

    monkeypatch.setattr(_symmetric, "_diagonal", spy)
    batches = _batches("leave-one-out")
    for threads in (1, 2):
        seen.clear()
        with _threads(threads):
            # blocks of about 32 rows, at most a tile's 48 (a tile: a share of chunk_bytes)
            chunk = _rank.SCRATCH_SHARE * 4 * 48 * 48
            aligned = _run(batches, Route("symmetric", block_bytes=4 * 32 * 32), chunk_bytes=chunk)
            assert str(aligned) == str(_run(batches, Route("dense")))
        ordered = torch.sort(batches[0].labels).values
        spans = sorted(seen)  # (the worker threads' order may vary)
        assert [start for start, _ in spans[1:]] == [stop for _, stop in spans[:-1]]
        assert spans[0][0] == 0 and spans[-1][1] == ordered.shape[0] and len(spans) > 2
        assert all(0 < stop - start <= 48 for start, stop in spans)
        assert all(ordered[start - 1] != ordered[start] for start, _ in spans[1:])
