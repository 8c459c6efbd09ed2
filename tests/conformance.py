"""Conformance harness: every input form of both metrics through every torchmetrics pattern.

In the spirit of torchmetrics' own ``MetricTester``, written anew. A :class:`Case` is one
input form (a metric configuration plus a generator of ``update`` calls on small data
with heavy ties and empty targets); its reference is the brute-force one
(``reference.reference_recall`` / ``embedding_reference.reference_embedding_recall``)
applied to the same calls. Each ``check_*`` function runs one torchmetrics pattern on a
case and asserts that the metric's values equal the reference: update against forward,
re-batching and reordering, pickling / deepcopy / ``state_dict``, ``merge_state``, dtype
casts, ``torch.inference_mode``, ``compute_on_cpu``, positional against keyword calls,
``MetricCollection``, and (:func:`distributed_worker`) two gloo processes.
"""

from __future__ import annotations

import copy
import math
import pickle
import random
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from embedding_reference import Batch, items_of, members, reference_embedding_recall
from reference import reference_recall
from torch import Tensor
from torchmetrics import Metric, MetricCollection

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK

TOLERANCE = 1e-6
RETRIEVAL_POSITIONAL = ("preds", "target", "indexes")
EMBEDDING_POSITIONAL = ("embeddings", "labels")


@dataclass(frozen=True)
class Call:
    """One ``update`` call: row-aligned tensors (leading dimension = rows) and options."""

    tensors: dict[str, Tensor]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(next(iter(self.tensors.values())).shape[0])

    def take(self, start: int, stop: int) -> Call:
        return Call({n: t[start:stop].clone() for n, t in self.tensors.items()}, dict(self.options))

    def cast_floats(self, dtype: torch.dtype) -> Call:
        tensors = {n: t.to(dtype) if t.is_floating_point() else t for n, t in self.tensors.items()}
        return Call(tensors, dict(self.options))


@dataclass(frozen=True)
class Case:
    """One input form of one metric, with its data and its brute-force reference."""

    name: str
    embedding: bool  # EmbeddingRecallAtK (else RetrievalRecallAtK)
    k: int | tuple[int, ...]
    options: dict[str, Any]  # constructor keywords besides ``k``
    generate: Callable[[int], list[Call]]  # seed -> update calls (an even number of them)
    whole_calls: bool = False  # calls may be reordered but not split (complete_queries)

    @property
    def ks(self) -> tuple[int, ...]:
        return (self.k,) if isinstance(self.k, int) else self.k

    def make(self, **extra: Any) -> Metric:
        cls = EmbeddingRecallAtK if self.embedding else RetrievalRecallAtK
        return cls(k=self.k, **{**self.options, **extra})

    def calls(self, seed: int = 0) -> list[Call]:
        return self.generate(seed)

    def reference(self, calls: Sequence[Call]) -> dict[str, float]:
        if self.embedding:
            return _embedding_reference(self, calls)
        return _retrieval_reference(self, calls)

    @property
    def positional(self) -> tuple[str, ...]:
        return EMBEDDING_POSITIONAL if self.embedding else RETRIEVAL_POSITIONAL


# ---------------------------------------------------------------- references


