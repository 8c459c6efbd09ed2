"""The CPU ranking on worker threads: with torch.get_num_threads() > 1 the tiles and the
squares run on that many threads, each running torch on one thread; the result, the
protocol report and the caller's thread count are the same as with one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from embedding_reference import ROUTES, Batch, Route, engine_recall, gen
from thread_spy import ThreadSpy

from recall_at_k import EmbeddingRecallAtK
from recall_at_k._kernel import Workspace
from recall_at_k.ranking import blocks as _blocks
from recall_at_k.ranking import engine as _engine
from recall_at_k.ranking.workers import Workers, caller_on_one_thread, worker_count

# Thread-count sweeps: `-m slow` runs them, as CI does.
pytestmark = pytest.mark.slow

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


def _run(batches: list[Batch], **kwargs: Any) -> tuple[Any, Any, Any]:
    metric = EmbeddingRecallAtK(KS, near_duplicate=0.9, **kwargs)
    for batch in batches:
        metric.update(batch.embeddings, batch.labels, **batch.kwargs())
    values = {key: float(value) for key, value in metric.compute().items()}
    return values, metric.protocol_report(), metric.confidence_interval()


@pytest.mark.parametrize("layout", ["leave-one-out", "query-gallery"])
@pytest.mark.parametrize("ties", ["pessimistic", "expected"])
def test_bit_identical_for_one_two_and_three_threads(layout: str, ties: str) -> None:
    batches = _batches(layout)
    first = values = None
    for threads in (1, 2, 3):
        # chunk_bytes=1 (tiles of one query, panels of one item: tens of thousands of
        # steps, seconds a run) at one thread: tiles that small take no worker thread
        # (test_small_tiles_stay_on_the_calling_thread), so more threads rerun that walk
        chunks = (1, 4 * 240 * 9, 256 * 2**20) if threads == 1 else (4 * 240 * 9, 256 * 2**20)
        with _threads(threads):
            for chunk in chunks:
                got = _run(batches, ties=ties, chunk_bytes=chunk)
                first = got if first is None else first
                assert str(got) == str(first), (threads, chunk)
            for route in ROUTES:
                found = engine_recall(batches, KS, route, ties=ties, near_duplicate=0.9)
                values = found if values is None else values
                assert found == values == first[0], (threads, route)


@pytest.mark.parametrize("layout", ["leave-one-out", "query-gallery"])
def test_compute_under_inference_mode_on_worker_threads(layout: str) -> None:
    """``compute()`` inside ``torch.inference_mode()`` with 2 threads (the workers take
    the caller's inference mode, so the protocol audit's blocks may write into the
    arrays the caller made there) gives the 1-thread result outside it."""
    batches = _batches(layout)
    with _threads(1):
        want = _run(batches)
    with _threads(2), torch.inference_mode():
        got = _run(batches)
    assert str(got) == str(want)


def test_workers_run_tasks_in_the_callers_inference_mode() -> None:
    with torch.inference_mode():
        made = torch.zeros(4)
        with Workers(2, Workspace()) as workers:
            list(workers.map(lambda i, _: made[i : i + 1].add_(1), range(4)))
    assert made.tolist() == [1.0, 1.0, 1.0, 1.0]
    with Workers(2, Workspace()) as workers:
        inference = workers.map(lambda _, __: torch.is_inference_mode_enabled(), range(3))
        assert list(inference) == [False, False, False]


def _product_threads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Each fast product the engine computes from now on, as (its thread's name, that
    thread's torch thread count); a worker thread's first product waits for one of the
    calling thread's, so that both take one whatever the scheduler does."""
    spy = ThreadSpy()
    monkeypatch.setattr(_engine, "product", spy.wrap(_blocks.product))
    return spy.seen


