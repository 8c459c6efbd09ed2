"""Brute-force Recall@K that is obviously right: plain Python, one query at a time.

Per query: drop ignored items, sort the rest by score (descending), place tied items
as the policy says (pessimistic: negatives first within a tie; optimistic: positives
first) and read the position of the first positive. For ``"expected"``, enumerate every
equally likely placement of the positives inside the tied block at the best positive's
score and average the hit indicator over them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

Row = Sequence[float]


def _valid_items(
    scores: Row, relevant: Sequence[bool], ignored: Sequence[bool] | None
) -> list[tuple[float, bool]]:
    return [
        (float(s), bool(r))
        for j, (s, r) in enumerate(zip(scores, relevant, strict=True))
        if not (ignored is not None and ignored[j])
    ]


def reference_first_hit_rank(
    scores: Row, relevant: Sequence[bool], ignored: Sequence[bool] | None, ties: str
) -> int:
    """1-based rank of the first positive after a literal sort; 0 when none."""
    items = _valid_items(scores, relevant, ignored)
    if not any(r for _, r in items):
        return 0
    # Python's sort is stable and sorts by the key: score descending, then the tie rule.
    if ties == "pessimistic":
        ordered = sorted(items, key=lambda it: (-it[0], it[1]))  # negatives (False) first
    elif ties == "optimistic":
        ordered = sorted(items, key=lambda it: (-it[0], not it[1]))  # positives first
    else:
        raise ValueError(ties)
    for position, (_, is_pos) in enumerate(ordered, start=1):
        if is_pos:
            return position
    raise AssertionError("unreachable")


def reference_expected_hit(
    scores: Row, relevant: Sequence[bool], ignored: Sequence[bool] | None, k: int
) -> float:
    """Average of hit@k over every placement of the positives in the tied block."""
    items = _valid_items(scores, relevant, ignored)
    positives = [s for s, r in items if r]
    if not positives:
        return 0.0
    best = max(positives)
    ahead = sum(1 for s, r in items if not r and s > best)
    block = sum(1 for s, _ in items if s == best)  # tied negatives and tied positives
    tied_pos = sum(1 for s, r in items if r and s == best)
    hits = 0
    total = 0
    for slots in itertools.combinations(range(block), tied_pos):
        total += 1
        hits += int(ahead + min(slots) + 1 <= k)
    return hits / total


def reference_recall(
    scores: Sequence[Row],
    relevant: Sequence[Sequence[bool]],
    ignored: Sequence[Sequence[bool]] | None,
    ks: Sequence[int],
    ties: str,
    empty_target_action: str,
) -> list[float]:
    """Recall@K for each k; NaN when no query is counted; raises for "error"."""
    totals = [0.0 for _ in ks]
    counted = 0
    empty = 0
    for q, row in enumerate(scores):
        ign = ignored[q] if ignored is not None else None
        has_pos = any(r for _, r in _valid_items(row, relevant[q], ign))
        if not has_pos:
            empty += 1
            if empty_target_action in ("skip", "error"):
                continue
            counted += 1
            for i in range(len(ks)):
                totals[i] += 1.0 if empty_target_action == "pos" else 0.0
            continue
        counted += 1
        if ties == "expected":
            for i, k in enumerate(ks):
                totals[i] += reference_expected_hit(row, relevant[q], ign, k)
        else:
            rank = reference_first_hit_rank(row, relevant[q], ign, ties)
            for i, k in enumerate(ks):
                totals[i] += 1.0 if rank <= k else 0.0
    if empty_target_action == "error" and empty:
        raise ValueError(f"{empty} queries had no valid positive")
    if counted == 0:
        return [math.nan for _ in ks]
    return [t / counted for t in totals]


def reference_flat_recall(
    items: Sequence[tuple[int, float, int]],
    ks: Sequence[int],
    ties: str,
    action: str,
    dense: Sequence[tuple[list[float], list[bool]]] = (),
    ignore_index: int | None = None,
) -> list[float] | str:
    """The flat form: ``(query id, score, target)`` items grouped into one row per query
    (items whose target is ``ignore_index`` dropped), plus complete ``dense`` rows;
    ``"error"`` where :func:`reference_recall` raises (the ``"error"`` action)."""
    rows: dict[int, tuple[list[float], list[bool]]] = {}
    for qid, score, target in items:
        if target == ignore_index:
            continue
        scores, relevant = rows.setdefault(qid, ([], []))
        scores.append(score)
        relevant.append(bool(target))
    queries = list(rows.values()) + list(dense)
    try:
        return reference_recall(
            [q[0] for q in queries], [q[1] for q in queries], None, ks, ties, action
        )
    except ValueError:
        return "error"
