"""Shared measuring tools for the benchmarks: timing, peak memory, children, tables, RESULTS.md.

Time is the median of repeated runs after a warm-up (CUDA events on a GPU). Peak memory
is measured in the same process: on CPU the resident-set high-water mark (Linux VmHWM,
reset through /proc/self/clear_refs before each contestant, with freed heap memory
handed back to the system first, during a run in which glibc returns every freed large
buffer at once: :func:`live_memory`), on CUDA ``torch.cuda.max_memory_allocated``; both
are reported as the increase over what was resident before the contestant started.

A contestant that may exceed a time bound runs in a child process (:func:`run_child`)
that is killed at the bound; its row then says so (:class:`Measurement` ``at_least``)
instead of disappearing from the table.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")

# glibc: hand every freed buffer above this size back to the system at once, so that the
# resident-set high-water mark is live memory rather than heap the allocator kept.
LIVE_MEMORY_MMAP_THRESHOLD = 128 * 1024


@dataclass
class Measurement:
    name: str
    seconds: float | None  # None: did not run (see note)
    peak_bytes: int | None
    note: str = ""
    at_least: bool = False  # stopped at a time bound: ``seconds`` is a lower bound


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
    """Collect garbage and hand freed heap memory back to the system (glibc).

    The survivors are then frozen out of later collections (``gc.freeze``): a full
    collection over everything torch imported takes a few tenths of a second, which
    would otherwise be paid before every contestant.
    """
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
    """In this process, what ``MALLOC_MMAP_THRESHOLD_`` does for a child (:func:`child_env`).

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


def peak_since(device: str, baseline: int) -> int:
    """Peak memory over ``baseline`` since :func:`start_peak`."""
    if device == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated()) - baseline
    return max(_hwm_bytes() - baseline, 0)


