"""Typed users need no casts: ``compute()`` is typed by ``k`` for both metrics.

One ``mypy --strict`` run over a small user file: an int ``k`` types ``compute()`` as
``Tensor``; a sequence ``k`` (or the default) as ``dict[str, Tensor]``, so
``compute()["recall@1"]`` type-checks; ``bidirectional=True`` always gives a dict.
``paired_comparison`` of two metrics is typed the same way (one ``PairedComparison`` or
a dict of them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

USER_CODE = """\
from torch import Tensor

from recall_at_k import EmbeddingRecallAtK, RetrievalRecallAtK


def log_value(name: str, value: float) -> None:
    print(name, value)


single = RetrievalRecallAtK(k=5)
several = RetrievalRecallAtK(k=(1, 5))
default = RetrievalRecallAtK()
as_list = RetrievalRecallAtK(k=[1, 10], ties="expected")
log_value("r5", single.compute().item())
log_value("r1", several.compute()["recall@1"].item())
for key, value in default.compute().items():
    log_value(key, value.item())
by_key: dict[str, Tensor] = as_list.compute()
scalar: Tensor = single.compute()
reveal_type(single.compute())  # line 20
reveal_type(several.compute())
reveal_type(default.compute())
reveal_type(as_list.compute())

e_single = EmbeddingRecallAtK(k=1, similarity="dot")
e_several = EmbeddingRecallAtK(k=(1, 5), exclude="same_group")
e_default = EmbeddingRecallAtK()
e_both = EmbeddingRecallAtK(k=1, bidirectional=True)
log_value("e1", e_single.compute().item())
log_value("e@5", e_several.compute()["recall@5"].item())
log_value("both", e_both.compute()["q2g/recall@1"].item())
reveal_type(e_single.compute())  # line 32
reveal_type(e_several.compute())
reveal_type(e_default.compute())
reveal_type(e_both.compute())
from recall_at_k import PairedComparison, QueryOutcomes, paired_comparison  # line 36

one: PairedComparison = paired_comparison(single, single)
log_value("p", paired_comparison(several, several)["recall@1"].p_value)
outcomes: QueryOutcomes = single.query_outcomes()
reveal_type(paired_comparison(single, single))  # line 41
reveal_type(paired_comparison(e_several, e_several))
reveal_type(paired_comparison(outcomes, outcomes))
"""

TENSOR = "torch._tensor.Tensor"
DICT = "dict[str, torch._tensor.Tensor]"
PAIRED = (  # how mypy writes a NamedTuple
    "tuple[float, float, float, float, int, int, int,"
    " fallback=recall_at_k._paired.PairedComparison]"
)
EXPECTED_REVEALS = {
    20: TENSOR,
    21: DICT,
    22: DICT,
    23: DICT,
    32: TENSOR,
    33: DICT,
    34: DICT,
    35: DICT,
    41: PAIRED,
    42: f"dict[str, {PAIRED}]",
    43: f"{PAIRED} | dict[str, {PAIRED}]",
}


def test_compute_is_typed_by_k_under_mypy_strict(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    user = tmp_path / "user_code.py"
    user.write_text(USER_CODE, encoding="utf-8")
    assert (SRC / "recall_at_k" / "py.typed").is_file(), "the package must ship py.typed"
    env = {**os.environ, "MYPYPATH": str(SRC)}
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-error-summary",
            "--hide-error-context",
            "--cache-dir",
            str(tmp_path / "mypy_cache"),
            str(user),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in completed.stdout.splitlines() if user.name + ":" in line]
    errors = [line for line in lines if ": error:" in line]
    assert not errors, "user code needs casts under mypy --strict:\n" + "\n".join(errors)
    reveals = {}
    for line in lines:
        match = re.match(r".*:(\d+): note: Revealed type is \"(.*)\"$", line)
        if match:
            reveals[int(match.group(1))] = match.group(2).replace("builtins.", "")
    assert reveals == EXPECTED_REVEALS, completed.stdout + completed.stderr
