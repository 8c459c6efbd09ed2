"""Small updates: the fixed cost of one ``update`` call against torchmetrics'.

One batch of Q = 8 queries x G = 100 items (float32, one true item a query),
K = (1, 5, 10), fed again and again to a metric made before the timed calls:
``RetrievalHitRate(top_k=10).update`` of its flat ``(preds, target, indexes)`` form (its
checks always run; it appends the batch to its list states), and ``RetrievalRecallAtK``
with a ``[Q]`` index target, a ``[Q, G]`` mask and the flat form, with the default
``validate_args=True`` (what the ratios compare) and ``False``. Time: per call, the
median over interleaved rounds of a block of calls; peak memory: what a block adds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import measure
import torch

from recall_at_k import RetrievalRecallAtK

KS = (1, 5, 10)
QUERIES, GALLERY = 8, 100

TORCHMETRICS = "torchmetrics RetrievalHitRate(top_k=10).update"
DENSE_INDEX = "RetrievalRecallAtK, dense [Q] index target"
DENSE_MASK = "RetrievalRecallAtK, dense [Q, G] mask target"
FLAT = "RetrievalRecallAtK, flat (preds, target, indexes)"
UNCHECKED = ", validate_args=False"


def _runs(device: str, calls: int) -> dict[str, measure.Run]:
    """Every contestant's run: ``calls`` timed update calls of a fresh metric (made, and
    called once for its one-off work, untimed)."""
    from torchmetrics.retrieval import RetrievalHitRate

    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(QUERIES, GALLERY, generator=gen).to(device)
    index = torch.randint(0, GALLERY, (QUERIES,), generator=gen).to(device)
    mask = torch.nn.functional.one_hot(index, GALLERY).bool()
    ids = torch.arange(QUERIES, device=device).repeat_interleave(GALLERY)
    forms = {DENSE_INDEX: ((scores, index), {}), DENSE_MASK: ((scores, mask), {})}
    forms[FLAT] = (scores.flatten(), mask.flatten()), {"indexes": ids}  # update's args, kwargs
    made = {TORCHMETRICS: (functools.partial(RetrievalHitRate, top_k=max(KS)), forms[FLAT])}
    for checked in (True, False):
        new = functools.partial(RetrievalRecallAtK, KS, validate_args=checked)
        made |= {name + ("" if checked else UNCHECKED): (new, args) for name, args in forms.items()}

    def block(new: Callable[[], Any], form: tuple[Any, dict[str, Any]]) -> measure.Run:
        inputs, kwargs = form

        def run(probe: measure.Probe) -> None:
            with probe.window():
                metric = new().to(device)
                metric.update(*inputs, **kwargs)
                with probe.timed():
                    for _ in range(calls):
                        metric.update(*inputs, **kwargs)

        return run

    return {name: block(*spec) for name, spec in made.items()}


def run(*, calls: int, rounds: int, setup: measure.Setup, **_: object) -> measure.Section:
    """Every contestant: ``rounds`` interleaved rounds of a block of ``calls`` updates."""
    made = [
        measure.Contestant(name, run, rounds) for name, run in _runs(setup.device, calls).items()
    ]
    rows = measure.compare(made, setup.device)
    columns = [
        ("time a call", lambda row: f"{(row.seconds or 0) / calls * 1e6:.1f} us"),
        measure.time_ratio_column("time / torchmetrics", rows[0]),
        measure.peak_column(f"peak memory of {calls:,} calls"),
    ]
    body = (
        f"One batch of Q = {QUERIES} queries x G = {GALLERY} items, float32, K = {KS},"
        f" {calls:,} `update` calls a block, median of {rounds} interleaved rounds (the ratio"
        " is the median of the per-round ratios). torchmetrics always checks its inputs;"
        " the ratios compare it with this package's default `validate_args=True`."
    )
    return f"{body}\n\n{measure.contestant_table(rows, columns)}", measure.by_name(rows)
