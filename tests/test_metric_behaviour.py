"""RetrievalRecallAtK as a torchmetrics Metric: state rules, collections, devices, plot."""

from __future__ import annotations

import io
import itertools
import pickle
from typing import Any

import pytest
import torch
from helpers import TIES
from torch import Tensor
from torchmetrics import MetricCollection

from recall_at_k import RetrievalRecallAtK
from recall_at_k.functional import retrieval_recall_at_k


def _state_bytes(metric: RetrievalRecallAtK) -> int:
    total = 0
    for value in metric.metric_state.values():
        for tensor in value if isinstance(value, list) else [value]:
            total += tensor.numel() * tensor.element_size()
    return total


def _batch(q: int, g: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(q, g), torch.randint(-1, g, (q,))


@pytest.mark.parametrize("ties", ["pessimistic", "expected"])
def test_state_size_does_not_depend_on_q(ties: str) -> None:
    small, large = RetrievalRecallAtK(ties=ties), RetrievalRecallAtK(ties=ties)
    small.update(*_batch(10))
    for _ in range(10):
        large.update(*_batch(10_000))
    assert int(large.query_counts.sum()) == 100_000
    assert _state_bytes(small) == _state_bytes(large) <= 16 * (10 + 2)


def test_int_k_returns_a_scalar_and_dict_keeps_order() -> None:
    scores, target = _batch(30)
    single = RetrievalRecallAtK(k=5)
    single.update(scores, target)
    value = single.compute()
    assert isinstance(value, torch.Tensor) and value.dim() == 0
    several = RetrievalRecallAtK(k=(10, 1, 5), key="R_at_{k}")
    several.update(scores, target)
    result = several.compute()
    assert isinstance(result, dict)
    assert list(result) == ["R_at_10", "R_at_1", "R_at_5"]
    assert torch.equal(result["R_at_5"], value)


def test_forward_returns_the_batch_value_and_accumulates() -> None:
    metric = RetrievalRecallAtK(k=(1, 3))
    first, second = _batch(20, 6), _batch(30, 6)
    batch_value = metric(*first)
    assert batch_value == retrieval_recall_at_k(*first, k=(1, 3))
    metric(*second)
    everything = (torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]))
    assert metric.compute() == retrieval_recall_at_k(*everything, k=(1, 3))


# compute() after reset(): torchmetrics warns beside our NaN warning (expected here).
@pytest.mark.filterwarnings(
    "ignore:The ``compute`` method of metric .* called before the ``update``"
)
def test_reset_merge_state_pickle_and_state_dict() -> None:
    a, b = RetrievalRecallAtK(ties="expected"), RetrievalRecallAtK(ties="expected")
    first, second = _batch(40, 8), _batch(25, 8)
    a.update(*first)
    b.update(*second)
    a.merge_state(b)
    everything = (torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]))
    want = retrieval_recall_at_k(*everything, ties="expected")
    assert a.compute() == want

    restored = pickle.loads(pickle.dumps(a))
    assert restored.compute() == want

    a.persistent(True)
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    fresh = RetrievalRecallAtK(ties="expected")
    fresh.load_state_dict(torch.load(buffer))
    assert fresh.compute() == want

    a.reset()
    assert int(a.query_counts.sum()) == 0 and float(a.rank_histogram.sum()) == 0.0


def _values(result: object) -> list[float]:
    assert isinstance(result, dict)
    return [float(v) for v in result.values()]


class TwoProcesses:
    """A ``dist_sync_fn`` that gathers a metric's states beside ``other``'s, as if
    ``other`` were a second process (no process group needed); counts its gathers."""

    def __init__(self, other: RetrievalRecallAtK) -> None:
        self.other = other
        self.metric: RetrievalRecallAtK | None = None
        self.gathers: list[str] = []

    def __call__(self, tensor: Tensor, group: Any = None) -> list[Tensor]:
        assert self.metric is not None
        for name, value in self.metric.metric_state.items():
            mine = value if isinstance(value, Tensor) else (value[0] if value else None)
            if mine is tensor:
                self.gathers.append(name)
                theirs = self.other.metric_state[name]
                if isinstance(theirs, list):
                    theirs = torch.cat(theirs) if theirs else tensor[:0]
                return [tensor, theirs]
        # compute()'s key: the update counts, gathered beside the states
        assert tensor.dtype == torch.int64 and tensor.tolist() == [self.metric.update_count]
        self.gathers.append("update_count")
        return [tensor, torch.tensor([self.other.update_count])]


