"""Worker threads for the CPU routes: independent tiles and blocks ranked on every core.

A tile's scan is many operations too small for torch's own threads, so on CPU with
``torch.get_num_threads() > 1`` whole tiles (or squares) go to that many threads: the
caller, which also merges the results, and worker threads, each running torch on one
thread with its own :class:`~recall_at_k._kernel.Workspace`. Results are merged in task
order and depend only on their inputs, so the counts are the same for any number of
threads. The caller runs torch on one thread meanwhile (:func:`caller_on_one_thread`) so
as not to spin on the workers' cores. With one thread, on a GPU, or for a callable
similarity the tasks run in the calling thread."""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from recall_at_k._kernel import Workspace

Item = TypeVar("Item")
Result = TypeVar("Result")

WINDOW_PER_WORKER = 2
"""Tasks given ahead of the one being merged, per worker (keeps every worker busy)."""


_held = threading.local()  # .count: the caller's torch threads while it runs on one


def worker_count(device: torch.device) -> int:
    """Worker threads on ``device``: torch's (held) thread count on CPU, else 1."""
    if device.type != "cpu":
        return 1
    held: int = getattr(_held, "count", 0)
    return max(1, held or torch.get_num_threads())


@contextlib.contextmanager
def caller_on_one_thread(hold: bool = True) -> Iterator[None]:
    """Inside, the caller runs torch on one thread (its OpenMP threads would spin on the workers'
    cores), :func:`worker_count` unchanged; nested, the outer holds; ``hold=False``: no-op."""
    count = torch.get_num_threads()
    held: int = getattr(_held, "count", 0)
    if not hold or count == 1 or held:
        yield
        return
    _held.count = count
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(count)
        _held.count = 0


class Workers:
    """``count`` threads (the caller's and ``count - 1`` workers) running tasks ``task(item,
    workspace)``, each torch on one thread: a context manager, whose :meth:`map` yields a
    task's results in the items' order."""

    def __init__(self, count: int, workspace: Workspace) -> None:
        self.count = count
        self.workspace = workspace  # the caller's, for one worker
        self.workspaces = [workspace]  # and each worker thread's, kept from map to map
        self.pool: ThreadPoolExecutor | None = None
        self.local = threading.local()
        self.held = contextlib.ExitStack()  # the pool, then the caller on one thread
        self.inference = False

    def __enter__(self) -> Workers:
        # Inference mode is per thread: the workers take the caller's.
        self.inference = torch.is_inference_mode_enabled()
        if self.count > 1:
            self.pool = _single_threaded_pool(self.count - 1)  # and the caller
            self.held.enter_context(caller_on_one_thread())
            self.held.callback(self.pool.shutdown, wait=True, cancel_futures=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.held.close()
        self.pool = None

    def _run(self, task: Callable[[Item, Workspace], Result], item: Item) -> Result:
        workspace = getattr(self.local, "workspace", None)
        if workspace is None:
            workspace = self.local.workspace = Workspace()
            self.workspaces.append(workspace)
        with torch.inference_mode(self.inference):
            return task(item, workspace)

    def map(
        self, task: Callable[[Item, Workspace], Result], items: Iterable[Item]
    ) -> Iterator[Result]:
        """``task``'s result for each item, in order. ``items`` is read lazily, an item once
        the result ``WINDOW_PER_WORKER * count`` places before it was merged (timing-
        independent). While the next result is not ready, the caller runs the first task no
        thread has started. Each thread keeps its workspace from map to map."""
        if self.pool is None:
            for item in items:
                yield task(item, self.workspace)
            return
        window, pool = WINDOW_PER_WORKER * self.count, self.pool
        running: deque[tuple[Item, Future[Result]]] = deque()

        def first() -> Result:
            while not running[0][1].done():  # a task not started yet: the caller's
                at = next((at for at, (_, future) in enumerate(running) if future.cancel()), -1)
                if at < 0:
                    break
                ran: Future[Result] = Future()
                ran.set_result(task(running[at][0], self.workspace))
                running[at] = running[at][0], ran
            return running.popleft()[1].result()

        try:
            for item in items:
                running.append((item, pool.submit(self._run, task, item)))
                if len(running) >= window:
                    yield first()
            while running:
                yield first()
        finally:
            for _, future in running:
                future.cancel()

    def release(self, *slots: str) -> None:
        """Free ``slots`` of every workspace of the pool (call between maps)."""
        for workspace in self.workspaces:
            workspace.drop(*slots)


def _single_threaded_pool(count: int) -> ThreadPoolExecutor:
    """A pool of ``count`` started threads, each running torch on one thread (setting it
    also sets later threads' count: the caller's is put back once all have started)."""
    before, ready = torch.get_num_threads(), threading.Barrier(count + 1)

    def start() -> None:
        torch.get_num_threads()  # this thread takes its count now, not later
        torch.set_num_threads(1)
        ready.wait()

    pool = ThreadPoolExecutor(count, thread_name_prefix="recall-at-k")
    try:
        for _ in range(count):
            pool.submit(start)
        ready.wait()
    finally:
        torch.set_num_threads(before)
    return pool
