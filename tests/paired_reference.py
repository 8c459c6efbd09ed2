"""Obviously-right per-query outcomes and paired statistics, one query at a time.

- :func:`reference_query_outcomes`: each query's hit@K (0/1, or the expected hit) and its
  first-hit rank capped at max K + 1, from a literal sort (:mod:`reference`), with
  ``empty_target_action`` applied as ``compute()`` applies it.
- :func:`reference_embedding_outcomes`: the same for every query of an
  ``EmbeddingRecallAtK`` scenario, keyed by its id (or its position among the items of
  its role).
- :func:`literal_mcnemar` and :func:`literal_newcombe`: the exact McNemar test through
  ``math.comb`` and Newcombe's (1998) method 10 interval, written out from the paper.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

from embedding_reference import Batch, ignored, items_of, members, score
from reference import reference_expected_hit, reference_first_hit_rank

Outcome = tuple[list[float], float]
"""(hit@K for each K, first-hit rank capped at max K + 1)."""


def reference_query_outcomes(
    scores: Sequence[float],
    relevant: Sequence[bool],
    ignore: Sequence[bool] | None,
    ks: Sequence[int],
    ties: str,
    action: str,
) -> Outcome | None:
    """One query's outcome; None when ``action`` leaves it out (``"skip"``, ``"error"``)."""
    max_k = max(ks)
    valid = [r for j, r in enumerate(relevant) if not (ignore is not None and ignore[j])]
    if not any(valid):
        if action in ("skip", "error"):
            return None
        if action == "pos":
            return [1.0 for _ in ks], 1.0
        return [0.0 for _ in ks], float(max_k + 1)
    if ties == "expected":
        cdf = [reference_expected_hit(scores, relevant, ignore, k) for k in range(1, max_k + 1)]
        rank = 1.0 + sum(1.0 - c for c in cdf)
        return [cdf[k - 1] for k in ks], rank
    first = reference_first_hit_rank(scores, relevant, ignore, ties)
    return [1.0 if first <= k else 0.0 for k in ks], float(min(first, max_k + 1))


def reference_embedding_outcomes(
    batches: Sequence[Batch],
    ks: Sequence[int],
    *,
    similarity: str = "cosine",
    exclude: str = "none",
    bidirectional: bool = False,
    ties: str = "pessimistic",
    empty_target_action: str = "neg",
    **_: object,
) -> list[dict[int, Outcome]]:
    """Per direction, ``{query id: outcome}``; the id is the query's ``ids`` entry, or its
    position among the items added with a role that makes it a query."""
    items = items_of(batches)
    as_query, as_gallery = ("query", "both"), ("gallery", "both")
    plan = [(as_query, as_gallery)]
    if bidirectional:
        plan.append((as_gallery, as_query))
    out = []
    for query_roles, gallery_roles in plan:
        in_role = [item for item in items if item.role in query_roles]
        position = {item.position: index for index, item in enumerate(in_role)}
        gallery = members(items, gallery_roles)
        direction: dict[int, Outcome] = {}
        for q in members(items, query_roles):
            row = [score(q, g, similarity) for g in gallery]
            relevant = [q.label == g.label for g in gallery]
            ignore = [ignored(q, g, exclude) for g in gallery]
            outcome = reference_query_outcomes(row, relevant, ignore, ks, ties, empty_target_action)
            if outcome is not None:
                direction[q.id if q.id is not None else position[q.position]] = outcome
        out.append(direction)
    return out


def literal_mcnemar(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar: twice the smaller binomial tail at 1/2, at most 1."""
    m = only_a + only_b
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(only_a, only_b) + 1)) / 2**m
    return min(1.0, 2 * tail)


def literal_newcombe(
    both: int, only_a: int, only_b: int, neither: int, level: float
) -> tuple[float, float]:
    """Newcombe (1998), Statistics in Medicine 17:2635, method 10, for P1 - P2 with
    P1 = (both + only_b) / n (model B) and P2 = (both + only_a) / n (model A)."""
    n = both + only_a + only_b + neither
    z = NormalDist().inv_cdf(1 - (1 - level) / 2)

    def wilson(x: int) -> tuple[float, float]:
        p = x / n
        root = z * math.sqrt(z * z + 4 * n * p * (1 - p))
        return (2 * n * p + z * z - root) / (2 * (n + z * z)), (2 * n * p + z * z + root) / (
            2 * (n + z * z)
        )

    p1, p2 = (both + only_b) / n, (both + only_a) / n
    l1, u1 = wilson(both + only_b)
    l2, u2 = wilson(both + only_a)
    e, f = both + only_b, only_a + neither  # B's hits, B's misses
    g, h = both + only_a, only_b + neither  # A's hits, A's misses
    if e * f * g * h == 0:
        phi = 0.0
    else:
        a = both * neither - only_b * only_a
        if a > n / 2:
            phi = (a - n / 2) / math.sqrt(e * f * g * h)
        elif a < 0:
            phi = a / math.sqrt(e * f * g * h)
        else:
            phi = 0.0
    delta = math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)
    epsilon = math.sqrt((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2)
    return (p1 - p2) - delta, (p1 - p2) + epsilon
