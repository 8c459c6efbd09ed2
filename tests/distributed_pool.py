"""Long-lived gloo worker processes for the multi-process tests, one pool per world size.

Spawning a process costs seconds (Python, torch, the test module, the process group);
most multi-process tests only need *some* processes joined by a group, so they share
them, as torchmetrics' test suite shares its ``pytest.pool``. Unlike a
``multiprocessing.Pool``, every rank here is one fixed process with a pipe of its own,
so ``fn`` always runs as ``fn(rank, world_size, payload)`` on the process of that rank.

- A pool of ``world_size`` processes is started on first use (:func:`run`), forked from a
  server process that imported torch and the package once, and kept until
  :func:`shutdown` (the tests' ``conftest.py`` calls it at the end of the session;
  ``atexit`` is the fallback). Each process joins one gloo process group on 127.0.0.1
  through a ``TCPStore`` that this (the parent) process holds, so no port is guessed.
- Before each call a worker restores what it started with: one torch thread, the
  default dtype, grad mode, deterministic algorithms, every random generator, the
  environment, the working directory and ``sys.path``; warnings filters are restored after
  the call. After a call that succeeds on every rank, the ranks check with one
  ``all_gather`` that the default group is still the one they share and that their
  collectives still line up.
- A worker's exception is re-raised in the parent with its traceback. After an
  exception, a death, a timeout (``timeout`` seconds, raising ``TimeoutError`` with the
  stacks of the ranks that had not returned) or a failed check, the pool is stopped and
  the next call spawns a new one: a rank that raised may have left the others inside a
  collective, or a message of a collective unmatched, which no later check can rule out.
- ``fresh=True`` spawns processes for this call alone (the old behaviour): for functions
  that measure the process itself (resident memory, environment read at start such as
  ``MALLOC_MMAP_THRESHOLD_``), or that destroy or replace the default process group.
- Stopping never hangs the parent: a worker passes a barrier, destroys its group and
  exits; one that has not exited a few seconds later is terminated, then killed (torch
  2.4's ``ProcessGroupGloo`` destructor can wait forever for the GIL).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import gc
import os
import pickle
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from multiprocessing import connection, get_context
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT", "Pool", "forked", "run", "shutdown"]

DEFAULT_TIMEOUT = 300.0
"""Seconds a call may run before the parent stops its processes and raises."""
START_TIMEOUT = 300.0
"""Seconds the processes of a pool may take to start and join their group."""
GRACE = 5.0
"""Seconds the parent still waits for the other ranks once one has failed."""
CHECK_TIMEOUT = 60.0
"""Seconds the ranks may take for the check after a call."""
STOP_TIMEOUT = 5.0
"""Seconds a worker may take to pass its barrier, destroy its group and exit."""

Fn = Callable[[int, int, Any], Any]

# ------------------------------------------------------------------------ the worker


class _Start:
    """What a worker started with, restored before every call."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        self.torch_rng = torch.random.get_rng_state()
        self.python_rng = random.getstate()
        self.numpy_rng: Any = None
        with contextlib.suppress(ImportError):
            import numpy

            self.numpy_rng = numpy.random.get_state()

    def restore(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        torch.set_num_threads(1)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        deterministic = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        if (deterministic, warn_only) != (self.deterministic, self.warn_only):
            # only when changed: its first call takes seconds (it imports much of torch)
            torch.use_deterministic_algorithms(self.deterministic, warn_only=self.warn_only)
        torch.random.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        if self.numpy_rng is not None:
            import numpy

            numpy.random.set_state(self.numpy_rng)


def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone (a killed pytest leaves no worker behind, even one
    blocked inside a collective)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _send(conn: connection.Connection, kind: str, value: Any) -> None:
    try:
        data = pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an unpicklable result is the call's failure
        data = pickle.dumps(("error", traceback.format_exc()))
    conn.send_bytes(data)


def _check(world_size: int, calls: int) -> str | None:
    """Why the default group is no longer fit for the next call, or None."""
    if not dist.is_initialized() or dist.get_world_size() != world_size:
        return "the default process group was destroyed or replaced"
    mine = torch.tensor([calls], dtype=torch.int64)
    seen = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(seen, mine)
    numbers = [int(s) for s in seen]
    if numbers != [calls] * world_size:
        return f"the ranks' call numbers differ ({numbers}): their collectives no longer line up"
    return None


def _serve(rank: int, world_size: int, port: int, conn: connection.Connection, stacks: str) -> None:
    """A worker: join the group, then run calls until told to stop."""
    _watch_parent(os.getppid())
    stack_file = open(stacks, "w")  # noqa: SIM115 -- open for the process's life
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=START_TIMEOUT)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    except BaseException:
        _send(conn, "error", traceback.format_exc())
        return
    start = _Start()
    _collect()
    _send(conn, "ready", None)
    calls = 0
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            os._exit(1)
        kind, body = pickle.loads(message)
        if kind == "stop":
            _stop()
        calls += 1
        start.restore()
        try:
            sys.path[:] = body["path"]  # where the parent finds the function's module
            fn, payload = pickle.loads(body["call"])
            with warnings.catch_warnings():
                result = fn(rank, world_size, payload)
        except BaseException:
            _send(conn, "error", traceback.format_exc())
            continue
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            start.restore()
        _send(conn, "ok", result)
        del result, fn, payload
        try:
            why = _check(world_size, calls) if body["check"] else None
        except BaseException:
            why = traceback.format_exc()
        _send(conn, "checked", why)
        _collect()


