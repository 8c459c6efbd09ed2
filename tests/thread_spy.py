"""A spy on the functions the engine's worker threads call: which thread called, at how
many torch threads, and a meeting point that makes "every worker took a task" a fact
rather than a matter of the scheduler.

A pool's threads take queued tasks in whatever order the OS runs them: on a loaded
machine one worker can take every block before another wakes. The spy therefore holds
each worker thread's first call until ``workers`` worker threads have each made one
(``threading.Barrier``, with a timeout): a pool with fewer threads, or fewer tasks in
flight than threads, breaks the barrier and fails the test instead of hanging it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

WORKER_PREFIX = "recall-at-k"  # the name prefix of the package's worker threads


class ThreadSpy:
    """``wrap(f)`` records ``(thread name, torch threads)`` per call in :attr:`seen`."""

    def __init__(self, workers: int, timeout: float = 60.0) -> None:
        self.seen: list[tuple[str, int]] = []
        self._meet = threading.Barrier(workers, timeout=timeout) if workers > 1 else None
        self._met: set[str] = set()
        self._lock = threading.Lock()

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            name = threading.current_thread().name
            self.seen.append((name, torch.get_num_threads()))
            if self._meet is not None and name.startswith(WORKER_PREFIX):
                with self._lock:
                    first = name not in self._met
                    self._met.add(name)
                if first:
                    self._meet.wait()
            return original(*args, **kwargs)

        return call

    def threads(self) -> set[str]:
        return {name for name, _ in self.seen}
