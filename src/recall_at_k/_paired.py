"""``paired_comparison(a, b)``: two models' Recall@K on the same queries compared query by
query (exact McNemar test, Newcombe's paired score interval) from the 2 x 2 table of hits."""

from __future__ import annotations

import math
from collections.abc import Mapping
from statistics import NormalDist
from typing import Any, NamedTuple, overload

import torch
from torch import Tensor

from recall_at_k._base import RecallAtKMetric
from recall_at_k._checks import check_level
from recall_at_k._outcomes import QueryOutcomes
from recall_at_k.ranking.budget import PAIRED_TERMS

EXACT_DISCORDANT = 4096  # discordant queries up to which McNemar's sum is exact


class PairedComparison(NamedTuple):
    """Model B against model A at one K, on the same queries.

    Attributes:
        difference: R_b - R_a, B's Recall@K minus A's (NaN without queries).
        low: lower end of the paired score interval of the difference (Newcombe's method
            10), within [-1, 1].
        high: upper end.
        p_value: exact two-sided McNemar p-value ``min(1, 2 P(X <= min(only_a, only_b)))``,
            X ~ Binomial(only_a + only_b, 1/2); 1.0 when the models never disagree.
        only_a: queries hit by A and missed by B.
        only_b: queries hit by B and missed by A.
        queries: the queries compared."""

    difference: float
    low: float
    high: float
    p_value: float
    only_a: int
    only_b: int
    queries: int


Comparable = QueryOutcomes | Mapping[str, QueryOutcomes] | RecallAtKMetric[Any]


