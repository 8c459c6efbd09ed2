"""``audit.sharded_codes``: the protocol audit's item codes over rows sharded across real
gloo processes equal ``audit.codes()`` over the rows concatenated in process order -- the
same classes (numbered alike on every process) and the same pairs of rounding copies --
over random rows, bitwise and rounding copies across processes, all rows equal, zeros of
both signs, forced hash collisions, float64 and mixed dtypes, rows that are not finite,
uneven shares, a process without rows and a process group covering some of the
processes; with the blocks of rows and pairs at their defaults and tiny, the rows stored
in blocks of one or two rows whose strides are not 1. (The protocol report over sharded
states, against the brute force: ``test_protocol_audit.py``.)"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from audit_reference import SIZES, codes_of, row_hash, ulps
from helpers import run_distributed
from torch import Tensor

from recall_at_k import audit
from recall_at_k.audit import Codes, bitwise, rounding
from recall_at_k.ranking import budget


class Scenario(NamedTuple):
    name: str
    parts: list[Tensor]  # each process's rows, in process order
    labels: Tensor
    groups: Tensor
    hook: str | None  # the row hash sharded_codes uses (None: the real one)


def _split(rows: Tensor, world: int, pattern: int) -> list[Tensor]:
    """Uneven shares of ``rows`` (pattern 1 leaves the second process without rows)."""
    num = rows.shape[0]
    if world == 1:
        return [rows]
    weights = [[3, 1, 2, 5][(r + pattern) % 4] for r in range(world)]
    if pattern == 1:
        weights[1] = 0
    total = sum(weights)
    bounds = [0, *(num * sum(weights[: r + 1]) // total for r in range(world - 1)), num]
    return [rows[lo:hi] for lo, hi in itertools.pairwise(bounds)]


def scenarios(world: int) -> list[Scenario]:
    """The cases, the same in every process (fixed seeds)."""
    gen = torch.Generator().manual_seed(5)
    cases: list[tuple[str, Tensor | list[Tensor], str | None, int]] = []

    def shuffled(rows: Tensor) -> Tensor:
        return rows[torch.randperm(rows.shape[0], generator=gen)]

    cases.append(("random", torch.randn(37, 5, generator=gen), None, 1))
    base = torch.randn(30, 4, generator=gen)
    repeats = shuffled(torch.cat([base, base[torch.randperm(30, generator=gen)[:12]]]))
    padded = torch.cat([repeats, repeats[:3]])  # DistributedSampler's padding: the first again
    cases.append(("bitwise_duplicates", padded, None, 0))
    base = torch.randn(25, 6, generator=gen)
    base[:4] *= torch.tensor([1e30, 1e-30, 1e3, 1e-3]).unsqueeze(1)
    copies = ulps(base[:10], torch.randint(-2, 3, (10, 6), generator=gen))
    chain = ulps(copies[:5], torch.randint(-2, 3, (5, 6), generator=gen))
    edge = torch.zeros(3, 6)
    edge[:, 0] = 1.0
    edge[1, 1] = 2.0**-12  # at the tolerance: a copy of the first
    edge[2, 1] = torch.nextafter(torch.tensor(2.0**-12), torch.tensor(1.0))  # beyond: not
    cases.append(("rounding_copies", shuffled(torch.cat([base, copies, chain, edge])), None, 2))
    cases.append(("all_equal", torch.full((41, 3), 0.3), None, 2))
    zeros = torch.tensor([[0.0, 0.0], [-0.0, 0.0], [0.0, -0.0], [-0.0, -0.0]])
    signed = torch.cat([zeros, torch.randn(6, 2, generator=gen), zeros.flip(0)])
    cases.append(("signed_zeros", signed, None, 0))
    few = torch.randint(-2, 3, (45, 3), generator=gen).float() / 2  # many repeats
    few[3], few[4] = torch.tensor([-0.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 0.0])
    cases.append(("every_hash_equal", few, "zero", 0))
    cases.append(("first_word_hash", few, "first_word", 2))
    wide = torch.randn(20, 4, generator=gen, dtype=torch.float64)
    near = ulps(wide[:6], torch.randint(-2, 3, (6, 4), generator=gen))
    near[5] = wide[5] * (1 + 2.0**-30)  # a copy in float32's units too
    cases.append(("float64", shuffled(torch.cat([wide, near, wide[7:10]])), None, 0))
    narrow = torch.randn(12, 3, generator=gen)
    later = torch.cat(
        [narrow[5:], narrow[:4], ulps(narrow[:3], torch.ones(3, 3, dtype=torch.int64))]
    )
    mixed = [narrow.double()[:5], *_split(later, world - 1, 0)]
    if world == 1:
        mixed = [torch.cat([mixed[0], mixed[1].double()])]
    cases.append(("mixed_dtypes", mixed, None, 0))
    odd = torch.tensor([[1.0, 2.0], [float("inf"), 2.0], [float("inf"), 2.0], [float("nan"), 0.0]])
    odd = torch.cat([odd, torch.nextafter(odd, torch.zeros(1, 2)), odd])
    cases.append(("not_finite", odd, None, 2))
    cases.append(("no_rows", torch.zeros(0, 4), None, 0))
    cases.append(("no_columns", torch.zeros(7, 0), None, 2))
    out = []
    for name, rows, hook, pattern in cases:
        parts = rows if isinstance(rows, list) else _split(rows, world, pattern)
        num = sum(part.shape[0] for part in parts)
        labels = torch.randint(0, 3, (num,), generator=gen)
        groups = torch.randint(0, 2, (num,), generator=gen)
        out.append(Scenario(name, parts, labels, groups, hook))
    return out


DEFAULT = budget.sharded_audit_sizes()
TINY = budget.AuditSizes(
    block_bytes=40,
    project_bytes=48,
    sort_items=4,
    sort_passes=3,
    candidate_pairs=3,
)
"""Blocks of one or two rows, sorts of four items, chunks of three pairs: every batching
path runs."""


def _strided(rows: Tensor) -> list[Tensor]:
    """``rows`` stored as blocks of one or two rows whose strides are not 1 (each a slice
    ``x[:, ::2]`` of a twice wider tensor), as views of an update's rows may be."""
    blocks = []
    for block in torch.split(rows, 2):
        wide = torch.stack([block, torch.full_like(block, 7.0)], dim=2)
        blocks.append(wide.reshape(block.shape[0], 2 * block.shape[1])[:, ::2])
    return blocks


