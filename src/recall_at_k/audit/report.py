"""Per direction, the queries with identical items and copies in their gallery, the
gallery's duplicates, the report dicts and the warning.

Each count is "gallery items with the query's key" -- a tally of the gallery's codes read
at the query's code -- by inclusion-exclusion over the ignore rules, less the query's own
sample where it would be counted: O(N) gathers and sorts of codes, no pairs. The copies
up to rounding are looked up per (query, class equal up to rounding) pair, none on
ordinary data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from recall_at_k.audit.bitwise import CODE32_LIMIT, code, code_dtype, composite, sorted_parts
from recall_at_k.ranking.budget import AuditSizes


class Codes(NamedTuple):
    """Per item, codes in ``[0, N)`` (:func:`code_dtype`): equal codes, equal keys."""

    klass: Tensor  # the class of bitwise-equal embeddings
    label: Tensor
    group: Tensor  # empty where exclude does not read the groups
    adjacent: Tensor  # int64 [P, 2]: the class pairs equal up to rounding, sorted


def codes_of(
    klass: Tensor, adjacent: Tensor, labels: Tensor, groups: Tensor | None, sizes: AuditSizes
) -> Codes:
    """:class:`Codes` from the bitwise classes, their rounding pairs and the metadata."""
    dtype = code_dtype(klass.shape[0])
    group = torch.zeros(0, dtype=dtype) if groups is None else code(groups, sizes)
    return Codes(klass.to(dtype), code(labels, sizes), group.to(klass.device), adjacent)


class DirectionAudit(NamedTuple):
    """The audit of one direction's queries, per query (``[Q]`` bool)."""

    counted: Tensor  # counted by compute() under empty_target_action
    identical_positive: Tensor
    identical_negative: Tensor
    duplicate_gallery_items: int
    rounding_positive: Tensor
    rounding_negative: Tensor
    rounding_duplicate_gallery_items: int

    def known(self) -> Tensor:
        """bool ``[2, Q]``: queries whose near positive / negative is certain (an identical
        item or a rounding copy), whatever its score (the ranking's ``known``)."""
        return torch.stack(
            [
                self.identical_positive | self.rounding_positive,
                self.identical_negative | self.rounding_negative,
            ]
        )


