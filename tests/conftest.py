import os
import sys
import warnings
from collections.abc import Iterator

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def quiet_warnings() -> Iterator[None]:
    """Silence warnings (Lightning's many, on small CPU runs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