def _retrieval_reference(case: Case, calls: Sequence[Call]) -> dict[str, float]:
    ties = case.options.get("ties", "pessimistic")
    action = case.options.get("empty_target_action", "neg")
    scores: list[list[float]] = []
    relevant: list[list[bool]] = []
    ignored: list[list[bool]] = []
    if any("indexes" in call.tensors for call in calls):
        ignore_index = case.options.get("ignore_index")
        complete = case.options.get("complete_queries", False)
        queries: dict[int, list[tuple[float, int]]] = {}
        for call in calls:
            seen_before = set(queries)
            ids = call.tensors["indexes"].tolist()
            preds = call.tensors["preds"].double().tolist()
            target = call.tensors["target"].tolist()
            for q, s, t in zip(ids, preds, target, strict=True):
                if complete and q in seen_before:
                    continue  # a repeat of a query already complete: counted once
                queries.setdefault(q, []).append((s, int(t)))
        for items in queries.values():
            kept = [(s, t) for s, t in items if ignore_index is None or t != ignore_index]
            if not kept:
                continue  # every item dropped: the query is not counted
            scores.append([s for s, _ in kept])
            relevant.append([t == 1 for _, t in kept])
            ignored.append([False] * len(kept))
    else:
        seen_ids: set[int] = set()
        for call in calls:
            preds = call.tensors["preds"].double()
            target = call.tensors["target"]
            ignore = call.tensors.get("ignore")
            query_ids = call.tensors.get("query_ids")
            for row in range(preds.shape[0]):
                if query_ids is not None:
                    qid = int(query_ids[row])
                    if qid in seen_ids:
                        continue
                    seen_ids.add(qid)
                width = preds.shape[1]
                if target.dim() == 1:
                    column = int(target[row])
                    rel = [j == column for j in range(width)]
                else:
                    rel = [bool(v) for v in target[row].tolist()]
                scores.append(preds[row].tolist())
                relevant.append(rel)
                ignored.append(
                    [False] * width if ignore is None else [bool(v) for v in ignore[row].tolist()]
                )
    values = reference_recall(scores, relevant, ignored, case.ks, ties, action)
    key = case.options.get("key", "recall@{k}")
    return {key.format(k=k): v for k, v in zip(case.ks, values, strict=True)}


def _embedding_reference(case: Case, calls: Sequence[Call]) -> dict[str, float]:
    batches = [
        Batch(
            embeddings=call.tensors["embeddings"],
            labels=call.tensors["labels"],
            role=call.options.get("role", "both"),
            groups=call.tensors.get("groups"),
            ids=call.tensors.get("ids"),
        )
        for call in calls
    ]
    options = {
        name: case.options[name]
        for name in ("similarity", "exclude", "bidirectional", "ties", "empty_target_action")
        if name in case.options
    }
    out = reference_embedding_recall(batches, case.ks, **options)
    # A direction that these calls alone cannot rank (no query or no gallery) is NaN.
    items = items_of(batches)
    as_query, as_gallery = ("query", "both"), ("gallery", "both")
    plan = [("q2g", as_query, as_gallery), ("g2q", as_gallery, as_query)]
    for direction, query_roles, gallery_roles in plan[: 2 if options.get("bidirectional") else 1]:
        if not members(items, query_roles) or not members(items, gallery_roles):
            for key in out:
                if not options.get("bidirectional") or key.startswith(direction + "/"):
                    out[key] = math.nan
    return out


# ---------------------------------------------------------------- data generators


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dense(mask: bool, ignore: bool, query_ids: bool) -> Callable[[int], list[Call]]:
    def generate(seed: int) -> list[Call]:
        gen = _gen(seed)
        calls: list[Call] = []
        next_id = 0
        for rows in (3, 5, 2, 4):
            width = 6
            tensors: dict[str, Tensor] = {
                "preds": torch.randint(0, 3, (rows, width), generator=gen).float()
            }
            if mask:
                tensors["target"] = torch.rand(rows, width, generator=gen) < 0.25
            else:
                tensors["target"] = torch.randint(-1, width, (rows,), generator=gen)
            if ignore:
                tensors["ignore"] = torch.rand(rows, width, generator=gen) < 0.2
            if query_ids:
                tensors["query_ids"] = torch.arange(next_id, next_id + rows)
                next_id += rows
            calls.append(Call(tensors))
        if query_ids:  # DistributedSampler padding: the first two queries come again
            last = calls[-1]
            calls[-1] = Call(
                {n: torch.cat([last.tensors[n], calls[0].tensors[n][:2]]) for n in last.tensors}
            )
        return calls

    return generate