def _two_batches() -> tuple[Any, Any, dict[str, Tensor], dict[str, Tensor]]:
    mine, theirs = _batch(20, 6), _batch(30, 6)
    local = retrieval_recall_at_k(*mine, k=(1, 3))
    both = retrieval_recall_at_k(
        torch.cat([mine[0], theirs[0]]), torch.cat([mine[1], theirs[1]]), k=(1, 3)
    )
    return mine, theirs, local, both


def test_the_kept_result_follows_sync_and_unsync() -> None:
    """With sync_on_compute=False: compute(), sync(), compute() gives the gathered value
    (a result is kept per state it counts); torchmetrics' compute() un-syncs after it,
    so the next compute() is the local value again."""
    mine, theirs, local, both = _two_batches()
    metric = RetrievalRecallAtK(k=(1, 3), sync_on_compute=False)
    metric.update(*mine)
    other = RetrievalRecallAtK(k=(1, 3))
    other.update(*theirs)
    gather = TwoProcesses(other)
    gather.metric = metric
    assert metric.compute() == local
    metric.sync(dist_sync_fn=gather, distributed_available=lambda: True)
    assert _values(metric.compute()) == pytest.approx(_values(both))
    assert metric.compute() == local
    metric.sync(dist_sync_fn=gather, distributed_available=lambda: True)
    metric.unsync()
    assert metric.compute() == local


def test_views_compute_once_for_all_k() -> None:
    """Under a (simulated) second process, the per_k() views read the parent's result,
    computed once: each view's compute() syncs the parent (a collective that every
    process makes alike) and finds the kept result of the same states, as Lightning's
    epoch end computes them one after another."""
    mine, theirs, _, both = _two_batches()
    other = RetrievalRecallAtK(k=(1, 3))
    other.update(*theirs)
    gather = TwoProcesses(other)
    metric = RetrievalRecallAtK(
        k=(1, 3), dist_sync_fn=gather, distributed_available_fn=lambda: True
    )
    gather.metric = metric
    computed = []
    recall_values = metric._recall_values
    metric._recall_values = lambda: computed.append(1) or recall_values()  # type: ignore[method-assign]
    metric.update(*mine)
    views = metric.per_k("val/")
    assert [float(v.compute()) for v in views.values()] == pytest.approx(_values(both))
    assert gather.gathers.count(metric._hist_name) == len(views) and len(computed) == 1
    assert _values(metric.compute()) == pytest.approx(_values(both))
    assert len(computed) == 1
    metric.update(*mine)  # a new state: computed again, once
    assert [float(v.compute()) for v in views.values()] != pytest.approx(_values(both))
    assert len(computed) == 2


def test_the_kept_result_is_never_handed_out_and_not_kept_across_a_move() -> None:
    metric = RetrievalRecallAtK(k=(1, 3))
    metric.update(*_batch(20, 6))
    before = metric.compute()
    assert isinstance(before, dict)
    want = before["recall@1"].clone()
    before["recall@1"].add_(1.0)  # the caller's copy
    assert metric.compute()["recall@1"] == want  # type: ignore[index]
    metric.to(torch.float16)  # casts no count
    after = metric.compute()
    assert isinstance(after, dict) and after["recall@1"].dtype == torch.float32
    assert after["recall@1"] == want
    # A result kept from before a move is not returned for states on another device:
    # on the meta device compute() computes again (and cannot: meta holds no values).
    metric.to("meta")
    with pytest.raises(NotImplementedError):
        metric.compute()


