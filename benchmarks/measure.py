"""The benchmarks' shared tools: one way to time, one way to measure peak memory, one
child-process runner, one table writer.

Time: the wall-clock (and CPU) seconds of the blocks a run marks (:class:`Probe`), the
device synchronised around each. Peak memory: what a block adds -- on CPU the resident-set
high-water mark (``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``) minus the
resident set before, with glibc's mmap threshold at 128 KiB (``MALLOC_MMAP_THRESHOLD_``)
so that a freed buffer leaves the resident set at once; on CUDA
``torch.cuda.max_memory_allocated`` minus what was allocated before. The tests' memory
probe uses the same :func:`start_peak`, :func:`peak_since` and :func:`on_own_thread`.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from math import inf
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

LIVE_MEMORY_MMAP_THRESHOLD = 128 * 1024  # bytes: glibc serves larger buffers with mmap


@dataclass
class Measurement:
    """A contestant's row: median time, peak memory and what else its workload reports."""

    name: str
    seconds: float | None  # None: did not run (the note says why)
    peak_bytes: int | None
    note: str = ""
    at_least: bool = False  # stopped at a time bound: ``seconds`` is a lower bound
    cpu_seconds: float | None = None
    values: dict[str, float] = field(default_factory=dict)  # Recall@K by key
    rounds: list[float] = field(default_factory=list)  # the time of each timed run
    details: dict[str, str] = field(default_factory=dict)  # workload-specific table cells


Section = tuple[str, dict[str, Measurement]]  # what a workload's run returns: body, rows


class Setup(NamedTuple):
    """Where the contestants run, on how many threads, isolated how, bounded how."""

    device: str = "cpu"
    threads: int = 1
    isolation: str = "process"  # or "grouped", or "inline" (the tests)
    time_limit: float | None = None


def by_name(rows: Sequence[Measurement]) -> dict[str, Measurement]:
    return {row.name: row for row in rows}


def _proc_bytes(path: str, key: str) -> int:
    with open(path) as f:
        found = re.search(rf"{key}:\s+(\d+) kB", f.read())
    assert found is not None, (path, key)
    return int(found.group(1)) * 1024


