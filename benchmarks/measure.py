"""Shared measuring tools of the benchmarks: timing, peak memory, child processes, tables.

Time is the median of repeated runs after a warm-up (CUDA events on a GPU). Peak memory
is the increase over what was resident before a contestant started: on CPU the
resident-set high-water mark (Linux VmHWM, reset through /proc/self/clear_refs, under
:func:`live_memory`), on CUDA ``torch.cuda.max_memory_allocated``. A contestant stopped
at a time bound keeps its row, which says so (:class:`Measurement` ``at_least``).
The tests' memory probe (``tests/memory_probe.py``) uses :func:`start_peak` and
:func:`peak_since` too: one implementation of the peak.
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
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# glibc: hand every freed buffer above this size back to the system at once, so that the
# resident-set high-water mark is live memory rather than heap the allocator kept.
LIVE_MEMORY_MMAP_THRESHOLD = 128 * 1024

# The script a child process runs (its hidden ``--child`` option calls :func:`child_main`).
CHILD_ENTRY = Path(__file__).with_name("run.py")


@dataclass
class Measurement:
    """A contestant's row: median time, peak memory and what else its workload reports.

    ``rounds`` (the time of every interleaved round) makes :func:`time_ratio` the median
    of the per-round ratios instead of the ratio of the medians.
    """

    name: str
    seconds: float | None  # None: did not run (see note)
    peak_bytes: int | None
    note: str = ""
    at_least: bool = False  # stopped at a time bound: ``seconds`` is a lower bound
    cpu_seconds: float | None = None
    values: dict[str, float] = field(default_factory=dict)  # Recall@K, by key
    rounds: list[float] = field(default_factory=list)
    details: dict[str, str] = field(default_factory=dict)  # workload-specific table cells


@dataclass
class Section:
    """What a workload's ``run`` returns: its markdown body and its rows by name."""

    body: str
    rows: dict[str, Measurement] = field(default_factory=dict)


@dataclass(frozen=True)
class Setup:
    """How the contestants run: where, with how many torch (and OpenMP) threads a child
    process, how isolated (:func:`call_each`), and the time bound of the slow peers."""

    device: str = "cpu"
    threads: int = 1
    isolation: str = "process"  # or "grouped", or "inline" (tests)
    time_limit: float | None = None


def by_name(rows: Sequence[Measurement]) -> dict[str, Measurement]:
    return {row.name: row for row in rows}


# ------------------------------------------------------------------------ memory


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        match = re.search(r"VmHWM:\s+(\d+) kB", f.read())
    assert match is not None
    return int(match.group(1)) * 1024