def _collect() -> None:
    """Free the cyclic garbage, then move what survives out of the collector's sight
    (``gc.freeze``): a full collection of a process holding torch takes about 0.4 s, one
    of what a call left behind next to nothing."""
    gc.collect()
    gc.freeze()


def _stop() -> None:
    """Pass a barrier (no rank leaves while another still talks to it), destroy the
    group, exit without running the interpreter's finalisers."""
    try:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# ------------------------------------------------------------------------ the parent


PRELOAD = ["torch", "torch.distributed", "recall_at_k", "lightning.pytorch"]
"""What the fork server imports once, before it forks a process: a shared pool's, a
Lightning DDP worker (``lightning_models.forked_ddp``) or another test's own
(``start_method="forkserver"``). Set when this module is imported (by conftest), before
any of them can start the server."""
get_context("forkserver").set_forkserver_preload(PRELOAD)


def _context(fresh: bool) -> Any:
    """How a pool's processes start. A shared pool's are forked from a server process that
    imported torch and the package once (``forkserver``): a spawned process imports them
    itself, seconds each, which was most of the multi-process tests' time. A fresh pool's
    are spawned: they measure the process from its start (the resident set, an environment
    such as ``MALLOC_MMAP_THRESHOLD_`` read when it starts), which the fork server's
    environment, taken when it started, would not have."""
    if fresh:
        return get_context("spawn")
    return get_context("forkserver")  # its server imports PRELOAD