def _libc(name: str, *args: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        getattr(ctypes.CDLL("libc.so.6"), name)(*args)


def release_memory() -> None:
    """Collect garbage, freeze the survivors out of later collections (which would run
    inside measured calls) and hand freed heap back to the system."""
    gc.collect()
    gc.freeze()
    _libc("malloc_trim", 0)


@contextlib.contextmanager
def live_memory() -> Iterator[None]:
    """In this process what ``MALLOC_MMAP_THRESHOLD_`` does for a child: inside the block
    every buffer above 128 KiB is mmapped, so the high-water mark is live memory rather
    than heap the allocator kept. After it the thresholds are fixed where glibc's dynamic
    ones settle (32 MiB mmap, 64 MiB trim), so that timed runs reuse heap as by default."""
    _libc("mallopt", -3, LIVE_MEMORY_MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
    _libc("mallopt", -1, LIVE_MEMORY_MMAP_THRESHOLD)  # M_TRIM_THRESHOLD
    try:
        yield
    finally:
        _libc("mallopt", -3, 32 * 2**20)
        _libc("mallopt", -1, 64 * 2**20)


def start_peak(device: str) -> int:
    """Start a peak-memory window; returns the baseline in bytes."""
    release_memory()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current resident set
    return _proc_bytes("/proc/self/status", "VmRSS")


def peak_since(device: str, baseline: int) -> int:
    """Peak memory over ``baseline`` since :func:`start_peak`."""
    if device == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated()) - baseline
    return max(_proc_bytes("/proc/self/status", "VmHWM") - baseline, 0)


def on_own_thread(call: Callable[[], Any]) -> Any:
    """``call()`` on a thread started for it; its result, or its exception raised here.

    glibc gives a new thread a heap (arena) of its own, so the measured call's small
    buffers do not land in the holes that building the measurement left in the main
    thread's heap (handed back by :func:`start_peak`: each would touch a page again). The
    arena is new only while no thread has ended (glibc hands an ended thread's arena,
    holes and all, to the next), so warm-ups run on the main thread.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as err:  # re-raised on the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=run, name="measured")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


class Probe:
    """One run of a contestant: the seconds (wall-clock and CPU) of the blocks it marks
    with :meth:`timed`, the largest peak of those it marks with :meth:`window`."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.seconds = self.cpu_seconds = 0.0
        self.peak_bytes = 0
        self.details: dict[str, str] = {}

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        if self.device == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        yield
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - wall
        self.cpu_seconds += time.process_time() - cpu

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        baseline = start_peak(self.device)
        try:
            yield
        finally:  # a run stopped at its time bound keeps its peak up to then
            self.peak_bytes = max(self.peak_bytes, peak_since(self.device, baseline))


Run = Callable[[Probe], Any]  # one run; returns its Recall@K values (a dict) or None


def whole(fn: Callable[[], Any]) -> Run:
    """A run that times ``fn()`` and measures its peak, whole."""

    def run(probe: Probe) -> Any:
        with probe.window(), probe.timed():
            return fn()

    return run


@dataclass
class Contestant:
    """``run`` (None: it cannot run here, ``note`` says why); ``repeats`` timed runs after
    the first (0: the first run's time is its time); ``warm``, if any, runs before. A slow
    peer states the bytes it ``need``s: it runs within the time bound, and not at all
    when it needs more than 80% of the available memory (CPU)."""

    name: str
    run: Run | None
    repeats: int = 0
    note: str = ""
    warm: Run | None = None
    need: int | None = None


def compare(
    contestants: Sequence[Contestant], device: str, time_limit: float | None = None
) -> list[Measurement]:
    """Each contestant's warm-up, then its first run under :func:`live_memory` (its peak;
    a slow peer's stopped at ``time_limit``), then its ``repeats`` in rounds that interleave
    the contestants, so that a change of load touches them alike. Time: the median repeat.

    The bound is ``SIGALRM``'s (main thread): a Python loop such as torchmetrics'
    per-query compute is stopped between two torch calls."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError

    rows, runs = [], []
    for c in contestants:
        bound = 0.8 * _proc_bytes("/proc/meminfo", "MemAvailable") if c.need else 0.0
        if c.need and device == "cpu" and c.need > bound:
            c.note = f"not run: needs about {fmt_bytes(c.need)}, over the memory bound of"
            c.note += f" {fmt_bytes(bound)} (80% of the available memory)"
            c.run = None
        if c.run is None:
            rows.append(Measurement(c.name, None, None, c.note))
            continue
        if c.warm is not None:
            c.warm(Probe(device))
        probe, previous = Probe(device), signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, (time_limit or 0) if c.need is not None else 0)
        try:
            with live_memory():
                result = c.run(probe)
        except TimeoutError:
            rows.append(timed_out(c.name, time_limit or 0.0, probe.peak_bytes))
            continue
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        values = {k: float(v) for k, v in result.items()} if isinstance(result, dict) else {}
        rows.append(Measurement(c.name, probe.seconds, probe.peak_bytes, c.note, values=values))
        rows[-1].cpu_seconds, rows[-1].details = probe.cpu_seconds, probe.details
        runs.append((c, rows[-1], [Probe(device) for _ in range(c.repeats)]))
    release_memory()
    for index in range(max((c.repeats for c, _, _ in runs), default=0)):
        for c, _, probes in runs:
            if index < c.repeats:
                c.run(probes[index])
    for _, row, probes in runs:
        if probes:
            row.rounds = [p.seconds for p in probes]
            row.seconds = statistics.median(row.rounds)
            row.cpu_seconds = statistics.median(p.cpu_seconds for p in probes)
    release_memory()
    return rows


def timed_out(name: str, seconds: float, peak: int | None = None) -> Measurement:
    """The row of a contestant stopped at a time bound of ``seconds``."""
    note = f"did not finish within the time bound of {fmt_seconds(seconds)}: stopped there"
    note += "" if peak is None else " (peak memory up to then)"
    return Measurement(name, seconds, peak, note, at_least=True)


def call(
    fn: Callable, kwargs: dict[str, Any], *, threads: int = 1, world: int = 0, timeout: float = inf
) -> list[Any] | None:
    """``fn(**kwargs)`` (a module-level function) in fresh child processes, their results
    through JSON: one child, or with ``world`` that many gloo processes on 127.0.0.1, each
    with ``threads`` torch (and OpenMP) threads and ``MALLOC_MMAP_THRESHOLD_`` at 128 KiB.
    None past ``timeout`` seconds (the children killed: a safety net, as a contestant bounds
    itself); RuntimeError with the stderr of a child that fails (the others killed)."""
    module = fn.__module__
    if module == "__main__":  # a benchmark run as a script: its children import it by name
        module = Path(sys.modules["__main__"].__file__ or "").stem
    command = [sys.executable, __file__, str(threads), f"{module}.{fn.__name__}"]
    command += [json.dumps(kwargs), str(world)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env["MALLOC_MMAP_THRESHOLD_"] = str(LIVE_MEMORY_MMAP_THRESHOLD)
    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as stack:  # each child's (stdout, stderr)
        logs = [
            [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in "12"]
            for _ in range(max(world, 1))
        ]
        children = [
            subprocess.Popen(command, env={**env, "RANK": str(rank)}, stdout=out, stderr=err)
            for rank, (out, err) in enumerate(logs)
        ]
        while running := [c for c in children if c.poll() is None]:
            if time.monotonic() > deadline or any(c.returncode for c in children):
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                running[0].wait(0.1)
        for child in running:
            child.kill()
            child.wait()
        for file in (file for pair in logs for file in pair):
            file.seek(0)
        for child, (_, err) in zip(children, logs, strict=True):
            if child.returncode and child not in running:
                raise RuntimeError(f"{shlex.join(command)} failed:\n{err.read()}")
        return None if running else [json.loads(out.read().splitlines()[-1]) for out, _ in logs]


def child_main(threads: str, target: str, kwargs: str, world: str) -> None:
    """The child side of :func:`call`: print the JSON of ``module.function(**kwargs)``."""
    torch.set_num_threads(int(threads))
    module, name = target.rsplit(".", 1)
    if int(world):
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(world))
    try:
        result = getattr(importlib.import_module(module), name)(**json.loads(kwargs))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(json.dumps(result))


def compare_named(
    module: str, names: list[str], kwargs: dict[str, Any], device: str, time_limit: float | None
) -> list[dict[str, Any]]:
    """``module.contestants(names, device=device, **kwargs)``, compared; the rows' fields."""
    made = importlib.import_module(module).contestants(names, device=device, **kwargs)
    return [asdict(row) for row in compare(made, device, time_limit)]


def isolated(
    module: str, names: Sequence[str], kwargs: dict[str, Any], setup: Setup
) -> list[Measurement]:
    """:func:`compare_named` in children: one a name with the ``"process"`` isolation, one
    for all with ``"grouped"``; in this process with ``"inline"`` (no interpreter start-up).
    A child still running at twice the time bound plus 300 s is stopped (a safety net):
    its rows say so."""
    limit, rows = setup.time_limit, []
    for group in [[name] for name in names] if setup.isolation == "process" else [list(names)]:
        job = dict(module=module, names=group, kwargs=kwargs, device=setup.device, time_limit=limit)
        if setup.isolation == "inline":
            out = compare_named(**job)
        else:
            safety = inf if limit is None else 2 * limit + 300
            outs = call(compare_named, job, threads=setup.threads, timeout=safety)
            out = outs[0] if outs else [asdict(timed_out(name, limit or 0.0)) for name in group]
        rows += [Measurement(**row) for row in out]
    return rows


def fmt_seconds(seconds: float | None, at_least: bool = False) -> str:
    if seconds is None:
        return "—"
    text = f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"
    return f"> {text}" if at_least else text


def fmt_bytes(num: float | None) -> str:
    if num is None:
        return "—"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= scale:
            return f"{num / scale:.1f} {unit}"
    return f"{int(num)} B"


def fmt_ratio(value: float | None, at_least: bool = False, digits: int = 2) -> str:
    return "—" if value is None else f"{'>= ' if at_least else ''}{value:.{digits}f}x"


def time_ratio(row: Measurement, base: Measurement) -> float | None:
    """``row``'s time over ``base``'s: the median of the per-round ratios when both have
    as many rounds, else the ratio of the medians."""
    if row.seconds is None or not base.seconds:
        return None
    if row.rounds and len(row.rounds) == len(base.rounds):
        return statistics.median(a / b for a, b in zip(row.rounds, base.rounds, strict=True))
    return row.seconds / base.seconds


def memory_ratio(row: Measurement, base: Measurement) -> float | None:
    return (
        None if row.peak_bytes is None or not base.peak_bytes else row.peak_bytes / base.peak_bytes
    )


def table(head: Sequence[str], body: Sequence[Sequence[object]], text_last: bool = False) -> str:
    """A markdown table: the first column left-aligned, the others right-aligned (the last
    left-aligned too with ``text_last``)."""
    align = ["---"] + ["---:"] * (len(head) - 2) + ["---" if text_last else "---:"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in body])