def _run_scenarios(group: Any) -> list[list[Codes]]:
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    found: list[list[Codes]] = []
    for sizes in (DEFAULT, TINY):
        results = []
        for case in scenarios(world):
            counts = [part.shape[0] for part in case.parts]
            mine = case.parts[me]
            blocks = _strided(mine) if sizes is TINY and mine.shape[1] else [mine]
            assert sizes is DEFAULT or all(b.stride(-1) != 1 for b in blocks if b.shape[1])
            with row_hash(case.hook):
                codes = audit.sharded_codes(blocks, counts, case.labels, case.groups, group, sizes)
            results.append(codes)
        found.append(results)
    return found


def _refusals(group: Any) -> None:
    """Counts that do not describe the processes' rows are refused (on every process)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    rows, labels = [torch.zeros(me + 1, 2)], torch.zeros(0, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"`blocks` must be this process's rows"):
        audit.sharded_codes(rows, [me + 1] * (world + 1), labels, labels, group, DEFAULT)
    with pytest.raises(ValueError, match=r"`blocks` must be this process's rows"):
        audit.sharded_codes([torch.zeros(2)], [1] * world, labels, labels, group, DEFAULT)
    wrong = [r + 2 for r in range(world)]
    wrong[me] = me + 1  # right about itself, wrong about the others
    with pytest.raises(ValueError, match=r"`counts` must be the rows each process holds"):
        audit.sharded_codes(rows, wrong, labels, labels, group, DEFAULT)


def _failures(group: Any) -> None:
    """A failure in one process's own work (here its row hash, then its projections)
    raises on every process instead of leaving the others waiting in a collective: that
    process its own error, the others a RuntimeError; the group works afterwards."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(5)
    parts = [torch.randn(3 + rank, 4, generator=gen) for rank in range(world)]
    parts[0][1] = parts[world - 1][0]  # a bitwise copy across processes
    counts = [part.shape[0] for part in parts]
    labels = torch.zeros(sum(counts), dtype=torch.int64)

    def broken(*args: Any) -> Tensor:
        raise ArithmeticError("forced failure of the row hash or of a projection")

    for module, name in ((bitwise, "hash_words"), (rounding, "project")):
        plain = getattr(module, name)
        if me == 1:
            setattr(module, name, broken)
        expected = (ArithmeticError, "forced failure")
        if me != 1:
            expected = (RuntimeError, "failed on another process")  # type: ignore[assignment]
        try:
            with pytest.raises(expected[0], match=expected[1]):
                audit.sharded_codes([parts[me]], counts, labels, labels, group, DEFAULT)
        finally:
            setattr(module, name, plain)
    got = audit.sharded_codes([parts[me]], counts, labels, labels, group, DEFAULT)
    assert int(got.klass.max()) + 1 == sum(counts) - 1  # one bitwise copy