def _flat(ignore_index: int | None) -> Callable[[int], list[Call]]:
    def generate(seed: int) -> list[Call]:
        gen = _gen(seed)
        calls = []
        for items in (12, 7, 15, 9):
            target = torch.randint(0, 2, (items,), generator=gen)
            if ignore_index is not None:
                target[torch.rand(items, generator=gen) < 0.2] = ignore_index
            calls.append(
                Call(
                    {
                        "preds": torch.randint(0, 3, (items,), generator=gen).float(),
                        "target": target,
                        "indexes": torch.randint(-3, 5, (items,), generator=gen),
                    }
                )
            )
        return calls

    return generate


def _flat_complete(seed: int) -> list[Call]:
    gen = _gen(seed)
    width = 4

    def queries(ids: list[int]) -> dict[str, Tensor]:
        n = len(ids) * width
        return {
            "preds": torch.randint(0, 3, (n,), generator=gen).float(),
            "target": (torch.rand(n, generator=gen) < 0.3).long(),
            "indexes": torch.tensor(ids).repeat_interleave(width),
        }

    first = queries([0, 1, 2])
    calls = [Call(first), Call(queries([3, 4, 5])), Call(queries([6, 7, 8]))]
    last = queries([9])
    # DistributedSampler padding: query 0 again, all its items, in the last call.
    repeat = {n: torch.cat([last[n], first[n][:width]]) for n in last}
    calls.append(Call(repeat))
    return calls


def _axis_vectors(rows: int, gen: torch.Generator) -> Tensor:
    """Signed, scaled axis vectors: every cosine is exactly 0, 1 or -1."""
    axis = torch.randint(0, 4, (rows,), generator=gen)
    scale = torch.randint(1, 3, (rows,), generator=gen).float()
    sign = torch.randint(0, 2, (rows,), generator=gen).float() * 2 - 1
    out = torch.zeros(rows, 4)
    out[torch.arange(rows), axis] = scale * sign
    return out


def _embedding_loo(seed: int) -> list[Call]:
    gen = _gen(seed)
    calls = []
    for rows in (5, 4, 6, 3):
        labels = torch.randint(0, 4, (rows,), generator=gen)
        labels[0] = 100 + len(calls)  # a label of its own: a query without a positive
        calls.append(Call({"embeddings": _axis_vectors(rows, gen), "labels": labels}))
    return calls


def _embedding_roles(groups: bool, span: int) -> Callable[[int], list[Call]]:
    def generate(seed: int) -> list[Call]:
        gen = _gen(seed)
        calls = []
        next_id = 0
        for role, rows in (("query", 4), ("gallery", 6), ("query", 3), ("gallery", 5)):
            tensors = {
                "embeddings": torch.randint(-span, span + 1, (rows, 3), generator=gen).float(),
                "labels": torch.randint(0, 3, (rows,), generator=gen),
            }
            if groups:
                tensors["groups"] = torch.randint(0, 2, (rows,), generator=gen)
            if role == "gallery" and groups:
                tensors["ids"] = torch.arange(next_id, next_id + rows)
                next_id += rows
            calls.append(Call(tensors, {"role": role}))
        if groups:  # padding: the first gallery item again, with its id
            last, first = calls[3], calls[1]
            calls[3] = Call(
                {n: torch.cat([last.tensors[n], first.tensors[n][:1]]) for n in last.tensors},
                {"role": "gallery"},
            )
        return calls

    return generate


