"""Shared test helpers: the option tuples, one NaN-aware comparison of recall values, the
hypothesis strategies, and real processes joined by a gloo process group on 127.0.0.1.

Distributed usage::

    def _worker(rank: int, world_size: int, payload) -> object:
        ...  # torch.distributed is initialised here; return something picklable

    results = run_distributed(_worker, world_size=2, payload=...)

The worker must be a module-level function (it is pickled by reference). Each process
returns a value; ``run_distributed`` returns them ordered by rank and re-raises a
worker's exception in the parent. The processes of a world size are shared by the calls
of a session (``tests/distributed_pool.py``); ``fresh=True`` spawns new ones.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import distributed_pool
import torch
from hypothesis import strategies as st
from torch import Tensor

from recall_at_k._types import (
    DETERMINISTIC_TIES,
    EMPTY_TARGET_ACTIONS,
    EXCLUDES,
    ROLES,
    SIMILARITIES,
    TIES,
)

__all__ = [
    "ACTIONS",
    "DETERMINISTIC_TIES",
    "EMPTY_TARGET_ACTIONS",
    "EXCLUDES",
    "FLAT_IGNORE",
    "LEVELS",
    "ROLES",
    "SIMILARITIES",
    "TIES",
    "DenseCase",
    "Item",
    "assert_recall_close",
    "compute_or_error",
    "dense_cases",
    "embedding_cases",
    "flat_cases",
    "flat_tensors",
    "recall_values",
    "run_distributed",
    "tied_rows",
]

# ------------------------------------------------------------------- option tuples

ACTIONS = EMPTY_TARGET_ACTIONS  # the short name the tests use

# ------------------------------------------------------------ comparing recall values

Recall = Tensor | Mapping[str, Any] | Sequence[float] | str


def recall_values(
    result: Tensor | Mapping[str, Any], ks: Sequence[int] | None = None
) -> list[float]:
    """A metric's output as floats: ``recall@k`` for each of ``ks`` (the output must then
    be a dict), or all its values in order."""
    if ks is not None:
        assert isinstance(result, Mapping), result
        return [float(result[f"recall@{k}"]) for k in ks]
    if isinstance(result, Tensor):
        return [float(v) for v in result.reshape(-1)]
    return [float(v) for v in result.values()]


def assert_recall_close(
    got: Recall,
    expected: Recall,
    ks: Sequence[int] | None = None,
    *,
    abs: float = 1e-6,  # the name pytest.approx uses
    rel: float = 0.0,
    where: object = None,
) -> None:
    """Assert recall values agree, NaN equal to NaN, within ``abs`` (or ``rel``).

    ``got`` and ``expected`` may each be a metric output (a tensor, or a dict of tensors
    keyed ``recall@k``), a sequence of floats, or a string standing for an outcome such as
    ``"error"`` (then both must be that string). A dict ``expected`` is compared key by
    key; otherwise values are taken in order, or for ``ks`` from a dict.
    """
    context = (where, got, expected)
    if isinstance(got, str) or isinstance(expected, str):
        assert got == expected, context
        return
    if isinstance(expected, Mapping):
        assert isinstance(got, Mapping), context
        pairs = [(float(got[key]), float(value)) for key, value in expected.items()]
    else:
        if isinstance(got, Tensor | Mapping):
            actual = recall_values(got, ks)
        else:
            actual = [float(v) for v in got]
        want = [float(v) for v in expected]
        assert len(actual) == len(want), context
        pairs = list(zip(actual, want, strict=True))
    for value, target in pairs:
        if math.isnan(target) or math.isnan(value):
            assert math.isnan(target) and math.isnan(value), context
        else:
            assert math.isclose(value, target, rel_tol=rel, abs_tol=abs), context


# ---------------------------------------------------------------- flat-form items

Item = tuple[int, float, int]
"""A flat-form item: (query id, score, target); a target equal to ``ignore_index`` drops it."""


def flat_tensors(
    items: Sequence[Item],
    dtype: torch.dtype = torch.float32,
    target_dtype: torch.dtype = torch.int64,
    index_dtype: torch.dtype = torch.int64,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(preds, target, indexes)`` of a list of items."""
    preds = torch.tensor([it[1] for it in items], dtype=dtype)
    target = torch.tensor([it[2] for it in items], dtype=torch.int64).to(target_dtype)
    indexes = torch.tensor([it[0] for it in items], dtype=index_dtype)
    return preds, target, indexes


def compute_or_error(metric: Any) -> list[float] | str:
    """The metric's values, or ``"error"`` when compute raises the empty-target error."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return recall_values(metric.compute())
    except ValueError as err:
        assert "had no valid positive" in str(err)
        return "error"


def tied_rows(num: int = 31, gallery: int = 6, seed: int = 11) -> tuple[Tensor, Tensor]:
    """Dense ``[num, gallery]`` scores from three values (heavy ties), one positive column
    a row (``-1``: none)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (num, gallery), generator=gen).float()
    target = torch.randint(-1, gallery, (num,), generator=gen)
    return scores, target


# ------------------------------------------------------------ hypothesis strategies

LEVELS = [-2.0, -0.5, 0.0, 0.25, 1.0, float("inf"), float("-inf")]


