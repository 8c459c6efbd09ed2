"""``compute()`` is a collective: what happens when one process calls it alone, and the
local-only alternative (docs/distributed.md, "Call compute() on every process"; calling
it on every process is examples/torchrun_evaluation.py, run by tests/test_examples.py).

Every case starts two gloo processes of its own: a collective that one process left half
done leaves the group unusable, so these never share processes with other tests. They are
forked from the tests' fork server (tests/distributed_pool.py), which imported torch and
the package once and never joins a process group.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK
from recall_at_k.functional import embedding_recall_at_k

# The default group's timeout is generous (a busy machine may take seconds to start the
# other process); a lone compute() waits on a group of its own with a short timeout.
TIMEOUT_S = 120
SHORT_TIMEOUT_S = 3
KS = (1, 5)
FORMS = ("embeddings", "dense")


def _embeddings(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's share: 20 embeddings of 3 labels (uneven: rank 1 has more)."""
    gen = torch.Generator().manual_seed(rank)
    size = 20 + 7 * rank
    return torch.randn(size, 8, generator=gen), torch.randint(0, 3, (size,), generator=gen)


def _metric(form: str, rank: int, **kwargs: Any) -> EmbeddingRecallAtK | RetrievalRecallAtK:
    if form == "embeddings":
        embedding_metric = EmbeddingRecallAtK(k=KS, **kwargs)
        embedding_metric.update(*_embeddings(rank))
        return embedding_metric
    gen = torch.Generator().manual_seed(rank)
    dense_metric = RetrievalRecallAtK(k=KS, **kwargs)
    dense_metric.update(
        torch.randn(10, 6, generator=gen), torch.randint(0, 6, (10,), generator=gen)
    )
    return dense_metric


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.02)


def _alone_after_the_others_finished(rank: int, out: Path) -> Any:
    """The second process ends without compute(); the first then calls it alone."""
    metric = _metric("embeddings", rank)
    if rank == 1:
        return None  # its process group is destroyed, and the process ends
    _wait_for(out / "rank1.pt")  # the second process has ended its process group
    try:
        metric.compute()
    except RuntimeError as err:
        return str(err)
    return "no error"


def _alone_while_the_others_run(rank: int, out: Path) -> Any:
    """The second process stays alive, never calling compute(), until the first is done.
    The first computes with ``sync_on_compute=False`` (both forms), then synchronised."""
    # Creating a group is a collective of its own: both processes take part.
    short = dist.new_group(timeout=timedelta(seconds=SHORT_TIMEOUT_S))
    if rank == 1:
        _wait_for(out / "first-done")
        return None
    local = {form: _metric(form, rank, sync_on_compute=False).compute() for form in FORMS}
    try:
        _metric("embeddings", rank, process_group=short).compute()
        message = "no error"
    except RuntimeError as err:
        message = str(err)
    (out / "first-done").touch()
    return {"local": local, "synchronised": message}


CASES: dict[str, Callable[[int, Path], Any]] = {
    "alone_after_the_others_finished": _alone_after_the_others_finished,
    "alone_while_the_others_run": _alone_while_the_others_run,
}


def _entry(rank: int, port: int, out_dir: str, case: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=2, timeout=timedelta(seconds=TIMEOUT_S)
        )
        try:
            result = {"ok": CASES[case](rank, out)}
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything to the test
        result = {"error": traceback.format_exc()}
    torch.save(result, out / f"rank{rank}.pt.tmp")
    os.replace(out / f"rank{rank}.pt.tmp", out / f"rank{rank}.pt")  # appears whole


def _run(case: str) -> list[Any]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _entry, args=(port, out_dir, case), nprocs=2, join=True, start_method="forkserver"
        )
        results = []
        for rank in range(2):
            result = torch.load(Path(out_dir) / f"rank{rank}.pt", weights_only=False)
            assert "error" not in result, f"rank {rank} failed:\n{result['error']}"
            results.append(result["ok"])
        return results


def test_compute_alone_after_the_others_finished_is_a_bare_gloo_error() -> None:
    message, _ = _run("alone_after_the_others_finished")
    assert "Connection closed by peer" in message or "Connection reset by peer" in message, message


@pytest.fixture(scope="module")
def while_the_others_run() -> dict[str, Any]:
    first, _ = _run("alone_while_the_others_run")
    assert isinstance(first, dict)
    return first


def test_compute_alone_while_the_others_run_waits_for_the_timeout(
    while_the_others_run: dict[str, Any],
) -> None:
    assert "Timed out" in while_the_others_run["synchronised"], while_the_others_run


@pytest.mark.parametrize("form", FORMS)
def test_sync_on_compute_false_computes_one_process_alone(
    form: str, while_the_others_run: dict[str, Any]
) -> None:
    """No communication: the value of the first process's own data, while the second
    process (alive, never calling compute) would have made any collective time out."""
    local = while_the_others_run["local"][form]
    if form == "embeddings":
        expected = embedding_recall_at_k(*_embeddings(0), k=KS)
    else:
        expected = _metric(form, 0).compute()  # one process, no process group
    assert local.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(local[key], value), key