CASES: tuple[Case, ...] = (
    Case("dense_index", False, (1, 2, 5), {}, _dense(mask=False, ignore=False, query_ids=False)),
    Case(
        "dense_mask",
        False,
        (1, 3),
        {"ties": "expected", "empty_target_action": "skip"},
        _dense(mask=True, ignore=False, query_ids=False),
    ),
    Case(
        "dense_mask_ignore",
        False,
        (2, 4),
        {"ties": "optimistic", "empty_target_action": "pos"},
        _dense(mask=True, ignore=True, query_ids=False),
    ),
    Case("dense_query_ids", False, 3, {}, _dense(mask=False, ignore=False, query_ids=True)),
    Case("flat", False, (1, 2, 4), {"ties": "expected"}, _flat(ignore_index=None)),
    Case("flat_ignore_index", False, (1, 3), {"ignore_index": -100}, _flat(ignore_index=-100)),
    Case(
        "flat_complete_queries",
        False,
        (1, 2),
        {"complete_queries": True, "ties": "expected"},
        _flat_complete,
        whole_calls=True,
    ),
    Case("embedding_loo", True, (1, 3), {"ties": "expected"}, _embedding_loo),
    Case(
        "embedding_query_gallery",
        True,
        (1, 2, 4),
        {"similarity": "dot", "exclude": "same_group"},
        _embedding_roles(groups=True, span=1),
    ),
    Case(
        "embedding_bidirectional",
        True,
        (1, 3),
        {"similarity": "euclidean", "bidirectional": True, "ties": "optimistic"},
        _embedding_roles(groups=False, span=2),
    ),
)
CASE_BY_NAME = {case.name: case for case in CASES}


# ---------------------------------------------------------------- calling and comparing


def as_values(result: Tensor | dict[str, Tensor], keys: Sequence[str]) -> dict[str, float]:
    if isinstance(result, Tensor):
        assert len(keys) == 1, f"a scalar result for keys {keys}"
        assert result.dim() == 0, f"an int `k` gives a scalar tensor, got shape {result.shape}"
        return {keys[0]: float(result)}
    assert isinstance(result, dict), f"expected a tensor or a dict, got {type(result)}"
    assert list(result) == list(keys), f"keys {list(result)} != {list(keys)}"
    return {key: float(value) for key, value in result.items()}


def assert_close(actual: dict[str, float], expected: dict[str, float], what: str = "") -> None:
    assert list(actual) == list(expected), f"{what}: keys {list(actual)} != {list(expected)}"
    for key, value in expected.items():
        got = actual[key]
        same = (math.isnan(value) and math.isnan(got)) or abs(got - value) <= TOLERANCE
        assert same, f"{what}: {key} = {got}, reference {value} (all: {actual} vs {expected})"


def call_metric(metric: Any, call: Call, *, positional: bool, names: Sequence[str]) -> Any:
    """``metric(...)`` (forward) with the leading tensors positional or all by keyword."""
    args: list[Tensor] = []
    kwargs: dict[str, Any] = dict(call.options)
    if positional:
        for name in names:
            if name not in call.tensors:
                break
            args.append(call.tensors[name])
        kwargs.update({n: t for n, t in call.tensors.items() if n not in names[: len(args)]})
    else:
        kwargs.update(call.tensors)
    return metric(*args, **kwargs)


def update(metric: Metric, call: Call) -> None:
    metric.update(**call.tensors, **call.options)


def forward(metric: Metric, call: Call) -> Any:
    return metric(**call.tensors, **call.options)


def compute_values(case: Case, metric: Metric) -> dict[str, float]:
    keys = list(case.reference(case.calls()))
    return as_values(metric.compute(), keys)


def regroup(case: Case, calls: Sequence[Call], seed: int) -> list[Call]:
    """Another batching of the same data: calls split at random rows, then shuffled."""
    rng = random.Random(seed)
    pieces: list[Call] = []
    for call in calls:
        if case.whole_calls or call.rows < 2:
            pieces.append(call)
            continue
        cut = rng.randrange(1, call.rows)
        pieces += [call.take(0, cut), call.take(cut, call.rows)]
    rng.shuffle(pieces)
    return pieces


# ---------------------------------------------------------------- checks


