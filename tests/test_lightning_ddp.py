"""Lightning DDP on CPU (two gloo processes): logged recall equals the single-process value."""

from __future__ import annotations

import pytest
from lightning_models import Ranker, make_data
from test_lightning import direct_recall, logged_recall, trainer_for
from torch.utils.data import DataLoader

pytestmark = pytest.mark.usefixtures("quiet_warnings")


def test_ddp_fit_logs_the_single_process_values_and_padding_counts_once() -> None:
    # 31 validation queries on 2 processes: DistributedSampler pads one repeated query.
    train, val = make_data(64, seed=3), make_data(31, seed=4)
    model = Ranker(use_query_ids=True)
    trainer = trainer_for(max_epochs=2, devices=2, strategy="ddp_spawn", num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(train, batch_size=16), DataLoader(val, batch_size=8))
    logged = logged_recall(dict(trainer.callback_metrics))
    # ddp_spawn hands the trained weights back: evaluate them here, on one process.
    single = direct_recall(model, val)
    assert logged == pytest.approx(single)  # with query_ids: each query once
    plain = {
        key.replace("plain/", "val/"): float(value)
        for key, value in trainer.callback_metrics.items()
        if key.startswith("plain/")
    }
    assert sorted(plain) == sorted(single)
    assert plain != pytest.approx(single)  # without them the padded repeat counts twice