def test_compute_with_cache_false_computes_every_time() -> None:
    first, second = _batch(20, 6), _batch(30, 6)
    metric = RetrievalRecallAtK(k=(1, 3), compute_with_cache=False)
    metric.update(*first)
    assert metric.compute() == retrieval_recall_at_k(*first, k=(1, 3))
    metric.update(*second)
    everything = (torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]))
    assert metric.compute() == retrieval_recall_at_k(*everything, k=(1, 3))
    with pytest.raises(ValueError, match=r"`compute_with_cache` must be a bool .*got 'no'"):
        RetrievalRecallAtK(compute_with_cache="no")


def test_counts_stay_exact_past_2_31_queries() -> None:
    big = RetrievalRecallAtK(k=(1, 2))
    big.update(torch.tensor([[1.0, 0.0]]), torch.tensor([0]))  # one hit at rank 1
    n = 3 * 2**31 + 1
    synthetic = RetrievalRecallAtK(k=(1, 2))
    synthetic.rank_histogram.copy_(torch.tensor([n, 0]))
    synthetic.query_counts.copy_(torch.tensor([2 * n + 1, 0]))
    big.merge_state(synthetic)
    assert big.query_counts.tolist() == [2 * n + 2, 0]
    assert big.rank_histogram.tolist() == [n + 1, 0]
    result = big.compute()
    assert isinstance(result, dict)
    assert float(result["recall@1"]) == pytest.approx((n + 1) / (2 * n + 2))


def test_empty_batch_changes_nothing_and_empty_gallery_has_no_positive() -> None:
    metric = RetrievalRecallAtK(k=1)
    metric.update(torch.empty(0, 7), torch.empty(0, dtype=torch.int64))
    assert int(metric.query_counts.sum()) == 0
    metric.update(torch.empty(3, 0), torch.full((3,), -1))
    metric.update(torch.empty(2, 0), torch.empty(2, 0, dtype=torch.bool))
    assert metric.query_counts.tolist() == [0, 5]
    assert float(metric.compute()) == 0.0  # type: ignore[arg-type]


def test_update_is_sync_free_on_the_meta_device() -> None:
    """With validate_args=False nothing reads a tensor value on the host (meta would fail)."""
    # A large batch and a small one (the paths with the fewest tensor operations).
    for (rows, gallery), ties in itertools.product([(256, 500), (8, 100)], TIES):
        metric = RetrievalRecallAtK(ties=ties, validate_args=False).to("meta")
        scores = torch.empty(rows, gallery, device="meta")
        index = torch.empty(rows, dtype=torch.int64, device="meta")
        mask = torch.empty(rows, gallery, dtype=torch.bool, device="meta")
        metric.update(scores, index)
        metric.update(scores, mask)
        ignore = torch.empty(rows, gallery, dtype=torch.bool, device="meta")
        metric.update(scores, index, ignore=ignore)
        metric.update(scores, mask, ignore=ignore)
        assert metric.rank_histogram.device.type == "meta"
    # ... and the validating update does read values, so it fails there.
    checked = RetrievalRecallAtK().to("meta")
    with pytest.raises((RuntimeError, NotImplementedError)):
        checked.update(scores, torch.empty(rows, dtype=torch.int64, device="meta"))


def test_requires_grad_scores_keep_no_graph() -> None:
    scores = torch.randn(5, 4, requires_grad=True)
    metric = RetrievalRecallAtK()
    metric.update(scores, torch.tensor([0, 1, 2, 3, -1]))
    assert not metric.rank_histogram.requires_grad
    assert metric.rank_histogram.grad_fn is None


def _fill(collection: MetricCollection) -> None:
    # First update: tie-free, so the pessimistic and optimistic states coincide.
    collection.update(torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.8, 0.3]]), torch.tensor([0, 2]))
    # Second update: every score tied.
    collection.update(torch.ones(4, 3), torch.tensor([0, 1, 2, 0]))