def _worker(rank: int, world_size: int, payload: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"all": _run_scenarios(None)}
    _refusals(None)
    _failures(None)
    if world_size == 3:
        # Every process creates every group, in the same order.
        outer, middle = dist.new_group([0, 2]), dist.new_group([1])
        out["some"] = _run_scenarios(middle if rank == 1 else outer)
    return out


def _same_partition(got: Tensor, want: Tensor) -> bool:
    return torch.equal(got.unsqueeze(0) == got.unsqueeze(1), want.unsqueeze(0) == want.unsqueeze(1))


def assert_same_codes(got: Codes, want: Codes, where: object) -> None:
    """The same keys up to the numbering of each: equal codes exactly where ``codes()``
    has equal codes, and the same rounding pairs once classes are matched through their
    items (both orientations, sorted)."""
    for name in Codes._fields[:-1]:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype == torch.int32 and g.shape == w.shape, (where, name)
        assert _same_partition(g, w), (where, name)
        assert sorted(set(g.tolist())) == list(range(len(set(g.tolist())))), (where, name)
    count = len(set(got.klass.tolist()))
    item = {int(c): n for n, c in reversed(list(enumerate(got.klass.tolist())))}
    pairs = [(int(a), int(b)) for a, b in got.adjacent.tolist()]
    assert pairs == sorted(pairs), where
    assert all(0 <= a < count and 0 <= b < count for a, b in pairs), where
    mapped = sorted((int(want.klass[item[a]]), int(want.klass[item[b]])) for a, b in pairs)
    assert mapped == [tuple(p) for p in want.adjacent.tolist()], where


def _check(results: list[list[list[Codes]]], world: int) -> None:
    """Each process's codes in each batching equal ``codes()`` of the concatenation, and
    every process's equal the first's exactly (the same numbering)."""
    cases = scenarios(world)
    for sizes in range(2):
        for index, case in enumerate(cases):
            want = audit.codes(torch.cat(case.parts), case.labels, case.groups, SIZES)
            first = results[0][sizes][index]
            for rank, found in enumerate(results):
                got = found[sizes][index]
                assert_same_codes(got, want, (world, case.name, sizes, rank))
                assert all(torch.equal(a, b) for a, b in zip(got, first, strict=True))


def _spans(parts: list[Tensor], klass: Tensor) -> bool:
    """Whether some class holds items of two processes."""
    owner = torch.cat([torch.full((p.shape[0],), r) for r, p in enumerate(parts)])
    return any(len(set(owner[klass == c].tolist())) > 1 for c in klass.unique())