def tally(code: Tensor, rows: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``[N]``: how many of ``rows`` (None: every item) have each code."""
    values = code if rows is None else code[rows]
    table = torch.zeros(code.shape[0], dtype=dtype, device=code.device)
    return table.index_add_(
        0, values, torch.ones(1, dtype=dtype, device=code.device).expand(values.shape[0])
    )


def audit_direction(
    keys: Codes, sides: Any, exclude: str, empty_target_action: str, sizes: AuditSizes
) -> DirectionAudit:
    """Identical and rounding positives / negatives of each query and the gallery's
    duplicates. ``sides``: ``((rows, identity), (rows, identity))`` of the queries and the
    gallery (rows into the items; the gallery's identities distinct)."""
    (q_rows, q_identity), (g_rows, g_identity) = sides
    num = keys.klass.shape[0]
    counts = code_dtype(g_rows.shape[0])
    q_every, g_every = (
        r.shape[0] == num and (num < 2 or bool((r[1:] > r[:-1]).all())) for r in (q_rows, g_rows)
    )  # a side of every item in order reads the codes as they are

    def of_queries(code: Tensor) -> Tensor:
        return code if q_every else code[q_rows]

    def in_gallery(code: Tensor) -> Tensor:
        """Per query: the gallery items that share the query's ``code``."""
        return tally(code, None if g_every else g_rows, counts)[of_queries(code)]

    has_self, self_row = own_samples(q_rows, q_identity, g_rows, g_identity, num, sizes)
    loo = self_row is q_rows  # each query's own sample is its own row
    same_class = (
        has_self.clone() if loo else has_self & (keys.klass[self_row] == of_queries(keys.klass))
    )
    same_label = (
        torch.ones_like(has_self) if loo else keys.label[self_row] == of_queries(keys.label)
    )
    grouped, group_rule = exclude != "none", exclude == "same_group"
    same_group = torch.zeros_like(same_label)
    label_group = class_label_group = None
    if grouped:
        if keys.group.shape[0] != num:
            raise ValueError(f"exclude={exclude!r} needs the codes made with the groups")
        same_group = (
            torch.ones_like(has_self) if loo else keys.group[self_row] == of_queries(keys.group)
        )
        label_group = composite(keys.label, keys.group, sizes=sizes)
    # Valid positives (which queries compute() counts), then the identical ones; each
    # count turned into flags before the next (one composite key at a time).
    self_positive = has_self & same_label & ~(same_group & grouped)
    positives = in_gallery(keys.label).sub_(self_positive.to(counts))
    if label_group is not None:
        positives -= in_gallery(label_group)
    skip = empty_target_action in ("skip", "error")
    counted = positives > 0 if skip else torch.ones_like(positives, dtype=torch.bool)
    del positives
    class_label = composite(keys.klass, keys.label, sizes=sizes)
    identical = in_gallery(class_label).sub_((self_positive & same_class).to(counts))
    if label_group is not None:
        class_label_group = composite(class_label, keys.group, sizes=sizes)
        identical -= in_gallery(class_label_group)
    identical_positive = counted & (identical > 0)
    # Identical negatives: another label; only "same_group" ignores negatives.
    identical = in_gallery(keys.klass).sub_(in_gallery(class_label))
    del class_label
    identical -= (same_class & ~same_label & ~(same_group & group_rule)).to(counts)
    if group_rule and class_label_group is not None:
        identical += in_gallery(class_label_group)
        identical -= in_gallery(composite(keys.klass, keys.group, sizes=sizes))
    identical_negative = counted & (identical > 0)
    del identical, class_label_group
    classes = tally(keys.klass, None if g_every else g_rows, counts)
    duplicates = int(g_rows.shape[0]) - int(torch.count_nonzero(classes))
    del classes
    rounding_pos = rounding_neg = torch.zeros_like(counted)
    rounding_duplicates = 0
    if keys.adjacent.numel():
        selves = (has_self, self_row)
        rounding_pos, rounding_neg = rounding_flags(
            keys, q_rows, g_rows, selves, exclude, label_group, sizes
        )
        rounding_duplicates = rounding_duplicate_items(keys, g_rows)
    return DirectionAudit(
        counted,
        identical_positive,
        identical_negative,
        duplicates,
        counted & rounding_pos,
        counted & rounding_neg,
        rounding_duplicates,
    )


def own_samples(
    q_rows: Tensor,
    q_identity: Tensor,
    g_rows: Tensor,
    g_identity: Tensor,
    num: int,
    sizes: AuditSizes,
) -> tuple[Tensor, Tensor]:
    """The query's own sample in the gallery (the ranking ignores it): bool ``[Q]`` whether
    it is there, and its row (:func:`code_dtype` of ``num``; the query's own row where it
    is not). Identities in ``[0, num)`` (the metric's) are looked up in a table of
    gallery positions; others through a sort of the gallery's identities in parts."""
    dtype, size = code_dtype(num), g_identity.shape[0]
    if size == 0 or q_identity.shape[0] == 0:
        return torch.zeros_like(q_rows, dtype=torch.bool), q_rows.to(dtype)
    if (
        q_rows.dtype == dtype
        and torch.equal(q_rows, g_rows)
        and torch.equal(q_identity, g_identity)
    ):
        return torch.ones_like(q_rows, dtype=torch.bool), q_rows  # leave-one-out
    device = g_identity.device
    low = min(int(g_identity.min()), int(q_identity.min()))
    high = max(int(g_identity.max()), int(q_identity.max()))
    if low >= 0 and high < num:
        position = torch.full((num,), -1, dtype=code_dtype(size), device=device)
        position[g_identity] = torch.arange(size, dtype=position.dtype, device=device)
        position = position[q_identity]
        has_self = position >= 0
    else:
        ident = torch.empty(size, dtype=torch.int64, device=device)
        order = torch.empty(size, dtype=code_dtype(size), device=device)
        at = 0
        for part, values in sorted_parts(g_identity.to(torch.int64), sizes):
            ident[at : at + part.shape[0]], order[at : at + part.shape[0]] = values, part
            at += part.shape[0]
        found = torch.searchsorted(ident, q_identity, out_int32=size <= CODE32_LIMIT)
        found.clamp_(max=size - 1)
        has_self = ident[found] == q_identity
        del ident
        position = order[found]
        del order, found
    self_row = torch.where(has_self, g_rows[position.clamp_(min=0)], q_rows).to(dtype)
    return has_self, self_row


def rounding_flags(
    keys: Codes,
    q_rows: Tensor,
    g_rows: Tensor,
    selves: tuple[Tensor, Tensor],
    exclude: str,
    label_group: Tensor | None,
    sizes: AuditSizes,
) -> tuple[Tensor, Tensor]:
    """bool ``[Q]`` twice: the queries whose gallery holds a non-ignored item, another
    sample, of a class equal to the query's up to rounding, of the query's label / of
    another. Per (query, adjacent class ``b``) pair, ``candidate_pairs`` at a time, the
    gallery items of class ``b`` with the query's key are counted by binary search in
    the gallery's sorted composite keys, the ignore rules by inclusion-exclusion as in
    :func:`audit_direction`, less the query's own sample where it is of class ``b``."""
    num, device = keys.klass.shape[0], q_rows.device
    positive = torch.zeros(q_rows.shape, dtype=torch.bool, device=device)
    negative = torch.zeros_like(positive)
    starts = keys.adjacent[:, 0].contiguous()
    q_class = keys.klass[q_rows]
    begin = torch.searchsorted(starts, q_class)
    degree = torch.searchsorted(starts, q_class, right=True) - begin
    ends = torch.cumsum(degree, dim=0)
    total = int(ends[-1]) if ends.numel() else 0

    def table(*codes: Tensor) -> Tensor:
        key = codes[0][g_rows].to(torch.int64)
        for more in codes[1:]:
            key = key * num + more[g_rows]
        return torch.sort(key)[0]

    def count(sorted_keys: Tensor, key: Tensor) -> Tensor:
        return torch.searchsorted(sorted_keys, key, right=True) - torch.searchsorted(
            sorted_keys, key
        )

    grouped, group_rule = label_group is not None, exclude == "same_group"
    by_class, by_label = table(keys.klass), table(keys.klass, keys.label)
    by_label_group = table(keys.klass, label_group) if label_group is not None else None
    by_group = table(keys.klass, keys.group) if group_rule else None
    has_self, self_row = selves
    for start in range(0, total, sizes.candidate_pairs):
        pair = torch.arange(start, min(start + sizes.candidate_pairs, total), device=device)
        query = torch.searchsorted(ends, pair, right=True)
        other = keys.adjacent[begin[query] + pair - (ends[query] - degree[query]), 1]
        row, own = q_rows[query], self_row[query]
        label = keys.label[row]
        pos = count(by_label, other * num + label)
        neg = count(by_class, other) - pos
        same_group = torch.zeros_like(own, dtype=torch.bool)
        if label_group is not None and by_label_group is not None:
            in_label_group = count(by_label_group, other * num + label_group[row])
            pos -= in_label_group
            same_group = keys.group[own] == keys.group[row]
            if by_group is not None:
                neg += in_label_group - count(by_group, other * num + keys.group[row])
        mine = has_self[query] & (keys.klass[own] == other)
        same_label = keys.label[own] == label
        pos -= (mine & same_label & ~(same_group & grouped)).long()
        neg -= (mine & ~same_label & ~(same_group & group_rule)).long()
        positive[query[pos > 0]] = True
        negative[query[neg > 0]] = True
    return positive, negative


def rounding_duplicate_items(keys: Codes, g_rows: Tensor) -> int:
    """Gallery items whose class first appears in the gallery after a class equal to it
    up to rounding (the bitwise repeats are ``duplicate_gallery_items``)."""
    num, size = keys.klass.shape[0], g_rows.shape[0]
    first = torch.full((num,), size, dtype=code_dtype(size), device=g_rows.device)
    positions = torch.arange(size, dtype=first.dtype, device=g_rows.device)
    first.scatter_reduce_(0, keys.klass[g_rows].long(), positions, reduce="amin")
    a, b = keys.adjacent[:, 0], keys.adjacent[:, 1]
    later = (first[a] < first[b]) & (first[b] < size)
    flagged = torch.zeros(num, dtype=torch.bool, device=g_rows.device)
    flagged[b[later]] = True
    return int(flagged.sum())


def counted_queries(
    histograms: Sequence[tuple[Tensor, Tensor] | None], empty_target_action: str
) -> list[int | None]:
    """The counted queries of each direction, from the ranking's query counts (with,
    without a valid positive), by the rule of ``compute()``."""
    skip = empty_target_action in ("skip", "error")
    return [None if h is None else int(h[1][0]) + (0 if skip else int(h[1][1])) for h in histograms]


def direction_report(
    queries: int, audit: DirectionAudit, near: Tensor | None, empty_target_action: str
) -> dict[str, int]:
    """One direction's report, its keys in the documented order (``near``: the ranking's
    near counts: positive, negative, negative without a valid positive, hits at 1)."""
    result = {
        "queries": queries,
        "identical_positive": int(audit.identical_positive.sum()),
        "identical_negative": int(audit.identical_negative.sum()),
        "rounding_positive": int(audit.rounding_positive.sum()),
        "rounding_negative": int(audit.rounding_negative.sum()),
    }
    if near is not None:
        positive, negative, negative_alone, hits = (int(v) for v in near.tolist())
        counts_all = empty_target_action not in ("skip", "error")
        result["near_positive"] = positive
        result["near_negative"] = negative + (negative_alone if counts_all else 0)
        result["near_hits_at_1"] = hits
    result["duplicate_gallery_items"] = audit.duplicate_gallery_items
    result["rounding_duplicate_gallery_items"] = audit.rounding_duplicate_gallery_items
    return result


def empty_report(near: bool) -> dict[str, int]:
    """The report of a direction without queries or gallery: every count 0."""
    keys = ["queries", "identical_positive", "identical_negative"]
    keys += ["rounding_positive", "rounding_negative"]
    keys += ["near_positive", "near_negative", "near_hits_at_1"] if near else []
    return dict.fromkeys([*keys, "duplicate_gallery_items", "rounding_duplicate_gallery_items"], 0)


def warning_message(
    names: Sequence[str], reports: Sequence[dict[str, int]], directions: Sequence[Any]
) -> str | None:
    """The warning about identical positives, duplicate gallery items or their rounding
    copies, or None. ``names``: the direction names (``""`` for one direction);
    ``directions``: each direction's sides, or None."""
    findings = []
    for name, found, sides in zip(names, reports, directions, strict=False):
        where = f"direction {name!r}: " if name else ""
        queries, size = found["queries"], 0 if sides is None else int(sides[1][0].shape[0])
        for key, what in (
            ("identical_positive", "a bitwise-identical item of their own label"),
            ("rounding_positive", "an item of their own label equal to them up to float rounding"),
        ):
            if found[key]:
                findings.append(
                    f"{where}{found[key]} of {queries} counted queries"
                    f" ({found[key] / queries:.1%}) have {what} in their gallery, a"
                    f" guaranteed hit (leakage) [{key}]"
                )
        for key, what in (
            ("duplicate_gallery_items", "bitwise-identical to"),
            ("rounding_duplicate_gallery_items", "equal up to float rounding to"),
        ):
            if found[key]:
                findings.append(
                    f"{where}{found[key]} of {size} gallery items"
                    f" ({found[key] / max(size, 1):.1%}) are {what} another gallery item, so"
                    f" every query ranks each repeat again [{key}]"
                )
    if not findings:
        return None
    return (
        "EmbeddingRecallAtK: "
        + "; ".join(findings)
        + ". Fixes: pass `ids=` so that repeats of one sample (a caption-indexed loader"
        " repeating its images, DistributedSampler padding, a query that is also in the"
        " gallery) count once; pass `groups=` with exclude='same_group' to ignore items of"
        " the query's own source; or de-duplicate the gallery. protocol_report() has the"
        " counts. (Shown once per metric instance.)"
    )
