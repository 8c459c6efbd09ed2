"""The score of a (query, item) pair: what ranks a gallery, defined once.

**The score.** One canonical score per pair, a function of the stored embeddings alone
(the same for every tiling, thread, process and device):

- embeddings are brought to float32 (float64 stays float64); for ``"cosine"`` each row
  ``x`` becomes ``n = fl32(x / sqrt(S))``, ``S`` the float64 sum of ``x_d ** 2`` in the
  order ``d = 0 .. D-1`` (``sqrt(S)`` clamped to at least 1e-12), elementwise, so a row's
  value never depends on its batch;
- ``"cosine"`` and ``"dot"``: the float64 sum over ``d = 0 .. D-1``, in that order, of
  ``q_d * g_d`` (exact in float64 for float32 factors; for float64 embeddings the fixed
  order still gives one value per pair on every device);
- ``"euclidean"``: minus the float64 sum, in the same order, of ``(q_d - g_d) ** 2``;
- a callable: its scores as returned, per tile (outside the guarantee).

**Fast path and certificate.** Each tile (or panel) of scores is one float32 matrix
product, the *fast* score. For each query a bound ``B`` with ``|fast - canonical| <= B``
for every item is known in advance (:func:`bound_coefficient`, :func:`bound_absolute`):
for a dot product of length D, ``|fl(q.g) - q.g| <= gamma_D |q| |g| + D eta (1 +
gamma_D)`` with ``gamma_D = D u / (1 - D u)`` whatever the order or blocking of the sum,
``eta`` (2**-150 in float32) the absolute rounding of a product whose result falls below
the smallest normal (2**-126). So ``B = 2 (gamma32_D + gamma64_D) |q| max_g |g| + 2 D eta
(1 + gamma32_{D+3})`` (the 2 covers the norms' own rounding and the band's edges; the
norms are upper bounds). With ``s*_f`` the best fast score of a query's valid positives,
an item above ``s*_f + 2B`` is surely above the canonical ``s*``, one below ``s*_f - 2B``
surely below; the items inside that band (the best positive always among them) are
re-scored canonically and decide ``s*``, the ties and the order at ``s*``: exactly the
ranking by canonical scores, with only the band costing more than the product.

``"euclidean"`` centres on the gallery's mean ``m``: ``q' = fl(q - m)``, ``g' = fl(g -
m)``, fast score ``2 q'.g' - |q'|^2 - |g'|^2``, so a common offset cancels before any
product. Its bound covers the centring (``u (2 + u) (|a| + |b|)^2`` on the squared
distance), the product and both norms (``gamma_{D+1}`` each), the two final additions
and the canonical sum: ``B = 2 (2 gamma32_{D+1} + 5 u32 + gamma64_{D+3}) (|q'| + max_g
|g'|)^2``, plus ``2 * 4 D eta (1 + gamma32_{D+3})``.

On CUDA with ``torch.get_float32_matmul_precision() != "highest"`` the bound adds ``2 u_in
+ u_in^2`` per product (``u_in`` 2**-11 for ``"high"``, 2**-8 for ``"medium"``): a wider
band, the same answer. Where float32 products could overflow or would all come close to
the subnormal range, the fast path runs in float64 (:func:`fast_dtype`). The bound
assumes IEEE gradual underflow (not ``torch.set_flush_denormal(True)``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from recall_at_k._kernel import Workspace
from recall_at_k._types import Similarity
from recall_at_k.ranking.budget import CANONICAL_BATCH_BYTES, CANONICAL_DIM_BLOCK, NORM_DIM_BLOCK

SAFETY = 2.0
"""Factor on the certified rounding bound (covers the norms' own rounding, the band's edges)."""


def prepare_rows(
    rows: Tensor,
    similarity: Similarity,
    dtype: torch.dtype,
    norms: Tensor | None = None,
    out: Tensor | None = None,
    wide: Tensor | None = None,
) -> Tensor:
    """Rows ``[m, D]`` as the ranking scores them: a new tensor of ``dtype`` (or ``out``), for
    ``"cosine"`` divided by each row's float64 norm (:func:`row_norms`, or ``norms`` computed
    before) in a float64 copy (or ``wide``, of ``rows``' shape)."""
    if similarity != "cosine":
        return rows.to(dtype, copy=True) if out is None else out.copy_(rows)
    wide = rows.to(torch.float64, copy=True) if wide is None else wide.copy_(rows)  # exact
    norms = row_norms(wide) if norms is None else norms
    wide.div_(norms.unsqueeze(1))
    return wide.to(dtype) if out is None else out.copy_(wide)


def row_norms(rows: Tensor) -> Tensor:
    """The float64 norm of each row ``[m, D]`` (float64 values): the square root of the
    sum of ``x_d ** 2`` added in the order ``d = 0 .. D-1``, clamped to at least 1e-12."""
    num, dim = rows.shape
    total = torch.zeros(num, dtype=torch.float64, device=rows.device)
    width = max(1, min(dim, NORM_DIM_BLOCK))
    terms = torch.empty(num, width + 1, dtype=torch.float64, device=rows.device)
    for first in range(0, dim, width):
        block = terms[:, : min(width, dim - first) + 1]
        torch.square(rows[:, first : first + width], out=block[:, 1:])  # exact for float32
        block[:, 0] = total
        add_in_order(block, total)
    return total.sqrt_().clamp_min_(1e-12)


def canonical_scores(
    queries: Tensor,
    gallery: Tensor,
    query_rows: Tensor,
    gallery_rows: Tensor,
    similarity: Similarity,
    workspace: Workspace | None = None,
    batch_bytes: int = CANONICAL_BATCH_BYTES,
) -> Tensor:
    """The canonical float64 score of each pair (``query_rows[i]``, ``gallery_rows[i]``): one
    term per ``d`` in order, never a BLAS product or a shape-dependent reduction."""
    if queries.dtype != gallery.dtype:
        raise TypeError(f"rows of one dtype expected, got {queries.dtype} and {gallery.dtype}")
    num, dim = query_rows.shape[0], queries.shape[1]
    device, wide = queries.device, torch.float64
    workspace = Workspace() if workspace is None else workspace
    out = torch.empty(num, dtype=wide, device=device)
    width = max(1, min(dim, CANONICAL_DIM_BLOCK))
    step = max(1, min(num, batch_bytes // (8 * width)))
    for start in range(0, num, step):
        count = min(step, num - start)
        query_batch = query_rows[start : start + count]
        gallery_batch = gallery_rows[start : start + count]
        total = torch.zeros(count, dtype=wide, device=device)
        for first in range(0, dim, width):
            last = min(first + width, dim)
            pair = workspace.get("canonical_rows", (count, last - first), queries.dtype, device)
            # Column 0 carries the sum so far, columns 1.. the terms of d = first .. last - 1.
            terms = workspace.get("canonical_terms", (count, last - first + 1), wide, device)
            g = workspace.get("canonical_g", (count, last - first), wide, device)
            torch.index_select(queries[:, first:last], 0, query_batch, out=pair)
            q = terms[:, 1:]
            q.copy_(pair)  # exact
            torch.index_select(gallery[:, first:last], 0, gallery_batch, out=pair)
            g.copy_(pair)
            if similarity == "euclidean":
                q.sub_(g).square_()  # each difference and square rounded to float64
            else:
                q.mul_(g)  # exact for float32 rows, rounded once for float64
            terms[:, 0] = total
            add_in_order(terms, total)
        out[start : start + count] = total.neg_() if similarity == "euclidean" else total
    return out


def add_in_order(terms: Tensor, total: Tensor) -> None:
    """``total = terms[:, 0] + ... + terms[:, -1]`` left to right (``terms`` overwritten): on CPU
    one prefix sum (one accumulator, in order), elsewhere one addition per column."""
    if terms.device.type == "cpu":
        terms.cumsum_(1)
        total.copy_(terms[:, -1])
        return
    total.copy_(terms[:, 0])
    for column in range(1, terms.shape[1]):
        total.add_(terms[:, column])


def gamma(terms: int, unit: float) -> float:
    """gamma_n = n u / (1 - n u), the relative bound of a sum of n rounded terms."""
    return math.inf if terms * unit >= 1 else terms * unit / (1 - terms * unit)


def input_unit(dtype: torch.dtype, device: torch.device) -> float:
    """The unit roundoff of a matrix product's inputs under TF32 or bfloat16; else 0."""
    if dtype != torch.float32 or device.type != "cuda":
        return 0.0
    precision = torch.get_float32_matmul_precision()
    return {"highest": 0.0, "high": 2.0**-11}.get(precision, 2.0**-8)


def bound_coefficient(
    similarity: Similarity, dim: int, dtype: torch.dtype, device: torch.device
) -> float:
    """``B``'s relative part, per ``|q| max |g|`` or (euclidean) ``(|q| + max |g|)^2``."""
    if callable(similarity):
        return 0.0
    unit, unit64 = float(torch.finfo(dtype).eps) / 2, float(torch.finfo(torch.float64).eps) / 2
    inputs = input_unit(dtype, device)
    rounded_inputs = 2 * inputs + inputs * inputs
    if similarity == "euclidean":
        fast = 2 * (gamma(dim + 1, unit) + rounded_inputs) + 5 * unit
        return SAFETY * (fast + gamma(dim + 3, unit64))
    return SAFETY * (gamma(dim, unit) + rounded_inputs + gamma(dim, unit64))


def subnormal_step(dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s subnormal numbers (2**-149 for float32)."""
    info = torch.finfo(dtype)
    return float(info.smallest_normal) * float(info.eps)


def bound_absolute(similarity: Similarity, dim: int, dtype: torch.dtype) -> float:
    """``B``'s absolute part: ``D eta`` per sum (four for ``"euclidean"``), plus ``D``
    float64 ``eta`` for the canonical sum of float64 embeddings (see the module)."""
    if callable(similarity):
        return 0.0
    sums = 4 if similarity == "euclidean" else 1
    roundings = sums * dim * subnormal_step(dtype) / 2
    if torch.finfo(dtype).bits > 32:
        roundings += dim * subnormal_step(torch.float64) / 2
    unit = float(torch.finfo(dtype).eps) / 2
    return SAFETY * roundings * (1 + gamma(dim + 3, unit))


def norm_upper(norms: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """Upper bounds (in place) of the exact norms of length-``dim`` vectors computed in
    ``dtype`` as ``norms``: past their rounding and their squares' underflow."""
    unit, slack = float(torch.finfo(dtype).eps) / 2, math.sqrt(dim * subnormal_step(dtype))
    return norms.mul_(1 + 2 * gamma(dim + 2, unit)).add_(slack)


UNDERFLOW_SCALE = 2.0**-100
"""The fast path runs in float64 when the largest ``|x_d|^2`` is below this (near underflow)."""


def fast_dtype(largest: float, dim: int, dtype: torch.dtype, similarity: Similarity) -> torch.dtype:
    """The fast products' dtype for prepared rows of ``dtype`` up to ``largest``: float64
    where float32 products could overflow or all come near the subnormal range."""
    if callable(similarity) or dtype != torch.float32:
        return dtype
    tiny = 0 < largest * largest < UNDERFLOW_SCALE
    if tiny or (similarity != "cosine" and overflows(largest, dim, dtype)):
        return torch.float64
    return dtype


def overflows(largest: float, dim: int, dtype: torch.dtype) -> bool:
    """Whether fast scores of vectors of length ``dim`` with values up to ``largest``
    could overflow ``dtype`` (a euclidean score is at most ``16 D largest^2``)."""
    return 4.0 * dim * largest * largest >= torch.finfo(dtype).max / 4


def may_produce_nan(largest: float, dim: int, dtype: torch.dtype, similarity: Similarity) -> bool:
    """Whether scores of finite embeddings could be NaN: a callable's, or an overflow."""
    return callable(similarity) or (similarity != "cosine" and overflows(largest, dim, dtype))


def largest_magnitude(rows: Tensor) -> float:
    """``max |x|`` of ``rows`` (0 when empty), without a copy (``aminmax``)."""
    if rows.numel() == 0:
        return 0.0
    low, high = torch.aminmax(rows)
    return max(-float(low), float(high))
