"""Shared measuring tools for the benchmarks: timing, peak memory, tables, RESULTS.md.

Time is the median of repeated runs after a warm-up (CUDA events on a GPU). Peak memory
is measured in the same process: on CPU the resident-set high-water mark (Linux VmHWM,
reset through /proc/self/clear_refs before each contestant, with freed heap memory
handed back to the system first), on CUDA ``torch.cuda.max_memory_allocated``; both are
reported as the increase over what was resident before the contestant started.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


@dataclass
class Measurement:
    name: str
    seconds: float | None  # None: did not run (see note)
    peak_bytes: int | None
    note: str = ""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        match = re.search(r"VmHWM:\s+(\d+) kB", f.read())
    assert match is not None
    return int(match.group(1)) * 1024


def _release_memory() -> None:
    gc.collect()
    with contextlib.suppress(OSError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak(device: str) -> int:
    """Start a peak-memory window; returns the baseline in bytes."""
    _release_memory()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    return _rss_bytes()


def _peak(device: str, baseline: int) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated()) - baseline
    return max(_hwm_bytes() - baseline, 0)


def _elapsed(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
) -> Measurement:
    """Peak memory of a first (warm-up) run, then the median time of ``repeats`` runs.

    A contestant whose warm-up run takes longer than ``time_limit`` seconds is not run
    again: its one run is its time.
    """
    baseline = _reset_peak(device)
    first = _elapsed(fn, device)
    peak = _peak(device, baseline)
    if time_limit is not None and first >= time_limit:
        times = [first]
    else:
        times = [_elapsed(fn, device) for _ in range(repeats)]
    _release_memory()
    return Measurement(name, statistics.median(times), peak)


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms"


def fmt_bytes(num: int | None) -> str:
    if num is None:
        return "—"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= scale:
            return f"{num / scale:.1f} {unit}"
    return f"{num} B"


def table(rows: Sequence[Measurement], reference: str, floor: str | None = None) -> str:
    """Markdown table: time and peak memory, with ratios to ``reference`` and ``floor``."""
    by_name = {row.name: row for row in rows}
    ref = by_name[reference]
    head = "| contestant | time | peak memory | time / this metric |"
    sep = "|---|---:|---:|---:|"
    if floor is not None:
        head += " time / floor |"
        sep += "---:|"
    lines = [head, sep]
    for row in rows:
        ratio = (
            "—" if row.seconds is None or not ref.seconds else f"{row.seconds / ref.seconds:.2f}x"
        )
        line = (
            f"| {row.name} | {fmt_seconds(row.seconds)} | {fmt_bytes(row.peak_bytes)} | {ratio} |"
        )
        if floor is not None:
            low = by_name[floor].seconds
            line += " — |" if row.seconds is None or not low else f" {row.seconds / low:.2f}x |"
        if row.note:
            line += f" {row.note}"
        lines.append(line)
    return "\n".join(lines)


def machine(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.+)", f.read())
        cpu = found.group(1).strip() if found else cpu
    except OSError:
        pass
    text = (
        f"CPU {cpu}, {os.cpu_count()} cores, torch {torch.__version__},"
        f" {torch.get_num_threads()} threads, device {device}"
    )
    if device == "cuda":
        text += f" ({torch.cuda.get_device_name()})"
    return text


def write_section(name: str, body: str) -> None:
    """Replace (or append) the section between ``<!-- name:start -->`` and ``:end -->``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        _, after = rest.split(end, 1)
        text = before + block + after
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)
