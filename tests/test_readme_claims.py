"""Claims of README.md and of the docs site that are not code blocks: numbers, the score's
definition, the install commands, that the README stays one page whose links resolve, and
that the site shows every shared README section (``scripts/readme_sections.py``)."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from embedding_reference import Batch, reference_embedding_recall

from recall_at_k import RetrievalRecallAtK
from recall_at_k.functional import embedding_recall_at_k

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = {path.name: path.read_text(encoding="utf-8") for path in (ROOT / "docs").glob("*.md")}


def _module(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


readme_sections = _module(ROOT / "scripts" / "readme_sections.py")


def _flat(text: str) -> str:
    """Markdown text with line breaks as spaces (claims are wrapped across lines)."""
    return re.sub(r"\s+", " ", text)


# ------------------------------------------------------------------ one page

README_LIMIT = 12_000  # characters: what and why, two commands, a quickstart, the links


def test_the_readme_is_one_page() -> None:
    assert len(README) <= README_LIMIT, f"README.md has {len(README):,} characters"
    assert "\n## Quickstart\n" in README
    assert "| | torchmetrics `RetrievalHitRate` | `RetrievalRecallAtK` |" in README


def test_the_readme_links_to_every_docs_page_and_every_link_resolves() -> None:
    targets = [target for _, target in readme_sections.LINK.findall(README)]
    local = [t for t in targets if not t.startswith(("http://", "https://", "#"))]
    for target in local:
        assert (ROOT / target.partition("#")[0]).exists(), target
    pages = {t.partition("#")[0] for t in local if t.startswith("docs/")}
    assert pages >= {f"docs/{name}" for name in DOCS} - {"docs/changelog.md"}


# ------------------------------------------------------------------ one source


def test_every_shared_section_is_on_the_site_and_every_placeholder_resolves() -> None:
    shared = readme_sections.sections(README)
    assert set(shared) == {"differences", "two-commands", "tested-versions"}
    used = set()
    for name, page in DOCS.items():
        used |= set(readme_sections.PLACEHOLDER.findall(page))
        filled = readme_sections.fill(page)
        assert "<!-- readme:" not in filled, name
    assert used == set(shared), "a README section is marked but shown nowhere on the site"


def test_shared_sections_are_adapted_to_the_site() -> None:
    readme = (
        "<!-- readme:part:start -->\n- **A bullet** that goes on\n  to a second line: see"
        " [the results](benchmarks/RESULTS.md), [a page](docs/distributed.md#ddp) and"
        " [`examples/cross_modal.py`](examples/cross_modal.py).\n<!-- readme:part:end -->\n"
    )
    part = readme_sections.sections(readme)["part"]
    assert part.startswith("**A bullet**")  # a bullet becomes a paragraph
    assert "\n  " not in part
    assert "[the results](benchmarks.md)" in part and "[a page](distributed.md#ddp)" in part
    assert part.endswith(" and `examples/cross_modal.py`.")  # repository files: their names
    differences = readme_sections.sections(README)["differences"]
    assert "(benchmarks.md)" in differences and "](benchmarks/" not in differences
    with pytest.raises(KeyError, match=r"README\.md has no section"):
        readme_sections.fill("<!-- readme:nothing -->", README)


def test_the_texts_that_moved_from_the_readme_are_written_for_the_site() -> None:
    """The score, the protocol guide, the intervals and the wrappers were README sections
    that the site included; they are the site's own text now."""
    score = DOCS["input-forms.md"].split("\n### The score\n", 1)[1].split("\n## ", 1)[0]
    assert score.lstrip().startswith("What is ranked, and what ties:")
    assert "\n  " not in score  # a paragraph, no longer a bullet of a list
    protocol = DOCS["protocol.md"]
    assert "[the score](input-forms.md#the-score)" in protocol
    assert "(benchmarks.md)" in protocol
    assert "](examples/" not in protocol  # repository files: their names only
    assert "`MinMaxMetric`, `MultioutputWrapper`" in DOCS["lightning.md"]


def test_the_site_no_longer_says_what_the_readme_corrected() -> None:
    site = _flat(" ".join(readme_sections.fill(page) for page in DOCS.values()))
    assert "BLAS" not in site  # identical vectors always tie: the score is canonical
    assert '"the score" above' not in site
    assert "last_compute_rescored" in site


# ------------------------------------------------------------------ numbers


