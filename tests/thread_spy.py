"""A spy on the functions the engine's threads call: which thread called, at how many
torch threads, and a meeting point that makes "the caller and a worker each took a task"
a fact rather than a matter of the scheduler.

A pool's worker threads take queued tasks in whatever order the OS runs them, and the
caller runs a task only while the result it waits for is not ready: on a loaded machine
either could take every block. The spy therefore holds each worker thread's first call
until the calling thread (the one that made the spy) has made one
(``threading.Event``, with a timeout): a pool whose caller runs no task beside its
workers fails the test instead of hanging it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

WORKER_PREFIX = "recall-at-k"  # the name prefix of the package's worker threads


class ThreadSpy:
    """``wrap(f)`` records ``(thread name, torch threads)`` per call in :attr:`seen`."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.seen: list[tuple[str, int]] = []
        self.caller = threading.current_thread().name
        self._called = threading.Event()
        self._timeout = timeout

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            name = threading.current_thread().name
            self.seen.append((name, torch.get_num_threads()))
            if name == self.caller:
                self._called.set()
            elif name.startswith(WORKER_PREFIX) and not self._called.wait(self._timeout):
                raise TimeoutError(f"{self.caller} ran no task beside worker thread {name}")
            return original(*args, **kwargs)

        return call

    def threads(self) -> set[str]:
        return {name for name, _ in self.seen}
