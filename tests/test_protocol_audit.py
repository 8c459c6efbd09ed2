"""``EmbeddingRecallAtK.protocol_report()`` and its warning, against a brute force.

The brute force is a literal double loop over (query, gallery item) pairs that applies
the ignore rules one by one (the query's own sample, ``exclude``, ids repeated within a
role), compares embeddings bit for bit with ``torch.equal`` and coordinate by coordinate for
the rounding copies (:func:`rounding_copy`), and scores pairs with the canonical score
written literally (``embedding_reference.canonical_score``). The data plant exact
copies, rounding copies (1-2 ulps per coordinate; a Linear layer's output for a batch
of 1 against a batch of 10) and near copies (of the same and of another label) among
random embeddings, and quantised embeddings whose scores equal the threshold exactly.

Two spawns of two gloo processes run every case too, the states gathered and
``sharded=True`` (the interval tests' two-process case rides on the first); the
audit's codes over sharded rows: ``test_audit_sharded.py``.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from audit_reference import (
    SIZES,
    codes_of,
    pairs,
    pairs_brute_force,
    rounding_copy,
    row_hash,
    ulps,
)
from embedding_reference import ROUTES, Batch, canonical_score, engine_recall, prepared_row
from helpers import run_distributed
from torch import Tensor

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK, audit
from recall_at_k.audit import bitwise, rounding
from recall_at_k.audit.report import own_samples
from recall_at_k.ranking import budget

DIM = 16


@dataclass
class Case:
    name: str
    batches: list[Batch]
    options: dict[str, Any] = field(default_factory=dict)


def dot(queries: Tensor, gallery: Tensor) -> Tensor:
    """A callable similarity (module level: the two-process test pickles it)."""
    return queries @ gallery.T


def _score(query: Tensor, item: Tensor, similarity: Any) -> float:
    """The metric's canonical score (a callable's: in float64)."""
    if callable(similarity):
        return float(query.double() @ item.double())
    q, g = (_prepared(row, similarity) for row in (query, item))
    return canonical_score(q, g, similarity)


def _bytes(row: Tensor) -> bytes:
    return row.clone(memory_format=torch.contiguous_format).view(torch.uint8).numpy().tobytes()


@functools.cache
def _prepared_of(row: bytes, dtype: torch.dtype, similarity: str) -> list[float]:
    return prepared_row(torch.frombuffer(bytearray(row), dtype=dtype).tolist(), similarity)


def _prepared(row: Tensor, similarity: str) -> list[float]:
    """:func:`prepared_row` of ``row``, once a row."""
    return _prepared_of(_bytes(row), row.dtype, similarity)


@functools.cache
def _pair_of(x: bytes, y: bytes, dtype: torch.dtype) -> tuple[bool, bool]:
    a, b = (torch.frombuffer(bytearray(r), dtype=dtype) for r in (x, y))
    return x == y, rounding_copy(a, b)


def _pair(x: Tensor, y: Tensor) -> tuple[bool, bool]:
    """Whether two rows are bitwise identical and whether they are rounding copies
    (:func:`rounding_copy`), once an unordered pair."""
    a, b = sorted(_bytes(row) for row in (x, y))
    assert x.dtype == y.dtype
    return _pair_of(a, b, x.dtype)


_REPORTS: dict[int, tuple[Case, dict[str, Any]]] = {}


def brute_force(case: Case) -> dict[str, Any]:
    """The report, pair by pair (one dict, or one per direction by name); computed once
    per case object (a copy each time)."""
    kept = _REPORTS.get(id(case))
    if kept is None or kept[0] is not case:
        kept = case, _brute_force(case)
        _REPORTS[id(case)] = kept
    return copy.deepcopy(kept[1])


def _brute_force(case: Case) -> dict[str, Any]:
    options = case.options
    exclude = options.get("exclude", "none")
    action = options.get("empty_target_action", "neg")
    near = options.get("near_duplicate")
    similarity = options.get("similarity", "cosine")
    optimistic = options.get("ties", "pessimistic") == "optimistic"
    items = []
    for batch in case.batches:
        for i in range(batch.labels.shape[0]):
            group = None if batch.groups is None else int(batch.groups[i])
            ident = None if batch.ids is None else int(batch.ids[i])
            items.append((batch.embeddings[i], int(batch.labels[i]), group, ident, batch.role))
    # A sample: items sharing an id are one; an item without id is alone.
    identity = [("id", it[3]) if it[3] is not None else ("item", n) for n, it in enumerate(items)]

    def side(role: str) -> list[int]:
        seen, rows = set(), []
        for n, it in enumerate(items):
            if it[4] in (role, "both") and identity[n] not in seen:
                seen.add(identity[n])
                rows.append(n)
        return rows

    names = options.get("directions", ("q2g", "g2q"))
    roles = [("query", "gallery"), ("gallery", "query")]
    if not options.get("bidirectional", False):
        roles = roles[:1]
    reports = {}
    for name, (query_role, gallery_role) in zip(names, roles, strict=False):
        queries, gallery = side(query_role), side(gallery_role)
        report = {"queries": 0, "identical_positive": 0, "identical_negative": 0}
        report.update(rounding_positive=0, rounding_negative=0)
        if near is not None:
            report.update(near_positive=0, near_negative=0, near_hits_at_1=0)
        for q in queries:
            eq, lq, hq = items[q][0], items[q][1], items[q][2]
            found = set()
            positives, negatives = [], []
            for g in gallery:
                eg, lg, hg = items[g][0], items[g][1], items[g][2]
                if identity[g] == identity[q]:
                    continue  # the query itself
                if exclude == "same_group" and hg == hq:
                    continue
                if exclude == "same_label_and_group" and lg == lq and hg == hq:
                    continue
                kind = "positive" if lg == lq else "negative"
                score = _score(eq, eg, similarity)
                (positives if kind == "positive" else negatives).append(score)
                identical, rounding = _pair(eq, eg)
                if identical:
                    found.add("identical_" + kind)
                if rounding:
                    found.add("rounding_" + kind)
                copy = identical or rounding
                if near is not None and (score >= near or copy):  # copies: near too
                    found.add("near_" + kind)
            if not positives and action in ("skip", "error"):
                continue
            report["queries"] += 1
            for key in found:
                report[key] += 1
            if near is not None and positives:
                best = max(positives)
                beaten = any(s > best if optimistic else s >= best for s in negatives)
                report["near_hits_at_1"] += int(not beaten and best >= near)
        duplicates = rounding_duplicates = 0
        for j, g in enumerate(gallery):
            earlier = [e for e in gallery[:j] if identity[e] != identity[g]]
            if any(_pair(items[e][0], items[g][0])[0] for e in earlier):
                duplicates += 1
            elif any(_pair(items[e][0], items[g][0])[1] for e in earlier):
                rounding_duplicates += 1
        report["duplicate_gallery_items"] = duplicates
        report["rounding_duplicate_gallery_items"] = rounding_duplicates
        reports[name] = report
    if not options.get("bidirectional", False):
        return reports[names[0]]
    return reports


def planted(seed: int, num: int = 48, classes: int = 6, groups: int = 3) -> Batch:
    """Random items plus exact, rounding (1-2 ulps per coordinate) and near copies of
    the same and of another label.

    Each planted copy has a base item of its own, so that no query has both an exact
    positive and an exact negative (which would tie at rank 1 by rounding alone)."""
    gen = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(num, DIM, generator=gen)
    labels = torch.randint(0, classes, (num,), generator=gen)
    group = torch.randint(0, groups, (num,), generator=gen)
    extra_e, extra_l, extra_g = [], [], []
    bases = torch.randperm(num, generator=gen)[:18].tolist()
    for n, base in enumerate(bases):
        copy = embeddings[base].clone()
        if n >= 12:  # a rounding copy
            copy = ulps(copy, torch.randint(-2, 3, (DIM,), generator=gen))
        elif n % 3 == 2:  # a near copy (not within rounding)
            copy = copy + 1e-2 * torch.randn(DIM, generator=gen)
        label = int(labels[base]) if n % 2 == 0 else (int(labels[base]) + 1) % classes
        extra_e.append(copy)
        extra_l.append(label)
        # Half the copies in the base's group (exclude may ignore them).
        extra_g.append(int(group[base]) if n % 4 < 2 else (int(group[base]) + 1) % groups)
    embeddings = torch.cat([embeddings, torch.stack(extra_e)])
    order = torch.randperm(embeddings.shape[0], generator=gen)
    return Batch(
        embeddings[order],
        torch.cat([labels, torch.tensor(extra_l)])[order],
        groups=torch.cat([group, torch.tensor(extra_g)])[order],
    )


def split(batch: Batch, parts: int) -> list[Batch]:
    size = math.ceil(batch.labels.shape[0] / parts)
    return [
        batch.take(slice(start, start + size)) for start in range(0, batch.labels.shape[0], size)
    ]


def threshold_cases() -> list[Case]:
    """Scores exactly at the threshold, decided on canonical scores: quantised embeddings
    (integer dot products, and cosines) and 1-decimal ones (whose float32 products round),
    the threshold set to the canonical score of one of their pairs."""
    gen = torch.Generator().manual_seed(5)
    quantised = torch.randint(-1, 2, (60, 8), generator=gen).float()
    decimal = torch.randn(60, DIM, generator=gen).round(decimals=1)
    labels = torch.arange(60) % 5

    def at_pair(embeddings: Tensor, similarity: str) -> float:
        """The canonical score of the highest pair whose float32 score rounds
        below it (so that a decision on float32 scores would miss it); with exact
        float32 scores (integers), the pair at the 97th percentile."""
        rows = [prepared_row(row.tolist(), similarity) for row in embeddings]
        pairs = []
        for i in range(len(rows)):
            for j in range(i):
                q, g = torch.tensor(rows[i]), torch.tensor(rows[j])
                fast = float(-((q - g) ** 2).sum() if similarity == "euclidean" else q @ g)
                pairs.append((canonical_score(rows[i], rows[j], similarity), fast))
        pairs.sort(reverse=True)
        below = [score for score, fast in pairs[: len(pairs) // 10] if fast < score]
        return below[0] if below else pairs[int(0.03 * len(pairs))][0]

    out = []
    for name, embeddings, similarity, ties in (
        ("quantised_dot", quantised, "dot", "pessimistic"),
        ("quantised_cosine", quantised, "cosine", "optimistic"),
        ("decimal_dot", decimal, "dot", "expected"),
        ("decimal_euclidean", decimal, "euclidean", "pessimistic"),
    ):
        options = {"similarity": similarity, "ties": ties}
        options["near_duplicate"] = at_pair(embeddings, similarity)
        out.append(Case(f"at_threshold_{name}", [Batch(embeddings, labels)], options))
    return out


def linear_padding(seed: int = 0) -> tuple[Batch, Tensor]:
    """A Linear layer's embeddings of 41 inputs, computed in batches of 10, then the
    first three inputs again, each in a batch of 1 (DistributedSampler padding): the
    repeats differ from the originals in their last bits. Also returns the ids."""
    gen = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(64, DIM)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(DIM, 64, generator=gen))
        layer.bias.copy_(torch.randn(DIM, generator=gen))
        inputs = torch.randn(41, 64, generator=gen)
        rows = [layer(inputs[i : i + 10]) for i in range(0, 41, 10)]
        rows += [layer(inputs[i : i + 1]) for i in range(3)]
    labels = torch.randint(0, 5, (41,), generator=gen)
    ids = torch.cat([torch.arange(41), torch.arange(3)])
    return Batch(torch.cat(rows), torch.cat([labels, labels[:3]])), ids


def cases() -> list[Case]:
    data = planted(0)
    n = data.labels.shape[0]
    ids = torch.arange(n) * 3 + 100
    # Ids that make some exact copies one sample (repeated within a role).
    ids_dup = ids.clone()
    classes = data.embeddings.view(torch.int32)
    for j in range(n):
        for i in range(j):
            if torch.equal(classes[i], classes[j]) and j % 2 == 0:
                ids_dup[j] = ids_dup[i]
                break
    q_rows = torch.arange(n) % 3 == 0
    gallery = Batch(data.embeddings, data.labels, "gallery", data.groups)
    queries = Batch(data.embeddings[q_rows], data.labels[q_rows], "query", data.groups[q_rows])
    near = {"near_duplicate": 0.95}
    relabelled = torch.where(
        q_rows & (torch.arange(n) % 2 == 0), (data.labels + 1) % 6, data.labels
    )
    regrouped = torch.where(q_rows & (torch.arange(n) % 4 < 2), (data.groups + 1) % 3, data.groups)
    padding, pad_ids = linear_padding()
    padding_queries = Batch(padding.embeddings[:-3], padding.labels[:-3], "query")
    padding_gallery = Batch(padding.embeddings[-8:], padding.labels[-8:], "gallery")
    out = [
        Case("loo", split(data, 3), {**near}),
        Case(
            "loo_optimistic_skip",
            split(data, 2),
            {**near, "ties": "optimistic", "empty_target_action": "skip"},
        ),
        Case(
            "loo_ids", [Batch(data.embeddings, data.labels, "both", data.groups, ids_dup)], {**near}
        ),
        Case("loo_same_group", [data], {**near, "exclude": "same_group"}),
        Case(
            "loo_junk_skip",
            [data],
            {**near, "exclude": "same_label_and_group", "empty_target_action": "skip"},
        ),
        Case("qg", [queries, gallery], {**near}),
        Case(
            "qg_ids",
            [
                Batch(queries.embeddings, queries.labels, "query", queries.groups, ids[q_rows]),
                Batch(gallery.embeddings, gallery.labels, "gallery", gallery.groups, ids),
            ],
            {**near, "exclude": "same_label_and_group"},
        ),
        Case(
            "bidirectional",
            [queries, gallery],
            {**near, "bidirectional": True, "directions": ("i2t", "t2i")},
        ),
        Case(
            "bidirectional_ids_group",
            [
                Batch(queries.embeddings, queries.labels, "query", queries.groups, ids[q_rows]),
                Batch(gallery.embeddings, gallery.labels, "gallery", gallery.groups, ids_dup),
            ],
            {**near, "bidirectional": True, "exclude": "same_group"},
        ),
        # A query's own sample (its id) in the gallery with another label / group: it
        # is still the query itself, never an identical negative.
        Case(
            "qg_ids_self_relabelled",
            [
                Batch(queries.embeddings, queries.labels, "query", queries.groups, ids[q_rows]),
                Batch(gallery.embeddings, relabelled, "gallery", regrouped, ids),
            ],
            {**near},
        ),
        Case(
            "qg_ids_self_relabelled_group",
            [
                Batch(queries.embeddings, queries.labels, "query", queries.groups, ids[q_rows]),
                Batch(gallery.embeddings, relabelled, "gallery", regrouped, ids),
            ],
            {**near, "exclude": "same_group", "bidirectional": True},
        ),
        Case("loo_bidirectional", [data], {**near, "bidirectional": True}),
        Case("loo_dot_no_near", [data], {"similarity": "dot"}),
        Case("loo_callable", split(data, 2), {"similarity": dot, "near_duplicate": 12.0}),
        *threshold_cases(),
        # A threshold no score reaches: the near items are the identical ones.
        Case("loo_dot_unreachable", [data], {"similarity": "dot", "near_duplicate": 1e6}),
        Case("loo_euclidean", [data], {"similarity": "euclidean", "near_duplicate": -1e-2}),
        Case("linear_padding", [padding], {}),
        Case("linear_padding_near", split(padding, 2), {"near_duplicate": 0.999}),
        Case("linear_padding_ids", [Batch(padding.embeddings, padding.labels, ids=pad_ids)]),
        Case("linear_padding_qg", [padding_queries, padding_gallery], {"bidirectional": True}),
    ]
    return out


CASES = cases()


def metric_of(case: Case, **extra: Any) -> EmbeddingRecallAtK[dict[str, Tensor]]:
    return EmbeddingRecallAtK(k=(1, 5), **case.options, **extra)


def feed(metric: EmbeddingRecallAtK[Any], batches: list[Batch]) -> None:
    for b in batches:
        metric.update(b.embeddings, b.labels, role=b.role, groups=b.groups, ids=b.ids)  # type: ignore[arg-type]


@pytest.mark.slow
def test_cases_plant_what_they_should() -> None:
    """The planted data exercise every count (so no test passes vacuously)."""
    totals: dict[str, int] = {}
    for case in CASES:
        expected = brute_force(case)
        reports = expected.values() if case.options.get("bidirectional") else [expected]
        for report in reports:
            for key, value in report.items():
                totals[key] = totals.get(key, 0) + value
    for key in (
        "identical_positive",
        "identical_negative",
        "rounding_positive",
        "rounding_negative",
        "rounding_duplicate_gallery_items",
        "near_positive",
        "near_negative",
        "near_hits_at_1",
        "duplicate_gallery_items",
    ):
        assert totals[key] > 0, key


@pytest.mark.slow  # a sweep over every case, against the brute force
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_report_equals_brute_force(case: Case) -> None:
    expected = brute_force(case)
    # On demand (no compute yet): the audit counts the queries itself.
    metric = metric_of(case)
    feed(metric, case.batches)
    assert metric.protocol_report() == expected
    # After compute(): "queries" comes from the ranking; the same report.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metric.compute()
    assert metric.protocol_report() == expected
    # Keys in the documented order.
    first = next(iter(expected.values())) if case.options.get("bidirectional") else expected
    keys = ["queries", "identical_positive", "identical_negative"]
    keys += ["rounding_positive", "rounding_negative"]
    if "near_duplicate" in case.options:
        keys += ["near_positive", "near_negative", "near_hits_at_1"]
    assert list(first) == [*keys, "duplicate_gallery_items", "rounding_duplicate_gallery_items"]


TILE_CASES = [CASES[0], CASES[1], CASES[3]]


@pytest.mark.parametrize("case", TILE_CASES, ids=[c.name for c in TILE_CASES])
def test_report_does_not_depend_on_tiles_or_batches(case: Case) -> None:
    """The near pass in tiles of one query, the data in one batch: the same report."""
    whole = Batch(
        torch.cat([b.embeddings for b in case.batches]),
        torch.cat([b.labels for b in case.batches]),
        case.batches[0].role,
        torch.cat([b.groups for b in case.batches if b.groups is not None]),
        None,
    )
    small = metric_of(case, chunk_bytes=1)
    feed(small, [whole])
    assert small.protocol_report() == brute_force(case)


@pytest.mark.slow  # a sweep over every case, against the brute force
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_near_counts_on_every_route(case: Case) -> None:
    """The near counts come from the ranking's own tiles: every way the engine walks the
    gallery, in tiles of a few queries or whole, counts the same."""
    options = {**case.options, "near_duplicate": case.options.get("near_duplicate", 0.9)}
    options = {k: v for k, v in options.items() if k != "chunk_bytes"}
    counts = []
    for route in (*ROUTES, ("panels", 700), ("squares", 700)):
        ranked = engine_recall(case.batches, (1, 2), route, raw=True, **options)
        counts.append([None if r is None else r.near.tolist() for r in ranked])  # type: ignore[union-attr]
    assert all(c == counts[0] for c in counts), counts


def test_compute_is_unchanged_and_warns_once_per_instance() -> None:
    case = CASES[0]
    plain = metric_of(Case("plain", case.batches, {}))
    feed(plain, case.batches)
    audited = metric_of(case)
    feed(audited, case.batches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expected = plain.compute()
        assert audited.compute() == expected
        assert audited.compute() == expected
        audited.reset()
        feed(audited, case.batches)
        assert audited.compute() == expected
    ours = [w for w in caught if "protocol_report()" in str(w.message)]
    assert len(ours) == 2  # one from each instance
    message = str(ours[0].message)
    report = brute_force(case)
    share = report["identical_positive"] / report["queries"]
    assert f"{report['identical_positive']} of {report['queries']} counted queries" in message
    assert f"({share:.1%})" in message
    for fix in ("`ids=`", "`groups=`", "exclude='same_group'", "de-duplicate the gallery"):
        assert fix in message
    assert ours[0].filename == __file__


def test_no_warning_for_a_clean_protocol() -> None:
    gen = torch.Generator().manual_seed(3)
    metric = EmbeddingRecallAtK(k=(1, 5))
    metric.update(torch.randn(30, DIM, generator=gen), torch.arange(30) % 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metric.compute()
    report = metric.protocol_report()
    assert report == {
        "queries": 30,
        "identical_positive": 0,
        "identical_negative": 0,
        "rounding_positive": 0,
        "rounding_negative": 0,
        "duplicate_gallery_items": 0,
        "rounding_duplicate_gallery_items": 0,
    }


def test_caption_loader_without_ids_is_detected() -> None:
    """Each image repeated once per caption: without ids the text -> image gallery holds
    the repeats; with ids they count once and the warning goes."""
    gen = torch.Generator().manual_seed(4)
    images = torch.randn(10, DIM, generator=gen).repeat_interleave(3, dim=0)
    image_ids = torch.arange(10).repeat_interleave(3)
    captions = images + 0.5 * torch.randn(30, DIM, generator=gen)
    reports = {}
    for use_ids in (False, True):
        metric = EmbeddingRecallAtK(k=1, bidirectional=True, directions=("i2t", "t2i"))
        metric.update(images, image_ids, role="query", ids=image_ids if use_ids else None)
        metric.update(captions, image_ids, role="gallery")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metric.compute()
        reports[use_ids] = (metric.protocol_report(), caught)
    without, caught = reports[False]
    assert isinstance(without["t2i"], dict)
    assert without["t2i"]["duplicate_gallery_items"] == 20
    assert without["i2t"]["duplicate_gallery_items"] == 0
    assert any("20 of 30 gallery items" in str(w.message) for w in caught)
    with_ids, caught = reports[True]
    assert isinstance(with_ids["t2i"], dict)
    assert with_ids["t2i"]["duplicate_gallery_items"] == 0
    assert not [w for w in caught if "protocol_report()" in str(w.message)]


def test_report_is_forgotten_when_data_changes() -> None:
    data = planted(1)
    metric = EmbeddingRecallAtK(k=1)
    feed(metric, [data])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metric.compute()
    first = metric.protocol_report()
    assert first["queries"] == data.labels.shape[0]
    metric.update(torch.randn(4, DIM), torch.tensor([0, 1, 2, 3]))
    assert metric.protocol_report()["queries"] == data.labels.shape[0] + 4
    metric.reset()
    metric.update(torch.randn(3, DIM), torch.tensor([0, 0, 1]))
    assert metric.protocol_report()["queries"] == 3
    other = EmbeddingRecallAtK(k=1)
    other.update(torch.randn(2, DIM), torch.tensor([0, 1]))
    metric.protocol_report()
    metric.merge_state(other)
    assert metric.protocol_report()["queries"] == 5


def test_near_duplicate_is_checked() -> None:
    for bad in (math.nan, math.inf, "0.9", True, [0.9]):
        with pytest.raises(ValueError, match="`near_duplicate`"):
            EmbeddingRecallAtK(near_duplicate=bad)  # type: ignore[call-overload]
    assert EmbeddingRecallAtK(near_duplicate=1).near_duplicate == 1.0


def test_empty_metric_reports_zeros() -> None:
    metric = EmbeddingRecallAtK(k=1, near_duplicate=0.9)
    assert metric.protocol_report() == {
        "queries": 0,
        "identical_positive": 0,
        "identical_negative": 0,
        "rounding_positive": 0,
        "rounding_negative": 0,
        "near_positive": 0,
        "near_negative": 0,
        "near_hits_at_1": 0,
        "duplicate_gallery_items": 0,
        "rounding_duplicate_gallery_items": 0,
    }


def test_collapsed_model_counts_every_item() -> None:
    """Every embedding equal (20,000 items): the counts come from one sort, not pairs."""
    num = 20_000
    metric = EmbeddingRecallAtK(k=1)
    metric.update(torch.ones(num, 8), torch.arange(num) % 100)
    report = metric.protocol_report()
    assert report == {
        "queries": num,
        "identical_positive": num,
        "identical_negative": num,
        "rounding_positive": 0,
        "rounding_negative": 0,
        "duplicate_gallery_items": num - 1,
        "rounding_duplicate_gallery_items": 0,
    }


def test_bitwise_means_bitwise() -> None:
    """-0.0 and 0.0 are equal numbers but not equal bits; copies in another dtype are
    compared in the metric's dtype (float64 here)."""
    metric = EmbeddingRecallAtK(k=1).double()
    first = torch.tensor([[1.0, 0.0], [1.0, -0.0], [0.5, 0.25]], dtype=torch.float64)
    metric.update(first, torch.tensor([0, 0, 1]))
    report = metric.protocol_report()
    assert isinstance(report, dict)
    assert report["identical_positive"] == 0 and report["duplicate_gallery_items"] == 0
    metric.update(first[2:].clone(), torch.tensor([1]))
    report = metric.protocol_report()
    assert report["identical_positive"] == 2 and report["duplicate_gallery_items"] == 1