def _interval(queries: int, recall: float) -> str:
    hits = round(queries * recall)
    scores = torch.zeros(queries, 2)
    scores[:hits, 0] = 1.0
    scores[hits:, 1] = 1.0
    metric = RetrievalRecallAtK(k=1)
    metric.update(scores, torch.zeros(queries, dtype=torch.long))
    low, high = metric.confidence_interval().tolist()
    return f"[{low:.3f}, {high:.3f}]"


def test_wilson_examples() -> None:
    text = _flat(DOCS["protocol.md"])
    assert (
        f"a model with R@1 = 0.620 has {_interval(1000, 0.620)} and one with 0.645 has"
        f" {_interval(1000, 0.645)}"
    ) in text
    assert (
        f"On 10,000 queries the same values give {_interval(10000, 0.620)} and"
        f" {_interval(10000, 0.645)}, which no longer overlap"
    ) in text


def _exact_mcnemar(b: int, c: int) -> float:
    """The exact two-sided McNemar p-value: a binomial test of b + c at 1/2."""
    n, low = b + c, min(b, c)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(low + 1)) / 2**n)


def test_mcnemar_examples() -> None:
    text = _flat(DOCS["protocol.md"])
    assert (62 - 37) == (162 - 137) == 25  # the 2.5-point gap on 1,000 queries
    statistic = (62 - 37) ** 2 / 99
    chi_square_p = math.erfc(math.sqrt(statistic / 2))  # one degree of freedom
    assert (
        "disagree on 99 of the 1,000 queries (37 hit by A alone, 62 by B alone), the exact"
        f" p-value is {_exact_mcnemar(62, 37):.3f} (the chi-square approximation"
        f" (62 - 37)^2 / 99 = {statistic:.1f} gives {chi_square_p:.3f})"
    ) in text
    assert (
        f"disagree on 299 queries (137 against 162), p = {_exact_mcnemar(162, 137):.2f}"
    ) in text


# ------------------------------------------------------------------ the score


def test_cosine_clamps_the_norm_at_1e_12() -> None:
    """A row of norm 1e-13 is scaled by 10^12 (to norm 0.1), not normalised to 1."""
    assert "x / max(sqrt(S), 1e-12)" in _flat(DOCS["input-forms.md"])
    query = torch.tensor([[1.0, 0.0]])
    gallery = torch.tensor([[1e-13, 0.0], [0.6, 0.8]])  # the positive, then a negative
    labels = torch.tensor([0, 1])
    # normalised, the positive would score 1.0 > 0.6; clamped it scores 0.1 < 0.6
    value = embedding_recall_at_k(query, torch.tensor([0]), gallery, labels, k=1)
    assert float(value) == 0.0
    assert (
        float(embedding_recall_at_k(query, torch.tensor([0]), gallery * 1e12, labels, k=1)) == 1.0
    )


def test_euclidean_score_is_of_the_stored_vectors_whatever_a_common_offset() -> None:
    """The fast path centres on the gallery's mean; what is ranked is still minus the
    squared distance of the stored (offset, float32) vectors, as the reference has it."""
    text = _flat(DOCS["input-forms.md"])
    assert "the fast path centres every vector on the gallery's mean first" in text
    assert "the score itself is that of the stored vectors" in text
    gen = torch.Generator().manual_seed(3)
    embeddings = torch.randn(60, 6, generator=gen) * 0.05 + 1e4
    labels = torch.randint(0, 6, (60,), generator=gen)
    got = embedding_recall_at_k(embeddings, labels, k=(1, 2, 5), similarity="euclidean")
    want = reference_embedding_recall(
        [Batch(embeddings=embeddings.double(), labels=labels)], (1, 2, 5), similarity="euclidean"
    )
    assert {key: float(value) for key, value in got.items()} == pytest.approx(want, abs=1e-6)


# ------------------------------------------------------------------ install and suite


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.DOTALL)