def test_collection_never_groups_instances_that_compute_differently() -> None:
    collection = MetricCollection(
        {
            "pess": RetrievalRecallAtK(k=(1, 2)),
            "opt": RetrievalRecallAtK(k=(1, 2), ties="optimistic"),
            "k2": RetrievalRecallAtK(k=2),
            "k3": RetrievalRecallAtK(k=3),
            "same_max_k": RetrievalRecallAtK(k=(3, 1)),
        }
    )
    _fill(collection)
    result = collection.compute()
    for name, metric in collection.items():
        alone = metric.__class__(
            k=metric.ks if not metric.single_k else metric.ks[0], ties=metric.ties
        )
        _fill(MetricCollection({name: alone}))
        want = alone.compute()
        if isinstance(want, dict):
            for key, value in want.items():
                assert torch.equal(result[f"{name}_{key}"], value), (name, key)
        else:
            assert torch.equal(result[name], want), name
    assert float(result["pess_recall@1"]) == pytest.approx(1 / 6)
    assert float(result["opt_recall@1"]) == pytest.approx(5 / 6)
    # Instances that differ only in how they compute may share a compute group.
    assert ["k3", "same_max_k"] in [sorted(g) for g in collection.compute_groups.values()]


def test_plot_draws_recall_against_k() -> None:
    metric = RetrievalRecallAtK(k=(1, 5, 10))
    metric.update(*_batch(50, 20))
    fig, ax = metric.plot()
    line = ax.get_lines()[0]
    assert list(line.get_xdata()) == [1, 5, 10]
    result = metric.compute()
    assert isinstance(result, dict)
    assert list(line.get_ydata()) == pytest.approx([float(v) for v in result.values()])
    fig2, ax2 = metric.plot([result, result], ax=ax)
    assert ax2 is ax and fig2 is fig and len(ax.get_lines()) == 3
    single = RetrievalRecallAtK(k=5)
    single.update(*_batch(10, 20))
    _, ax3 = single.plot()
    assert list(ax3.get_lines()[0].get_xdata()) == [5]


def test_plot_accepts_logged_values_with_a_prefix() -> None:
    metric = RetrievalRecallAtK(k=(1, 5))
    logged = {"val/recall@1": torch.tensor(0.25), "val/recall@5": 0.75, "epoch": 3}
    _, ax = metric.plot(logged)  # type: ignore[arg-type]
    line = ax.get_lines()[0]
    assert list(line.get_ydata()) == [0.25, 0.75]
    assert list(ax.get_xticks()) == [1, 5]


def test_plot_of_several_results_takes_labels_and_draws_a_legend() -> None:
    metric = RetrievalRecallAtK(k=(1, 5))
    first = {"recall@1": 0.25, "recall@5": 0.5}
    second = {"recall@1": 0.5, "recall@5": 0.75}
    _, ax = metric.plot([first, second], labels=["model A", "model B"])  # type: ignore[list-item]
    assert [line.get_label() for line in ax.get_lines()] == ["model A", "model B"]
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["model A", "model B"]
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[0.25, 0.5], [0.5, 0.75]]
    _, one = metric.plot(first, labels=["model A"])  # type: ignore[arg-type]
    assert [text.get_text() for text in one.get_legend().get_texts()] == ["model A"]
    with pytest.raises(ValueError, match=r"`labels` must give one label per result: 2 result"):
        metric.plot([first, second], labels=["model A"])  # type: ignore[list-item]


def test_plot_labels_name_each_direction_of_a_bidirectional_result() -> None:
    from recall_at_k import EmbeddingRecallAtK

    metric = EmbeddingRecallAtK(k=(1, 2), bidirectional=True, directions=("i2t", "t2i"))
    result = {"i2t/recall@1": 0.5, "i2t/recall@2": 1.0, "t2i/recall@1": 0.25, "t2i/recall@2": 0.5}
    _, ax = metric.plot([result], labels=["epoch 3"])  # type: ignore[list-item]
    assert [line.get_label() for line in ax.get_lines()] == ["epoch 3 (i2t)", "epoch 3 (t2i)"]
