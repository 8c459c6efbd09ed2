"""The canonical score and the cosine norm are float64 sums over ``d = 0 .. D-1`` in that
order, literally, on every torch release CI tests (the CPU kernels add them as one prefix
sum, whose order these tests pin): they run on every leg, the oldest torch included."""

from __future__ import annotations

import pytest
import torch

from recall_at_k.ranking import score as _score


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dim", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("similarity", ["dot", "euclidean"])
def test_canonical_scores_are_the_sum_in_order_of_d(
    dim: int, dtype: torch.dtype, similarity: str
) -> None:
    """The canonical score is the literal float64 sum over d = 0 .. D-1 (one rounded
    product or squared difference and one rounded add per d), whatever the batch size and
    however many blocks of dimensions a batch's rows are gathered in."""
    g = _gen(7)
    embeddings = (
        torch.randn(9, dim, generator=g) * 10.0 ** torch.randint(-3, 4, (9, dim), generator=g)
    ).to(dtype)
    pairs = torch.cartesian_prod(torch.arange(9), torch.arange(9))
    want = []
    for i, j in pairs.tolist():
        total = 0.0
        for a, b in zip(
            embeddings[i].double().tolist(), embeddings[j].double().tolist(), strict=True
        ):
            total += (a - b) * (a - b) if similarity == "euclidean" else a * b
        want.append(-total if similarity == "euclidean" else total)
    for batch_bytes in (8, 1024, _score.CANONICAL_BATCH_BYTES):
        got = _score.canonical_scores(
            embeddings, embeddings, pairs[:, 0], pairs[:, 1], similarity, batch_bytes=batch_bytes
        )  # type: ignore[arg-type]
        assert got.tolist() == want, (dim, dtype, similarity, batch_bytes)


@pytest.mark.parametrize("dim", [1, 15, 16, 17, 300])
def test_cosine_rows_are_divided_by_the_norm_summed_in_order_of_d(dim: int) -> None:
    """Each cosine row is divided by the square root of its float64 sum of squares added
    in the order d = 0 .. D-1 (values over 30 orders of magnitude: any other order of
    additions rounds differently)."""
    g = _gen(dim)
    rows = torch.randn(40, dim, generator=g) * torch.logspace(-15, 15, dim)
    wide = rows.double()
    norms = []
    for row in wide.tolist():
        total = 0.0
        for value in row:
            total += value * value
        norms.append(max(total**0.5, 1e-12))
    want = (wide / torch.tensor(norms, dtype=torch.float64).unsqueeze(1)).float()
    got = _score.prepare_rows(rows, "cosine", torch.float32)
    assert torch.equal(got, want), dim