def check_update_and_forward(case: Case) -> None:
    calls = case.calls()
    expected = case.reference(calls)
    keys = list(expected)
    updated = case.make()
    for call in calls:
        update(updated, call)
    assert_close(as_values(updated.compute(), keys), expected, "update")
    forwarded = case.make()
    for i, call in enumerate(calls):
        batch = as_values(forward(forwarded, call), keys)
        assert_close(batch, case.reference([call]), f"forward batch {i}")
    assert_close(as_values(forwarded.compute(), keys), expected, "forward then compute")
    # compute() twice gives the same; reset() forgets everything.
    assert_close(as_values(forwarded.compute(), keys), expected, "second compute")
    forwarded.reset()
    for call in calls[:2]:  # (a query batch and a gallery batch, for the embedding cases)
        update(forwarded, call)
    assert_close(as_values(forwarded.compute(), keys), case.reference(calls[:2]), "after reset")


def check_batching_and_order(case: Case) -> None:
    calls = case.calls()
    expected = case.reference(calls)
    for seed in range(3):
        metric = case.make()
        for call in regroup(case, calls, seed):
            update(metric, call)
        assert_close(compute_values(case, metric), expected, f"regrouped (seed {seed})")
    reversed_metric = case.make()
    for call in reversed(calls):
        update(reversed_metric, call)
    assert_close(compute_values(case, reversed_metric), expected, "reversed")


def check_persistence(case: Case) -> None:
    calls = case.calls()
    expected = case.reference(calls)
    half = len(calls) // 2
    metric = case.make()
    for call in calls[:half]:
        update(metric, call)
    metric.persistent(True)
    loaded = case.make()
    loaded.persistent(True)
    loaded.load_state_dict(copy.deepcopy(metric.state_dict()))
    copies = {
        "pickle": pickle.loads(pickle.dumps(metric)),
        "deepcopy": copy.deepcopy(metric),
        "state_dict": loaded,
        "original": metric,
    }
    for name, copied in copies.items():
        for call in calls[half:]:
            update(copied, call)
        assert_close(compute_values(case, copied), expected, name)
    # A pickled metric that has computed (and cached) pickles and computes again too.
    assert_close(compute_values(case, pickle.loads(pickle.dumps(metric))), expected, "re-pickle")


def check_merge_state(case: Case) -> None:
    calls = case.calls()
    expected = case.reference(calls)
    first, second = case.make(), case.make()
    for call in calls[:1]:
        update(first, call)
    for call in calls[1:]:
        update(second, call)
    first.merge_state(second)
    assert_close(compute_values(case, first), expected, "merge_state(metric)")
    # merging into an empty metric, and merging an empty one, change nothing
    empty = case.make()
    empty.merge_state(first)
    assert_close(compute_values(case, empty), expected, "empty.merge_state(full)")
    first.merge_state(case.make())
    assert_close(compute_values(case, first), expected, "full.merge_state(empty)")


CASTS: dict[str, tuple[Callable[[Metric], Any], torch.dtype]] = {
    "to(float16)": (lambda m: m.to(torch.float16), torch.float16),
    "half()": (lambda m: m.half(), torch.float16),
    "to(bfloat16)": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    "bfloat16()": (lambda m: m.bfloat16(), torch.bfloat16),
    "set_dtype(float16)": (lambda m: m.set_dtype(torch.float16), torch.float16),
    "set_dtype(bfloat16)": (lambda m: m.set_dtype(torch.bfloat16), torch.bfloat16),
    "double()": (lambda m: m.double(), torch.float64),
}


def check_dtype_casts(case: Case) -> None:
    """A cast before the updates (inputs in that dtype) or between them changes no value.

    The cases' float inputs are small integers, exact in every float dtype, so any
    difference comes from the metric's own state.
    """
    calls = case.calls()
    expected = case.reference(calls)
    for name, (cast, dtype) in CASTS.items():
        before = case.make()
        cast(before)
        for call in calls:
            update(before, call.cast_floats(dtype))
        assert_close(compute_values(case, before), expected, f"{name} before the updates")
        between = case.make()
        update(between, calls[0])
        cast(between)
        for call in calls[1:]:
            update(between, call)
        assert_close(compute_values(case, between), expected, f"{name} between updates")
        # a cast there and back keeps every count
        round_trip = case.make()
        for call in calls:
            update(round_trip, call)
        cast(round_trip)
        round_trip.float()
        round_trip.set_dtype(torch.float32)
        assert_close(compute_values(case, round_trip), expected, f"{name} and back")