def test_torch_is_pinned_alike_everywhere_and_the_cpu_index_is_an_alternative() -> None:
    pins = set(re.findall(r"torch==([\d.]+)", README))
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    lowest = (ROOT / ".ci" / "lowest-versions.txt").read_text(encoding="utf-8")
    assert pins == set(re.findall(r"torch==([\d.]+)", ci)) == {"2.13.0"}
    # The lowest versions' leg installs the torch of .ci/lowest-versions.txt: a release of
    # the declared lower bound, which the README names.
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    floor = re.findall(r'"torch>=([\d.]+)"', pyproject)
    lowest_torch = re.findall(r"^torch==([\d.]+)$", lowest, re.MULTILINE)
    assert len(floor) == len(lowest_torch) == 1
    assert lowest_torch[0].startswith(floor[0] + ".")
    assert "grep -E '^torch==' .ci/lowest-versions.txt" in ci
    assert f"torch {lowest_torch[0]}" in _flat(README)
    assert f"`torch>={floor[0]}`" in README
    blocks = _bash_blocks(README)
    first = blocks[0]
    # The two commands themselves install torch from PyPI (this project's machines carry
    # a local CPU wheel); the CPU index is an alternative in a block of its own.
    assert first.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install torch==")
    assert "--index-url" not in first and blocks[1].strip() == "python -m pytest -q -n 2"
    cpu = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu\n"
    assert cpu in blocks
    assert "TORCH_INDEX_URL" in ci  # CI can take the same index


def test_the_readme_names_the_default_selection_and_the_command_for_every_test() -> None:
    """What the README says the default run leaves out is what ``conftest.py`` leaves out
    and what the markers registered in ``pyproject.toml`` mean."""
    import conftest

    text = _flat(README)
    assert conftest.LEFT_OUT_BY_DEFAULT == ("slow", "memory")
    assert (
        "every test but the slow ones (marked `slow`: the benchmark smoke runs and the"
        " ranking's exactness and property sweeps) and the resident-memory probes (marked"
        " `memory`)" in text
    )
    assert "python -m pytest -q --all\n" in _bash_blocks(README)
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for marker in ("slow: benchmark smoke runs", "memory: resident-memory probes", "ddp: "):
        assert f'"{marker}' in pyproject, marker


def test_the_readme_says_cuda_tests_skip_without_a_gpu() -> None:
    assert "the CUDA tests (`tests/test_cuda.py`) are skipped on a machine without a GPU" in _flat(
        README
    )
    source = (ROOT / "tests" / "test_cuda.py").read_text(encoding="utf-8")
    assert "pytestmark = pytest.mark.skipif(" in source and "torch.cuda.is_available()" in source


def test_the_lowest_versions_run_leaves_out_what_the_readme_says() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = [line for line in ci.splitlines() if "python -m pytest -q" in line]
    commands = [line for line in commands if not line.startswith("leg ")]
    # Leg 1 (the newest versions) runs the memory probes (in the background, at the
    # lowest CPU priority), the README's command as it is and the slow tests; the lowest
    # versions' leg leaves out the memory probes, the benchmark smoke runs and the
    # exactness sweeps, and nothing else.
    left_out = ("test_memory.py", "test_benchmarks.py", "test_embedding_exact.py")
    left_out += ("test_embedding_band.py",)
    fewer = "python -m pytest -q -n 2" + "".join(f" --ignore=tests/{name}" for name in left_out)
    memory = "nice -n 19 python -m pytest -q -p no:cacheprovider -m memory --timeout 1800"
    memory += ' >"$work/memory.log" 2>&1 &'
    slow = "python -m pytest -q -n 2 -m slow"
    assert commands == [memory, "python -m pytest -q -n 2", slow, fewer]
    assert 'wait "$memory_tests" || memory_status=$?' in ci
    said = (
        "that second run is the default selection, less the band tests: it leaves out the"
        " memory probes, benchmark smoke runs and the ranking's exactness sweeps"
    )
    assert said in _flat(README)
    assert said in _flat(readme_sections.fill(DOCS["index.md"]))  # the README's section
    for name in left_out:
        assert (ROOT / "tests" / name).exists()


def test_the_input_forms_page_states_the_memory_bound_of_the_large_galleries_page() -> None:
    """The memory sentence of "Input forms" (once the README's) is the page's formula (``tests/memory_formula.py``,
    measured by ``tests/test_memory.py``): one copy plus ``chunk_bytes``, which holds
    the bookkeeping."""
    from recall_at_k.ranking import budget

    per_item = budget.BOOKKEEPING_BYTES_PER_ITEM
    text = _flat(DOCS["input-forms.md"])
    assert (
        "`compute()` adds one copy of the stored (under DDP, gathered) embeddings plus"
        f" `chunk_bytes`, which holds its tiles, scratch and bookkeeping ({per_item} bytes"
        " an item);" in text
    )
    assert f"and {per_item} bytes x N of bookkeeping" in _flat(DOCS["large-galleries.md"])
