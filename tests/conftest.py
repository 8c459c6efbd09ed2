"""Test-session set-up: the Agg backend, a seed per test, one torch thread per xdist worker,
the test selection by marker and the shared distributed worker pool.

Markers (registered in ``pyproject.toml``): ``slow`` (benchmark smoke runs), ``memory``
(resident-memory probes), ``ddp`` (more than one process). ``python -m pytest`` runs
every test but the ``slow`` and ``memory`` ones; ``--all`` runs every test, as does a
command that names tests by node id (``tests/test_x.py::test_y``); ``-m EXPR`` selects
by marker as pytest does, in place of that default.
"""

import os
import sys
import warnings
from collections.abc import Iterator

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
sys.path.insert(0, os.path.dirname(__file__))

import distributed_pool  # from this directory, put on the path above

LEFT_OUT_BY_DEFAULT = ("slow", "memory")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist (-n N) the N workers share the cores: each runs torch on one
    # thread, as do the processes it starts (OMP_NUM_THREADS), or their torch threads
    # would spin beside the other workers'. Tests of thread counts set them themselves.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all",
        action="store_true",
        help="run every test, those marked slow or memory included",
    )


def _default_selection(config: pytest.Config) -> bool:
    """Whether this run leaves out the slow and memory tests."""
    named = any("::" in str(arg) for arg in config.args)
    return not (config.getoption("--all") or config.option.markexpr or named)


def pytest_report_header(config: pytest.Config) -> str | None:
    if _default_selection(config):
        return "default selection: tests marked slow or memory are left out (--all runs them)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _default_selection(config):
        return
    kept, left_out = [], []
    for item in items:
        marked = any(item.get_closest_marker(name) for name in LEFT_OUT_BY_DEFAULT)
        (left_out if marked else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before any fixture of the test, the module-scoped ones included: a test that runs
    # processes through run_distributed must be marked ddp (run_distributed checks).
    distributed_pool.RUNNING_TEST = item


@pytest.fixture(scope="session", autouse=True)
def _distributed_pools() -> Iterator[None]:
    """The worker pools live for the session (spawned on first use) and stop at its end."""
    yield
    distributed_pool.shutdown()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def quiet_warnings() -> Iterator[None]:
    """Silence warnings (Lightning's many, on small CPU runs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