def check_inference_mode(case: Case) -> None:
    calls = case.calls()
    expected = case.reference(calls)
    keys = list(expected)
    for via_forward in (False, True):
        metric = case.make()
        with torch.inference_mode():
            if via_forward:
                forward(metric, calls[0])
            else:
                update(metric, calls[0])
        for call in calls[1:]:
            if via_forward:
                forward(metric, call)
            else:
                update(metric, call)
        assert_close(as_values(metric.compute(), keys), expected, f"mixed ({via_forward=})")
        metric.reset()
        for call in calls:
            update(metric, call)
        assert_close(as_values(metric.compute(), keys), expected, "after reset")
        metric.reset()
        with torch.inference_mode():
            for call in calls:
                update(metric, call)
            assert_close(as_values(metric.compute(), keys), expected, "all inside")


def check_compute_on_cpu(case: Case) -> None:
    calls = case.calls()
    expected = case.reference(calls)
    metric = case.make(compute_on_cpu=True)
    for i, call in enumerate(calls):
        if i % 2:
            update(metric, call)
        else:
            forward(metric, call)
    assert_close(compute_values(case, metric), expected, "compute_on_cpu")


def check_call_styles(case: Case) -> None:
    """forward and update, positionally and by keyword, alone and in a MetricCollection."""
    calls = case.calls()
    expected = case.reference(calls)
    keys = list(expected)
    for positional in (True, False):
        metric = case.make()
        for call in calls:
            value = call_metric(metric, call, positional=positional, names=case.positional)
            assert_close(as_values(value, keys), case.reference([call]), f"{positional=}")
        assert_close(as_values(metric.compute(), keys), expected, f"{positional=}")
        # A collection of two instances that must not share a compute group.
        other_ties = "optimistic" if case.options.get("ties") == "pessimistic" else "pessimistic"
        other_case = Case(
            case.name, case.embedding, case.k, {**case.options, "ties": other_ties}, case.generate
        )
        collection = MetricCollection({"a": case.make(), "b": other_case.make()})
        for call in calls:
            call_metric(collection, call, positional=positional, names=case.positional)
        result = collection.compute()
        for name, ref in (("a", expected), ("b", other_case.reference(calls))):
            if isinstance(case.k, int):
                flattened = {keys[0]: float(result[name])}
            else:
                flattened = {key: float(result[f"{name}_{key}"]) for key in keys}
            assert_close(flattened, ref, f"collection member {name} ({positional=})")


def check_beside_torchmetrics(case: Case) -> None:
    """Flat form in a MetricCollection with RetrievalHitRate and RetrievalMRR, positionally.

    On tie-free scores Recall@K is torchmetrics' ``RetrievalHitRate(top_k=K)``; a padded
    repeat (``complete_queries``) is left out, as torchmetrics would count it twice.
    """
    from torchmetrics.retrieval import RetrievalHitRate, RetrievalMRR

    calls = case.calls()[:3] if case.whole_calls else case.calls()
    gen = torch.Generator().manual_seed(1)
    total = sum(call.rows for call in calls)
    distinct = torch.randperm(total, generator=gen).float() / total
    tie_free, start = [], 0
    for call in calls:
        tensors = dict(call.tensors)
        tensors["preds"] = distinct[start : start + call.rows]
        start += call.rows
        tie_free.append(Call(tensors, dict(call.options)))
    ignore_index = case.options.get("ignore_index")
    theirs = {
        f"hit_rate@{k}": RetrievalHitRate(top_k=k, ignore_index=ignore_index) for k in case.ks
    }
    collection = MetricCollection(
        {"ours": case.make(), "mrr": RetrievalMRR(ignore_index=ignore_index), **theirs}
    )
    mrr = RetrievalMRR(ignore_index=ignore_index)
    for call in tie_free:
        call_metric(collection, call, positional=True, names=RETRIEVAL_POSITIONAL)
        update(mrr, call)
    result = collection.compute()
    expected = case.reference(tie_free)
    if isinstance(case.k, int):
        ours = {next(iter(expected)): float(result["ours"])}
    else:
        ours = {key: float(result[key]) for key in expected}
    assert_close(ours, expected, "beside torchmetrics")
    hit_rates = {
        key: float(result[f"hit_rate@{k}"]) for k, key in zip(case.ks, expected, strict=True)
    }
    assert_close(hit_rates, expected, "RetrievalHitRate(top_k=k)")
    assert abs(float(result["mrr"]) - float(mrr.compute())) <= TOLERANCE


