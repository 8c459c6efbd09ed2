"""The maths of Recall@K: per-query tie counts -> outcomes -> rank histogram -> recall.

Every input form reduces to per-query :class:`TieCounts`; the tie policy turns them into
one outcome per query, summed into a fixed-size rank histogram. Vectorised torch that
reads no tensor value on the host (except :func:`recall_from_histogram`).

Notation, per query: ``s*`` the best score among the valid (not ignored) positives, g_>
the valid negatives scored above ``s*``, e those scored exactly ``s*``, p the valid
positives scored exactly ``s*`` (at least one when the query has a valid positive)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


def count_dtype(terms: int) -> torch.dtype:
    """The float dtype in which ``terms`` 0/1 comparison results sum exactly (on CPU,
    torch's bool-output kernels are several times slower than the float ones)."""
    return torch.float32 if terms < 2**24 else torch.float64


class TieCounts(NamedTuple):
    """Per-query ``[Q]`` counts deciding Recall@K under every tie policy: g_>, g_> + e, p (None
    where not needed, :func:`needed_counts`; meaningless without a valid positive), whether
    there is a valid positive, and NaN rows where a kernel's reductions reveal them."""

    greater: Tensor | None
    at_or_above: Tensor | None
    tied_positives: Tensor | None
    has_positive: Tensor
    nan_rows: Tensor | None = None


class NeededCounts(NamedTuple):
    """Which fields of :class:`TieCounts` a tie policy needs."""

    greater: bool
    at_or_above: bool
    tied_positives: bool


def needed_counts(ties: str) -> NeededCounts:
    """The counts that decide hit@K under ``ties`` (``"expected"`` needs all three)."""
    return NeededCounts(ties != "pessimistic", ties != "optimistic", ties == "expected")


def no_positive_counts(num_queries: int, device: torch.device) -> TieCounts:
    """The counts of queries none of which has a valid positive."""
    zeros = torch.zeros(num_queries, dtype=torch.int64, device=device)
    return TieCounts(zeros, zeros, zeros, zeros.bool())


class Workspace:
    """Scratch buffers reused across calls (never metric state); each slot grows to the largest
    request (on CPU to at least twice its size, or at once to what it will hold where the
    caller knows: pages never written are never resident, and each new buffer is paged in
    again), and one made under ``torch.inference_mode()`` is replaced outside it."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}

    def get(
        self,
        slot: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        least: int = 0,
        most: int = 0,
    ) -> Tensor:
        """An uninitialised tensor of ``shape`` from ``slot``, made at least ``least`` long and,
        on CPU, ``most`` long: the most it will hold."""
        numel, key = math.prod(shape), (slot, dtype, device)
        least = max(least, most) if device.type == "cpu" else least
        buffer = self._buffers.get(key)
        stale = buffer is not None and buffer.is_inference() > torch.is_inference_mode_enabled()
        if buffer is None or stale or buffer.numel() < numel:
            doubled = 0 if buffer is None or stale or device.type != "cpu" else 2 * buffer.numel()
            size = max(numel, least, doubled)
            buffer = self._buffers[key] = torch.empty(size, dtype=dtype, device=device)
        return buffer[:numel].view(shape)

    def clear(self) -> None:
        """Free every buffer."""
        self._buffers.clear()

    def drop(self, *slots: str) -> None:
        """Free the buffers of ``slots`` (of any dtype and device)."""
        self._buffers = {key: kept for key, kept in self._buffers.items() if key[0] not in slots}


def scratch(
    workspace: Workspace | None,
    slot: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """A buffer from ``workspace``, or a fresh tensor without one."""
    if workspace is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return workspace.get(slot, shape, dtype, device)


def first_hit_rank(counts: TieCounts, ties: str) -> Tensor:
    """1-based first-hit rank under a deterministic policy; 0 for no valid positive."""
    ahead = counts.at_or_above if ties == "pessimistic" else counts.greater
    assert ahead is not None
    return torch.where(counts.has_positive, ahead + 1, 0)


def expected_hit_probability(
    greater: Tensor, tied_negatives: Tensor, tied_positives: Tensor, max_k: int
) -> Tensor:
    """float64 ``[Q, max_k]``: P(hit@K) for K = 1..max_k under a uniformly random order
    of the tied items. With m = K - g_>: 0 if m <= 0, 1 if m > e, else 1 - C(e, m) /
    C(e + p, m), a product of ratios summed in log space (exact for millions of ties)."""
    device = greater.device
    e = tied_negatives.to(torch.float64).unsqueeze(-1)
    p = tied_positives.to(torch.float64).unsqueeze(-1)
    steps = torch.arange(max_k, dtype=torch.float64, device=device)
    # log((e - i) / (e + p - i)) = log1p(-p / (e + p - i)); only i < e is ever used.
    log_ratio = torch.log1p(-p / (e + p - steps).clamp(min=1.0)).cumsum(dim=-1)
    m = (steps + 1) - greater.to(torch.float64).unsqueeze(-1)
    index = (m - 1).clamp(min=0, max=max_k - 1).to(torch.int64)
    miss_all_tied = torch.exp(log_ratio.gather(-1, index))
    prob = torch.where(m > e, 1.0, 1.0 - miss_all_tied)
    return torch.where(m <= 0, 0.0, prob)


def query_outcomes(counts: TieCounts, ties: str, max_k: int) -> Tensor:
    """Each query's contribution to the rank histogram: an int64 bin, ``r - 1`` for a first
    hit at rank ``r <= max_k``, ``max_k`` later, ``max_k + 1`` without a valid positive; for
    ``"expected"`` float64 ``[max_k + 1]``: P(first hit at 1..max_k), then 1.0 without one."""
    has_pos = counts.has_positive
    if ties == "expected":
        greater, at_or_above, tied = counts.greater, counts.at_or_above, counts.tied_positives
        assert greater is not None and at_or_above is not None and tied is not None
        cdf = expected_hit_probability(greater, at_or_above - greater, tied, max_k)
        pmf = torch.diff(cdf, dim=-1, prepend=torch.zeros_like(cdf[..., :1]))
        pmf = torch.where(has_pos.unsqueeze(-1), pmf, 0.0)
        return torch.cat([pmf, (~has_pos).to(pmf.dtype).unsqueeze(-1)], dim=-1)
    rank = first_hit_rank(counts, ties)
    return torch.where(has_pos, (rank - 1).clamp(max=max_k), max_k + 1)


def histogram_of(outcomes: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
    """:func:`query_outcomes` records summed: ``hist`` ``[max_k]``, (expected) first hits at each
    rank, and ``queries``, int64 ``[2]``: the queries with a valid positive and without."""
    if outcomes.is_floating_point():
        hist = outcomes[:, :max_k].sum(dim=0)
        without = outcomes[:, max_k].sum().to(torch.int64)
        return hist, torch.stack([outcomes.shape[0] - without, without])
    bins = torch.zeros(max_k + 2, dtype=torch.int64, device=outcomes.device)
    bins.scatter_add_(0, outcomes, torch.ones_like(outcomes))
    return bins[:max_k], torch.stack([bins[: max_k + 1].sum(), bins[max_k + 1]])


def rank_histogram(counts: TieCounts, ties: str, max_k: int) -> tuple[Tensor, Tensor]:
    """``histogram_of(query_outcomes(counts, ties, max_k), max_k)`` in fewer operations, for a
    deterministic policy (the clamp at 0 keeps a NaN row's counts a valid index)."""
    if ties == "expected":
        return histogram_of(query_outcomes(counts, ties, max_k), max_k)
    ahead = counts.at_or_above if ties == "pessimistic" else counts.greater
    assert ahead is not None
    device = ahead.device
    none = constant(max_k + 1, torch.int64, device)
    bins = torch.where(counts.has_positive, ahead.clamp(min=0, max=max_k), none)
    if device.type == "cpu":
        # One operation; on an accelerator bincount would read the largest bin.
        found = torch.bincount(bins, minlength=max_k + 2)
    else:
        found = torch.zeros(max_k + 2, dtype=torch.int64, device=device)
        found.scatter_add_(0, bins, torch.ones_like(bins))
    without = found[max_k + 1 :]
    return found[:max_k], torch.cat([torch.rsub(without, bins.shape[0]), without])


def first_of_each_id(ids: Tensor) -> Tensor:
    """Positions of the first occurrence of every distinct id, in order of the ids."""
    sorted_ids, order = torch.sort(ids, stable=True)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    return order[first]


def recall_from_histogram(
    hist: Tensor, queries: Tensor, ks: tuple[int, ...], empty_target_action: str
) -> tuple[Tensor, int, int]:
    """float64 ``[len(ks)]`` Recall@K from a rank histogram and the query counts (NaN when
    none is counted), the counted queries and those without a valid positive."""
    cumulative = hist.cumsum(dim=0).to(torch.float64)
    index = torch.tensor([k - 1 for k in ks], device=hist.device)
    hits = cumulative.gather(0, index)
    with_pos, without_pos = (int(v) for v in queries.tolist())
    if empty_target_action == "pos":
        hits = hits + without_pos
    counted = with_pos if empty_target_action in ("skip", "error") else with_pos + without_pos
    if counted == 0:
        return torch.full_like(hits, float("nan")), 0, without_pos
    return hits / counted, counted, without_pos


_CONSTANTS: dict[tuple[float | str, torch.dtype, torch.device], Tensor] = {}


def constant(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 0-d tensor of ``value``, made once per (value, dtype, device), a cheaper operand than
    a Python number. Never an inference tensor; must not be written."""
    key = (value if value == value else "nan", dtype, device)  # NaN != NaN as a key
    found = _CONSTANTS.get(key)
    if found is None:
        with torch.inference_mode(False):
            found = torch.full((), value, dtype=dtype, device=device)
        _CONSTANTS[key] = found
    return found
