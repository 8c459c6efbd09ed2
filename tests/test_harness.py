"""The test harness itself: the shared gloo worker pools behind ``run_distributed``
(``tests/distributed_pool.py``) and the default selection by marker (``conftest.py``)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import distributed_pool
import pytest
import torch
import torch.distributed as dist
from helpers import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _ranks(rank: int, world: int, payload: Any) -> dict[str, Any]:
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return {"rank": rank, "world": world, "payload": payload, "sum": int(total), "pid": os.getpid()}


def _disturb(rank: int, world: int, payload: Any) -> None:
    """Changes every piece of process state the pool restores."""
    torch.set_num_threads(3)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.rand(7)
    random.random()
    warnings.simplefilter("error")
    os.environ["RUN_DISTRIBUTED_LEFTOVER"] = "1"
    os.chdir("/")


def _state(rank: int, world: int, payload: Any) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("a warning, not an error", UserWarning, stacklevel=1)
    return {
        "threads": torch.get_num_threads(),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "torch": torch.rand(3).tolist(),
        "python": random.random(),
        "warned": len(caught),
        "leftover": "RUN_DISTRIBUTED_LEFTOVER" in os.environ,
        "cwd": os.getcwd(),
    }


def _fail_on_one(rank: int, world: int, payload: Any) -> None:
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that never comes


def _sleep(rank: int, world: int, seconds: float) -> None:
    time.sleep(seconds)


def _destroy(rank: int, world: int, payload: Any) -> None:
    dist.destroy_process_group()


@pytest.mark.ddp
def test_calls_share_the_processes_and_return_results_by_rank() -> None:
    first = run_distributed(_ranks, world_size=3, payload=[1, "x"])
    again = run_distributed(_ranks, world_size=3)
    assert [r["rank"] for r in first] == [0, 1, 2]
    assert {r["world"] for r in first} == {3} and {r["sum"] for r in first} == {6}
    assert all(r["payload"] == [1, "x"] for r in first)
    assert [r["pid"] for r in again] == [r["pid"] for r in first]


@pytest.mark.ddp
def test_each_call_starts_from_the_processes_first_state() -> None:
    before = run_distributed(_state, world_size=2)
    run_distributed(_disturb, world_size=2)
    after = run_distributed(_state, world_size=2)
    assert after == before
    assert after[0]["threads"] == 1 and after[0]["dtype"] == torch.float32
    assert after[0]["grad"] and after[0]["warned"] == 1 and not after[0]["leftover"]


@pytest.mark.ddp
def test_an_unpicklable_function_fails_before_anything_runs() -> None:
    pids = [r["pid"] for r in run_distributed(_ranks, world_size=2)]
    with pytest.raises(TypeError, match="must be picklable"):
        run_distributed(lambda rank, world, payload: None, world_size=2)
    assert [r["pid"] for r in run_distributed(_ranks, world_size=2)] == pids  # the same pool


# The tests below stop a pool; one process (world size 1) where two are not needed.


@pytest.mark.ddp
def test_a_call_past_its_timeout_raises_with_the_stacks_of_the_ranks() -> None:
    run_distributed(_ranks, world_size=1)  # the pool started, this module imported there
    with pytest.raises(TimeoutError, match=r"(?s)did not return within 2 s.*in _sleep"):
        run_distributed(_sleep, world_size=1, payload=600.0, timeout=2)
    assert [r["sum"] for r in run_distributed(_ranks, world_size=1)] == [1]


@pytest.mark.ddp
def test_a_function_that_destroys_the_group_is_an_error_naming_fresh() -> None:
    pids = {r["pid"] for r in run_distributed(_ranks, world_size=1)}
    with pytest.raises(AssertionError, match="needs fresh=True"):
        run_distributed(_destroy, world_size=1)
    assert run_distributed(_destroy, world_size=1, fresh=True) == [None]
    again = run_distributed(_ranks, world_size=1)
    assert [r["sum"] for r in again] == [1]
    assert not {r["pid"] for r in again} & pids  # a new pool


@pytest.mark.ddp
def test_a_failure_on_one_rank_is_raised_and_the_next_call_has_a_working_group() -> None:
    pids = {r["pid"] for r in run_distributed(_ranks, world_size=2)}
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed:\n.*planted failure on rank 1"):
        run_distributed(_fail_on_one, world_size=2)
    # rank 0 was stuck in its all_reduce: stopped after the grace period, not waited for
    assert time.monotonic() - started < distributed_pool.DEFAULT_TIMEOUT
    again = run_distributed(_ranks, world_size=2)
    assert [r["sum"] for r in again] == [3, 3]
    assert not {r["pid"] for r in again} & pids  # a new pool


def test_a_test_not_marked_ddp_cannot_run_processes() -> None:
    with pytest.raises(RuntimeError, match=r"is not marked ddp: add @pytest\.mark\.ddp"):
        run_distributed(_ranks, world_size=2)


_COLLECT = """\
import json
import sys

import pytest

for args in sys.argv[1:]:
    print("=== collect", flush=True)
    pytest.main(["--collect-only", "-q", *json.loads(args)])
    sys.stdout.flush()
"""


def _collected(*runs: tuple[str, ...]) -> list[tuple[int, int]]:
    """(selected, deselected) of each ``pytest --collect-only`` run of ``runs`` in this
    repository: one process, which imports the test modules once for them all."""
    done = subprocess.run(
        [sys.executable, "-c", _COLLECT, *(json.dumps(args) for args in runs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    parts = done.stdout.split("=== collect\n")[1:]
    assert len(parts) == len(runs), done.stdout[-2000:] + done.stderr[-2000:]
    counts = []
    for part in parts:
        last = part.strip().splitlines()[-1]
        found = re.match(r"(\d+)(?:/(\d+))? tests? collected(?: \((\d+) deselected\))?", last)
        assert found, part[-2000:] + done.stderr[-2000:]
        counts.append((int(found.group(1)), int(found.group(3) or 0)))
    return counts


@pytest.mark.slow
def test_the_default_run_leaves_out_slow_and_memory_and_all_runs_them() -> None:
    benchmarks = "tests/test_benchmarks.py"
    source = (ROOT / benchmarks).read_text(encoding="utf-8")
    slow = source.count("@pytest.mark.slow\n")
    assert slow >= 4
    named = f"{benchmarks}::test_threads_all_runs_at_every_core_only"  # marked slow
    plain, every, by_name = _collected((benchmarks,), (benchmarks, "--all"), (named,))
    default, left_out = plain
    assert left_out >= slow and default > 0
    assert every == (default + left_out, 0)
    assert by_name == (1, 0)
