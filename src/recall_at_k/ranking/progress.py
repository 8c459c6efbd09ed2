"""A progress bar over a ranking's queries (``progress=True``): tqdm (optional), on stderr,
on the process of rank 0 only."""

from __future__ import annotations

import importlib
from typing import Any


def check_progress(progress: object) -> bool:
    """``progress`` as a bool (ValueError), or ImportError naming tqdm when True and missing."""
    if not isinstance(progress, bool):
        raise ValueError(
            f"`progress` must be a bool (True shows a progress bar over the ranking),"
            f" got {progress!r}"
        )
    if progress:
        _tqdm()
    return progress


def _tqdm() -> Any:
    """tqdm's ``tqdm`` class, or an ImportError saying what to install."""
    try:
        module = importlib.import_module("tqdm")
    except ImportError as err:
        raise ImportError(
            "progress=True shows its bar with tqdm, which is not installed: pip install tqdm"
            " (or pass progress=False)"
        ) from err
    return module.tqdm


class Progress:
    """A bar over ``total`` queries (or other units) when ``enabled``, else nothing."""

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