@pytest.mark.parametrize("layout", ["leave-one-out", "query-gallery"])
def test_tiles_and_squares_run_on_worker_threads(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 2 threads the tiles (query/gallery) or squares (leave-one-out) compute their
    products on the calling thread and on one worker thread, each running torch on one
    thread; the caller's count is unchanged after."""
    seen = _product_threads(monkeypatch)
    batches = _batches(layout)
    # Squares of 60 rows (leave-one-out), tiles of a few queries (query/gallery).
    route: Route = (
        ("squares", 4 * 4 * 60 * 60) if layout == "leave-one-out" else ("panels", 4 * 4 * 160 * 20)
    )
    caller = threading.current_thread().name
    with _threads(1):
        one = engine_recall(batches, KS, route)
    assert seen and all(thread == caller for thread, _ in seen)
    seen = _product_threads(monkeypatch)  # a new meeting: the caller's first product again
    with _threads(2):
        two = engine_recall(batches, KS, route)
        assert torch.get_num_threads() == 2
        with ThreadPoolExecutor(1) as fresh:  # threads started later keep the count too
            assert fresh.submit(torch.get_num_threads).result() == 2
    assert one == two
    threads = {thread for thread, _ in seen}
    assert len(threads) == 2 and caller in threads, seen
    assert all(t.startswith("recall-at-k") for t in threads - {caller}), seen
    assert all(count == 1 for _, count in seen)


def test_a_cpu_workspace_slot_that_grows_takes_twice_its_size() -> None:
    """A CPU slot that must grow takes at least twice its size (pages never written are
    never resident), so that a slot growing a little at a time is paged in a few times a
    ranking, not once a request."""
    workspace, cpu = Workspace(), torch.device("cpu")
    first = workspace.get("slot", (10,), torch.float32, cpu)
    grown = workspace.get("slot", (11,), torch.float32, cpu)
    within = workspace.get("slot", (4, 5), torch.float32, cpu)
    assert first.data_ptr() != grown.data_ptr() == within.data_ptr()
    assert within.shape == (4, 5)
    assert workspace.get("slot", (21,), torch.float32, cpu).data_ptr() != grown.data_ptr()


def test_a_cpu_workspace_slot_is_taken_at_the_most_it_will_hold() -> None:
    """``most``: on CPU the slot is made that long at once, so every later request up to it
    reads the same buffer; elsewhere (here ``meta``) the request's size alone."""
    workspace, cpu, meta = Workspace(), torch.device("cpu"), torch.device("meta")
    first = workspace.get("slot", (2, 3), torch.float32, cpu, 0, 64)
    assert first.shape == (2, 3)
    later = workspace.get("slot", (8, 8), torch.float32, cpu)
    assert later.data_ptr() == first.data_ptr()
    assert workspace.get("slot", (65,), torch.float32, cpu).data_ptr() != first.data_ptr()
    workspace.get("slot", (6,), torch.float32, meta, 0, 64)
    assert workspace.get("slot", (7,), torch.float32, meta).shape == (7,)
    assert workspace._buffers[("slot", torch.float32, meta)].numel() == 7


def test_a_pool_keeps_each_threads_workspace_from_map_to_map_and_frees_released_slots() -> None:
    """Two maps of one pool (the caller and one worker thread): each thread's second task
    finds the buffer its first task put in its workspace (no page written again);
    :meth:`Workers.release` frees the named slots of every workspace the tasks use, the
    caller's included."""
    cpu = torch.device("cpu")
    ready = threading.Barrier(2)

    def fill(item: int, workspace: Workspace) -> tuple[str, int, int]:
        ready.wait(timeout=30)  # both threads take one item each
        kept = workspace.get("kept", (4,), torch.float32, cpu).fill_(item)
        workspace.get("freed", (4,), torch.float32, cpu)
        return threading.current_thread().name, kept.data_ptr(), id(workspace)

    def read(item: int, workspace: Workspace) -> tuple[str, int, int]:
        ready.wait(timeout=30)
        kept = workspace.get("kept", (4,), torch.float32, cpu)
        return threading.current_thread().name, kept.data_ptr(), id(workspace)

    caller = Workspace()
    with _threads(2), Workers(2, caller) as pool:
        first = {name: (ptr, ws) for name, ptr, ws in pool.map(fill, range(2))}
        second = {name: (ptr, ws) for name, ptr, ws in pool.map(read, range(2))}
        assert len(first) == 2 and second == first
        assert threading.current_thread().name in first  # the caller took one of each
        pool.release("freed")
        slots = {key[0] for workspace in pool.workspaces for key in workspace._buffers}
        assert slots == {"kept"} and len(pool.workspaces) == 2 and pool.workspaces[0] is caller


def test_results_come_in_order_and_errors_reach_the_caller() -> None:
    def task(item: int, workspace: Workspace) -> int:
        if item == 7:
            raise RuntimeError("task 7 failed")
        return item * item

    for count in (1, 3):
        with Workers(count, Workspace()) as pool:
            assert list(pool.map(task, range(7))) == [i * i for i in range(7)]
        with Workers(count, Workspace()) as pool, pytest.raises(RuntimeError, match="7"):
            list(pool.map(task, range(20)))


def test_the_caller_runs_torch_on_one_thread_while_its_workers_run() -> None:
    """While a pool of workers runs, the calling thread (which merges their results)
    runs torch on one thread (its own torch threads would spin beside the workers); its
    count is back after, also when a task fails."""

    def task(item: int, workspace: Workspace) -> int:
        if item == 5:
            raise RuntimeError("task 5 failed")
        return torch.get_num_threads()

    with _threads(2):
        with Workers(2, Workspace()) as pool:
            inside = torch.get_num_threads()
            assert list(pool.map(task, range(4))) == [1, 1, 1, 1]
        assert inside == 1 and torch.get_num_threads() == 2
        with Workers(2, Workspace()) as pool, pytest.raises(RuntimeError, match="5"):
            list(pool.map(task, range(8)))
        assert torch.get_num_threads() == 2
        with Workers(1, Workspace()) as pool:  # no workers: the caller's own count
            assert list(pool.map(task, range(2))) == [2, 2]
        # Held around a whole compute(): one torch thread, the workers still counted.
        with caller_on_one_thread():
            assert torch.get_num_threads() == 1
            assert worker_count(torch.device("cpu")) == 2
            with Workers(2, Workspace()) as pool:
                assert list(pool.map(task, range(4))) == [1, 1, 1, 1]
            assert torch.get_num_threads() == 1  # the outer hold keeps it
            with caller_on_one_thread():
                assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with caller_on_one_thread(hold=False):
            assert torch.get_num_threads() == 2
        seen: list[int] = []
        original = _engine.rank_direction

        def spy(*args: Any, **kwargs: Any) -> Any:
            seen.append(torch.get_num_threads())
            return original(*args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_engine, "rank_direction", spy)
            _run(_batches("query-gallery"))
        assert seen and all(count == 1 for count in seen)
        assert torch.get_num_threads() == 2


def test_leave_one_out_spans_are_whole_labels() -> None:
    """Where every label fits a square, the squares' spans are whole labels (each span's
    diagonal square gives its bands and its negatives at once), of about ``size`` rows
    and at most ``most``, covering every item in order."""
    labels = torch.sort(_batches("leave-one-out")[0].labels).values
    num = labels.shape[0]
    rows = torch.zeros(num, 2)
    stats = _blocks.Stats(torch.float32, None, 1.0, 0.0, 0.0, False, 64)
    gallery = _blocks.gallery_block(rows, rows, labels, labels, torch.arange(num), stats)
    spans = _engine.label_spans(gallery, 32, 48)
    assert [span.start for span in spans[1:]] == [span.stop for span in spans[:-1]]
    assert spans[0].start == 0 and spans[-1].stop == num and len(spans) > 2
    assert all(0 < span.stop - span.start <= 48 for span in spans)
    assert all(labels[span.start - 1] != labels[span.start] for span in spans[1:])
    batches = _batches("leave-one-out")
    want = engine_recall(batches, KS, ("tiles", 2**20), near_duplicate=0.9)
    for threads in (1, 2):
        with _threads(threads):
            assert (
                engine_recall(batches, KS, ("squares", 4 * 4 * 48 * 48), near_duplicate=0.9) == want
            )


def test_small_tiles_stay_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranking shares its tiles among worker threads only where each gets
    ``CPU_WORKER_BYTES`` of them (as docs/input-forms.md says): at a small ``chunk_bytes``
    every product runs on the calling thread, at the default on both workers, with the
    same result."""
    from recall_at_k.ranking import budget

    assert budget.CPU_WORKER_BYTES == 2**20
    page = Path(__file__).resolve().parents[1] / "docs" / "input-forms.md"
    text = " ".join(page.read_text(encoding="utf-8").split())
    assert "Each thread takes at least 1 MiB of tiles at a time" in text
    embeddings = torch.randn(3000, 16, generator=gen(8))
    labels = torch.randint(0, 300, (3000,), generator=gen(9))

    def compute(chunk_bytes: int) -> tuple[Any, set[str]]:
        seen = _product_threads(monkeypatch)  # a new meeting each time
        metric = EmbeddingRecallAtK(KS, chunk_bytes=chunk_bytes)
        metric.update(embeddings, labels)
        return metric.compute(), {name for name, _ in seen}

    caller = threading.current_thread().name
    with _threads(2):
        small, small_threads = compute(2**21)
        default, default_threads = compute(2**28)
    assert small_threads == {caller}, small_threads
    assert len(default_threads) == 2 and caller in default_threads, default_threads
    assert all(name.startswith("recall-at-k") for name in default_threads - {caller})
    assert small == default
