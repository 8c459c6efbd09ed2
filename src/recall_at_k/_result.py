"""From a rank histogram to what users receive: a scalar or a ``{"recall@K": value}`` dict."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from recall_at_k._kernel import recall_from_histogram

RecallOutput = Tensor | dict[str, Tensor]


def format_recall(values: Tensor, ks: tuple[int, ...], single: bool, key: str) -> RecallOutput:
    """A scalar tensor when ``k`` was an int, else a dict keyed by ``key.format(k=K)``."""
    values = values.to(torch.get_default_dtype())
    if single:
        return values[0]
    return {key.format(k=k): values[i] for i, k in enumerate(ks)}


def recall_result(
    hist: Tensor,
    queries: Tensor,
    ks: tuple[int, ...],
    single: bool,
    key: str,
    empty_target_action: str,
) -> RecallOutput:
    """Recall@K from the state, raising or warning as DESIGN section 1 says."""
    values, counted, without_pos = recall_from_histogram(hist, queries, ks, empty_target_action)
    if empty_target_action == "error" and without_pos:
        raise ValueError(
            f"{without_pos} quer{'y' if without_pos == 1 else 'ies'} had no valid positive"
            " target while `empty_target_action='error'`; pass 'neg', 'pos' or 'skip' to"
            " count them differently"
        )
    if counted == 0:
        warnings.warn(
            "No query was counted for Recall@K (no update, or every query lacked a valid"
            f" positive with empty_target_action={empty_target_action!r}); returning NaN",
            UserWarning,
            stacklevel=3,
        )
    return format_recall(values, ks, single, key)
