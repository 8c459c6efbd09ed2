"""The option types of the public API, in one place; the runtime tuples derive from them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar, get_args

from torch import Tensor

Ties = Literal["pessimistic", "optimistic", "expected"]
DeterministicTies = Literal["pessimistic", "optimistic"]
EmptyTargetAction = Literal["neg", "pos", "skip", "error"]
SimilarityName = Literal["cosine", "dot", "euclidean"]
SimilarityFn = Callable[[Tensor, Tensor], Tensor]
Similarity = SimilarityName | SimilarityFn
Exclude = Literal["none", "same_group", "same_label_and_group"]
Role = Literal["query", "gallery", "both"]

TIES: tuple[str, ...] = get_args(Ties)
DETERMINISTIC_TIES: tuple[str, ...] = get_args(DeterministicTies)
EMPTY_TARGET_ACTIONS: tuple[str, ...] = get_args(EmptyTargetAction)
SIMILARITIES: tuple[str, ...] = get_args(SimilarityName)
EXCLUDES: tuple[str, ...] = get_args(Exclude)
ROLES: tuple[str, ...] = get_args(Role)

# What compute() returns: a scalar tensor for an int k, else a dict by key.
RecallOutput = Tensor | dict[str, Tensor]
OutputT = TypeVar("OutputT", Tensor, dict[str, Tensor])  # Tensor for an int k
