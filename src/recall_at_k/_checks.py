"""Check primitives: each raises a ``ValueError`` naming the argument in backticks, what was
expected, what came and the remedy. Only :func:`check_no_nan` and :func:`check_binary`
read tensor values (``validate_args``)."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, SupportsIndex, TypeVar, cast

import torch
from torch import Tensor

INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
SIGNED_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)
_P = ParamSpec("_P")
_R = TypeVar("_R")

TORCHMETRICS_NAMES = {
    "top_k": (
        "`top_k` is torchmetrics' name for one K; Recall@K here takes `k`, an int or a"
        " sequence of ints: pass k={value!r}"
    ),
    "aggregation": (
        "`aggregation` is torchmetrics' choice of how per-query values combine (got"
        " {value!r}); Recall@K here is always the mean of hit@K over the counted queries"
        " (hit@K is 0 or 1 per query, so a median would be 0 or 1). For per-query"
        " outcomes use recall_at_k.functional.retrieval_first_hit_rank: rank <= K is hit@K"
    ),
}


def check_torchmetrics_names(kwargs: Mapping[str, Any]) -> None:
    """Raise for a torchmetrics retrieval argument that has another name or no use here."""
    for name, message in TORCHMETRICS_NAMES.items():
        if name in kwargs:
            raise ValueError(message.format(value=kwargs[name]))


def refuse_torchmetrics_names(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function``, raising :func:`check_torchmetrics_names`' errors before a TypeError."""

    @functools.wraps(function)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        check_torchmetrics_names(kwargs)
        return function(*args, **kwargs)

    return checked


def describe(tensor: Tensor) -> str:
    """``shape [..] and dtype ..``, for error messages."""
    return f"shape {list(tensor.shape)} and dtype {tensor.dtype}"


def _as_int(value: object) -> int | None:
    """An integral value (int, numpy integer, 0-d integer tensor) as int; else None."""
    if isinstance(value, (bool, float)) or not hasattr(value, "__index__"):
        return None
    try:
        return operator.index(cast(SupportsIndex, value))
    except TypeError:
        return None


def check_k(k: object) -> tuple[tuple[int, ...], bool]:
    """``k`` as a tuple of distinct positive ints in the order given, and whether it was
    one integral value (the result is then a scalar tensor rather than a dict)."""
    single = _as_int(k)
    if single is not None:
        values: tuple[int, ...] = (single,)
    elif isinstance(k, Sequence) and not isinstance(k, str):
        converted = [_as_int(value) for value in k]
        for value, as_int in zip(k, converted, strict=True):
            if as_int is None:
                raise ValueError(f"`k` must contain only ints, got {value!r} in {k!r}")
        values = tuple(v for v in converted if v is not None)
        if not values:
            raise ValueError("`k` must not be empty: pass an int or a sequence such as (1, 5, 10)")
    else:
        raise ValueError(f"`k` must be a positive int or a sequence of them, got {k!r}")
    for value in values:
        if value < 1:
            raise ValueError(f"`k` values must be >= 1, got {value} in {k!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"`k` must not contain duplicates, got {k!r}")
    return values, single is not None


def check_choice(name: str, value: object, allowed: Sequence[str]) -> None:
    """``value`` is one of the strings ``allowed``."""
    if not isinstance(value, str) or value not in allowed:
        options = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"`{name}` must be one of {options}, got {value!r}")


def check_key(key: object, ks: Sequence[int]) -> list[str]:
    """The result keys of template ``key`` (``str.format`` of ``k``), distinct for each K."""
    if not isinstance(key, str):
        raise ValueError(f"`key` must be a str template such as 'recall@{{k}}', got {key!r}")
    try:
        names = [key.format(k=k) for k in ks]
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(
            f"`key` must be a str.format template whose only field is {{k}} (such as"
            f" 'recall@{{k}}' or 'R{{k:03d}}'), got {key!r}: {type(err).__name__}: {err}"
        ) from err
    if len(set(names)) != len(names):
        raise ValueError(
            f"`key` must give a distinct key for every K, but {key!r} gives {names} for"
            f" k={tuple(ks)}; put the field {{k}} in it (a doubled brace '{{{{k}}}}' is a"
            " literal brace)"
        )
    return names


def check_positive_int(name: str, value: object) -> int:
    """A positive int (numpy integers too)."""
    as_int = _as_int(value)
    if as_int is None or as_int < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return as_int


def check_optional_int(name: str, value: object) -> int | None:
    """None or an int (numpy integers too)."""
    if value is None:
        return None
    as_int = _as_int(value)
    if as_int is None:
        raise ValueError(f"`{name}` must be an int or None, got {value!r}")
    return as_int


def check_tensors(**tensors: Any) -> None:
    """Every named value that is not None is a ``torch.Tensor``."""
    for name, value in tensors.items():
        if value is not None and not isinstance(value, Tensor):
            raise ValueError(f"`{name}` must be a torch.Tensor, got {type(value).__name__}")


def check_same_device(**tensors: Tensor | None) -> None:
    """Every named tensor that is not None is on the device of the first one."""
    named = [(name, t) for name, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, tensor in named[1:]:
        if tensor.device != first.device:
            raise ValueError(
                f"`{name}` is on device {tensor.device} but `{first_name}` is on"
                f" {first.device}; all inputs must be on the same device"
            )


def check_id_vector(name: str, value: Tensor | None, length: int, what: str) -> None:
    """An integer tensor of shape ``[length]`` (``what`` says what each entry is)."""
    if value is None:
        return
    if value.dim() != 1 or value.shape[0] != length or value.dtype not in INTEGER_DTYPES:
        raise ValueError(
            f"`{name}` must be an integer (int64) tensor of shape [{length}], {what},"
            f" got {describe(value)}"
        )


def check_no_nan(scores: Tensor, name: str = "scores", nan_rows: Tensor | None = None) -> None:
    """No NaN in ``scores``: from ``nan_rows`` where a kernel revealed them, else from one
    ``amax`` (it propagates NaN; a bool ``isnan`` is several times slower on CPU)."""
    if nan_rows is not None:
        found = bool(nan_rows.any())
    else:
        found = bool(scores.numel()) and math.isnan(float(scores.detach().amax()))
    if found:
        count = int(torch.isnan(scores).sum())
        raise ValueError(f"`{name}` must not contain NaN, found {count} NaN value(s)")


def check_binary(target: Tensor, what: str, hint: str = "") -> None:
    """Relevance values 0 or 1 (bool passes unread); reads the tensor on the host."""
    if not target.numel() or target.dtype == torch.bool:
        return
    bad = (target != 0) & (target != 1)
    if bool(bad.any()):
        example = target[bad][0]
        floating = target.is_floating_point()
        shown = float(example) if floating else int(example)
        remedy = "; binarise graded relevance first, for example `target > 0`" if floating else ""
        raise ValueError(
            f"{what} must be 0 or 1, got {int(bad.sum())} other value(s),"
            f" e.g. {shown}{hint}{remedy}"
        )


def check_level(level: object) -> float:
    """``level`` of a confidence interval: a float in (0, 1)."""
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ValueError(f"`level` must be a float in (0, 1) such as 0.95, got {level!r}")
    return float(level)