# ------------------------------------------------------------------ two processes


def _interval_cases() -> dict[str, tuple[dict[str, Any], list[tuple[Any, ...]]]]:
    """Metrics (kwargs) and their update batches, for one process or split over two."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(37, 9, generator=gen)
    target = torch.randint(-1, 9, (37,), generator=gen)
    preds = torch.randn(200, generator=gen)
    flat_target = torch.randint(0, 2, (200,), generator=gen)
    indexes = torch.randint(0, 23, (200,), generator=gen)
    return {
        "dense": ({"k": (1, 3)}, [(scores[i : i + 5], target[i : i + 5]) for i in range(0, 37, 5)]),
        "dense_expected": (
            {"k": 2, "ties": "expected"},
            [((scores[i : i + 7] * 2).round(), target[i : i + 7]) for i in range(0, 37, 7)],
        ),
        "flat": (
            {"k": (1, 2, 5)},
            [
                (preds[i : i + 30], flat_target[i : i + 30], indexes[i : i + 30])
                for i in range(0, 200, 30)
            ],
        ),
    }


def _run_one(case: Case, batches: list[Batch], **extra: Any) -> tuple[Any, Any, Any]:
    metric = metric_of(case, **extra)
    feed(metric, batches)
    on_demand = metric.protocol_report()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = metric.compute()
        interval = metric.confidence_interval(0.9)
    return on_demand, metric.protocol_report(), (values, interval)


def _interval_of(kwargs: dict[str, Any], batches: list[tuple[Any, ...]]) -> Any:
    metric = RetrievalRecallAtK(**kwargs)
    for batch in batches:
        if len(batch) == 3:
            metric.update(batch[0], batch[1], indexes=batch[2])
        else:
            metric.update(*batch)
    return metric.confidence_interval(0.8)


def _width_one_batches(rank: int, world_size: int) -> list[Batch]:
    """Embeddings of width 1 fed as single-row batches whose strides are not 1: each a
    ``[1, 1]`` slice ``x[:, ::2]`` of a ``[1, 2]`` tensor (bitwise copies among them)."""
    values = torch.tensor([0.5, -1.0, 0.5, 2.0, 0.5, -1.0, 3.0, 2.0, -0.0, 0.0])
    labels = torch.tensor([0, 1, 0, 1, 1, 0, 1, 1, 0, 0])
    out = []
    for i in range(rank, values.shape[0], world_size):
        wide = torch.stack([values[i : i + 1], torch.full((1,), 7.0)], dim=1)
        out.append(Batch(wide[:, ::2], labels[i : i + 1]))
    return out


WIDTH_ONE = Case("width_one", [], {"similarity": "dot", "near_duplicate": 1.0})


def _worker(rank: int, world_size: int, payload: Any) -> dict[str, Any]:
    """Every case split over the processes, their metrics ``sharded`` or not (the
    states gathered)."""
    sharded = payload["sharded"]
    results: dict[str, Any] = {}
    strided = _width_one_batches(rank, world_size)
    assert all(b.embeddings.shape == (1, 1) and b.embeddings.stride(-1) != 1 for b in strided)
    results[WIDTH_ONE.name] = _run_one(WIDTH_ONE, strided, sharded=sharded)
    for case in CASES:
        if sharded and callable(case.options.get("similarity")):
            continue  # sharded=True needs a built-in similarity
        # Uneven shards: rank 0 takes the first batch only; a process may hold nothing
        # of one role (the query/gallery cases).
        batches = [b for i, b in enumerate(case.batches) if (i == 0) == (rank == 0)]
        if len(case.batches) == 1:
            whole = case.batches[0]
            cut = whole.labels.shape[0] // 3
            part = slice(0, cut) if rank == 0 else slice(cut, None)
            batches = [whole.take(part)]
        results[case.name] = _run_one(case, batches, sharded=sharded)
    for name, (kwargs, batches) in _interval_cases().items():
        if not sharded:
            results["interval/" + name] = _interval_of(kwargs, batches[rank::world_size])
    # Uneven updates after a compute(): only rank 1 adds data; the reports (on demand
    # and from compute) follow on both processes, none waits for the other forever.
    case = CASES[0]
    metric = metric_of(case, sharded=sharded)
    feed(metric, case.batches[rank::world_size])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metric.compute()
        before = metric.protocol_report()
        if rank == 1:
            feed(metric, case.batches[:1])
        after_update = metric.protocol_report()
        metric.compute()
        metric.confidence_interval()
        after_compute = metric.protocol_report()
    results["uneven"] = (before, after_update, after_compute)
    return results


@pytest.fixture(scope="module", params=[False, True], ids=["gathered", "sharded"])
def two_processes(request: pytest.FixtureRequest) -> tuple[bool, list[dict[str, Any]]]:
    """Two gloo processes running :func:`_worker`, the states gathered or sharded."""
    sharded: bool = request.param
    return sharded, run_distributed(_worker, world_size=2, payload={"sharded": sharded})


@pytest.mark.ddp
def test_two_processes_equal_one_process(two_processes: tuple[bool, list[Any]]) -> None:
    """Two gloo processes: every report and interval equals the one-process result, on
    every process (embedding cases: reports with and without compute, values and
    intervals; dense, flat and embedding intervals), the states gathered or sharded."""
    sharded, results = two_processes
    assert results[0].keys() == results[1].keys()
    for case in CASES:
        if case.name not in results[0]:
            assert sharded and callable(case.options["similarity"])
            continue
        expected = brute_force(case)
        single = _run_one(case, case.batches)
        for result in results:
            on_demand, after, (values, interval) = result[case.name]
            assert on_demand == expected, case.name
            assert after == expected, case.name
            assert values == single[2][0], case.name
            assert interval.keys() == single[2][1].keys()
            for key in interval:
                assert torch.equal(interval[key], single[2][1][key]), (case.name, key)
    more = Case("more", [*CASES[0].batches, CASES[0].batches[0]], CASES[0].options)
    for result in results:
        before, after_update, after_compute = result["uneven"]
        assert before == brute_force(CASES[0])
        assert after_update == after_compute == brute_force(more)
    for name, (kwargs, batches) in _interval_cases().items():
        if sharded:
            assert "interval/" + name not in results[0]
            continue
        single = _interval_of(kwargs, batches)
        for result in results:
            got = result["interval/" + name]
            if isinstance(single, Tensor):
                assert torch.equal(got, single), name
            else:
                assert got.keys() == single.keys()
                assert all(torch.equal(got[k], single[k]) for k in single), name


@pytest.mark.ddp
def test_width_one_single_row_strided_batches_on_two_processes(
    two_processes: tuple[bool, list[Any]],
) -> None:
    """Embeddings of width 1 fed as single-row batches whose strides are not 1 (each a
    ``[1, 1]`` slice ``x[:, ::2]`` of a ``[1, 2]`` tensor) on two processes, gathered
    or ``sharded=True``: the values and report of one process on the same items (the
    sharded audit once failed to read such rows' bits)."""
    _, results = two_processes
    items = [b for rank in range(2) for b in _width_one_batches(rank, 2)]
    single = _run_one(WIDTH_ONE, items)
    case = Case(WIDTH_ONE.name, items, WIDTH_ONE.options)
    assert single[0] == brute_force(case)
    assert single[0]["identical_positive"] > 0 and single[0]["duplicate_gallery_items"] > 0
    for result in results:
        on_demand, after, (values, interval) = result[WIDTH_ONE.name]
        assert on_demand == after == single[0]
        assert values == single[2][0]
        assert all(torch.equal(interval[k], single[2][1][k]) for k in interval)


def test_expected_ties_count_certain_near_hits_and_forward_keeps_no_report() -> None:
    """``ties="expected"``: a near hit at 1 is a certain one (as ``"pessimistic"``);
    ``forward``'s batch value neither stores a report nor warns."""
    case = CASES[0]
    pessimistic = metric_of(case)
    feed(pessimistic, case.batches)
    expected_ties = metric_of(Case("expected", case.batches, {**case.options, "ties": "expected"}))
    feed(expected_ties, case.batches)
    assert expected_ties.protocol_report() == pessimistic.protocol_report()
    metric = metric_of(case)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for b in case.batches:
            metric(b.embeddings, b.labels)
    assert metric._life.report is None
    assert metric.protocol_report() == brute_force(case)


def test_interval_after_compute_reuses_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """``confidence_interval()`` after ``compute()`` ranks again but does not audit again;
    a report made on demand still lets ``compute()`` warn."""
    calls = []
    original = audit.protocol_reports

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(audit, "protocol_reports", counting)
    case = CASES[0]
    metric = metric_of(case)
    feed(metric, case.batches)
    metric.protocol_report()
    with pytest.warns(UserWarning, match="protocol_report"):
        metric.compute()
    metric.confidence_interval()
    assert metric.protocol_report() == brute_force(case)
    assert len(calls) == 1


@pytest.mark.parametrize("hashes", [None, "zero", "first_word"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_bitwise_classes_are_exact_whatever_the_hash(dtype: torch.dtype, hashes: Any) -> None:
    """Rows share a class exactly when their bits are equal: with the real hash, and with
    hashes that collide (all equal, or equal on the first word only) -- the exact
    fallback. -0.0 and 0.0 differ."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(-2, 3, (300, 3), generator=gen).to(dtype) / 2
    rows[7] = torch.tensor([-0.0, 0.0, 0.0]).to(dtype)
    rows[8] = torch.tensor([0.0, 0.0, 0.0]).to(dtype)
    with row_hash(hashes):
        classes = codes_of(rows).klass
    bits = rows.view(torch.int16)
    same_bits = (bits.unsqueeze(0) == bits.unsqueeze(1)).all(dim=2)
    assert torch.equal(classes.unsqueeze(0) == classes.unsqueeze(1), same_bits)
    assert classes[7] != classes[8]
    distinct = set(classes.tolist())
    assert sorted(distinct) == list(range(len(distinct)))  # classes 0..C-1


def test_report_on_demand_leaves_the_last_compute_attributes() -> None:
    """``protocol_report()`` ranks on demand (for the near counts) when data came after
    ``compute()``; ``last_compute_*`` still describe that compute."""
    case = CASES[0]
    metric = metric_of(case)
    feed(metric, case.batches[:1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metric.compute()
    ranked, rescored = metric.last_compute_num_queries_ranked, metric.last_compute_rescored
    feed(metric, case.batches[1:])
    assert metric.protocol_report() == brute_force(case)
    assert metric.last_compute_num_queries_ranked == ranked
    assert metric.last_compute_rescored == rescored


# ------------------------------------------------------------------ rounding copies


def _tricky_rows() -> Tensor:
    """Random rows and their rounding copies (1-2 ulps per coordinate, chains of them),
    copies exactly at the tolerance and one float beyond it, rows of very different
    scales, zeros of both signs, a collapsed cluster of jittered copies."""
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(40, 6, generator=gen)
    base[:10] *= torch.tensor([1e30, 1e-30, 3.0, 1e-3, 1e3]).repeat(2).unsqueeze(1)
    rows = [base]
    rows.append(ulps(base[:15], torch.randint(-2, 3, (15, 6), generator=gen)))
    rows.append(ulps(rows[-1][:8], torch.randint(-2, 3, (8, 6), generator=gen)))  # chains
    edge = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]).repeat(4, 1)
    edge[1, 1] = 2.0**-12  # at the tolerance (of the larger norm): a copy
    edge[2, 1] = torch.nextafter(edge[1, 1], torch.tensor(1.0))  # one float beyond: not
    edge[3, 0] = 1.0 + 2.0**-12  # the norm grows by the tolerance: a copy
    rows.append(edge)
    rows.append(torch.tensor([[0.0] * 6, [-0.0] * 6, [0.0] * 5 + [-0.0]]))
    rows.append(ulps(torch.ones(30, 6) * 0.7, torch.randint(-2, 3, (30, 6), generator=gen)))
    rows.append(rows[0][20:25].clone())  # bitwise copies
    return torch.cat(rows)


def test_rounding_pairs_equal_the_brute_force(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pair of rounding copies is found, and only those, whatever the chunking of
    the candidate pairs (chunks of 3)."""
    rows = _tricky_rows()
    expected = pairs_brute_force(rows)
    assert len(expected) > 30 * 29  # the collapsed cluster alone
    classes = codes_of(rows).klass
    at = {(int(classes[i]), int(classes[j])) for i, j in ((40 + 15 + 8, 40 + 15 + 8 + 1),)}
    assert at <= expected  # the copy at the tolerance
    beyond = (int(classes[40 + 15 + 8]), int(classes[40 + 15 + 8 + 2]))
    assert beyond not in expected
    assert pairs(rows) == expected
    assert pairs(rows, SIZES._replace(candidate_pairs=3)) == expected
    # Every pair summed in the fixed order (not only those near the boundary).
    monkeypatch.setattr(rounding, "IN_ORDER_MARGIN", math.inf)
    assert pairs(rows) == expected
    # In float64 storage and reordered: the same pairs of rows.
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(2))
    assert pairs(rows[order]) == pairs_brute_force(rows[order])


@pytest.mark.parametrize("threads", [2, 3])
def test_audit_blocks_give_the_same_codes_at_any_thread_count(threads: int) -> None:
    """:func:`audit.codes` hashes and projects its rows in many blocks: at ``threads`` torch
    threads the codes are those of one thread, the rounding pairs the brute force's; a
    hash that collides, likewise; torch's thread count is left as it was."""
    rows = _tricky_rows()
    rows = torch.cat([rows, rows[:60], rows[90:]])  # bitwise copies in other blocks
    labels = torch.arange(rows.shape[0]) % 5
    groups = torch.arange(rows.shape[0]) % 3
    sizes = budget.audit_sizes(4 * 2**10)  # several blocks of rows
    assert sizes.block_bytes < rows.shape[0] * rows.shape[1] * rows.element_size()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = audit.codes(rows, labels, groups, sizes)
        with row_hash("zero"):
            collide = audit.codes(rows, labels, groups, sizes)
        torch.set_num_threads(threads)
        many = audit.codes(rows, labels, groups, sizes)
        assert torch.get_num_threads() == threads
        for a, b in zip(one, many, strict=True):
            assert torch.equal(a, b)
        found = {(int(a), int(b)) for a, b in many.adjacent.tolist()}
        assert found == pairs_brute_force(rows) and len(found) > 30 * 29
        with row_hash("zero"):
            exact = audit.codes(rows, labels, groups, sizes)
        for a, b, c in zip(one, collide, exact, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
    finally:
        torch.set_num_threads(before)


def test_rounding_pairs_ignore_rows_that_are_not_finite() -> None:
    rows = torch.tensor([[1.0, 2.0], [math.inf, 2.0], [math.inf, 2.0 + 1e-6], [math.nan, 0.0]])
    rows = torch.cat([rows, torch.nextafter(rows[:1], torch.zeros(1, 2))])
    assert pairs(rows) == pairs_brute_force(rows)
    assert len(pairs(rows)) == 2  # rows 0 and 4, both ways


def _no_copies(rows: Tensor) -> None:
    assert pairs(rows) == set()
    metric = EmbeddingRecallAtK(k=1)
    metric.update(rows, torch.arange(rows.shape[0]) % 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metric.compute()
    report = metric.protocol_report()
    assert isinstance(report, dict)
    keys = ("rounding_positive", "rounding_negative", "rounding_duplicate_gallery_items")
    assert all(report[key] == 0 for key in keys)


@pytest.mark.parametrize("kind", ["random", "int8_neighbours", "binary", "ternary", "float16"])
def test_no_rounding_copies_among_distinct_embeddings(kind: str) -> None:
    """No false positive: random embeddings; quantised embeddings that are distinct, down
    to one quantisation step in one coordinate (int8 codes, binary and ternary codes);
    float16 values distinct by more than 2^-10 of their largest coordinate."""
    gen = torch.Generator().manual_seed(7)
    if kind == "random":
        rows = torch.randn(3000, 32, generator=gen)
    elif kind == "int8_neighbours":
        base = torch.randint(-127, 128, (300, 16), generator=gen)
        rows = base.repeat(16, 1)
        rows[torch.arange(300 * 16), torch.arange(16).repeat_interleave(300)] += 1  # one step
        rows = torch.cat([base, rows]).clamp(-127, 127).unique(dim=0).float()
    elif kind == "binary":
        rows = (torch.randint(0, 2, (2000, 24), generator=gen) * 2 - 1).unique(dim=0).float()
    elif kind == "ternary":
        rows = torch.randint(-1, 2, (2000, 12), generator=gen).unique(dim=0).float()
    else:
        base = torch.randn(500, 8, generator=gen).half()
        step = base.abs().amax(dim=1, keepdim=True) * 2.0**-9  # above the tolerance
        moved = (base.float() + step * (torch.arange(8) == 3)).half()
        rows = torch.cat([base, moved]).float().unique(dim=0)
    _no_copies(rows)


def test_the_documented_limits_of_the_tolerance() -> None:
    """Distinct int8 codes of 1,040 dimensions at full scale (norm just below 4,096)
    one step apart are not copies; a repeat one bfloat16 unit away in every coordinate
    is not a copy; a float16 output whose rounding flips in a few coordinates is."""
    codes = torch.full((1, 1040), 127.0) * torch.where(torch.arange(1040) % 2 == 0, 1, -1)
    assert float(codes.norm()) < 4096
    stepped = codes.clone()
    stepped[0, 5] -= 1
    assert pairs(torch.cat([codes, stepped])) == set()
    gen = torch.Generator().manual_seed(12)
    row = torch.randn(1, 64, generator=gen).bfloat16()
    away = torch.nextafter(row, torch.full_like(row, math.inf))
    assert pairs(torch.cat([row, away]).float()) == set()
    half = torch.randn(1, 512, generator=gen).half()
    flipped = half.clone()
    flipped[0, :8] = torch.nextafter(half[0, :8], torch.full_like(half[0, :8], math.inf))
    assert len(pairs(torch.cat([half, flipped]).float())) == 2


def test_a_padded_repeat_from_another_batch_shape_warns() -> None:
    """The DistributedSampler case: a repeat computed by a Linear layer in a batch of 1
    differs from the original (computed in a batch of 10) in its last bits; compute()
    warns about it, R@K is what it is without the audit, and ``ids=`` fixes it."""
    padding, ids = linear_padding()
    assert not torch.equal(padding.embeddings[0], padding.embeddings[41])
    metric = EmbeddingRecallAtK(k=(1, 5))
    feed(metric, [padding])
    with pytest.warns(
        UserWarning,
        match=r"6 of 44 counted queries \(13\.6%\) have an item of their own label equal to them"
        r" up to float rounding in their gallery.*\[rounding_positive\]; 3 of 44 gallery"
        r" items \(6\.8%\) are equal up to float rounding to another gallery item.*"
        r"\[rounding_duplicate_gallery_items\]\. Fixes: pass `ids=`",
    ):
        values = metric.compute()
    # The ranking never reads the audit: the functional (no audit) gives the same values.
    from recall_at_k.functional import embedding_recall_at_k

    assert values == embedding_recall_at_k(padding.embeddings, padding.labels, k=(1, 5))
    fixed = EmbeddingRecallAtK(k=(1, 5))
    fixed.update(padding.embeddings, padding.labels, ids=ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed.compute()


# ------------------------------------------------------------------ planted rules
#
# Three rules of the audit that the random cases above do not pin on their own, each on a
# small planted case whose counts are written out (and checked against the brute force).


def _report_of(case: Case) -> dict[str, Any]:
    metric = metric_of(case)
    feed(metric, case.batches)
    report = metric.protocol_report()
    assert report == brute_force(case)
    return dict(report)


def _alone_with_a_copy(copy: Tensor, action: str, near: float | None = None) -> Case:
    """Leave-one-out: item 0 is the only one of label 0; ``copy`` (of item 0) has
    label 1, as have items 2 and 3 (far from both)."""
    gen = torch.Generator().manual_seed(9)
    first = torch.randn(1, DIM, generator=gen)
    rest = torch.randn(2, DIM, generator=gen)
    embeddings = torch.cat([first, copy(first), rest])
    options: dict[str, Any] = {"empty_target_action": action}
    if near is not None:
        options["near_duplicate"] = near
    return Case(f"alone_{action}", [Batch(embeddings, torch.tensor([0, 1, 1, 1]))], options)


@pytest.mark.parametrize("action", ["neg", "pos", "skip", "error"])
def test_a_query_without_positives_and_a_copy_of_another_label(action: str) -> None:
    """Item 0 has no positive and a copy of another label (bitwise; then a rounding copy):
    it is counted -- and its copy is an identical / rounding negative -- only when
    ``empty_target_action`` counts it ("neg", "pos"); its copy (item 1, with positives)
    has item 0 as an identical / rounding negative under every action."""
    counted = action in ("neg", "pos")
    for make, key in ((Tensor.clone, "identical_negative"), (_one_ulp, "rounding_negative")):
        report = _report_of(_alone_with_a_copy(make, action))
        assert report["queries"] == 3 + counted
        assert report[key] == 1 + counted, (action, key)


def _one_ulp(rows: Tensor) -> Tensor:
    return ulps(rows, torch.ones_like(rows, dtype=torch.int64))


@pytest.mark.parametrize("action", ["neg", "skip", "error"])
def test_near_negatives_of_queries_without_positives(action: str) -> None:
    """``near_negative`` of a query without a valid positive (item 0, whose copy of
    another label scores above the threshold) counts under "neg" only: "error" counts
    like "skip" (on demand: compute() would raise)."""

    def near(rows: Tensor) -> Tensor:
        return rows + 1e-2 * torch.ones_like(rows)

    report = _report_of(_alone_with_a_copy(near, action, near=0.99))
    counted = action == "neg"
    assert report["queries"] == 3 + counted
    assert report["near_negative"] == 1 + counted
    assert report["identical_negative"] == report["rounding_negative"] == 0
    if action == "error":
        metric = metric_of(_alone_with_a_copy(near, action, near=0.99))
        feed(metric, _alone_with_a_copy(near, action, near=0.99).batches)
        with pytest.raises(ValueError, match="empty_target_action"):
            metric.compute()


def test_one_id_with_different_embeddings_in_its_two_roles() -> None:
    """Query id 7 is in the gallery too with another embedding (a rounding copy of
    itself, or a far one) and another label: it is the query itself, never an identical
    or rounding item; the bitwise copies of the query in the gallery (id 8 of its label,
    id 13 of another) and its rounding copy (id 9, another label) are."""
    gen = torch.Generator().manual_seed(10)
    query = torch.randn(1, DIM, generator=gen)
    others = torch.randn(3, DIM, generator=gen)
    for own, own_label in ((_one_ulp(query), 1), (others[:1], 0), (others[:1], 1)):
        gallery = torch.cat([own, query.clone(), _one_ulp(_one_ulp(query)), others, query])
        batches = [
            Batch(query, torch.tensor([0]), "query", torch.tensor([0]), torch.tensor([7])),
            Batch(
                gallery,
                torch.tensor([own_label, 0, 1, 0, 1, 1, 1]),
                "gallery",
                torch.tensor([1, 1, 1, 1, 1, 1, 1]),
                torch.tensor([7, 8, 9, 10, 11, 12, 13]),
            ),
        ]
        for exclude in ("none", "same_group", "same_label_and_group"):
            case = Case("one_id", batches, {"exclude": exclude, "bidirectional": True})
            report = _report_of(case)
            q2g = report["q2g"]
            assert q2g["identical_positive"] == 1 and q2g["identical_negative"] == 1
            assert q2g["rounding_positive"] == 0 and q2g["rounding_negative"] == 1
            g2q = report["g2q"]  # gallery items 8, 13 (bitwise) and 9 (rounding) find it
            assert g2q["identical_positive"] == 1 and g2q["identical_negative"] == 1
            assert g2q["rounding_positive"] == 0 and g2q["rounding_negative"] == 1


# ------------------------------------------------------------------ the audit's own memory


def test_sorted_parts_equal_one_stable_sort() -> None:
    """:func:`bitwise.sorted_parts` in many passes (keys that fill a range alone, runs
    of equal keys, negative and extreme keys) gives the stable sort of the whole, each
    key in one part only."""
    gen = torch.Generator().manual_seed(5)
    keys = torch.randint(-50, 50, (3000,), generator=gen)
    keys[::3] = 7  # a key that fills ranges alone
    keys[5] = -(2**63)
    keys[6] = 2**63 - 1
    keys[100:400] = torch.randint(-(2**62), 2**62, (300,), generator=gen)
    parts = list(bitwise.sorted_parts(keys, SIZES._replace(sort_items=100)))
    assert len(parts) > 10
    values, order = torch.sort(keys, stable=True)
    assert torch.equal(torch.cat([o for o, _ in parts]), order)
    assert torch.equal(torch.cat([v for _, v in parts]), values)
    last = [int(v[-1]) for _, v in parts]
    assert all(int(v[0]) > before for (_, v), before in zip(parts[1:], last, strict=False))
    assert len(list(bitwise.sorted_parts(keys, SIZES))) == 1  # 3,000 items: one sort


@pytest.mark.slow
@pytest.mark.parametrize("limit", ["int32", "int64"])
def test_report_whatever_the_code_type_and_sort_passes(
    limit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The codes are int32 up to ``CODE32_LIMIT`` items, int64 beyond (forced here: a
    limit of 10), and their sorts run in many passes (forced: 16 items a sort): every
    report equals the brute force."""
    monkeypatch.setattr(budget, "AUDIT_SORT_MIN_ITEMS", 16)
    monkeypatch.setattr(budget, "AUDIT_SORT_BYTES", 2**20)
    if limit == "int64":
        monkeypatch.setattr(bitwise, "CODE32_LIMIT", 10)
    rows = _tricky_rows()
    sizes = budget.audit_sizes(2**20)
    assert sizes.sort_items == 16
    num = rows.shape[0]
    keys = audit.codes(rows, torch.arange(num) % 5, torch.arange(num) % 3, sizes)
    assert all(getattr(keys, name).dtype == getattr(torch, limit) for name in ("klass", "label"))
    found = {(int(a), int(b)) for a, b in keys.adjacent.tolist()}
    assert found == pairs_brute_force(rows)
    for case in CASES:
        metric = metric_of(case)
        feed(metric, case.batches)
        assert metric.protocol_report() == brute_force(case), case.name


def test_rounding_pairs_of_float64_rows_at_the_ends_of_the_range() -> None:
    """float64 rows whose largest coordinate is subnormal (their scaling to ``[0.5, 1)``
    needs ``2^1073``, beyond the range as one factor) or near the largest float: their
    rounding copies (one ulp per coordinate) are found, as the brute force finds them."""
    gen = torch.Generator().manual_seed(21)
    base = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    base[:, 0] = 1.5  # the largest coordinate: 2^-14 of an ulp at 2^-1060
    scales = torch.tensor([2.0**-1060, 2.0**-1030, 2.0**1000], dtype=torch.float64)
    rows = torch.cat([base[4 * i : 4 * i + 4] * s for i, s in enumerate(scales.tolist())])
    moved = torch.nextafter(rows, torch.full_like(rows, math.inf))
    rows = torch.cat([rows, moved, rows[:2] * 3])
    expected = pairs_brute_force(rows)
    classes = codes_of(rows).klass
    subnormal = {(int(classes[i]), int(classes[i + 12])) for i in range(4)}
    assert subnormal <= expected
    assert pairs(rows) == expected
    small = SIZES._replace(block_bytes=64, project_bytes=64, candidate_pairs=2)
    assert pairs(rows, small) == expected


@pytest.mark.parametrize("offset", [0, 2**40])
def test_own_samples_equal_the_brute_force(offset: int) -> None:
    """The query's own sample in the gallery (the gallery's identities distinct), for
    identities ``0..n-1`` (the metric's) and others (``offset``: ids beyond the items); a
    side of every item in order (leave-one-out)."""
    gen = torch.Generator().manual_seed(5)
    num = 40
    identity = torch.randperm(num, generator=gen) // 2 * 3 + offset  # pairs share one
    g_rows = torch.randperm(num, generator=gen)[:25]
    keep = torch.unique(identity[g_rows], return_inverse=True)[1]
    first = torch.full((num,), 99).scatter_reduce(0, keep, torch.arange(25), "amin")
    g_rows = g_rows[first[: int(keep.max()) + 1]].sort()[0]  # distinct identities
    q_rows = torch.randperm(num, generator=gen)[:30].to(torch.int32)
    every = torch.arange(num, dtype=torch.int32)
    alone = torch.arange(num) * 3 + offset
    for queries, gallery, ids in [(q_rows, g_rows, identity), (every, every, alone)]:
        q_id, g_id = ids[queries.long()], ids[gallery.long()]
        has_self, self_row = own_samples(((queries, q_id), (gallery, g_id)), num, SIZES)
        assert self_row.dtype == torch.int32
        for q, (row, ident) in enumerate(zip(queries.tolist(), q_id.tolist(), strict=True)):
            match = [
                int(g) for g, i in zip(gallery.tolist(), g_id.tolist(), strict=True) if i == ident
            ]
            assert bool(has_self[q]) == bool(match)
            assert int(self_row[q]) == (match[0] if match else row)
    empty = torch.zeros(0, dtype=torch.int64)
    q_id = identity[q_rows.long()]
    has_self, self_row = own_samples(((q_rows, q_id), (empty, empty)), num, SIZES)
    assert not has_self.any() and torch.equal(self_row, q_rows)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_sorted_parts_equal_a_stable_sort(dtype: torch.dtype) -> None:
    """The parts of :func:`bitwise.sorted_parts` (many here: 1,024 items a sort) are a
    stable sort of the keys, equal keys never in two parts; a key that fills its range
    alone (half the items share one) is one part whose values are one broadcast key."""
    gen = torch.Generator().manual_seed(8)
    keys = torch.randint(-(2**30), 2**30, (6000,), generator=gen, dtype=torch.int64)
    keys[torch.randperm(6000, generator=gen)[:3000]] = 7
    keys = keys.to(dtype)
    parts = list(bitwise.sorted_parts(keys, SIZES._replace(sort_items=1024)))
    assert len(parts) > 3
    order = torch.cat([part[0] for part in parts])
    values = torch.cat([part[1] for part in parts])
    want_values, want_order = torch.sort(keys, stable=True)
    assert torch.equal(order, want_order) and torch.equal(values.to(dtype), want_values)
    last = [int(part[1][-1]) for part in parts[:-1]]
    first = [int(part[1][0]) for part in parts[1:]]
    assert all(a < b for a, b in zip(last, first, strict=True))
    heavy = [part for part in parts if int(part[1][0]) == 7]
    assert len(heavy) == 1 and heavy[0][1].stride() == (0,) and heavy[0][0].shape[0] >= 3000
