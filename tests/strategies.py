"""Hypothesis strategies shared by the property tests: small retrieval problems with ties."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

LEVELS = [-2.0, -0.5, 0.0, 0.25, 1.0, float("inf"), float("-inf")]
TIES = ("pessimistic", "optimistic", "expected")
ACTIONS = ("neg", "pos", "skip", "error")


@dataclass
class DenseCase:
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
