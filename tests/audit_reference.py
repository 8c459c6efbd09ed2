"""What the protocol audit's tests share: the literal definition of a rounding copy, rows
moved by a few ulps, colliding row hashes, and the audit's codes and pairs of rows."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from fractions import Fraction

import torch
from torch import Tensor

from recall_at_k import audit
from recall_at_k.audit import Codes, bitwise
from recall_at_k.ranking import budget

SIZES = budget.audit_sizes(2**20)
"""The audit's sizes for blocks of a MiB (the tests' default)."""

TOLERANCE = 2.0**-12

NARROW = (torch.float32, torch.float16, torch.bfloat16)


def _bits(row: Tensor) -> Tensor:
    return row.clone(memory_format=torch.contiguous_format).view(torch.int16)


def rounding_copy(x: Tensor, y: Tensor) -> bool:
    """Equal up to float rounding, literally: finite, not the same bits, and
    ``|x - y|_2 <= 2^-12 max(|x|_2, |y|_2)`` -- squared, in exact rational arithmetic
    (``fractions.Fraction``), so that the audit's float64 sums, within 2^-30 of the
    boundary nowhere here, must agree."""
    if torch.equal(_bits(x), _bits(y)) or not (x.isfinite().all() and y.isfinite().all()):
        return False
    if x.dtype in NARROW and y.dtype in NARROW:
        # Float32 or narrower: a float64 sum errs by under D * 2^-52 of its value (no
        # square under- or overflows there), so a pair whose float64 gap is over twice
        # the bound is far from it; only the rest need the exact sums.
        u, v = x.double(), y.double()
        far = (u - v).square().sum() > 2 * TOLERANCE**2 * max(u.square().sum(), v.square().sum())
        if bool(far):
            return False
    a = [Fraction(v) for v in x.tolist()]
    b = [Fraction(v) for v in y.tolist()]
    gap = sum(((u - v) ** 2 for u, v in zip(a, b, strict=True)), Fraction(0))
    norms = max(sum((u * u for u in a), Fraction(0)), sum((v * v for v in b), Fraction(0)))
    return gap <= Fraction(TOLERANCE) ** 2 * norms


def ulps(rows: Tensor, steps: Tensor) -> Tensor:
    """``rows`` moved by ``steps`` (-2..2) units in the last place, coordinate-wise."""
    out = rows.clone()
    for _ in range(int(steps.abs().max())):
        move = steps.sign() * (steps.abs() > 0)
        out = torch.where(move != 0, torch.nextafter(out, out + move.to(out.dtype)), out)
        steps = steps - move
    return out


def zero_hash(words: Tensor, workspace: object) -> Tensor:
    """Every row the same hash: every run splits by comparison alone."""
    return torch.zeros(words.shape[0], dtype=torch.int64, device=words.device)


def first_word_hash(words: Tensor, workspace: object) -> Tensor:
    """A hash of the first word only: collides where rows share it."""
    return words[:, 0].long()


HASHES: dict[str, Callable[[Tensor, object], Tensor]] = {
    "zero": zero_hash,
    "first_word": first_word_hash,
}


@contextlib.contextmanager
def row_hash(name: str | None) -> Iterator[None]:
    """The audit's row hash replaced by one of :data:`HASHES` (None: the real one)."""
    plain = bitwise.hash_words
    if name is not None:
        bitwise.hash_words = HASHES[name]  # type: ignore[assignment]
    try:
        yield
    finally:
        bitwise.hash_words = plain  # type: ignore[assignment]


def codes_of(rows: Tensor, sizes: budget.AuditSizes = SIZES) -> Codes:
    """The audit's codes of ``rows`` (labels and groups all 0)."""
    zeros = torch.zeros(rows.shape[0], dtype=torch.int64)
    return audit.codes(rows, zeros, zeros, sizes)


def pairs(rows: Tensor, sizes: budget.AuditSizes = SIZES) -> set[tuple[int, int]]:
    """The audit's rounding pairs of classes."""
    return {(int(a), int(b)) for a, b in codes_of(rows, sizes).adjacent.tolist()}


def pairs_brute_force(rows: Tensor) -> set[tuple[int, int]]:
    """The pairs of bitwise classes (numbered as the audit numbers them) that are rounding
    copies, literally."""
    classes = codes_of(rows).klass.tolist()
    first: dict[int, int] = {}
    for n, c in enumerate(classes):
        first.setdefault(c, n)
    return {
        (a, b)
        for a, i in first.items()
        for b, j in first.items()
        if a != b and rounding_copy(rows[i], rows[j])
    }