def available_bytes() -> int | None:
    """Memory the system can still hand out (Linux MemAvailable), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            found = re.search(r"MemAvailable:\s+(\d+) kB", f.read())
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


# -------------------------------------------------------------------------- time


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def elapsed(fn: Callable[[], object], device: str) -> float:
    """Seconds one call of ``fn`` takes (CUDA events on a GPU)."""
    if device == "cuda":
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end)) / 1000.0
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def measure(
    name: str,
    fn: Callable[[], object],
    *,
    repeats: int = 5,
    device: str = "cpu",
    time_limit: float | None = None,
    note: str = "",
) -> Measurement:
    """Peak memory of a first (warm-up) run, then the median time of ``repeats`` runs.

    A contestant whose warm-up run takes longer than ``time_limit`` seconds is not run
    again: its one run is its time.
    """
    with live_memory():
        baseline = start_peak(device)
        first = elapsed(fn, device)
        peak = peak_since(device, baseline)
    if time_limit is not None and first >= time_limit:
        times = [first]
    else:
        times = [elapsed(fn, device) for _ in range(repeats)]
    release_memory()
    return Measurement(name, statistics.median(times), peak, note)


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
    """:func:`measure` for several contestants, their timed runs interleaved in rounds.

    Each contestant first runs once alone (warm-up; its peak memory, under
    :func:`live_memory`). Then round r runs,
    one after the other, every contestant with more than r repeats, so that a change of
    load on a shared machine touches them alike; a time is the median of its rounds.
    """
    peaks = []
    with live_memory():
        for contestant in contestants:
            baseline = start_peak(device)
            elapsed(contestant.fn, device)
            peaks.append(peak_since(device, baseline))
    release_memory()
    times: list[list[float]] = [[] for _ in contestants]
    for round_index in range(max(c.repeats for c in contestants)):
        for contestant, out in zip(contestants, times, strict=True):
            if round_index < contestant.repeats:
                out.append(elapsed(contestant.fn, device))
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
    name: str,
    fn: Callable[[], object],
    *,
    device: str = "cpu",
    time_limit: float | None = None,
    note: str = "",
) -> Measurement:
    """One run of a slow contestant (time and peak memory), stopped at ``time_limit``.

    Runs under :func:`live_memory`: a slow peer's few large allocations cost little.
    """
    baseline = start_peak(device)
    try:
        with live_memory(), time_bound(time_limit):
            seconds = elapsed(fn, device)
    except TimeBoundError:
        assert time_limit is not None
        row = timed_out(name, time_limit)
        row.peak_bytes = peak_since(device, baseline)
        row.note += " (peak memory up to then)"
        return row
    peak = peak_since(device, baseline)
    release_memory()
    return Measurement(name, seconds, peak, note)


# ---------------------------------------------------------------------- children


def child_env(live_memory: bool) -> dict[str, str]:
    """The environment of a child process; ``live_memory``: see the module constant."""
    env = dict(os.environ)
    if live_memory:
        env["MALLOC_MMAP_THRESHOLD_"] = str(LIVE_MEMORY_MMAP_THRESHOLD)
    return env


def run_child(
    script: str | Path,
    args: Sequence[str],
    *,
    live_memory: bool = False,
    timeout: float | None = None,
) -> Any:
    """Run ``python script args...`` and return the JSON of its last output line.

    Returns ``None`` when the child ran past ``timeout`` seconds (it is killed: a safety
    net; a child bounds its contestant itself with :func:`measure_bounded`); raises
    ``RuntimeError`` with its stderr when it fails.
    """
    command = [sys.executable, str(script), *args]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            check=False,
            env=child_env(live_memory),
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed_out(name: str, seconds: float) -> Measurement:
    """The row of a contestant stopped at a time bound of ``seconds``."""
    note = f"did not finish within the time bound of {fmt_seconds(seconds)}: stopped there"
    return Measurement(name, seconds, None, note, at_least=True)


def not_run(name: str, note: str) -> Measurement:
    """The row of a contestant that was not run (memory bound, missing package, ...)."""
    return Measurement(name, None, None, note)


def over_memory_bound(name: str, need: int, device: str, share: float = 0.8) -> Measurement | None:
    """The row of a contestant that would need ``need`` bytes, over ``share`` of the
    available memory (CPU only); ``None`` when it fits and should run."""
    free = available_bytes()
    if device != "cpu" or free is None or need <= share * free:
        return None
    return not_run(
        name,
        f"not run: needs about {fmt_bytes(need)}, over the memory bound of"
        f" {fmt_bytes(share * free)} ({share:.0%} of the available memory)",
    )


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


def time_ratio(row: Measurement, base: Measurement) -> float | None:
    if row.seconds is None or not base.seconds:
        return None
    return row.seconds / base.seconds


def memory_ratio(row: Measurement, base: Measurement) -> float | None:
    if row.peak_bytes is None or not base.peak_bytes:
        return None
    return row.peak_bytes / base.peak_bytes


def table(
    rows: Sequence[Measurement],
    reference: str,
    floor: str | None = None,
    *,
    memory: bool = False,
    note_header: str = "note",
) -> str:
    """Markdown table: time and peak memory, with ratios to ``reference`` and ``floor``.

    ``time / this metric`` of a peer is how many times longer the peer takes than the
    reference (this package); ``memory`` adds the same ratio for peak memory. A row that
    was stopped at a time bound shows its time and ratios as lower bounds.
    """
    by_name = {row.name: row for row in rows}
    ref = by_name[reference]
    low = by_name[floor] if floor is not None else None
    head = ["contestant", "time", "peak memory", "time / this metric"]
    align = ["---", "---:", "---:", "---:"]
    if memory:
        head.append("memory / this metric")
        align.append("---:")
    if low is not None:
        head.append("time / floor")
        align.append("---:")
    head.append(note_header)
    align.append("---")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for row in rows:
        cells = [
            row.name,
            fmt_seconds(row.seconds, row.at_least),
            fmt_bytes(row.peak_bytes),
            fmt_ratio(time_ratio(row, ref), row.at_least),
        ]
        if memory:
            cells.append(fmt_ratio(memory_ratio(row, ref), digits=1))
        if low is not None:
            cells.append(fmt_ratio(time_ratio(row, low), row.at_least))
        cells.append(row.note or "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_table(head: Sequence[str], body: Sequence[Sequence[object]]) -> str:
    """A plain markdown table (first column left-aligned, the others right-aligned)."""
    align = ["---"] + ["---:"] * (len(head) - 1)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in body]
    return "\n".join(lines)


# ----------------------------------------------------------------------- reports


def machine(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.+)", f.read())
        cpu = found.group(1).strip() if found else cpu
    except OSError:
        pass
    threads = torch.get_num_threads()
    text = (
        f"CPU {cpu}, {os.cpu_count()} cores, torch {torch.__version__},"
        f" {threads} thread{'' if threads == 1 else 's'}, device {device}"
    )
    if device == "cuda":
        text += f" ({torch.cuda.get_device_name()})"
    return text


def write_section(name: str, body: str, path: Path = RESULTS) -> None:
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
