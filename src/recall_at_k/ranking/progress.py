"""A progress bar over a ranking's queries (``progress=True``): tqdm, on stderr.

tqdm is optional: :func:`check_progress` is called where ``progress`` is given, so that
``progress=True`` without tqdm fails there, saying what to install. Under DDP only the
process of rank 0 shows a bar (:func:`recall_at_k.ranking.rank.rank_shared`).
"""

from __future__ import annotations

import importlib
from typing import Any

INSTALL = "pip install tqdm"


def check_progress(progress: object) -> bool:
    """``progress`` as a bool: a ValueError unless it is one, an ImportError naming what
    to install when it is True and tqdm cannot be imported."""
    if not isinstance(progress, bool):
        raise ValueError(
            f"`progress` must be a bool (True shows a progress bar over the ranking),"
            f" got {progress!r}"
        )
    if progress:
        _tqdm()
    return progress


def _tqdm() -> Any:
    """tqdm's ``tqdm`` class, or an ImportError that says what to install."""
    try:
        module = importlib.import_module("tqdm")
    except ImportError as err:
        raise ImportError(
            f"progress=True shows its bar with tqdm, which is not installed: {INSTALL}"
            " (or pass progress=False)"
        ) from err
    return module.tqdm


class Progress:
    """A bar over ``total`` queries (``enabled``), or over other units (a sharded gallery's
    blocks), advanced as tiles or blocks of queries are ranked; nothing at all when not
    enabled."""

    def __init__(
        self, total: int, enabled: bool, description: str = "ranking", unit: str = "query"
    ) -> None:
        self.bar: Any = None
        if enabled and total > 0:
            self.bar = _tqdm()(total=total, desc=description, unit=unit, leave=False)

    def update(self, count: int) -> None:
        if self.bar is not None:
            self.bar.update(count)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
