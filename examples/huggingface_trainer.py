"""Recall@K in the Hugging Face ``Trainer``, streamed batch by batch (no download).

``TrainingArguments(batch_eval_metrics=True)`` makes the ``Trainer`` call
``compute_metrics(eval_pred, compute_result)`` after every evaluation batch instead of
once on the predictions of the whole evaluation set, which it then never holds: each
call feeds the batch's embeddings to :class:`recall_at_k.EmbeddingRecallAtK`, and the
call of the last batch (``compute_result=True``) computes Recall@K and resets the metric
for the next evaluation.

The model is a tiny BERT built from a config (one layer, 32 dimensions; nothing is
downloaded) that reads each of scikit-learn's 8x8 digit images as a "sentence" of 64
pixel tokens (intensities 0..16) and embeds it as the normalised mean of its token
states. It is trained for three epochs with one learnable proxy per digit (cross-entropy
on the cosine similarities to the proxies); after each epoch the ``Trainer`` evaluates
leave-one-out Recall@1/5/10 on 360 held-out images (``eval_recall@1``, ...).

At the end, ``trainer.predict`` runs the same streamed metric once more and also
returns the embeddings of the whole evaluation set; the script checks that ranking them
in one call (``embedding_recall_at_k``) gives the same values, bit for bit.

Under several processes (``torchrun``, ``accelerate launch``) the ``Trainer`` gathers
each batch from all processes before it calls ``compute_metrics`` (and drops the samples
its sampler repeated), so every process already sees every sample: the metric is built
with ``sync_on_compute=False``, or it would gather them a second time.

Needs ``pip install "transformers[torch]>=4.41"`` (``batch_eval_metrics`` is new in
4.41). Run: ``python examples/huggingface_trainer.py`` (about 20 s on one CPU core).
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor
from transformers import (
    BertConfig,
    BertModel,
    BertPreTrainedModel,
    EvalPrediction,
    PrinterCallback,
    Trainer,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

from recall_at_k import EmbeddingRecallAtK
from recall_at_k.functional import embedding_recall_at_k

KS = (1, 5, 10)
VAL_SIZE = 360


class DigitEncoder(BertPreTrainedModel):
    """A BERT encoder of pixel tokens; returns L2-normalised embeddings (and a proxy loss)."""

    def __init__(self, config: BertConfig, temperature: float = 0.05) -> None:
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.proxies = torch.nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.temperature = temperature
        self.post_init()

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> dict[str, Tensor]:
        mask = torch.ones_like(input_ids)  # every pixel token is attended to
        states = self.bert(input_ids=input_ids, attention_mask=mask).last_hidden_state
        embeddings = F.normalize(states.mean(dim=1), dim=1)
        if labels is None:
            return {"embeddings": embeddings}
        cosine = embeddings @ F.normalize(self.proxies.weight, dim=1).T
        loss = F.cross_entropy(cosine / self.temperature, labels)
        return {"loss": loss, "embeddings": embeddings}


class Digits(torch.utils.data.Dataset[dict[str, Tensor]]):
    """Digit images as sequences of 64 pixel tokens, with their digit as ``labels``."""

    def __init__(self, tokens: Tensor, labels: Tensor) -> None:
        self.tokens, self.labels = tokens, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.labels[index]}


def digits_split(seed: int) -> tuple[Digits, Digits]:
    """A fixed, stratified train / evaluation split (1,437 / 360 images)."""
    digits = load_digits()
    tokens = torch.tensor(digits.data, dtype=torch.int64)  # intensities 0..16: the vocabulary
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_rows, val_rows = train_test_split(
        range(len(labels)), test_size=VAL_SIZE, stratify=digits.target, random_state=seed
    )
    train, val = torch.tensor(train_rows), torch.tensor(val_rows)
    return Digits(tokens[train], labels[train]), Digits(tokens[val], labels[val])


# --8<-- [start:compute_metrics]
def streaming_recall(ks: tuple[int, ...] = KS) -> Any:
    """A ``compute_metrics`` for ``batch_eval_metrics=True`` that streams into Recall@K."""
    # sync_on_compute=False: the Trainer has already gathered every batch from all processes.
    recall = EmbeddingRecallAtK(k=ks, sync_on_compute=False)  # cosine, leave-one-out

    def compute_metrics(eval_pred: EvalPrediction, compute_result: bool) -> dict[str, float]:
        # With batch_eval_metrics the predictions (here the embeddings) and labels of one
        # batch arrive as tensors.
        recall.update(torch.as_tensor(eval_pred.predictions), torch.as_tensor(eval_pred.label_ids))
        if not compute_result:
            return {}
        result = recall.compute()  # the last batch: rank the whole evaluation set
        recall.reset()  # ready for the next evaluation
        return {key: float(value) for key, value in result.items()}

    return compute_metrics


# --8<-- [end:compute_metrics]


def quiet_transformers() -> None:
    """No progress bars, banners or warnings about a tiny CPU run."""
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")
    warnings.filterwarnings("ignore", module="accelerate")


def main() -> dict[str, float]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally
    quiet_transformers()
    torch.manual_seed(0)
    train_set, eval_set = digits_split(seed=0)
    config = BertConfig(
        vocab_size=17,  # pixel intensities 0..16
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,  # 64 pixels
        type_vocab_size=1,
        num_labels=10,
    )
    model = DigitEncoder(config)

    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            num_train_epochs=3,
            learning_rate=5e-3,
            per_device_train_batch_size=32,
            per_device_eval_batch_size=128,
            eval_strategy="epoch",
            batch_eval_metrics=True,  # compute_metrics(eval_pred, compute_result) per batch
            save_strategy="no",
            logging_strategy="no",
            report_to="none",
            use_cpu=True,
            ddp_find_unused_parameters=False,  # under several processes: every weight is used
            seed=0,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=train_set,
            eval_dataset=eval_set,
            compute_metrics=streaming_recall(),
        )
        trainer.remove_callback(PrinterCallback)  # the table below shows what it would print
        trainer.train()
        # predict() streams the same metric and returns the whole set's embeddings too.
        prediction = trainer.predict(eval_set, metric_key_prefix="eval")

    if trainer.is_world_process_zero():
        print(f"{'epoch':>5s}  " + "  ".join(f"{f'eval_recall@{k}':>14s}" for k in KS))
        for entry in trainer.state.log_history:
            if "eval_recall@1" in entry:
                values = "  ".join(f"{entry[f'eval_recall@{k}']:14.4f}" for k in KS)
                print(f"{entry['epoch']:5.0f}  {values}")
    streamed = {key: prediction.metrics[f"eval_{key}"] for key in (f"recall@{k}" for k in KS)}
    embeddings = torch.as_tensor(prediction.predictions)
    labels = torch.as_tensor(prediction.label_ids)
    # Each evaluation sample once, also when a sampler padded the shards of several processes.
    assert len(embeddings) == len(eval_set), (len(embeddings), len(eval_set))
    one_call = embedding_recall_at_k(embeddings, labels, k=KS)
    same = all(streamed[key] == float(value) for key, value in one_call.items())
    if trainer.is_world_process_zero():
        print(
            f"streamed through compute_metrics, batch by batch, equals one call on all"
            f" {len(embeddings)} evaluation embeddings: {same}"
        )
    assert same, (streamed, one_call)
    if torch.distributed.is_initialized():
        # The Trainer leaves its gloo group alive at exit (under torchrun); ending it here
        # keeps gloo's threads out of the C++ static destructors, where a process aborted
        # now and then ("terminate called without an active exception"). The barrier
        # first lets gloo's threads let go of the last collective.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return streamed


if __name__ == "__main__":
    main()