# ---------------------------------------------------------------- distributed


def _shard(calls: Sequence[Call], rank: int, scenario: str) -> list[Call]:
    if scenario == "uneven":
        return list(calls[:1]) if rank == 0 else list(calls[1:])
    if scenario == "idle":  # the second process sees no data at all
        return list(calls) if rank == 0 else []
    raise ValueError(scenario)


def distributed_worker(rank: int, world_size: int, payload: Sequence[str]) -> list[Any]:
    """Run every named case on this process; return (case, scenario, step, values) rows.

    A case that raises is reported as ``(case, "error", traceback, {})`` and the others
    still run (a failing case must not break the collective calls of the next one, so
    both processes stop that case at the same call: the error is raised in both).
    """
    out: list[Any] = []
    for name in payload:
        try:
            out += _distributed_case(CASE_BY_NAME[name], rank, world_size)
        except Exception:
            out.append((name, "error", traceback.format_exc(), {}))
    return out


def _distributed_case(case: Case, rank: int, world_size: int) -> list[Any]:
    out: list[Any] = []
    name = case.name
    calls = case.calls()
    keys = list(case.reference(calls))
    for sync_on_step in (False, True):
        for scenario in ("uneven", "idle"):
            metric = case.make(dist_sync_on_step=sync_on_step)
            for call in _shard(calls, rank, scenario):
                update(metric, call)
            label = f"{scenario}, dist_sync_on_step={sync_on_step}"
            out.append((name, label, "compute", as_values(metric.compute(), keys)))
        # forward in lockstep: at step j, process r holds call 2 j + r.
        metric = case.make(dist_sync_on_step=sync_on_step)
        label = f"lockstep, dist_sync_on_step={sync_on_step}"
        for step in range(len(calls) // world_size):
            value = forward(metric, calls[step * world_size + rank])
            out.append((name, label, f"forward {step}", as_values(value, keys)))
        out.append((name, label, "compute", as_values(metric.compute(), keys)))
    return out


def distributed_expectations(
    name: str, world_size: int, rank: int
) -> dict[tuple[str, str], dict[str, float]]:
    """What :func:`distributed_worker` must return on ``rank`` for one case."""
    case = CASE_BY_NAME[name]
    calls = case.calls()
    whole = case.reference(calls)
    out: dict[tuple[str, str], dict[str, float]] = {}
    for sync_on_step in (False, True):
        for scenario in ("uneven", "idle"):
            out[(f"{scenario}, dist_sync_on_step={sync_on_step}", "compute")] = whole
        label = f"lockstep, dist_sync_on_step={sync_on_step}"
        for step in range(len(calls) // world_size):
            if sync_on_step:  # the batch value of every process's batch of this step
                batch = calls[step * world_size : (step + 1) * world_size]
            else:
                batch = [calls[step * world_size + rank]]
            out[(label, f"forward {step}")] = case.reference(batch)
        out[(label, "compute")] = whole
    return out
