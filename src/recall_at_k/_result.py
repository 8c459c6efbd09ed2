"""From a rank histogram to what users receive: values, intervals, warnings, output shape."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from recall_at_k._kernel import recall_from_histogram
from recall_at_k._types import RecallOutput


def format_output(values: Tensor, keys: Sequence[str], single: bool) -> RecallOutput:
    """``values`` (``[len(keys)]`` or ``[len(keys), 2]``): a scalar for an int ``k``, or a dict."""
    values = values.to(torch.get_default_dtype())
    if single:
        return values[0]
    return {key: values[i] for i, key in enumerate(keys)}


def recall_values(
    hist: Tensor, queries: Tensor, ks: tuple[int, ...], empty_target_action: str
) -> tuple[Tensor, int]:
    """float64 ``[len(ks)]`` Recall@K and the number of counted queries, raising for
    ``empty_target_action="error"`` and warning when nothing is counted."""
    values, counted, without_pos = recall_from_histogram(hist, queries, ks, empty_target_action)
    if empty_target_action == "error" and without_pos:
        raise no_positive_error(without_pos)
    if counted == 0:
        warnings.warn(
            "No query was counted for Recall@K (no update, or every query lacked a valid"
            f" positive with empty_target_action={empty_target_action!r}); returning NaN",
            UserWarning,
            stacklevel=4,
        )
    return values, counted


def no_positive_error(without_pos: int) -> ValueError:
    """The error of ``empty_target_action="error"`` for queries without a valid positive."""
    return ValueError(
        f"{without_pos} quer{'y' if without_pos == 1 else 'ies'} had no valid positive"
        " target while `empty_target_action='error'`; pass 'neg', 'pos' or 'skip' to"
        " count them differently"
    )


def wilson_interval(values: Tensor, counted: int, level: float) -> Tensor:
    """float64 ``[len(values), 2]``: the Wilson score interval (low, high) of each
    proportion of ``values`` out of ``counted`` trials (NaN where there are none)."""
    p = values.to(torch.float64)
    if counted == 0:
        return torch.full((p.shape[0], 2), math.nan, dtype=torch.float64, device=p.device)
    z = float(torch.special.ndtri(torch.tensor(0.5 + level / 2, dtype=torch.float64)))
    n = float(counted)
    denominator = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z / denominator * torch.sqrt((p * (1 - p) / n + z * z / (4 * n * n)).clamp(min=0))
    return torch.stack([(centre - half).clamp(min=0), (centre + half).clamp(max=1)], dim=-1)