def test_the_cases_test_what_they_name() -> None:
    """The copies lie across processes; the collisions collide; the rounding cases have
    rounding pairs, among them pairs across processes."""
    for world in (2, 3):
        cases = {case.name: case for case in scenarios(world)}
        for name in ("bitwise_duplicates", "all_equal", "signed_zeros", "every_hash_equal"):
            case = cases[name]
            assert _spans(case.parts, codes_of(torch.cat(case.parts)).klass), name
        for name in ("rounding_copies", "float64", "mixed_dtypes", "not_finite"):
            case = cases[name]
            rows = torch.cat(case.parts)
            klass, _, _, adjacent = codes_of(rows)
            assert adjacent.numel(), name
            owner = torch.cat([torch.full((p.shape[0],), r) for r, p in enumerate(case.parts)])
            first = [int((klass == c).nonzero()[0]) for c in range(int(klass.max()) + 1)]
            across = [owner[first[a]] != owner[first[b]] for a, b in adjacent.tolist()]
            assert any(across), name
        assert any(part.shape[0] == 0 for part in cases["random"].parts[1:2])
        assert len({p.shape[0] for p in cases["random"].parts}) > 1
        rows = torch.cat(cases["every_hash_equal"].parts)
        assert len(set(codes_of(rows).klass.tolist())) > 20
        words = rows.contiguous().view(torch.int16)
        first_word = words[:, 0].unsqueeze(1) == words[:, 0].unsqueeze(0)
        same = (words.unsqueeze(0) == words.unsqueeze(1)).all(dim=2)
        assert bool((first_word & ~same).any())  # the first word's hash collides


@pytest.mark.ddp
def test_two_processes_give_the_codes_of_the_concatenation() -> None:
    results = run_distributed(_worker, world_size=2)
    _check([r["all"] for r in results], 2)


@pytest.mark.slow
@pytest.mark.ddp
def test_three_processes_and_a_group_of_two_give_the_codes_of_the_concatenation() -> None:
    results = run_distributed(_worker, world_size=3)
    _check([r["all"] for r in results], 3)
    _check([results[0]["some"], results[2]["some"]], 2)
    _check([results[1]["some"]], 1)  # a group of one process: codes() itself


def test_one_process_without_torch_distributed_is_codes() -> None:
    for case in scenarios(1):
        want = audit.codes(case.parts[0], case.labels, case.groups, SIZES)
        counts = [case.parts[0].shape[0]]
        for sizes in (DEFAULT, TINY):
            blocks = _strided(case.parts[0]) if case.parts[0].shape[1] else case.parts
            got = audit.sharded_codes(blocks, counts, case.labels, case.groups, None, sizes)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), case.name


def test_within_decides_on_the_two_rows_alone() -> None:
    """The rounding check a process makes of a pair of rows is the same whatever the
    other pairs checked with it (batch shape and order) and whichever row comes first:
    processes checking different batches agree."""
    gen = torch.Generator().manual_seed(8)
    base = torch.randn(64, 33, generator=gen)
    scale = 2.0**-12 * base.norm(dim=1, keepdim=True) / 33**0.5
    shifts = torch.tensor([0.5, 0.999, 1.0, 1.001, 2.0]).repeat(13)[:64].unsqueeze(1)
    other = base + scale * shifts * torch.sign(torch.randn(64, 33, generator=gen))
    other[::7] = ulps(base[::7], torch.randint(-2, 3, base[::7].shape, generator=gen))
    whole = rounding.within(base, other)
    assert 0 < int(whole.sum()) < 64  # both decisions occur
    one_by_one = torch.cat([rounding.within(base[n : n + 1], other[n : n + 1]) for n in range(64)])
    order = torch.randperm(64, generator=gen)
    assert torch.equal(whole, one_by_one)
    assert torch.equal(whole, rounding.within(other, base))
    assert torch.equal(whole[order], rounding.within(base[order], other[order].double()))
