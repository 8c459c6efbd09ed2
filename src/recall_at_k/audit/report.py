"""Per direction, the queries with copies in their gallery and the gallery's duplicates, by
binary search in sorted keys and inclusion-exclusion (no pairs); the reports, the warning."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from recall_at_k.audit.bitwise import code, code_dtype, expand, pair_code, sorted_copy
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
    """:class:`Codes` of the bitwise classes, their rounding pairs and the metadata."""
    dtype = code_dtype(klass.shape[0])
    group = torch.zeros(0, dtype=dtype) if groups is None else code(groups, sizes)
    return Codes(klass.to(dtype), code(labels, sizes), group.to(klass.device), adjacent)


class AuditOptions(NamedTuple):
    """The metric's options that the audit reads, and the sizes it works in."""

    exclude: str
    empty_target_action: str
    near_duplicate: float | None  # the threshold; None: no near-duplicate counts
    names: tuple[str, ...]  # the direction names ("" for one direction)
    sizes: AuditSizes


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
        positive = self.identical_positive | self.rounding_positive
        return torch.stack([positive, self.identical_negative | self.rounding_negative])


def audit_direction(keys: Codes, sides: Any, options: AuditOptions) -> DirectionAudit:
    """The audit of one direction. ``sides``: ``((rows, identity), (rows, identity))`` of
    its queries and gallery (rows into the items; the gallery's identities distinct)."""
    (q_rows, _), (g_rows, _) = sides
    num, queries, device = keys.klass.shape[0], q_rows.shape[0], q_rows.device
    sizes, exclude = options.sizes, options.exclude
    has_self, self_row = own_samples(sides, num, sizes)
    grouped, group_rule = exclude != "none", exclude == "same_group"
    label_group = pair_code(keys.label, keys.group, sizes) if grouped else keys.label

    def present(klass: Tensor, pairs: Iterable[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """bool ``[Q]`` twice: the queries whose gallery holds a non-ignored item, another
        sample, of class ``c`` for one of their ``pairs`` (query, c), of their label / not."""

        def table(more: Tensor | None = None) -> Tensor:  # the gallery's sorted keys
            key = klass[g_rows].to(torch.int64)
            return sorted_copy(key if more is None else key.mul_(num).add_(more[g_rows]), sizes)[0]

        def count(table: Tensor, key: Tensor) -> Tensor:
            return torch.searchsorted(table, key, right=True) - torch.searchsorted(table, key)

        by_class, by_label = table(), table(keys.label)
        by_label_group = table(label_group) if grouped else by_label
        by_group = table(keys.group) if group_rule else by_class
        positive = torch.zeros(queries, dtype=torch.bool, device=device)
        negative = torch.zeros_like(positive)
        for query, c in pairs:
            row, own = q_rows[query], self_row[query]
            pos = count(by_label, c * num + keys.label[row])
            neg = count(by_class, c) - pos
            same_group = torch.zeros_like(pos, dtype=torch.bool)
            if grouped:  # both rules ignore same-group items of the query's label
                in_label_group = count(by_label_group, c * num + label_group[row])
                pos -= in_label_group
                same_group = keys.group[own] == keys.group[row]
                if group_rule:
                    neg += in_label_group - count(by_group, c * num + keys.group[row])
            mine = has_self[query] & (klass[own] == c)
            same_label = keys.label[own] == keys.label[row]
            pos -= (mine & same_label & ~(same_group & grouped)).long()
            neg -= (mine & ~same_label & ~(same_group & group_rule)).long()
            positive[query[pos > 0]] = True
            negative[query[neg > 0]] = True
        return positive, negative

    def own(klass: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
        for at in range(0, queries, sizes.candidate_pairs):
            query = torch.arange(at, min(queries, at + sizes.candidate_pairs), device=device)
            yield query, klass[q_rows[query]].long()

    counted = torch.ones(queries, dtype=torch.bool, device=device)
    if options.empty_target_action in ("skip", "error"):  # a valid positive of any class
        anyone = torch.zeros_like(keys.klass)
        counted = present(anyone, own(anyone))[0]
    identical = (torch.zeros_like(counted), torch.zeros_like(counted))
    if num and int(keys.klass.max()) + 1 < num:  # else each item a class: no other sample
        identical = present(keys.klass, own(keys.klass))
    rounding = (torch.zeros_like(counted), torch.zeros_like(counted))
    if keys.adjacent.numel():
        starts, q_class = keys.adjacent[:, 0].contiguous(), keys.klass[q_rows]
        begin = torch.searchsorted(starts, q_class)
        size = torch.searchsorted(starts, q_class, right=True) - begin
        pairs = expand(begin, size, sizes.candidate_pairs)
        rounding = present(keys.klass, ((q, keys.adjacent[at, 1]) for q, at in pairs))
    seen = torch.zeros(num, dtype=torch.bool, device=device)
    seen.index_fill_(0, keys.klass[g_rows].long(), True)
    same_pos, same_neg = counted & identical[0], counted & identical[1]
    round_pos, round_neg = counted & rounding[0], counted & rounding[1]
    duplicates, rounded = g_rows.shape[0] - int(seen.sum()), rounding_duplicates(keys, g_rows)
    return DirectionAudit(counted, same_pos, same_neg, duplicates, round_pos, round_neg, rounded)


def own_samples(sides: Any, num: int, sizes: AuditSizes) -> tuple[Tensor, Tensor]:
    """bool ``[Q]``: whether the query's own sample is in the gallery, and its row (the
    query's row where it is not), through a sort of the gallery's identities."""
    (q_rows, q_identity), (g_rows, g_identity) = sides
    dtype = code_dtype(num)
    if g_identity.shape[0] == 0 or q_identity.shape[0] == 0:
        return torch.zeros_like(q_rows, dtype=torch.bool), q_rows.to(dtype)
    if (
        q_rows.dtype == dtype
        and torch.equal(q_rows, g_rows)
        and torch.equal(q_identity, g_identity)
    ):
        return torch.ones_like(q_rows, dtype=torch.bool), q_rows  # leave-one-out
    identity, order = sorted_copy(g_identity.to(torch.int64), sizes)
    found = torch.searchsorted(identity, q_identity).clamp_(max=g_identity.shape[0] - 1)
    has_self = identity[found] == q_identity
    del identity
    return has_self, torch.where(has_self, g_rows[order[found]], q_rows).to(dtype)


def rounding_duplicates(keys: Codes, g_rows: Tensor) -> int:
    """Gallery items whose class first appears in the gallery after a class equal to it
    up to rounding (the bitwise repeats are ``duplicate_gallery_items``)."""
    num, size = keys.klass.shape[0], g_rows.shape[0]
    first = torch.full((num,), size, dtype=code_dtype(size), device=g_rows.device)
    positions = torch.arange(size, dtype=first.dtype, device=g_rows.device)
    first.scatter_reduce_(0, keys.klass[g_rows].long(), positions, reduce="amin")
    a, b = keys.adjacent[:, 0], keys.adjacent[:, 1]
    later = (first[a] < first[b]) & (first[b] < size)
    flagged = torch.zeros(num, dtype=torch.bool, device=g_rows.device)
    return int(flagged.index_fill_(0, b[later], True).sum())


def counted_queries(
    histograms: Sequence[tuple[Tensor, Tensor] | None], empty_target_action: str
) -> list[int | None]:
    """Each direction's counted queries from the ranking's query counts, by ``compute()``'s rule."""
    skip = empty_target_action in ("skip", "error")
    return [None if h is None else int(h[1][0]) + (0 if skip else int(h[1][1])) for h in histograms]


PER_QUERY = ("identical_positive", "identical_negative", "rounding_positive", "rounding_negative")
"""The report's counts of queries flagged by the audit, in the documented order."""


def protocol_reports(
    audits: Sequence[DirectionAudit | None],
    near: Sequence[Tensor | None],
    counted: Sequence[int | None],
    options: AuditOptions,
) -> list[dict[str, int]]:
    """Each direction's report, keys in the documented order, from its audit (None: nothing
    ranked), the ranking's near counts (None: none) and ``compute()``'s counted queries
    (None: from the audit)."""
    reports, counts_all = [], options.empty_target_action not in ("skip", "error")
    for audit, found, queries in zip(audits, near, counted, strict=True):
        if queries is None:
            queries = 0 if audit is None else int(audit.counted.sum())
        report = {"queries": queries}
        for name in PER_QUERY:
            report[name] = 0 if audit is None else int(getattr(audit, name).sum())
        if options.near_duplicate is not None:
            positive, negative, alone, hits = [0] * 4 if found is None else found.tolist()
            report.update(near_positive=positive, near_negative=negative + alone * counts_all)
            report["near_hits_at_1"] = hits
        for name in ("duplicate_gallery_items", "rounding_duplicate_gallery_items"):
            report[name] = 0 if audit is None else getattr(audit, name)
        reports.append(report)
    return reports


FINDINGS = {
    "identical_positive": "have a bitwise-identical item of their own label in their gallery",
    "rounding_positive": "have an item of their own label equal to them up to float rounding"
    " in their gallery",
    "duplicate_gallery_items": "are bitwise-identical to another gallery item",
    "rounding_duplicate_gallery_items": "are equal up to float rounding to another gallery item",
}
"""What the warning names: the report's key and what it counts."""


def warning_message(
    names: Sequence[str], reports: Sequence[dict[str, int]], directions: Sequence[Any]
) -> str | None:
    """The warning about identical positives, duplicate gallery items or their rounding
    copies (None: nothing to warn about), per direction name and sides."""
    findings = []
    for name, found, sides in zip(names, reports, directions, strict=False):
        gallery = 0 if sides is None else int(sides[1][0].shape[0])
        for key, what in FINDINGS.items():
            whole, of, why = (
                (found["queries"], "counted queries", "a guaranteed hit (leakage)")
                if key.endswith("positive")
                else (gallery, "gallery items", "so every query ranks each repeat again")
            )
            if found[key]:
                where, share = f"direction {name!r}: " if name else "", found[key] / max(whole, 1)
                findings.append(
                    f"{where}{found[key]} of {whole} {of} ({share:.1%}) {what}, {why} [{key}]"
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