def release_memory() -> None:
    """Collect garbage and hand freed heap memory back to the system (glibc); freeze the
    survivors out of later collections, a few tenths of a second otherwise paid before
    every contestant."""
    gc.collect()
    gc.freeze()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def _mallopt(param: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").mallopt(param, value)


@contextlib.contextmanager
def live_memory() -> Iterator[None]:
    """In this process, what ``MALLOC_MMAP_THRESHOLD_`` does for a child (:func:`call`).

    Inside the block glibc serves and frees every buffer above 128 KiB with mmap, so
    the resident-set high-water mark is live memory rather than heap that the allocator
    kept (a peer's large temporaries otherwise leave gigabytes of RSS behind). After it,
    the thresholds are fixed where glibc's dynamic ones settle (32 MiB mmap, 64 MiB trim),
    so that timed runs reuse heap as they would by default.
    """
    _mallopt(_M_MMAP_THRESHOLD, LIVE_MEMORY_MMAP_THRESHOLD)
    _mallopt(_M_TRIM_THRESHOLD, LIVE_MEMORY_MMAP_THRESHOLD)
    try:
        yield
    finally:
        _mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
        _mallopt(_M_TRIM_THRESHOLD, 64 * 2**20)


def start_peak(device: str) -> int:
    """Start a peak-memory window; returns the baseline in bytes."""
    release_memory()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    return _rss_bytes()


def on_own_thread(call: Callable[[], Any]) -> Any:
    """``call()`` on a thread started for it; its result, or its exception raised here.

    A measured call runs so that its C-heap allocations come from a heap of their own
    (glibc gives a new thread a new arena) rather than from the holes that building
    the measurement left in the main thread's heap, which :func:`start_peak` hands
    back to the system: small buffers placed in those holes each touch a page again,
    wherever they land, and the same ``compute()`` read from 2.6 to 4.8 MiB beyond its
    copy of 20,000 x 128 embeddings on the main thread, 3.6-3.8 MiB on its own. The
    arena is new only while no thread has ended before: glibc hands an ended thread's
    arena, holes and all, to the next thread, so warm-ups run on the main thread (one
    on a thread of its own made the measured call read up to 0.8 MiB more).
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


def peak_since(device: str, baseline: int) -> int:
    """Peak memory over ``baseline`` since :func:`start_peak`."""
    if device == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated()) - baseline
    return max(_hwm_bytes() - baseline, 0)


# -------------------------------------------------------------------------- time


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """``fn()`` and the seconds it took (CUDA events on a GPU)."""
    if device == "cuda":
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        start.record()
        result = fn()
        end.record()
        torch.cuda.synchronize()
        return result, float(start.elapsed_time(end)) / 1000.0
    begin = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - begin


@dataclass
class Contestant:
    """A contestant of :func:`measure_interleaved`."""

    name: str
    fn: Callable[[], object]
    repeats: int = 5
    note: str = ""


def measure_interleaved(
    contestants: Sequence[Contestant], device: str = "cpu"
) -> list[Measurement]:
    """Each contestant's peak memory in a warm-up run (:func:`live_memory`), then its
    median time over rounds that interleave the contestants, so that a change of load on
    a shared machine touches them alike (round r: every contestant with over r repeats).
    """
    peaks = []
    with live_memory():
        for contestant in contestants:
            baseline = start_peak(device)
            timed(contestant.fn, device)
            peaks.append(peak_since(device, baseline))
    release_memory()
    times: list[list[float]] = [[] for _ in contestants]
    for round_index in range(max(c.repeats for c in contestants)):
        for contestant, out in zip(contestants, times, strict=True):
            if round_index < contestant.repeats:
                out.append(timed(contestant.fn, device)[1])
    release_memory()
    return [
        Measurement(c.name, statistics.median(t), peak, c.note)
        for c, t, peak in zip(contestants, times, peaks, strict=True)
    ]


class TimeBoundError(Exception):
    """A contestant ran past its time bound (raised by :func:`time_bound`)."""


@contextlib.contextmanager
def time_bound(seconds: float | None) -> Iterator[None]:
    """Raise :class:`TimeBoundError` in the block once it has run ``seconds`` seconds.

    Through ``SIGALRM`` (main thread, POSIX): a Python loop, such as torchmetrics'
    per-query compute, is interrupted between two torch calls.
    """
    if seconds is None or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise TimeBoundError

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def measure_bounded(
    name: str, fn: Callable[[], object], *, device: str = "cpu", time_limit: float | None = None
) -> Measurement:
    """One run of a slow contestant (time and peak memory), stopped at ``time_limit``.

    Runs under :func:`live_memory`: a slow peer's few large allocations cost little.
    """
    baseline = start_peak(device)
    try:
        with live_memory(), time_bound(time_limit):
            _, seconds = timed(fn, device)
    except TimeBoundError:
        assert time_limit is not None
        row = timed_out(name, time_limit)
        row.peak_bytes = peak_since(device, baseline)
        row.note += " (peak memory up to then)"
        return row
    peak = peak_since(device, baseline)
    release_memory()
    return Measurement(name, seconds, peak)


# ---------------------------------------------------------------------- children


def call(
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    setup: Setup,
    *,
    live_memory: bool = False,
    timeout: float | None = None,
) -> Any:
    """``fn(**kwargs)``, its result through JSON, in a fresh child process of its own.

    ``fn`` is a module-level function of a module on the child's path (the benchmarks
    and ``PYTHONPATH``). The child runs ``setup.threads`` torch (and OpenMP) threads and,
    with ``live_memory``, glibc's ``MALLOC_MMAP_THRESHOLD_`` at 128 KiB (see
    :func:`live_memory`). Returns ``None`` when the child ran past ``timeout`` seconds
    (it is killed: a safety net; a contestant bounds itself with :func:`time_bound`);
    raises ``RuntimeError`` with its stderr when it fails. The ``"inline"`` isolation
    calls ``fn`` in this process instead (tests: no interpreter start-up).
    """
    if setup.isolation == "inline":
        return json.loads(json.dumps(fn(**kwargs)))
    target = f"{fn.__module__}.{fn.__name__}"
    command = [sys.executable, str(CHILD_ENTRY), "--threads", str(setup.threads)]
    command += ["--child", target, json.dumps(kwargs)]
    env = {**os.environ, "OMP_NUM_THREADS": str(setup.threads)}
    if live_memory:
        env["MALLOC_MMAP_THRESHOLD_"] = str(LIVE_MEMORY_MMAP_THRESHOLD)
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, check=False, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def call_each(
    fn: Callable[..., list[Any]],
    names: Sequence[str],
    kwargs: dict[str, Any],
    setup: Setup,
    live_memory: bool,
) -> list[Any]:
    """``fn(names=..., **kwargs)`` (a list, an item a name) through :func:`call`: with
    the ``"process"`` isolation a child of its own for each name, else one for all."""
    groups = [[name] for name in names] if setup.isolation == "process" else [list(names)]
    outs = []
    for group in groups:
        outs += call(fn, {**kwargs, "names": group}, setup, live_memory=live_memory)
    return outs


def bounded_peer(
    name: str, need: int, fn: Callable[..., Any], kwargs: dict[str, Any], setup: Setup
) -> Measurement:
    """A slow peer's row: ``fn(**kwargs, time_limit=...)``, which returns the fields of its
    :class:`Measurement` and stops itself at ``setup.time_limit``, run by :func:`call`
    under live-memory settings; not started when it ``need``s more than the memory bound."""
    skipped = over_memory_bound(name, need, setup.device)
    if skipped is not None:
        return skipped
    bound = setup.time_limit
    safety = None if bound is None else 2 * bound + 300
    out = call(fn, {**kwargs, "time_limit": bound}, setup, live_memory=True, timeout=safety)
    if out is None:
        assert bound is not None
        return timed_out(name, bound)
    return Measurement(**out)


def child_main(target: str, kwargs: str) -> None:
    """The child side of :func:`call`: print the JSON of ``module.function(**kwargs)``."""
    module, name = target.rsplit(".", 1)
    fn = getattr(importlib.import_module(module), name)
    print(json.dumps(fn(**json.loads(kwargs))))


def timed_out(name: str, seconds: float) -> Measurement:
    """The row of a contestant stopped at a time bound of ``seconds``."""
    note = f"did not finish within the time bound of {fmt_seconds(seconds)}: stopped there"
    return Measurement(name, seconds, None, note, at_least=True)


def over_memory_bound(name: str, need: int, device: str, share: float = 0.8) -> Measurement | None:
    """The row of a contestant that would need ``need`` bytes, over ``share`` of the
    available memory (CPU only); ``None`` when it fits and should run."""
    try:
        with open("/proc/meminfo") as f:
            found = re.search(r"MemAvailable:\s+(\d+) kB", f.read())
    except OSError:
        found = None
    free = int(found.group(1)) * 1024 if found else None
    if device != "cpu" or free is None or need <= share * free:
        return None
    note = (
        f"not run: needs about {fmt_bytes(need)}, over the memory bound of"
        f" {fmt_bytes(share * free)} ({share:.0%} of the available memory)"
    )
    return Measurement(name, None, None, note)


# ------------------------------------------------------------------------ format


def fmt_seconds(seconds: float | None, at_least: bool = False) -> str:
    if seconds is None:
        return "—"
    text = f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"
    return f"> {text}" if at_least else text


def fmt_bytes(num: int | float | None) -> str:
    if num is None:
        return "—"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= scale:
            return f"{num / scale:.1f} {unit}"
    return f"{int(num)} B"


def fmt_ratio(value: float | None, at_least: bool = False, digits: int = 2) -> str:
    if value is None:
        return "—"
    return f"{'>= ' if at_least else ''}{value:.{digits}f}x"


def fmt_values(values: dict[str, float]) -> str:
    """Recall@K values in the order of K: ``recall@1 = 0.5673, recall@5 = ...``."""
    ordered = sorted(values.items(), key=lambda item: int(item[0].rsplit("@", 1)[1]))
    return ", ".join(f"{key} = {value:.4f}" for key, value in ordered)


def time_ratio(row: Measurement, base: Measurement) -> float | None:
    """``row``'s time over ``base``'s: per round then the median when both have rounds."""
    if row.seconds is None or not base.seconds:
        return None
    if row.rounds and len(row.rounds) == len(base.rounds):
        return statistics.median(a / b for a, b in zip(row.rounds, base.rounds, strict=True))
    return row.seconds / base.seconds


def memory_ratio(row: Measurement, base: Measurement) -> float | None:
    if row.peak_bytes is None or not base.peak_bytes:
        return None
    return row.peak_bytes / base.peak_bytes


def markdown_table(
    head: Sequence[str], body: Sequence[Sequence[object]], *, text_last: bool = False
) -> str:
    """A markdown table: the first column left-aligned, the others right-aligned (the last
    left-aligned too with ``text_last``)."""
    align = ["---"] + ["---:"] * (len(head) - 1)
    if text_last:
        align[-1] = "---"
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in body]
    return "\n".join(lines)


Column = tuple[str, Callable[[Measurement], str]]


def contestant_table(rows: Sequence[Measurement], columns: Sequence[Column]) -> str:
    """A table of contestants: their name, then ``columns``; the last column is text."""
    head = ["contestant", *(title for title, _ in columns)]
    body = [[row.name, *(cell(row) for _, cell in columns)] for row in rows]
    return markdown_table(head, body, text_last=True)


TIME_COLUMN: Column = ("time", lambda row: fmt_seconds(row.seconds, row.at_least))


def peak_column(title: str = "peak memory") -> Column:
    return title, lambda row: fmt_bytes(row.peak_bytes)


def time_ratio_column(title: str, base: Measurement, digits: int = 2) -> Column:
    return title, lambda row: fmt_ratio(time_ratio(row, base), row.at_least, digits)


def memory_ratio_column(title: str, base: Measurement) -> Column:
    return title, lambda row: fmt_ratio(memory_ratio(row, base), digits=1)


# Recall@K values, then the row's note (why it did not run, ...).
RECALL_COLUMN: Column = (
    "Recall@K",
    lambda row: "; ".join(filter(None, [fmt_values(row.values), row.note])) or "—",
)


# ----------------------------------------------------------------------- reports


def machine(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.+)", f.read())
        cpu = found.group(1).strip() if found else cpu
    except OSError:
        pass
    text = f"CPU {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, device {device}"
    if device == "cuda":
        text += f" ({torch.cuda.get_device_name()})"
    return text


def write_section(name: str, body: str, path: Path) -> None:
    """Replace (or append) the section between ``<!-- name:start -->`` and ``:end -->``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        _, after = rest.split(end, 1)
        text = before + block + after
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
