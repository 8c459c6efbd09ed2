"""Two-process scripts run to their exit: ``compute()`` then ``destroy_process_group()``
never hangs, and every process exits 0 with the one-process result.

Each run starts two processes of tests/exit_worker.py (a gloo group of two), each of
which computes both metrics and destroys the process group ROUNDS times, then exits:
RUNS x ROUNDS teardowns right after a metric's collectives, RUNS exits. Up to torch 2.7
a gloo thread still holding a collective's tensor when the script dropped it made
``destroy_process_group()`` wait for ever, in about half of such scripts' runs
(recall_at_k._collectives). A run that outlives RUN_TIMEOUT_S fails with both
processes' stacks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from exit_worker import KS, shares, values

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

RUNS = 2
ROUNDS = 10
RUN_TIMEOUT_S = 120  # a run takes seconds; generous for a loaded CI machine
WORKER = Path(__file__).with_name("exit_worker.py")


def _one_process_results() -> dict[str, dict[str, float]]:
    """Both metrics on both processes' data, in this process."""
    embedding, dense = EmbeddingRecallAtK(k=KS), RetrievalRecallAtK(k=KS)
    for rank in range(2):
        embeddings, labels, scores, columns = shares(rank)
        embedding.update(embeddings, labels)
        dense.update(scores, columns)
    return {"embedding": values(embedding.compute()), "dense": values(dense.compute())}


def _run(where: Path) -> list[tuple[int, str, str]]:
    """One run of two processes: each one's exit code, stdout and stderr. On a timeout,
    both dump their threads' stacks (faulthandler, SIGUSR1), are killed, and the test
    fails with them."""
    where.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), *sys.path])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(ROUNDS), str(where)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        for proc in procs:
            proc.kill()
        outputs = [proc.communicate() for proc in procs]
        pytest.fail(
            f"a two-process run outlived {RUN_TIMEOUT_S} s; stacks and output:\n"
            + "\n".join(
                f"--- rank {r}\n{out}\n{err[-6000:]}" for r, (out, err) in enumerate(outputs)
            )
        )
    return [(proc.returncode, *proc.communicate()) for proc in procs]


@pytest.mark.ddp
@pytest.mark.timeout(RUNS * (RUN_TIMEOUT_S + 30))
def test_two_process_scripts_exit(tmp_path: Path) -> None:
    expected = _one_process_results()
    for run in range(RUNS):
        for rank, (code, out, err) in enumerate(_run(tmp_path / f"run{run}")):
            assert code == 0, f"run {run}, rank {rank} exited {code}:\n{err[-6000:]}"
            results = [
                json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")
            ]
            assert len(results) == ROUNDS, f"run {run}, rank {rank}: {out}\n{err[-3000:]}"
            for result in results:
                assert result == expected, f"run {run}, rank {rank}"  # as on one process