Column = tuple[str, Callable[[Measurement], str]]


def contestant_table(rows: Sequence[Measurement], columns: Sequence[Column]) -> str:
    """A table of contestants: their name, then ``columns``; the last column is text."""
    body = [[row.name, *(cell(row) for _, cell in columns)] for row in rows]
    return table(["contestant", *(title for title, _ in columns)], body, text_last=True)


TIME_COLUMN: Column = ("time", lambda row: fmt_seconds(row.seconds, row.at_least))


def peak_column(title: str = "peak memory") -> Column:
    return title, lambda row: fmt_bytes(row.peak_bytes)


def time_ratio_column(title: str, base: Measurement, digits: int = 2) -> Column:
    return title, lambda row: fmt_ratio(time_ratio(row, base), row.at_least, digits)


def memory_ratio_column(title: str, base: Measurement) -> Column:
    return title, lambda row: fmt_ratio(memory_ratio(row, base), digits=1)


def _recall_cell(row: Measurement) -> str:
    """Recall@K values in the order of K, then the row's note."""
    ordered = sorted(row.values.items(), key=lambda item: int(item[0].rsplit("@", 1)[1]))
    values = ", ".join(f"{key} = {value:.4f}" for key, value in ordered)
    return "; ".join(filter(None, [values, row.note])) or "—"


RECALL_COLUMN: Column = ("Recall@K", _recall_cell)


def machine(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        found = re.search(r"model name\s*:\s*(.+)", f.read())
        cpu = found.group(1).strip() if found else cpu
    text = f"CPU {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, device {device}"
    return text + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else "")


def write_section(name: str, body: str, path: Path) -> None:
    """Replace (or append) the block between ``<!-- name:start -->`` and ``:end -->``;
    the text outside the blocks stays."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":  # a child of call()
    child_main(*sys.argv[1:])
