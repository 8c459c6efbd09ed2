"""Checks of the embedding inputs: one batch, finite values, the similarity, the
direction names; and the error for NaN scores. Reads no state and ranks nothing."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from recall_at_k._checks import (
    check_choice,
    check_id_vector,
    check_same_device,
    check_tensors,
    describe,
)
from recall_at_k._types import EXCLUDES, ROLES, SIMILARITIES


def check_batch(
    embeddings: Tensor,
    labels: Tensor,
    groups: Tensor | None,
    ids: Tensor | None,
    names: tuple[str, str, str, str] = ("embeddings", "labels", "groups", "ids"),
) -> None:
    """Types, shapes, dtypes and devices of one batch of items (no value read)."""
    check_tensors(**dict(zip(names, (embeddings, labels, groups, ids), strict=True)))
    if embeddings.dim() != 2 or not embeddings.is_floating_point():
        raise ValueError(
            f"`{names[0]}` must be a floating point tensor of shape [B, D],"
            f" got {describe(embeddings)}"
        )
    if embeddings.shape[1] == 0:
        raise ValueError(
            f"`{names[0]}` must have at least one column (D >= 1), got shape"
            f" {list(embeddings.shape)}: zero-width embeddings have no score to rank by;"
            " pass the model's [B, D] features"
        )
    batch = embeddings.shape[0]
    for name, value in zip(names[1:], (labels, groups, ids), strict=True):
        check_id_vector(name, value, batch, f"one entry per row of `{names[0]}`")
    check_same_device(**dict(zip(names, (embeddings, labels, groups, ids), strict=True)))


def check_finite(embeddings: Tensor, name: str = "embeddings") -> None:
    """Finite embeddings (reads values on the host; only with ``validate_args=True``): their
    least and largest values (NaN propagates), found in one pass."""
    extremes = torch.aminmax(embeddings) if embeddings.numel() else ()
    if not all(bool(value.isfinite()) for value in extremes):
        nan, inf = int(torch.isnan(embeddings).sum()), int(torch.isinf(embeddings).sum())
        raise ValueError(f"`{name}` must be finite, found {nan} NaN and {inf} infinite value(s)")


def check_similarity(similarity: object, exclude: object = "none") -> None:
    """A built-in similarity's name, or a callable; and ``exclude``."""
    if not callable(similarity):
        check_choice("similarity", similarity, SIMILARITIES)
    check_choice("exclude", exclude, EXCLUDES)


def check_update(
    embeddings: Tensor,
    labels: Tensor,
    groups: Tensor | None,
    ids: Tensor | None,
    role: object,
    exclude: str,
) -> None:
    """One ``update``'s batch (:func:`check_batch`), role, and groups if ``exclude`` reads them."""
    check_batch(embeddings, labels, groups, ids)
    check_choice("role", role, ROLES)
    if exclude != "none" and groups is None:
        raise ValueError(
            f"`groups` are required with exclude={exclude!r}: pass the group"
            " (camera, source, ...) of every item to update()"
        )


def nan_scores_error(queries: int) -> ValueError:
    """The error for scores that came out NaN although the embeddings are finite."""
    return ValueError(
        f"`similarity` returned NaN scores for {queries} quer{'y' if queries == 1 else 'ies'};"
        " scores must not be NaN (a bug in a callable, or the overflow of huge embeddings"
        " under 'dot' / 'euclidean')"
    )


def check_directions(directions: object) -> tuple[str, str]:
    if (
        isinstance(directions, str)
        or not isinstance(directions, Sequence)
        or len(directions) != 2
        or not all(isinstance(d, str) and d for d in directions)
        or directions[0] == directions[1]
    ):
        raise ValueError(
            "`directions` must be two distinct non-empty strings (the key prefixes of"
            f" query -> gallery and gallery -> query), got {directions!r}"
        )
    return (directions[0], directions[1])


def check_sharded(sharded: object, similarity: object) -> bool:
    """``sharded`` as a bool; a ValueError unless a bool, or True with a callable
    ``similarity`` (a sharded gallery is scored by blocks; a callable's scores may vary)."""
    if not isinstance(sharded, bool):
        raise ValueError(
            "`sharded` must be a bool (True: under DDP each process keeps its items and"
            f" the gallery passes around the processes in blocks), got {sharded!r}"
        )
    if sharded and callable(similarity):
        raise ValueError(
            "`sharded=True` needs a built-in `similarity` ('cosine', 'dot' or"
            " 'euclidean'), whose canonical scores do not depend on how the gallery is"
            f" split; got a callable ({similarity!r}): pass sharded=False"
        )
    return sharded