def mcnemar_p_value(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p-value ``min(1, 2 sum_{i <= min} C(m, i) / 2^m)``, m = only_a +
    only_b (1.0 for m = 0): exact integers up to :data:`EXACT_DISCORDANT`, else float
    (relative error below 1e-10)."""
    m = only_a + only_b
    low = min(only_a, only_b)
    if m == 0 or 2 * low >= m:
        return 1.0
    if m <= EXACT_DISCORDANT:
        tail, term = 0, 1
        for j in range(low + 1):
            tail += term
            term = term * (m - j) // (j + 1)
        return min(1.0, (2 * tail) / (1 << m))
    # Terms i = low, low - 1, ... relative to C(m, low) (ratio i / (m - i + 1)), in chunks.
    log_top = _log_binomial_half(low, m)
    total, carry, start = 0.0, 0.0, low
    while start >= 0:
        i = torch.arange(start, max(-1, start - PAIRED_TERMS), -1, dtype=torch.float64)
        steps = torch.log(i[:-1] / (m - i[:-1] + 1))
        log_relative = carry + torch.cat([i.new_zeros(1), steps.cumsum(0)])
        total += float(log_relative.exp().sum())
        last, smallest = float(log_relative[-1]), int(i[-1])
        if smallest == 0 or math.exp(last) < 2.0**-60 * total:
            break
        carry = last + math.log(smallest / (m - smallest + 1))
        start = smallest - 1
    return min(1.0, 2.0 * math.exp(log_top + math.log(total)))


def _log_binomial_half(x: int, n: int) -> float:
    """log(C(n, x) / 2^n), to about 1e-15 relative for any n (Loader's saddle-point form,
    as in R's ``dbinom``, rather than differences of huge ``lgamma`` values)."""
    if x == 0 or x == n:
        return -n * math.log(2.0)
    y = n - x
    half = n / 2
    log_c = _stirling_error(n) - _stirling_error(x) - _stirling_error(y)
    log_c -= _deviance(x, half) + _deviance(y, half)
    return log_c - 0.5 * (math.log(2 * math.pi) + math.log(x) + math.log1p(-x / n))


def _stirling_error(n: int) -> float:
    """log(n!) - log(sqrt(2 pi n) (n / e)^n)."""
    if n <= 15:
        return math.lgamma(n + 1) - (n + 0.5) * math.log(n) + n - 0.5 * math.log(2 * math.pi)
    # (s0 - (s1 - (s2 - ...) / nn) / nn) / n, with fewer terms the larger n.
    nn, terms = float(n) * n, (1 / 12, 1 / 360, 1 / 1260, 1 / 1680, 1 / 1188)
    used = 2 if n > 500 else 3 if n > 80 else 4 if n > 35 else 5
    total = terms[used - 1]
    for term in reversed(terms[: used - 1]):
        total = term - total / nn
    return total / n


def _deviance(x: float, mean: float) -> float:
    """x log(x / mean) + mean - x, without cancellation when x is near the mean."""
    if abs(x - mean) < 0.1 * (x + mean):
        v = (x - mean) / (x + mean)
        total = (x - mean) * v
        term = 2 * x * v
        for j in range(1, 1000):
            term *= v * v
            updated = total + term / (2 * j + 1)
            if updated == total:
                return updated
            total = updated
        return total
    return x * math.log(x / mean) + mean - x


def _wilson(successes: int, n: int, z: float) -> tuple[float, float]:
    p = successes / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    denominator = 1 + z * z / n
    return (centre - spread) / denominator, (centre + spread) / denominator


def newcombe_interval(
    both: int, only_a: int, only_b: int, neither: int, level: float
) -> tuple[float, float]:
    """Newcombe's (1998) method 10 interval for R_b - R_a on paired data: P1 = R_b, P2 = R_a,
    Wilson intervals (l1, u1), (l2, u2), psi the corrected correlation (A = both * neither -
    only_a * only_b over the root of the margins' product, less n/2 if A > n/2, 0 if 0 <= A
    <= n/2); low = P1 - P2 - sqrt((P1 - l1)^2 - 2 psi (P1 - l1)(u2 - P2) + (u2 - P2)^2),
    high likewise with (u1 - P1) and (P2 - l2)."""
    n = both + only_a + only_b + neither
    z = NormalDist().inv_cdf(0.5 + level / 2)
    hits_b, hits_a = both + only_b, both + only_a
    p1, p2 = hits_b / n, hits_a / n
    (l1, u1), (l2, u2) = _wilson(hits_b, n, z), _wilson(hits_a, n, z)
    margins = hits_b * (n - hits_b) * hits_a * (n - hits_a)
    psi = 0.0
    if margins > 0:
        a = both * neither - only_a * only_b
        if a > n / 2:
            psi = (a - n / 2) / math.sqrt(margins)
        elif a < 0:
            psi = a / math.sqrt(margins)
    d1, d2 = p1 - l1, u2 - p2
    e1, e2 = u1 - p1, p2 - l2
    low = (p1 - p2) - math.sqrt(max(0.0, d1 * d1 - 2 * psi * d1 * d2 + d2 * d2))
    high = (p1 - p2) + math.sqrt(max(0.0, e1 * e1 - 2 * psi * e1 * e2 + e2 * e2))
    return max(-1.0, low), min(1.0, high)


@overload
def paired_comparison(
    a: RecallAtKMetric[Tensor], b: RecallAtKMetric[Tensor], level: float = 0.95
) -> PairedComparison: ...


@overload
def paired_comparison(
    a: RecallAtKMetric[dict[str, Tensor]],
    b: RecallAtKMetric[dict[str, Tensor]],
    level: float = 0.95,
) -> dict[str, PairedComparison]: ...


@overload
def paired_comparison(
    a: Comparable, b: Comparable, level: float = 0.95
) -> PairedComparison | dict[str, PairedComparison]: ...


def paired_comparison(
    a: Comparable, b: Comparable, level: float = 0.95
) -> PairedComparison | dict[str, PairedComparison]:
    """Compare model B with model A query by query, on the same queries.

    ``a`` and ``b`` are two metrics (``RetrievalRecallAtK`` or ``EmbeddingRecallAtK`` with
    the same K; their synchronised ``query_outcomes()`` is taken) or what their
    ``query_outcomes()`` returned, holding the same set of query ids (in any order and split).

    For each K, a ``PairedComparison``: R_b - R_a, the exact two-sided McNemar test (a
    binomial test of ``only_b`` out of the ``only_a + only_b`` discordant queries at 1/2)
    and Newcombe's paired score interval (method 10 of Newcombe, 1998, Statistics in
    Medicine 17:2635) at ``level``. Queries without a valid positive count as ``compute()``
    counts them. Hits must be 0 or 1: under ``ties="expected"`` a hit probability strictly
    between 0 and 1 raises a ``ValueError``; compare ``"pessimistic"`` and ``"optimistic"``
    instead, which bound it.

    Returns:
        In ``compute()``'s structure: one :class:`PairedComparison` for an int ``k``,
        else a dict keyed like ``compute()``.

    Example:
        >>> import torch
        >>> from recall_at_k import RetrievalRecallAtK, paired_comparison
        >>> target = torch.tensor([0, 0, 0, 0])
        >>> ids = torch.arange(4)
        >>> a, b = RetrievalRecallAtK(k=1), RetrievalRecallAtK(k=1)
        >>> a.update(torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.3, 0.7], [0.4, 0.6]]), target,
        ...          query_ids=ids)
        >>> b.update(torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]]), target,
        ...          query_ids=ids)
        >>> result = paired_comparison(a, b)
        >>> result.difference, result.only_a, result.only_b, result.p_value
        (0.75, 0, 3, 0.25)
    """
    level = check_level(level)
    outcomes_a, outcomes_b = _outcomes_of(a, "a"), _outcomes_of(b, "b")
    if list(outcomes_a) != list(outcomes_b):
        raise ValueError(
            f"`a` and `b` must have the same directions to compare, got {list(outcomes_a)}"
            f" and {list(outcomes_b)}"
        )
    results: dict[str, PairedComparison] = {}
    single = False
    for direction, first in outcomes_a.items():
        second = outcomes_b[direction]
        if first.ks != second.ks or first.keys != second.keys:
            raise ValueError(
                f"`a` and `b` must have the same K and keys to compare, got k={first.ks}"
                f" (keys {first.keys}) and k={second.ks} (keys {second.keys})"
            )
        single = first.keys is None
        keys = first.keys or (str(first.ks[0]),)
        hits_a, hits_b = _aligned(first, second, direction)
        for column, key in enumerate(keys):
            results[key] = _compare(hits_a[:, column], hits_b[:, column], level)
    if single:
        return next(iter(results.values()))
    return results


def _outcomes_of(value: Comparable, name: str) -> dict[str, QueryOutcomes]:
    """The outcomes of a metric or of ``query_outcomes()``, per direction ("" for one)."""
    outcomes: object = value
    query_outcomes = getattr(value, "query_outcomes", None)
    if callable(query_outcomes):
        outcomes = query_outcomes()
    if isinstance(outcomes, QueryOutcomes):
        return {"": outcomes}
    if isinstance(outcomes, Mapping) and all(
        isinstance(v, QueryOutcomes) for v in outcomes.values()
    ):
        return {str(key): v for key, v in outcomes.items()}
    raise ValueError(
        f"`{name}` must be a RetrievalRecallAtK or EmbeddingRecallAtK metric, or what its"
        f" query_outcomes() returned, got {type(value).__name__}"
    )


def _aligned(a: QueryOutcomes, b: QueryOutcomes, direction: str) -> tuple[Tensor, Tensor]:
    """Both models' hits, rows in the order of the sorted ids (which must be the same)."""
    where = f" (direction {direction!r})" if direction else ""
    for name, outcomes in (("a", a), ("b", b)):
        distinct = torch.unique(outcomes.ids)
        if distinct.numel() != outcomes.ids.numel():
            raise ValueError(
                f"`{name}`{where}: query ids must be unique, got"
                f" {outcomes.ids.numel() - distinct.numel()} repeated id(s)"
            )
        fractional = (outcomes.hits != 0) & (outcomes.hits != 1)
        if bool(fractional.any()):
            raise ValueError(
                f"`{name}`{where}: {int(fractional.any(dim=1).sum())} queries have a hit"
                " probability strictly between 0 and 1 (ties='expected' with ties at the"
                " cut-off); McNemar's test needs 0/1 hits: compare with ties='pessimistic'"
                " and ties='optimistic' instead"
            )
    ids_a, order_a = torch.sort(a.ids.cpu())
    ids_b, order_b = torch.sort(b.ids.cpu())
    if not torch.equal(ids_a, ids_b):
        only_a = ids_a[~torch.isin(ids_a, ids_b)]
        only_b = ids_b[~torch.isin(ids_b, ids_a)]
        raise ValueError(
            f"`a` and `b`{where} must hold the same query ids: {only_a.numel()} only in `a`"
            f" (e.g. {only_a[:5].tolist()}), {only_b.numel()} only in `b` (e.g."
            f" {only_b[:5].tolist()}), of {ids_a.numel()} and {ids_b.numel()} queries;"
            " update both metrics with the same queries (and ids)"
        )
    return a.hits.cpu()[order_a], b.hits.cpu()[order_b]


def _compare(hits_a: Tensor, hits_b: Tensor, level: float) -> PairedComparison:
    hit_a, hit_b = hits_a == 1, hits_b == 1
    both = int((hit_a & hit_b).sum())
    only_a = int((hit_a & ~hit_b).sum())
    only_b = int((~hit_a & hit_b).sum())
    n = hit_a.numel()
    p_value = mcnemar_p_value(only_a, only_b)
    if n == 0:
        return PairedComparison(math.nan, math.nan, math.nan, p_value, 0, 0, 0)
    low, high = newcombe_interval(both, only_a, only_b, n - both - only_a - only_b, level)
    return PairedComparison((only_b - only_a) / n, low, high, p_value, only_a, only_b, n)
