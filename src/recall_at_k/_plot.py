"""Recall@K curves (CMC curves) with matplotlib, following torchmetrics' plot conventions."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

MARGIN = 0.1  # of the drawn values' span, on each side of them...
MIN_MARGIN = 0.01  # ... and at least this much, within [0, 1]

Curves = Mapping[str, tuple[Sequence[int], Sequence[float]]]
Bands = Mapping[str, tuple[Sequence[float], Sequence[float]]]


def plot_curves(
    results: Curves | Sequence[Curves],
    ax: Any | None,
    title: str,
    bands: Bands | None = None,
    labels: Sequence[str] | None = None,
) -> tuple[Any, Any]:
    """Draw Recall@K against K; ``(fig, ax)``. ``results``: ``{label: (ks, recalls)}`` or a list
    of them (steps, labelled by step or ``labels``); ``bands``: ``{label: (lows, highs)}``."""
    try:
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as err:  # pragma: no cover - exercised without matplotlib
        raise ModuleNotFoundError(
            "plot() needs matplotlib: pip install 'recall-at-k[plot]'"
        ) from err
    fig, ax = plt.subplots() if ax is None else (ax.get_figure(), ax)
    steps: Sequence[Curves] = [results] if isinstance(results, Mapping) else results
    if labels is not None and len(labels) != len(steps):
        raise ValueError(
            f"`labels` must give one label per result: {len(steps)} result(s), got"
            f" {len(labels)} label(s)"
        )
    for step, curves in enumerate(steps):
        for label, (ks, values) in curves.items():
            if labels is not None:
                name = f"{labels[step]} ({label})" if label else labels[step]
            else:
                name = label if len(steps) == 1 else f"{label} (step {step})".strip()
            # Unclipped, so that a marker at 0 or 1 (on the axis' edge) is drawn whole.
            (line,) = ax.plot(list(ks), list(values), marker="o", label=name or None, clip_on=False)
            if bands is not None and label in bands:
                lows, highs = bands[label]
                ax.fill_between(list(ks), lows, highs, color=line.get_color(), alpha=0.2)
    ax.set_xticks(sorted({k for curves in steps for ks, _ in curves.values() for k in ks}))
    ax.set_xlabel("K")
    ax.set_ylabel("Recall@K")
    ax.set_ylim(*fitted_limits(ax.dataLim.intervaly))
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if labels is not None or any(label for curves in steps for label in curves):
        ax.legend()
    return fig, ax


def fitted_limits(drawn: Sequence[float]) -> tuple[float, float]:
    """y-axis limits around ``(lowest, highest)`` within [0, 1]; ``(0, 1)`` if none is finite."""
    low, high = float(min(drawn)), float(max(drawn))
    if not (math.isfinite(low) and math.isfinite(high)) or low > high:
        return 0.0, 1.0
    margin = max(MARGIN * (high - low), MIN_MARGIN)
    return max(0.0, low - margin), min(1.0, high + margin)


def _lookup(result: Mapping[str, Any], key: str) -> Any:
    """``result[key]``, or the one entry whose key ends in ``"/" + key`` (a logged name
    with a prefix, such as ``"val/recall@1"`` for ``"recall@1"``)."""
    if key in result:
        return result[key]
    found = [name for name in result if name.endswith("/" + key)]
    if len(found) != 1:
        raise ValueError(
            f"`val` must hold the key {key!r} (optionally with a prefix ending in '/'),"
            f" found {sorted(result)}"
        )
    return result[found[0]]


def values_of(result: Tensor | Mapping[str, Any], keys: Sequence[str]) -> list[float]:
    """Recall values of one result (or Lightning's logged values) by ``keys`` (scalar: one)."""
    if isinstance(result, Tensor):
        return [float(result)]
    return [float(_lookup(result, key)) for key in keys]


def bounds_of(
    interval: Tensor | Mapping[str, Any], keys: Sequence[str]
) -> tuple[list[float], list[float]]:
    """(lows, highs) of a ``confidence_interval()`` result, in the order of ``keys``."""
    pairs = [interval] if isinstance(interval, Tensor) else [_lookup(interval, k) for k in keys]
    return [float(p[0]) for p in pairs], [float(p[1]) for p in pairs]