@dataclass
class DenseCase:
    """A small dense retrieval problem with ties, drawn by :func:`dense_cases`."""

    scores: list[list[float]]
    mask: list[list[bool]]
    ignored: list[list[bool]] | None
    index_target: bool  # the single positive given as a [Q] column (mask has <= 1 True)
    ks: tuple[int, ...]
    ties: str
    action: str
    cuts: list[int]  # batch boundaries

    def tensors(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        scores = torch.tensor(self.scores, dtype=dtype).reshape(len(self.scores), -1)
        if self.index_target:
            columns = [row.index(True) if True in row else -1 for row in self.mask]
            target = torch.tensor(columns, dtype=torch.int64)
        else:
            target = torch.tensor(self.mask, dtype=torch.bool).reshape(scores.shape)
        ignore = None
        if self.ignored is not None:
            ignore = torch.tensor(self.ignored, dtype=torch.bool).reshape(scores.shape)
        return scores, target, ignore

    def batches(self) -> list[tuple[int, int]]:
        bounds = [0, *sorted(self.cuts), len(self.scores)]
        return list(itertools.pairwise(bounds))


@st.composite
def dense_cases(draw: st.DrawFn, max_queries: int = 8, max_gallery: int = 9) -> DenseCase:
    q = draw(st.integers(1, max_queries))
    g = draw(st.integers(1, max_gallery))
    levels = draw(st.lists(st.sampled_from(LEVELS), min_size=1, max_size=4, unique=True))
    scores = [[draw(st.sampled_from(levels)) for _ in range(g)] for _ in range(q)]
    index_target = draw(st.booleans())
    if index_target:
        columns = [draw(st.integers(-1, g - 1)) for _ in range(q)]
        mask = [[j == c for j in range(g)] for c in columns]
    else:
        mask = [[draw(st.booleans()) for _ in range(g)] for _ in range(q)]
    ignored = None
    if draw(st.booleans()):
        ignored = [[draw(st.integers(0, 3)) == 0 for _ in range(g)] for _ in range(q)]
    ks = tuple(draw(st.lists(st.integers(1, g + 3), min_size=1, max_size=4, unique=True)))
    cuts = draw(st.lists(st.integers(0, q), max_size=3))
    return DenseCase(
        scores=scores,
        mask=mask,
        ignored=ignored,
        index_target=index_target,
        ks=ks,
        ties=draw(st.sampled_from(TIES)),
        action=draw(st.sampled_from(ACTIONS)),
        cuts=cuts,
    )


FLAT_IGNORE = -100
"""The ``ignore_index`` of :func:`flat_cases`."""


@st.composite
def flat_cases(draw: st.DrawFn) -> dict[str, object]:
    levels = draw(st.lists(st.sampled_from(LEVELS), min_size=1, max_size=4, unique=True))
    use_ignore = draw(st.booleans())
    items: list[tuple[int, float, int]] = []
    for query in range(draw(st.integers(1, 6))):
        for _ in range(draw(st.integers(0, 8))):
            target = draw(st.sampled_from([0, 1, FLAT_IGNORE] if use_ignore else [0, 1]))
            items.append((query * 7 + 3, draw(st.sampled_from(levels)), target))  # sparse ids
    return {
        "items": items,
        "ignore_index": FLAT_IGNORE if use_ignore else None,
        "ks": tuple(draw(st.lists(st.integers(1, 10), min_size=1, max_size=3, unique=True))),
        "ties": draw(st.sampled_from(TIES)),
        "action": draw(st.sampled_from(ACTIONS)),
        "seed": draw(st.integers(0, 2**16)),
        "batches": draw(st.integers(1, 5)),
    }


@st.composite
def embedding_cases(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(2, 9))
    similarity = draw(st.sampled_from(["dot", "euclidean", "cosine"]))
    # Scores must be exact in float32 whatever kernel the matrix product uses (a fused
    # multiply-add rounds differently, see the README): small integers for dot and
    # euclidean; for cosine, vectors whose normalised entries are exact (an axis times
    # 1 or 2, or four entries of +-1, norm 2), so every cosine is in {0, +-0.5, +-1}.
    embeddings: list[list[float]] = []
    for _ in range(n):
        if similarity == "cosine":
            kind = draw(st.sampled_from(["axis", "signs"]))
            if kind == "axis":
                vector = [0.0] * 4
                vector[draw(st.integers(0, 3))] = draw(st.sampled_from([-2.0, -1.0, 1.0, 2.0]))
            else:
                vector = [draw(st.sampled_from([-1.0, 1.0])) for _ in range(4)]
        else:
            coords = st.sampled_from([-1.0, 0.0, 1.0, 2.0])
            vector = [draw(coords), draw(coords)]
        embeddings.append(vector)
    roles = draw(st.sampled_from(["both", "split"]))
    return {
        "embeddings": embeddings,
        "labels": [draw(st.integers(0, 2)) for _ in range(n)],
        "groups": [draw(st.integers(0, 1)) for _ in range(n)],
        "use_ids": draw(st.booleans()),
        "roles": roles,
        "similarity": similarity,
        "exclude": draw(st.sampled_from(["none", "same_group", "same_label_and_group"])),
        "ks": tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3, unique=True))),
        "ties": draw(st.sampled_from(TIES)),
        "action": draw(st.sampled_from(("neg", "pos", "skip"))),
        "chunk_bytes": draw(st.sampled_from([1, 12, 64, 2**20])),
        "bidirectional": roles == "split" and draw(st.booleans()),
    }


# ------------------------------------------------------------------ distributed runs


def run_distributed(
    fn: Callable[[int, int, Any], Any],
    world_size: int = 2,
    payload: Any = None,
    *,
    fresh: bool = False,
    timeout: float | None = distributed_pool.DEFAULT_TIMEOUT,
) -> list[Any]:
    """``fn(rank, world_size, payload)`` on ``world_size`` gloo processes; the results by rank.

    The processes are this world size's shared pool (``tests/distributed_pool.py``),
    restored between calls; ``fresh=True`` spawns them for this call alone, for a
    function that measures its process or destroys or replaces the default process group.
    A call running past ``timeout`` seconds raises ``TimeoutError`` (``None``: no limit).
    """
    return distributed_pool.run(fn, world_size, payload, fresh=fresh, timeout=timeout)
