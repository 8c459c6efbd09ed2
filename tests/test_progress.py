"""``progress=True``: a tqdm bar on stderr over the ranked queries (rank 0 only under DDP);
the default prints nothing; without tqdm, an ImportError that says what to install."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run_distributed

from recall_at_k import EmbeddingRecallAtK
from recall_at_k.functional import embedding_recall_at_k

NUM = 300
ROOT = Path(__file__).resolve().parents[1]


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(NUM, 16, generator=gen), torch.randint(0, 12, (NUM,), generator=gen)


def _metric(layout: str, **kwargs: Any) -> dict[str, float]:
    embeddings, labels = _data()
    metric = EmbeddingRecallAtK((1, 5), **kwargs)
    if layout == "leave-one-out":
        metric.update(embeddings, labels)
    else:
        ids = torch.arange(NUM)
        metric.update(embeddings[:100], labels[:100], role="query", ids=ids[:100])
        metric.update(embeddings[100:], labels[100:], role="gallery", ids=ids[100:])
    return {key: float(value) for key, value in metric.compute().items()}


@pytest.mark.parametrize("layout", ["leave-one-out", "query-gallery"])
def test_default_prints_nothing(layout: str, capfd: pytest.CaptureFixture[str]) -> None:
    _metric(layout)
    embedding_recall_at_k(*_data(), k=(1, 5))
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


@pytest.mark.parametrize("layout", ["leave-one-out", "query-gallery"])
def test_progress_shows_a_bar_on_stderr(layout: str, capsys: pytest.CaptureFixture[str]) -> None:
    quiet = _metric(layout)
    assert _metric(layout, progress=True) == quiet
    out, err = capsys.readouterr()
    queries = NUM if layout == "leave-one-out" else 100
    assert out == ""
    assert "ranking" in err and f"/{queries}" in err and "query" in err, err
    # The same with small tiles (many of them) and through the function.
    assert _metric(layout, progress=True, chunk_bytes=4 * NUM * 7) == quiet
    assert f"/{queries}" in capsys.readouterr().err
    embedding_recall_at_k(*_data(), k=(1, 5), progress=True)
    assert f"/{NUM}" in capsys.readouterr().err


def test_progress_without_tqdm_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` raises ImportError
    with pytest.raises(ImportError, match=r"progress=True .*tqdm.*pip install tqdm"):
        EmbeddingRecallAtK(1, progress=True)
    with pytest.raises(ImportError, match=r"pip install tqdm"):
        embedding_recall_at_k(*_data(), k=1, progress=True)
    # progress=False never needs it.
    assert _metric("leave-one-out") == _metric("leave-one-out", progress=False)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_progress_must_be_a_bool(value: Any) -> None:
    with pytest.raises(ValueError, match=r"`progress` must be a bool .* got"):
        EmbeddingRecallAtK(1, progress=value)
    with pytest.raises(ValueError, match=r"`progress` must be a bool"):
        embedding_recall_at_k(*_data(), k=1, progress=value)


def _distributed_worker(rank: int, world: int, payload: Any) -> tuple[dict[str, float], str]:
    torch.set_num_threads(1)
    captured = io.StringIO()
    sys.stderr = captured
    try:
        embeddings, labels = _data()
        metric = EmbeddingRecallAtK((1, 5), progress=True)
        ids = torch.arange(NUM)
        mine = ids[rank::world]
        metric.update(embeddings[mine], labels[mine], ids=mine)
        values = {key: float(value) for key, value in metric.compute().items()}
    finally:
        sys.stderr = sys.__stderr__
    return values, captured.getvalue()


@pytest.mark.ddp
def test_only_rank_zero_shows_the_bar() -> None:
    (values0, err0), (values1, err1) = run_distributed(_distributed_worker, world_size=2)
    assert values0 == values1 == _metric("leave-one-out")
    assert "ranking" in err0 and f"/{NUM // 2}" in err0, err0  # its share of the queries
    assert err1 == ""


def _documented_block(path: Path) -> str:
    """The progress example of a docs page: the python block that opens with
    the comment ``# A progress bar over the ranking``."""
    text = path.read_text(encoding="utf-8")
    start = text.index("```python\n# A progress bar over the ranking")
    return text[start + len("```python\n") : text.index("```", start + 3)]


@pytest.mark.parametrize("page", ["docs/input-forms.md"])
def test_documented_example_runs_and_shows_a_bar(
    page: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _documented_block(ROOT / page)
    exec(compile(code, page, "exec"), {})
    out, err = capsys.readouterr()
    assert "'recall@1': tensor(" in out and "'recall@5': tensor(" in out
    assert "ranking" in err and "/3000" in err, err
