"""Named input checks shared by every entry point, in one error style.

Each check raises ``ValueError`` whose message starts with the argument's name in
backticks and says what was expected and what was given. Checks named ``..._structure``
read only shapes, dtypes and devices (no host-device synchronisation) and always run;
checks named ``..._values`` read tensor values and run only when ``validate_args=True``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from recall_at_k._kernel import (
    EMPTY_TARGET_ACTIONS,
    TIES,
    TieCounts,
    Workspace,
    dense_tie_counts,
    reveals_nan,
)

_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)


def _describe(tensor: Tensor) -> str:
    return f"shape {list(tensor.shape)} and dtype {tensor.dtype}"


def _k_validation(k: int | Sequence[int]) -> tuple[int, ...]:
    """``k`` as a tuple of distinct positive ints, in the order given."""
    if isinstance(k, bool) or not isinstance(k, (int, Sequence)) or isinstance(k, str):
        raise ValueError(f"`k` must be a positive int or a sequence of them, got {k!r}")
    values = (k,) if isinstance(k, int) else tuple(k)
    if not values:
        raise ValueError("`k` must not be empty")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"`k` must contain only ints, got {value!r} in {k!r}")
        if value < 1:
            raise ValueError(f"`k` values must be >= 1, got {value} in {k!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"`k` must not contain duplicates, got {k!r}")
    return values


def _choice_validation(name: str, value: object, allowed: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in allowed:
        options = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"`{name}` must be one of {options}, got {value!r}")


def _ties_validation(ties: object, allowed: Sequence[str] = TIES) -> None:
    _choice_validation("ties", ties, allowed)


def _empty_target_action_validation(action: object) -> None:
    _choice_validation("empty_target_action", action, EMPTY_TARGET_ACTIONS)


def _key_validation(key: object) -> None:
    if not isinstance(key, str) or "{k}" not in key:
        raise ValueError(f"`key` must be a str template containing '{{k}}', got {key!r}")


def _same_device_validation(**tensors: Tensor | None) -> None:
    named = [(name, t) for name, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, tensor in named[1:]:
        if tensor.device != first.device:
            raise ValueError(
                f"`{name}` is on device {tensor.device} but `{first_name}` is on"
                f" {first.device}; all inputs must be on the same device"
            )


def _dense_structure_validation(scores: Tensor, target: Tensor, ignore: Tensor | None) -> None:
    """Shapes, dtypes and devices of a dense ``(scores, target, ignore)`` triple."""
    for name, value in (("scores", scores), ("target", target), ("ignore", ignore)):
        if value is not None and not isinstance(value, Tensor):
            raise ValueError(f"`{name}` must be a torch.Tensor, got {type(value).__name__}")
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(
            f"`scores` must be a floating point tensor of shape [Q, G], got {_describe(scores)}"
        )
    num_queries, gallery = scores.shape
    if target.dim() == 1:
        if target.shape[0] != num_queries or target.dtype not in _INDEX_DTYPES:
            raise ValueError(
                "`target` of one dimension must be a signed integer (int64) tensor of shape [Q] ="
                f" [{num_queries}] holding each query's true column (-1 for none),"
                f" got {_describe(target)}"
            )
    elif target.dim() == 2:
        if tuple(target.shape) != (num_queries, gallery) or target.is_floating_point():
            raise ValueError(
                "`target` of two dimensions must be a bool or 0/1 integer tensor of the"
                f" same shape as `scores` [{num_queries}, {gallery}],"
                f" got {_describe(target)}"
            )
    else:
        raise ValueError(
            "`target` must be a [Q, G] bool/0-1 mask or a [Q] int64 column index,"
            f" got {_describe(target)}"
        )
    if ignore is not None and (
        ignore.dtype != torch.bool or tuple(ignore.shape) != (num_queries, gallery)
    ):
        raise ValueError(
            f"`ignore` must be a bool tensor of the same shape as `scores`"
            f" [{num_queries}, {gallery}], got {_describe(ignore)}"
        )
    _same_device_validation(scores=scores, target=target, ignore=ignore)


def _scores_values_validation(scores: Tensor, name: str = "scores") -> None:
    # amax propagates NaN: one fast reduction finds whether there is any (a bool-output
    # isnan over the whole batch is several times slower on CPU); count only then.
    if scores.numel() and bool(torch.isnan(scores.detach().amax())):
        _raise_nan(scores, name)


def _raise_nan(scores: Tensor, name: str = "scores") -> None:
    count = int(torch.isnan(scores).sum())
    raise ValueError(f"`{name}` must not contain NaN, found {count} NaN value(s)")


def _dense_values_validation(scores: Tensor, target: Tensor, *, check_nan: bool = True) -> None:
    """Value checks of a dense input (each reads tensor values on the host).

    ``check_nan=False`` leaves NaN to :func:`_checked_dense_tie_counts`, for the kernel
    paths that find NaN rows in their own passes.
    """
    if check_nan:
        _scores_values_validation(scores)
    if not target.numel():
        return
    if target.dim() == 1:
        gallery = scores.shape[1]
        low, high = int(target.min()), int(target.max())
        if low < -1 or high >= gallery:
            raise ValueError(
                f"`target` column indices must lie in [-1, {gallery}) (the gallery has"
                f" {gallery} items; -1 = no true item), got values in [{low}, {high}]"
            )
    elif target.dtype != torch.bool:
        bad = (target != 0) & (target != 1)
        if bool(bad.any()):
            example = int(target[bad][0])
            raise ValueError(
                f"`target` mask values must be 0 or 1, got {int(bad.sum())} other"
                f" value(s), e.g. {example}"
            )


def _query_ids_validation(query_ids: Tensor, scores: Tensor) -> None:
    """``query_ids`` of a dense update: integer ``[Q]`` on the scores' device."""
    if not isinstance(query_ids, Tensor):
        raise ValueError(f"`query_ids` must be a torch.Tensor, got {type(query_ids).__name__}")
    num_queries = scores.shape[0]
    if (
        query_ids.dim() != 1
        or query_ids.shape[0] != num_queries
        or query_ids.dtype not in (_INDEX_DTYPES)
    ):
        raise ValueError(
            f"`query_ids` must be an integer (int64) tensor of shape [Q] = [{num_queries}],"
            f" one id per row of `scores`, got {_describe(query_ids)}"
        )
    _same_device_validation(preds=scores, query_ids=query_ids)


def _checked_dense_tie_counts(
    scores: Tensor,
    target: Tensor,
    ignore: Tensor | None,
    need: tuple[bool, bool, bool],
    validate_args: bool,
    workspace: Workspace | None = None,
) -> TieCounts:
    """:func:`dense_tie_counts` after the value checks that ``validate_args`` asks for.

    Where the kernel reveals NaN rows itself (:func:`reveals_nan`), the NaN check reads
    its result instead of the scores: one pass over the batch fewer.
    """
    fused = validate_args and reveals_nan(scores, target, ignore)
    if validate_args:
        _dense_values_validation(scores, target, check_nan=not fused)
    counts = dense_tie_counts(scores, target, ignore, need, workspace)
    if fused and counts.nan_rows is not None and bool(counts.nan_rows.any()):
        _raise_nan(scores)
    return counts
