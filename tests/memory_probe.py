"""The memory that ``EmbeddingRecallAtK.compute()`` adds, measured as the benchmarks do.

On CPU: the resident-set high-water mark after ``compute()`` minus the resident set
before it (Linux ``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``), in a
process started with ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed buffers leave the
resident set at once. A first ``compute()`` and ``protocol_report()`` of the same items
(a second metric, filled alike) run before, so that what a process does once is done
before the window, as in a validation epoch after the first: the code the measured
call runs is paged in from libtorch's file, and the interpreter has run ours. They run
on the main thread: on a thread of their own, the measured call's thread took over
that thread's C heap, holes and all (glibc hands an exited thread's arena to the next),
and read up to 0.8 MiB more at 24,000 x 256 items. With a first call of other items
(the branches taken depend on the items) 0.3 MiB of libtorch's code was still read
during the measured call at 1,600 x 2,048 items, and 1.0 MiB from a torch installed
just before (as CI installs it); with a tenth of the items, 0.4 MiB at 24,000 x 256
items. On CUDA: ``torch.cuda.max_memory_allocated()`` minus the memory allocated
before.

On CPU the protocol audit's window is measured apart as well: ``"audit_peak"`` is the
peak over the same baseline while the metric audits its items (``_audits``), and
``"ranking_peak"`` the peak of the rest of ``compute()`` and ``protocol_report()`` (the
high-water mark reset as the audit ends); ``"peak"`` is the larger of the two.

A case may set ``"exclude"`` (``"same_group"`` or ``"same_label_and_group"``: items get
groups, :func:`groups_of`) and ``"near_duplicate"``; items always have ids.

``python tests/memory_probe.py`` reads one case a line (JSON) from its standard input and
prints one JSON line for each, ``{"case": ..., "peak": bytes, "audit_peak": bytes,
"ranking_peak": bytes, "stored": bytes, "tile": bytes, "items": N}`` (or ``{"case": ...,
"error": traceback}``), measured in a child forked for the case (:func:`serve`): a process
that starts with the imports done, so that each case does not pay seconds of imports,
and whose heap is its own from the fork on.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

# One implementation of the probe: the benchmarks' (benchmarks/measure.py).
from measure import LIVE_MEMORY_MMAP_THRESHOLD, on_own_thread, peak_since, start_peak
from memory_formula import CPU_TILE_BYTES

ENV = {"MALLOC_MMAP_THRESHOLD_": str(LIVE_MEMORY_MMAP_THRESHOLD), "OMP_NUM_THREADS": "1"}
"""The environment of a measuring process."""

TIMEOUT_S = 1500
"""How long the probes that start processes of their own wait for them: CI runs the probes
in the background at the lowest CPU priority (``.ci/run``), where they take minutes more
than on an idle machine (pytest's own limit, 600 s a test, is raised there to match)."""

start = start_peak
"""Start a window; the baseline in bytes (then :func:`peak_since`)."""

__all__ = [
    "CPU_TILE_BYTES",
    "ENV",
    "TIMEOUT_S",
    "fill",
    "groups_of",
    "items",
    "measure",
    "on_own_thread",
    "peak_since",
    "start",
]


def items(num: int, dim: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``num`` random float32 embeddings of ``dim`` and labels of ``num // 10`` classes."""
    gen = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(num, dim, generator=gen).to(device)
    labels = torch.randint(0, max(1, num // 10), (num,), generator=gen).to(device)
    return embeddings, labels


def groups_of(labels: torch.Tensor) -> torch.Tensor:
    """Groups for ``exclude``: seven groups (cameras), spread over every label."""
    return torch.arange(labels.shape[0], device=labels.device) % 7


def fill(
    metric: Any,
    protocol: str,
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    groups: torch.Tensor | None = None,
) -> None:
    """Add the items in batches of 1,000: leave-one-out (``"loo"``), or half queries
    and half gallery (``"qg"``, also for ``"bidirectional"``), with ids (and
    ``groups``, if given)."""
    num = embeddings.shape[0]
    ids = torch.arange(num, device=embeddings.device)
    half = num // 2
    for first, stop in ((0, half), (half, num)):
        role = "both" if protocol == "loo" else ("query" if first == 0 else "gallery")
        for start_row in range(first, stop, 1000):
            rows = slice(start_row, min(stop, start_row + 1000))
            batch_groups = None if groups is None else groups[rows]
            metric.update(
                embeddings[rows], labels[rows], role=role, ids=ids[rows], groups=batch_groups
            )


def _reset_peak() -> None:
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _audit_window(device: str, baseline: int, peaks: dict[str, int]) -> None:
    """Measure the audit (``audits_for``) apart: its peak into ``peaks["audit"]``, the
    peak before it into ``peaks["ranking"]``, the high-water mark reset after it."""
    from recall_at_k import _embedding_lifecycle as lifecycle

    audits = lifecycle.audits_for

    def measured(*args: Any, **kwargs: Any) -> Any:
        peaks["ranking"] = max(peaks["ranking"], peak_since(device, baseline))
        result = audits(*args, **kwargs)
        peaks["audit"] = max(peaks["audit"], peak_since(device, baseline))
        _reset_peak()
        return result

    lifecycle.audits_for = measured  # type: ignore[assignment]


def measure(case: dict[str, Any]) -> dict[str, Any]:
    """The peak that ``compute()`` (then ``protocol_report()``) adds for one case."""
    from recall_at_k import EmbeddingRecallAtK

    device = case.get("device", "cpu")
    exclude = case.get("exclude", "none")
    options = {
        "similarity": case["similarity"],
        "chunk_bytes": case["chunk_bytes"],
        "bidirectional": case["protocol"] == "bidirectional",
        "near_duplicate": case.get("near_duplicate"),
        "exclude": exclude,
    }

    def compute_and_report(of: Any) -> None:
        of.compute()
        of.protocol_report()

    warm = EmbeddingRecallAtK((1, 5, 10), **options)
    warm_embeddings, warm_labels = items(case["num"], case["dim"], 0, device)
    warm_groups = None if exclude == "none" else groups_of(warm_labels)
    fill(warm, case["protocol"], warm_embeddings, warm_labels, warm_groups)
    compute_and_report(warm)  # the code the measured call runs is then paged in
    metric = EmbeddingRecallAtK((1, 5, 10), **options)
    embeddings, labels = items(case["num"], case["dim"], 0, device)
    groups = None if exclude == "none" else groups_of(labels)
    fill(metric, case["protocol"], embeddings, labels, groups)
    stored = embeddings.numel() * embeddings.element_size()
    del embeddings, labels, groups, warm, warm_embeddings, warm_labels, warm_groups
    baseline = start(device)
    peaks = {"audit": 0, "ranking": 0}
    if device == "cuda":
        compute_and_report(metric)
    else:  # on a thread of its own: its C heap is then its own (measure.on_own_thread)
        _audit_window(device, baseline, peaks)
        on_own_thread(lambda: compute_and_report(metric))
    peaks["ranking"] = max(peaks["ranking"], peak_since(device, baseline))
    peak = max(peaks.values())
    tile = case["chunk_bytes"] if device == "cuda" else min(case["chunk_bytes"], CPU_TILE_BYTES)
    return {
        "case": case,
        "peak": peak,
        "audit_peak": peaks["audit"],
        "ranking_peak": peaks["ranking"],
        "stored": stored,
        "tile": tile,
        "items": case["num"],
    }


def _measured_in_a_child(case: dict[str, Any]) -> str:
    """``measure(case)`` in a child forked for it, as a JSON line; an ``"error"`` line with
    the traceback if it failed. The parent runs no torch operation and starts no thread,
    so the child forks from one thread and its heap and threads are its own."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, write the line, leave without the parent's exits
        os.close(read)
        try:
            line, code = json.dumps(measure(case)), 0
        except BaseException:
            line, code = json.dumps({"case": case, "error": traceback.format_exc()}), 1
        with os.fdopen(write, "w") as out:
            out.write(line)
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as result:
        line = result.read()
    _, status = os.waitpid(pid, 0)
    if not line:
        return json.dumps({"case": case, "error": f"the child died (wait status {status})"})
    return line


def serve() -> None:
    """Measure each case read from standard input (a JSON line) in a child of its own;
    print one JSON line for each."""
    for line in sys.stdin:
        print(_measured_in_a_child(json.loads(line)), flush=True)


def main() -> None:
    torch.set_num_threads(1)
    serve()


if __name__ == "__main__":
    main()