def forked(target: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``target(*args)`` in a process forked from the shared pools' server (started; not a
    daemon, so that it may start processes of its own)."""
    process = _context(fresh=False).Process(target=target, args=args)
    process.start()
    return process


def _describe(fn: Fn, world_size: int) -> str:
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    return f"run_distributed({name}, world_size={world_size})"


class Pool:
    """``world_size`` processes joined by one gloo process group (``check=False``: a
    fresh pool, see :func:`_context`)."""

    def __init__(self, world_size: int, *, check: bool = True) -> None:
        self.world_size = world_size
        self.check = check  # whether the ranks check their group after each call
        self.closed = False
        # The parent holds the store: port 0 binds a free port, with no race for it.
        self._store = dist.TCPStore(
            "127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False
        )
        self._stacks = tempfile.TemporaryDirectory(prefix="run_distributed-")
        context = _context(fresh=not check)
        self._processes = []
        self._conns: list[connection.Connection] = []
        try:
            for rank in range(world_size):
                here, there = context.Pipe()
                process = context.Process(
                    target=_serve,
                    args=(rank, world_size, self._store.port, there, self._stack_path(rank)),
                    name=f"run_distributed rank {rank} of {world_size}",
                    daemon=True,
                )
                process.start()
                there.close()
                self._processes.append(process)
                self._conns.append(here)
            replies, waiting = self._replies(time.monotonic() + START_TIMEOUT)
            failed = {r: v for r, v in replies.items() if v[0] != "ready"}
            if failed or waiting:
                raise RuntimeError(
                    f"the {world_size} processes of run_distributed did not start: "
                    f"{self._failure_text(failed, waiting)}"
                )
        except BaseException:
            self.close(force=True)
            raise

    def _stack_path(self, rank: int) -> str:
        return str(Path(self._stacks.name) / f"rank{rank}.txt")

    def _replies(
        self, deadline: float, ranks: set[int] | None = None
    ) -> tuple[dict[int, tuple[str, Any]], set[int]]:
        """One message from each of ``ranks`` (all by default) until ``deadline``, or
        :data:`GRACE` seconds after the first failure: the replies by rank and the ranks
        still waited for. A process that died replies ``("died", exit code)``."""
        waiting = set(range(self.world_size)) if ranks is None else set(ranks)
        replies: dict[int, tuple[str, Any]] = {}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            by_conn = {self._conns[r]: r for r in waiting}
            for conn in connection.wait(list(by_conn), timeout=left):
                rank = by_conn[conn]  # type: ignore[index]
                try:
                    reply = pickle.loads(conn.recv_bytes())  # type: ignore[union-attr]
                except (EOFError, OSError):
                    self._processes[rank].join(timeout=1.0)
                    reply = ("died", self._processes[rank].exitcode)
                except Exception:
                    reply = ("error", f"its reply could not be read:\n{traceback.format_exc()}")
                replies[rank] = reply
                waiting.discard(rank)
                if reply[0] in ("error", "died"):
                    deadline = min(deadline, time.monotonic() + GRACE)
        return replies, waiting

    def _failure_text(self, failed: dict[int, tuple[str, Any]], waiting: set[int]) -> str:
        parts = []
        for rank, (kind, value) in sorted(failed.items()):
            if kind == "died":
                parts.append(f"rank {rank} exited with code {value}")
            else:
                parts.append(f"rank {rank} failed:\n{value}")
        if waiting:
            parts.append(f"ranks {sorted(waiting)} had not replied:\n{self._stacks_of(waiting)}")
        return "\n".join(parts)

    def _stacks_of(self, ranks: set[int]) -> str:
        """The Python stacks of ``ranks``' processes (faulthandler, on SIGUSR1)."""
        for rank in ranks:
            with contextlib.suppress(OSError, ValueError):
                os.kill(self._processes[rank].pid or 0, signal.SIGUSR1)
        time.sleep(1.0)
        out = []
        for rank in sorted(ranks):
            with contextlib.suppress(OSError):
                out.append(f"--- rank {rank}:\n{Path(self._stack_path(rank)).read_text()}")
        return "\n".join(out)

    def run(self, fn: Fn, payload: Any, timeout: float | None) -> list[Any]:
        """``fn(rank, world_size, payload)`` on every process; the results by rank."""
        if self.closed:
            raise RuntimeError("this pool was stopped")
        what = _describe(fn, self.world_size)
        try:  # pickled here, so that an unpicklable function fails before anything runs
            call = pickle.dumps((fn, payload), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:
            raise TypeError(
                f"{what}: fn (a module-level function) and payload must be picklable: {err}"
            ) from err
        body = {"path": list(sys.path), "call": call, "check": self.check}
        message = pickle.dumps(("run", body))
        done = False
        try:
            for conn in self._conns:
                conn.send_bytes(message)
            limit = float("inf") if timeout is None else timeout
            replies, waiting = self._replies(time.monotonic() + limit)
            failed = {r: v for r, v in replies.items() if v[0] != "ok"}
            if failed:
                first = min(failed)
                kind, value = failed[first]
                others = {r: v for r, v in failed.items() if r != first}
                text = f"rank {first} failed:\n{value}" if kind == "error" else ""
                text = text or f"rank {first} exited with code {value}"
                if others or waiting:
                    text += "\n(the other ranks: " + self._failure_text(others, waiting) + ")"
                raise AssertionError(text)
            if waiting:
                raise TimeoutError(
                    f"{what} did not return within {timeout} s: " + self._failure_text({}, waiting)
                )
            checks, waiting = self._replies(time.monotonic() + CHECK_TIMEOUT)
            broken = {r: v for r, v in checks.items() if v != ("checked", None)}
            if broken or waiting:
                raise AssertionError(
                    f"{what} returned, but left the processes' default group unfit for "
                    "another call (a function that destroys or replaces it, or calls "
                    "collectives on some ranks only, needs fresh=True): "
                    + self._failure_text({r: ("error", v[1]) for r, v in broken.items()}, waiting)
                )
            done = True
            return [replies[rank][1] for rank in range(self.world_size)]
        finally:
            if not done:
                self.close(force=True)

    def close(self, force: bool = False) -> None:
        """Stop the processes: ask them to stop (unless ``force``), then terminate, then
        kill whatever is still alive a few seconds later. Never blocks for long."""
        if self.closed:
            return
        self.closed = True
        if not force:
            stop = pickle.dumps(("stop", None))
            for conn in self._conns:
                with contextlib.suppress(OSError, ValueError):
                    conn.send_bytes(stop)
            deadline = time.monotonic() + STOP_TIMEOUT
            for process in self._processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        for signal_them in ("terminate", "kill"):
            alive = [p for p in self._processes if p.is_alive()]
            for process in alive:
                getattr(process, signal_them)()
            for process in alive:
                process.join(timeout=STOP_TIMEOUT)
        for conn in self._conns:
            conn.close()
        self._stacks.cleanup()


_POOLS: dict[int, Pool] = {}

RUNNING_TEST: Any = None
"""The pytest item being run (set by the tests' ``conftest.py``): a call from a test
not marked ``ddp`` is refused, so that ``-m ddp`` and ``-m "not ddp"`` select rightly."""


def _check_marked() -> None:
    test = RUNNING_TEST
    if test is not None and test.get_closest_marker("ddp") is None:
        raise RuntimeError(
            f"{test.nodeid} runs processes through run_distributed but is not marked ddp: "
            "add @pytest.mark.ddp to it (or pytestmark = pytest.mark.ddp to its module)"
        )


def run(
    fn: Fn,
    world_size: int,
    payload: Any = None,
    *,
    fresh: bool = False,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> list[Any]:
    """``fn(rank, world_size, payload)`` on ``world_size`` processes, the results by rank:
    on this world size's pool (spawned on first use), or with ``fresh=True`` on processes
    spawned for this call alone."""
    _check_marked()
    if fresh:
        with _fresh_pool(world_size) as pool:
            return pool.run(fn, payload, timeout)
    pool = _POOLS.get(world_size)
    if pool is None or pool.closed:
        pool = _POOLS[world_size] = Pool(world_size)
    return pool.run(fn, payload, timeout)


@contextlib.contextmanager
def _fresh_pool(world_size: int) -> Iterator[Pool]:
    pool = Pool(world_size, check=False)  # its processes end after this call
    try:
        yield pool
    finally:
        pool.close()


def shutdown() -> None:
    """Stop every pool (at the end of the test session)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


atexit.register(shutdown)
